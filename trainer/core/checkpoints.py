"""Chief-aware checkpointing: every worker takes part in a save, only the chief's lands in model_dir.

Saving only on the chief deadlocks multi-worker strategies (DESIGN.md rule 6), so non-chief
workers save the same checkpoint into a temporary directory of their own and delete it.
All workers restore from the chief's directory.
"""
from __future__ import annotations

import glob
import os
import re
import shutil
import tempfile
from typing import Callable

import tensorflow as tf

from trainer.errors import RunFailure, UserError


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

    def candidates(self) -> list[str]:
        """Checkpoints of the chief's directory, newest first."""
        state = tf.train.get_checkpoint_state(self.model_dir)
        if state is None:
            return []
        paths = list(state.all_model_checkpoint_paths) or [state.model_checkpoint_path]
        return [p if os.path.isabs(p) else os.path.join(self.model_dir, p) for p in reversed(paths)]

    def restore_latest(self, print_fn: Callable[[str], None] = print) -> str | None:
        """Restores the newest readable checkpoint; returns its path (None: nothing to restore).

        A checkpoint that cannot be read (truncated, corrupted, a file missing) is skipped,
        saying so, for the one before it. One that does not fit the model is a UserError:
        restoring an older one would not fit either.
        """
        for path in self.candidates():
            try:
                self._checkpoint.restore(path).assert_existing_objects_matched()
                return path
            except tf.errors.OpError as e:
                print_fn(f"warning: {path} cannot be read ({_first_line(e)}); trying the checkpoint before it")
            except (ValueError, AssertionError) as e:
                raise UserError(
                    f"checkpoint {path} does not match the model ({_first_line(e)}); use the model "
                    "that wrote it or a fresh --model_dir"
                ) from e
        if self.candidates():
            raise UserError(
                f"no checkpoint in {self.model_dir} can be read; move them away to start over"
            )
        return None

    def save(self, step: int) -> str:
        """Every worker must call this at the same step; returns the path written.

        A save that fails (a full disk, a model_dir that vanished) is one RunFailure line: the
        checkpoint state file still names the previous checkpoint, which stays in charge, and
        the partial files of this one are removed, so a rerun (after freeing space) continues.
        """
        if self._is_chief:
            try:
                path = self._manager.save(checkpoint_number=step)
            except (tf.errors.OpError, OSError) as e:
                for partial in glob.glob(os.path.join(glob.escape(self.model_dir), f"ckpt-{step}_temp*")):
                    shutil.rmtree(partial, ignore_errors=True)
                latest = self.latest()
                keep = f"{latest} is intact and a rerun continues from it" if latest else \
                    "there is no earlier checkpoint: a rerun starts over"
                raise RunFailure(f"saving checkpoint {step} in {self.model_dir} failed ({_first_line(e)}); {keep} "
                                 "(free disk space or restore the directory first)") from e
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


def _first_line(error: Exception) -> str:
    text = re.sub(r"\{\{function_node [^}]*\}\}\s*", "", str(error))
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return (lines[0] if lines else type(error).__name__).rstrip(".")
