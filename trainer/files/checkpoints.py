"""Chief-aware checkpointing: every worker takes part in a save, only the chief's lands in model_dir.

Saving only on the chief deadlocks multi-worker strategies (docs/design.md, rule 6), so non-chief
workers save the same checkpoint into a temporary directory of their own and delete it.

With `async_checkpoint`, a save takes the values on the training thread (no copy: `_snapshot`) and
writes them on a background thread, keeping a synchronous save's guarantees: the state file names
a checkpoint only once its files are complete (`_commit`), and every pending write is finished
(`wait`) before the next save, a restore, `latest()` and the run's end, its failure reported there.
TensorFlow's own async checkpoint is not used: its copy to the host fails on Keras 3 variables from
the second save on (tf.Variable created inside a tf.function, TF 2.21 / Keras 3.15).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import glob
import logging
import os
import re
import shutil
import tempfile
from typing import Any, Callable

import tensorflow as tf

from trainer import internals
from trainer.errors import RunFailure, UserError, error_line
from trainer.files.run_checkpoint import RunCheckpoint


class CheckpointSaver:
    """Saves and restores `checkpoint` as `ckpt-<step>` under `model_dir` (chief) or a temp dir."""

    def __init__(
        self,
        checkpoint: RunCheckpoint | tf.train.Checkpoint,
        model_dir: str,
        *,
        is_chief: bool,
        task_name: str = "worker",
        max_to_keep: int = 3,
        async_checkpoint: bool = False,
    ):
        if isinstance(checkpoint, tf.train.Checkpoint):
            checkpoint = RunCheckpoint.of(checkpoint)
        self._run_checkpoint = checkpoint
        self.checkpoint = checkpoint.root  # what every save writes (the preemption handler reads it too)
        self.model_dir = model_dir
        self._is_chief = is_chief
        self._task_name = task_name
        self._max_to_keep = max_to_keep
        self._manager: tf.train.CheckpointManager | None = None  # made at the first save: it reads the state file
        # One writer thread: saves are written in order, one at a time. Its thread is joined at
        # interpreter exit, so even a process that leaves without `wait` finishes the write.
        pool = concurrent.futures.ThreadPoolExecutor
        self._writer = pool(1, thread_name_prefix="trainer-checkpoint") if async_checkpoint else None
        self._pending: tuple[int, concurrent.futures.Future] | None = None
        self.last_saved_step: int | None = None

    def write_copy(self, path: str) -> None:
        """Writes the run's checkpoint, as it is now, at the prefix `path` (best checkpoints, a
        non-chief's temporary copy); not numbered, named in no state file."""
        self._run_checkpoint.write(path)

    def latest(self) -> str | None:
        """The newest checkpoint in the chief's directory, or None (after any pending write)."""
        self.wait()
        return tf.train.latest_checkpoint(self.model_dir)

    def candidates(self, print_fn: Callable[[str], None] | None = None) -> list[str]:
        """Checkpoints of the chief's directory, newest first (a damaged state file: those on disk, saying so
        through `print_fn`)."""
        return list(reversed(listed_checkpoints(self.model_dir, print_fn)))

    def restore_latest(self, print_fn: Callable[[str], None] = print) -> str | None:
        """Restores the newest readable checkpoint; returns its path (None: nothing to restore).
        An unreadable one (its index, a data shard: missing, cut short or corrupt) is skipped, saying so
        in one line; one that does not fit the model is a UserError (an older one would not fit either)."""
        self.wait()
        for path in self.candidates(print_fn):
            try:
                self._run_checkpoint.restore(path)
                return path
            except (tf.errors.OpError, IndexError) as e:  # IndexError: a data shard cut short
                print_fn(f"warning: {path} cannot be read ({error_line(e)}); trying the checkpoint before it")
            except (ValueError, AssertionError) as e:
                raise UserError(
                    f"checkpoint {path} does not match the model ({error_line(e)}); use the model "
                    "that wrote it or a fresh --model_dir"
                ) from e
        if self.candidates():
            raise UserError(f"no checkpoint in {self.model_dir} can be read; move them away to start over")
        return None

    def save(self, step: int) -> str:
        """Every worker must call this at the same step; returns the path written (or being written).
        A failed save is one RunFailure line (for an asynchronous one, at the next `wait`); the previous
        checkpoint stays in charge and this one's partial files are removed."""
        self.wait()
        if self._writer is not None:
            snapshot = _snapshot(self.checkpoint)  # this step's values, whatever the next steps do
            self._pending = (step, self._writer.submit(self._write, snapshot, step))
            path = os.path.join(self.model_dir, f"ckpt-{step}")
        elif self._is_chief:
            try:
                path = self._chief_manager().save(checkpoint_number=step)
            except (tf.errors.OpError, OSError) as e:
                raise self._failure(step, e) from e
        else:
            with self._temp_dir() as temp:
                path = tf.train.CheckpointManager(self.checkpoint, temp, max_to_keep=1).save(checkpoint_number=step)
        self.last_saved_step = step
        return path

    def _chief_manager(self) -> tf.train.CheckpointManager:
        """The chief's synchronous manager, made at the first save: it reads the state file, refusing an empty
        one (a full disk) and ignoring a garbled one; either is replaced by the state of this run's saves."""
        if self._manager is None:
            if _state_is_damaged(self.model_dir):
                os.remove(os.path.join(self.model_dir, STATE_FILE))
            self._manager = tf.train.CheckpointManager(self.checkpoint, self.model_dir, max_to_keep=self._max_to_keep)
        return self._manager

    def wait(self) -> None:
        """Finishes the pending asynchronous write, if any; its failure is the save's RunFailure."""
        if self._pending is None:
            return
        step, future = self._pending
        self._pending = None
        try:
            future.result()
        except (tf.errors.OpError, OSError) as e:
            if not self._is_chief:
                raise
            raise self._failure(step, e) from e

    def _write(self, snapshot: tuple[Any, Any, str], step: int) -> None:
        """The writer thread's job: the chief's files, then the state file; a non-chief's temp dir."""
        if self._is_chief:
            prefix = os.path.join(self.model_dir, f"ckpt-{step}")
            _write_snapshot(snapshot, prefix)
            self._commit(prefix)
            return
        with self._temp_dir() as temp:  # deleted only once the write is done
            _write_snapshot(snapshot, os.path.join(temp, f"ckpt-{step}"))

    def _temp_dir(self) -> tempfile.TemporaryDirectory:
        """Where a non-chief worker's copy goes (every worker takes part in a save), deleted after."""
        return tempfile.TemporaryDirectory(prefix=f"trainer-{self._task_name}-ckpt-", ignore_cleanup_errors=True)

    def _commit(self, prefix: str) -> None:
        """Names the complete checkpoint `prefix` in the (atomically replaced) state file, then deletes
        those that fall out, as tf.train.CheckpointManager does."""
        kept = [os.path.basename(p) for p in listed_checkpoints(self.model_dir)]
        kept = [name for name in kept if name != os.path.basename(prefix)] + [os.path.basename(prefix)]
        dropped, kept = kept[: -self._max_to_keep], kept[-self._max_to_keep :]
        # What the manager calls (the v1 name warns). The paths are given as model_dir joined to
        # each name, and written relative to model_dir, as the manager writes them: TensorFlow
        # reads a bare name given with a relative model_dir as relative to the working directory.
        tf.__internal__.train.update_checkpoint_state(
            self.model_dir,
            os.path.join(self.model_dir, kept[-1]),
            all_model_checkpoint_paths=[os.path.join(self.model_dir, name) for name in kept],
            save_relative_paths=True,
        )
        for name in dropped:
            for path in glob.glob(os.path.join(glob.escape(self.model_dir), glob.escape(name)) + ".*"):
                os.remove(path)

    def _failure(self, step: int, error: Exception) -> RunFailure:
        """The one line of a failed chief save, once its partial files are removed."""
        for partial in glob.glob(os.path.join(glob.escape(self.model_dir), f"ckpt-{step}_temp*")):
            shutil.rmtree(partial, ignore_errors=True)
        latest = tf.train.latest_checkpoint(self.model_dir)
        keep = (
            f"{latest} is intact and a rerun continues from it"
            if latest
            else "there is no earlier checkpoint: a rerun starts over"
        )
        return RunFailure(
            f"saving checkpoint {step} in {self.model_dir} failed ({error_line(error)}); {keep} "
            "(free disk space or restore the directory first)"
        )


