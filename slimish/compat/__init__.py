"""compat."""
