"""`train.keep_best`: the best K checkpoints by an eval metric, in `model_dir/best/`, beside the newest ones.

Every worker takes part in each write (the chief's alone deadlocks multi-worker strategies,
docs/design.md rule 6) and decides alike (one all-reduce). The ranking is the extension's own
checkpointed state, so a resumed run ranks as one that never stopped. As CheckpointManager does,
files are written first, then `best/best.json` and `best/checkpoint` (so `tf.train.latest_checkpoint`
names the best) replaced atomically, then dropped ones deleted; files the restored ranking does not
name are deleted at start. The best is offered as `BEST_CHECKPOINT` (the export uses it).
"""

from __future__ import annotations

import dataclasses
import glob
import json
import math
import os
import tempfile
from typing import Any

from trainer.errors import UserError
from trainer.extensions.context import Context
from trainer.extensions.monitoring import AnyWorker, Monitored
from trainer.extensions.protocol import Extension, Outputs
from trainer.files.atomic import write_text_atomic

BEST_DIR = "best"
STATE_FILE = "best.json"
BEST_CHECKPOINT = "best_checkpoint"


@dataclasses.dataclass(frozen=True)
class BestCheckpoint:
    """Named value `BEST_CHECKPOINT` (a function returning one, or None while nothing ranks)."""

    step: int
    path: str
    metric: str


class BestCheckpoints(Extension):
    """Keeps `keep` checkpoints, the best by `metric`, as `model_dir/best/ckpt-<step>`."""

    name = "best_checkpoints"
    setting = "train.keep_best"
    after = ("eval",)

    def __init__(self, keep: int, metric: Monitored):
        self.keep, self.metric = keep, metric
        self.kept: list[dict] = []  # {"step", "value", "name"}, best first
        self._from_checkpoint = False
        self._dir = ""
        self._any_worker: AnyWorker | None = None

    def state_dict(self) -> dict[str, Any]:
        return {"metric": self.metric.name, "mode": self.metric.mode, "kept": self.kept}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._from_checkpoint = True
        if state.get("metric") == self.metric.name and state.get("mode") == self.metric.mode:
            self.kept = list(state.get("kept", []))

    def attach(self, context: Context) -> None:
        context.provide(BEST_CHECKPOINT, self.best)

    def restored(self, context: Context, path: str | None) -> None:
        state = read_state(context.settings.model_dir)
        if path is not None and not self._from_checkpoint and state:  # a checkpoint older than extension state
            self.load_state_dict(state)
        elif state and (state.get("metric"), state.get("mode")) != (self.metric.name, self.metric.mode):
            context.print(
                f"note: {os.path.join(context.settings.model_dir, BEST_DIR)} ranks by {state.get('metric')!r} "
                f"({state.get('mode')}), this run by {self.metric.name!r} ({self.metric.mode}); ranking anew"
            )

    def verify(self, outputs: Outputs) -> None:
        self.metric.verify(outputs)

    def best(self) -> BestCheckpoint | None:
        """The best checkpoint so far (None while nothing ranks)."""
        if not self.kept:
            return None
        return BestCheckpoint(self.kept[0]["step"], os.path.join(self._dir, self.kept[0]["name"]), self.metric.name)

    def begin(self, context: Context) -> None:
        self._any_worker = AnyWorker(context.runtime.strategy)
        self._dir = os.path.join(context.settings.model_dir, BEST_DIR)
        if context.runtime.is_chief and os.path.isdir(self._dir):
            self._write_state()
            self._delete_unlisted()

    def after_loop(self, context: Context, step: int, metrics: dict[str, float]) -> None:
        results = context.evaluations.at(step)
        if results is None or any(e["step"] == step for e in self.kept):
            return
        value = self.metric.value(results)
        if self._any_worker(self.ranks(value)):
            self._save(context, step, value)

    def end(self, context: Context, step: int) -> None:
        self.after_loop(context, step, {})  # the final eval, if it was not at a boundary

    def ranks(self, value: float) -> bool:
        """Whether an eval of `value` enters the best K: a NaN or infinite value never does, even with room."""
        return math.isfinite(value) and (len(self.kept) < self.keep or self._better(value, self.kept[-1]["value"]))

    def _better(self, value: float, than: float) -> bool:
        """Strictly better; a NaN or infinite value never ranks (nor takes the place of the best)."""
        return math.isfinite(value) and (value < than if self.metric.mode == "min" else value > than)

    def _save(self, context: Context, step: int, value: float) -> None:
        if not context.runtime.is_chief:
            prefix = f"trainer-{context.runtime.cluster.task_name}-best-"
            with tempfile.TemporaryDirectory(prefix=prefix, ignore_cleanup_errors=True) as temp:
                context.saver.write_copy(os.path.join(temp, f"ckpt-{step}"))
            self._rank(step, value)
            return
        os.makedirs(self._dir, exist_ok=True)
        context.saver.write_copy(os.path.join(self._dir, f"ckpt-{step}"))
        dropped = self._rank(step, value)
        self._write_state()
        for entry in dropped:
            _delete_checkpoint(os.path.join(self._dir, entry["name"]))
        shown = ", ".join(f"{e['step']}: {e['value']:.6g}" for e in self.kept)
        context.print(f"best checkpoints by {self.metric.name} ({self.metric.mode}): {shown}")

    def _write_state(self) -> None:
        """`best.json` and the `checkpoint` state file, for readers of the directory (chief)."""
        write_text_atomic(os.path.join(self._dir, STATE_FILE), json.dumps(self.state_dict(), indent=1))
        write_text_atomic(
            os.path.join(self._dir, "checkpoint"),
            "".join(  # the CheckpointState text proto
                [f'model_checkpoint_path: "{self.kept[0]["name"]}"\n' if self.kept else ""]
                + [f'all_model_checkpoint_paths: "{e["name"]}"\n' for e in reversed(self.kept)]
            ),
        )

    def _rank(self, step: int, value: float) -> list[dict]:
        """Inserts the new entry in order (ties: the earlier step first); returns those that drop out."""
        entry = {"step": step, "value": value, "name": f"ckpt-{step}"}
        index = next((i for i, e in enumerate(self.kept) if self._better(value, e["value"])), len(self.kept))
        self.kept.insert(index, entry)
        dropped, self.kept = self.kept[self.keep :], self.kept[: self.keep]
        return dropped

    def _delete_unlisted(self) -> None:
        """Checkpoint files the ranking does not name."""
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
