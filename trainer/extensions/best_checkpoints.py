"""The best K checkpoints by an eval metric, in `model_dir/best/`, beside the newest ones.

After each eval whose value ranks among the best K so far, the run's checkpoint is written to
`best/ckpt-<step>`. Every worker takes part in the write (saving on the chief only deadlocks the
multi-worker strategies, DESIGN.md rule 6; non-chief workers write into a temp dir and delete
it), and every worker makes the same decision: the values are the same on all of them (eval
reduces across workers) and the decision is agreed with one all-reduce all the same.

Like tf.train.CheckpointManager, a state file commits each change: the checkpoint's files are
written first, then `best/best.json` (the kept steps and values, best first) and the
`best/checkpoint` file (so `tf.train.latest_checkpoint(model_dir + '/best')` names the best one)
are replaced atomically, and only then are the checkpoints that dropped out deleted. A crash in
between leaves files that no state names; the next run deletes them. The ranking is read back
from `best.json` on resume.
"""
from __future__ import annotations

import glob
import json
import os
import shutil
import tempfile

import tensorflow as tf

from trainer.extensions.early_stopping import AnyWorker, Monitored, eval_done_at, monitored
from trainer.hooks.base import Hook, RunContext
from trainer.files.model_dir import write_text_atomic
from trainer.errors import UserError
from trainer.validation import check_int

BEST_DIR = "best"
STATE_FILE = "best.json"


def make_hooks(keep_best: int, best_metric: str, best_mode: str, checkpoint: tf.train.Checkpoint,
               splits: tuple[str, ...], task_name: str = "worker") -> list[Hook]:
    """The hook of `train.keep_best` (checked), or none when it is 0."""
    check_int("train.keep_best", keep_best, minimum=0)
    metric = monitored("train.best_", best_metric, best_mode, splits)
    if not keep_best:
        return []
    return [BestCheckpointHook(checkpoint, keep_best, metric, task_name)]


class BestCheckpointHook(Hook):
    """Keeps `keep` checkpoints, the best by `metric`, as `model_dir/best/ckpt-<step>`."""

    def __init__(self, checkpoint: tf.train.Checkpoint, keep: int, metric: Monitored, task_name: str = "worker"):
        self._checkpoint, self.keep, self.metric, self._task_name = checkpoint, keep, metric, task_name
        self.kept: list[dict] = []  # {"step", "value", "name"}, best first
        self._dir = ""
        self._any_worker: AnyWorker | None = None

    def begin(self, run: RunContext) -> None:
        self._any_worker = AnyWorker(run.strategy)
        self._dir = os.path.join(run.model_dir, BEST_DIR)
        state = read_state(run.model_dir)
        if state.get("metric") == self.metric.name and state.get("mode") == self.metric.mode:
            self.kept = [e for e in state.get("kept", [])
                         if os.path.exists(os.path.join(self._dir, e["name"]) + ".index")]
        elif state:
            run.print_fn(f"note: {self._dir} ranks by {state.get('metric')!r} ({state.get('mode')}), this run by "
                         f"{self.metric.name!r} ({self.metric.mode}); ranking anew")
        if run.is_chief and os.path.isdir(self._dir):
            self._delete_unlisted()

    def after_loop(self, run: RunContext, step: int, metrics: dict[str, float]) -> None:
        if not eval_done_at(run, step) or any(e["step"] == step for e in self.kept):
            return
        value = self.metric.value(run)
        ranks = len(self.kept) < self.keep or self._better(value, self.kept[-1]["value"])
        if self._any_worker(ranks):
            self._save(run, step, value)

    def end(self, run: RunContext, step: int) -> None:
        self.after_loop(run, step, {})  # the final eval, if it was not at a boundary

    def _better(self, value: float, than: float) -> bool:
        return value == value and (value < than if self.metric.mode == "min" else value > than)

    def _save(self, run: RunContext, step: int, value: float) -> None:
        if not run.is_chief:
            temp_dir = tempfile.mkdtemp(prefix=f"trainer-{self._task_name}-best-")
            try:
                self._checkpoint.write(os.path.join(temp_dir, f"ckpt-{step}"))
            finally:
                shutil.rmtree(temp_dir, ignore_errors=True)
            self._rank(step, value)
            return
        os.makedirs(self._dir, exist_ok=True)
        self._checkpoint.write(os.path.join(self._dir, f"ckpt-{step}"))
        dropped = self._rank(step, value)
        write_text_atomic(os.path.join(self._dir, STATE_FILE), json.dumps(
            {"metric": self.metric.name, "mode": self.metric.mode, "kept": self.kept}, indent=1))
        write_text_atomic(os.path.join(self._dir, "checkpoint"), "".join(  # the CheckpointState text proto
            [f'model_checkpoint_path: "{self.kept[0]["name"]}"\n']
            + [f'all_model_checkpoint_paths: "{e["name"]}"\n' for e in reversed(self.kept)]))
        for entry in dropped:
            _delete_checkpoint(os.path.join(self._dir, entry["name"]))
        shown = ", ".join(f"{e['step']}: {e['value']:.6g}" for e in self.kept)
        run.print_fn(f"best checkpoints by {self.metric.name} ({self.metric.mode}): {shown}")

    def _rank(self, step: int, value: float) -> list[dict]:
        """Inserts the new entry in order (ties: the earlier step first); returns those that drop out."""
        entry = {"step": step, "value": value, "name": f"ckpt-{step}"}
        index = next((i for i, e in enumerate(self.kept) if self._better(value, e["value"])), len(self.kept))
        self.kept.insert(index, entry)
        dropped, self.kept = self.kept[self.keep:], self.kept[:self.keep]
        return dropped

    def _delete_unlisted(self) -> None:
        """Checkpoint files no state names (a save that crashed before its state was written)."""
        listed = {e["name"] for e in self.kept}
        for index_file in glob.glob(os.path.join(self._dir, "ckpt-*.index")):
            prefix = index_file[: -len(".index")]
            if os.path.basename(prefix) not in listed:
                _delete_checkpoint(prefix)


def read_state(model_dir: str) -> dict:
    """`best/best.json`: {"metric", "mode", "kept": [{"step", "value", "name"}, ...]} best first ({} if none)."""
    path = os.path.join(model_dir, BEST_DIR, STATE_FILE)
    if not os.path.exists(path):
        return {}
    try:
        with open(path) as f:
            return json.load(f)
    except ValueError as e:
        raise UserError(f"{path} cannot be read ({e}); move {os.path.dirname(path)} away to rank anew") from e


def _delete_checkpoint(prefix: str) -> None:
    for name in glob.glob(prefix + ".*"):
        os.remove(name)
