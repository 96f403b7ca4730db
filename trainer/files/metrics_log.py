"""Where metrics land: `metrics.jsonl` and TensorBoard event files, written by the chief only.

`metrics.jsonl` (the contract in docs/design.md) holds one JSON object per line, appended across restarts:
{"step": int, "split": "train"|"eval"|<eval split>, <metric>: float, ...}. TensorBoard gets the
same scalars under `model_dir/train`, `model_dir/eval` and, for another eval split,
`model_dir/eval/<split>` (a run of its own, `eval/<split>`, beside `eval`). The train event file is
also where the step's own `tf.summary` calls land (trainer/loops/step_summaries.py): one writer per
directory (trainer/files/event_writers.py).
"""
from __future__ import annotations

import json
import os
from typing import Callable, Mapping

import tensorflow as tf

from trainer.errors import RunFailure
from trainer.files.event_writers import EventWriter, event_writer

METRICS_FILE = "metrics.jsonl"


class MetricsLog:
    """Appends metric records; a no-op on non-chief workers, decided once in the constructor."""

    def __init__(self, model_dir: str, *, enabled: bool):
        self.enabled = enabled
        self._path = os.path.join(model_dir, METRICS_FILE)
        self._model_dir = model_dir
        self._writers: dict[str, EventWriter] = {}
        self._listeners: list[Callable[[int, str, dict[str, float]], None]] = []
        if enabled:
            self._writer("train")
            self._writer("eval")

    def _writer(self, split: str) -> EventWriter:
        if split not in self._writers:
            where = split if split in ("train", "eval") else os.path.join("eval", split)
            writer = event_writer(os.path.join(self._model_dir, where))
            writer.init()
            self._writers[split] = writer
        return self._writers[split]

    def record(self, step: int, split: str, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        line = {"step": int(step), "split": split} | {k: float(v) for k, v in metrics.items()}
        try:
            with open(self._path, "a") as f:
                f.write(json.dumps(line) + "\n")
        except OSError as e:  # a full disk, a model_dir that vanished: say so in one line
            raise RunFailure(f"writing {self._path} failed ({e.strerror or e}); free disk space or restore "
                             "model_dir, then rerun: it continues from the newest checkpoint") from e
        writer = self._writer(split)
        with writer.as_default(step=step):
            for name, value in metrics.items():
                tf.summary.scalar(name, value)
        if split != "train":  # rare, and what a reader waits for
            writer.flush()
        for listener in self._listeners:
            listener(int(step), split, dict(metrics))

    def subscribe(self, listener: Callable[[int, str, dict[str, float]], None]) -> None:
        """`listener(step, split, metrics)` gets every record written from now on (e.g. MLflow's hook)."""
        self._listeners.append(listener)

    def text(self, step: int, name: str, markdown: str) -> None:
        """A text summary (e.g. the operative gin config) in the train event files."""
        if not self.enabled:
            return
        with self._writers["train"].as_default(step=step):
            tf.summary.text(name, markdown)
        self._writers["train"].flush()

    def hparams(self, values: Mapping[str, bool | int | float | str], trial_id: str) -> None:
        """The run's hyperparameters as an hparams summary in `model_dir` itself, the parent of
        `train/` and `eval/`: TensorBoard's HParams tab shows each run directory as a session,
        its hparams beside its train and eval scalars (the eval ones at their last value).

        No `hparams_config` is written: TensorBoard takes the first one it finds for the whole
        logdir, which would hide the hparams of sibling runs bound differently; without one it
        takes the union of every run's hparams and its scalar tags as the metrics.
        """
        if not self.enabled:
            return
        from tensorboard.plugins.hparams import api as hp

        writer = tf.summary.create_file_writer(os.path.dirname(self._path))
        with writer.as_default():
            hp.hparams(dict(values), trial_id=trial_id)
        writer.close()

    def close(self) -> None:
        for writer in self._writers.values():
            writer.close()


def read_metrics(model_dir: str) -> list[dict]:
    """All records of `model_dir/metrics.jsonl`, in order (empty if there is none)."""
    path = os.path.join(model_dir, METRICS_FILE)
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
