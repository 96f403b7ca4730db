"""Hooks: what runs eagerly between compiled loop calls (progress, eval, checkpoints, the config)."""
