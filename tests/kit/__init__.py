"""Test kits: the scaffolding tests share instead of rebuilding by hand (a one-rank trainer, samples, ...)."""