STATE_FILE = "checkpoint"  # TensorFlow's state file: the checkpoints of a directory, newest last
_NUMBERED = re.compile(r"ckpt-(\d+)\.index$")


def listed_checkpoints(model_dir: str, print_fn: Callable[[str], None] | None = None) -> list[str]:
    """The complete checkpoints model_dir's state file lists, oldest first, as get_checkpoint_state gives
    them (joined to model_dir already: joining again breaks a relative model_dir). Where the state file
    cannot be read (empty, garbled), the `ckpt-N` whose index is on disk, by N, said through `print_fn`."""
    try:
        state = _read_state(model_dir)
    except ValueError as e:
        found = sorted(
            (int(m.group(1)), os.path.join(model_dir, f"ckpt-{m.group(1)}"))
            for name in tf.io.gfile.listdir(model_dir)
            if (m := _NUMBERED.fullmatch(name))
        )
        if print_fn is not None:
            names = ", ".join(os.path.basename(path) for _, path in found) or "none"
            print_fn(
                f"warning: {os.path.join(model_dir, STATE_FILE)} cannot be read ({e}); taking the checkpoints "
                f"beside it instead ({names})"
            )
        return [path for _, path in found]
    return [] if state is None else list(state.all_model_checkpoint_paths) or [state.model_checkpoint_path]


