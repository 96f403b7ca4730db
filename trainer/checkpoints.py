"""Chief-aware checkpointing: every worker takes part in a save, only the chief's lands in model_dir.

Saving only on the chief deadlocks multi-worker strategies (DESIGN.md rule 6), so non-chief
workers save the same checkpoint into a temporary directory of their own and delete it.
All workers restore from the chief's directory.
"""
from __future__ import annotations

import shutil
import tempfile

import tensorflow as tf


class CheckpointSaver:
    """Saves and restores `checkpoint` as `ckpt-<step>` under `model_dir` (chief) or a temp dir."""

    def __init__(
        self,
        checkpoint: tf.train.Checkpoint,
        model_dir: str,
        *,
        is_chief: bool,
        task_name: str = "worker",
        max_to_keep: int = 3,
    ):
        self._checkpoint = checkpoint
        self.model_dir = model_dir
        self._is_chief = is_chief
        self._task_name = task_name
        self._manager = (
            tf.train.CheckpointManager(checkpoint, model_dir, max_to_keep=max_to_keep)
            if is_chief
            else None
        )
        self.last_saved_step: int | None = None

    def latest(self) -> str | None:
        """The newest checkpoint in the chief's directory, or None."""
        return tf.train.latest_checkpoint(self.model_dir)

    def restore_latest(self) -> str | None:
        """Restores the newest checkpoint if there is one; returns its path."""
        path = self.latest()
        if path:
            self._checkpoint.restore(path).assert_existing_objects_matched()
        return path

    def save(self, step: int) -> str:
        """Every worker must call this at the same step; returns the path written."""
        if self._is_chief:
            path = self._manager.save(checkpoint_number=step)
        else:
            temp_dir = tempfile.mkdtemp(prefix=f"trainer-{self._task_name}-ckpt-")
            try:
                path = tf.train.CheckpointManager(self._checkpoint, temp_dir, max_to_keep=1).save(
                    checkpoint_number=step
                )
            finally:
                shutil.rmtree(temp_dir, ignore_errors=True)
        self.last_saved_step = step
        return path
