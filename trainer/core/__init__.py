"""The core: runtime, task, controller, loops, hooks, checkpoints, steps."""