def _read_state(model_dir: str):
    """model_dir's checkpoint state (None: no state file); ValueError where the file cannot be parsed.
    TensorFlow ignores a garbled file with a log line of its own and returns None: that is an error here."""
    path = os.path.join(model_dir, STATE_FILE)
    try:
        with _tensorflow_log_quiet():
            state = tf.train.get_checkpoint_state(model_dir)
    except ValueError:  # what TensorFlow says of an empty file
        state = None
    if state is None and tf.io.gfile.exists(path):
        raise ValueError("it is empty" if tf.io.gfile.stat(path).length == 0 else "it is no checkpoint state")
    return state


def _state_is_damaged(model_dir: str) -> bool:
    try:
        _read_state(model_dir)
    except ValueError:
        return True
    return False


@contextlib.contextmanager
def _tensorflow_log_quiet():
    """TensorFlow's Python log ("Checkpoint ignored") kept for errors only while the state file is read."""
    logger = logging.getLogger("tensorflow")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _snapshot(checkpoint: tf.train.Checkpoint) -> tuple[Any, Any, str]:
    """What a save of `checkpoint` writes, read now (no copy: the next update of a held value copies
    first): (tensors by trackable, registered savers, device). The device places the writer's ops: a new
    thread does not inherit the training thread's, which under multi_worker_mirrored names this job."""
    checkpoint.save_counter.assign_add(1)  # as CheckpointManager.save does: the files are the same
    tensors, registered_savers = internals.checkpoint_tensors(checkpoint)
    for trackable in list(tensors):
        tensors[trackable] = _read_now(tensors[trackable])
    return tensors, registered_savers, checkpoint.save_counter.device


def _read_now(value: Any) -> Any:
    """A serialized value (a tensor, a lazy SaveSpec, a variable, or a dict of them) as a tensor read now."""
    if isinstance(value, dict):
        return {key: _read_now(v) for key, v in value.items()}
    if isinstance(value, tf.Variable):  # a Keras 3 variable serialises as the (distributed) variable itself
        return tf.identity(value)
    return internals.read_save_spec(value)


def _write_snapshot(snapshot: tuple[Any, Any, str], prefix: str) -> None:
    """Writes `prefix.index` and `prefix.data-*` as a synchronous save would (via `prefix_temp/`)."""
    tensors, registered_savers, device = snapshot
    tf.io.gfile.makedirs(os.path.dirname(prefix))
    with tf.device(device):
        internals.write_checkpoint_tensors(tensors, registered_savers, prefix)
