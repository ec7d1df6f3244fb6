"""A reward module that raises at import (tests/rollout/test_reward_workers.py)."""

raise RuntimeError("this reward module fails at import")
