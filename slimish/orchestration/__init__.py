"""orchestration."""
