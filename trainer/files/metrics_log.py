"""Where metrics land: `MetricsLog`, the one writer of metrics (training, its evals and the sidecar),
and `read_history`, the one reader of `metrics.jsonl` as one history.

One `record(step, split, values)` reaches every sink, as CLU's MultiWriter does: `metrics.jsonl`
(the contract in docs/design.md), TensorBoard (`model_dir/train`, `model_dir/eval`, `model_dir/workers`,
another eval split under `eval/<split>`; one writer per directory, trainer/files/event_writers.py) and each
subscribed sink (MLflow's). A run that continues a history (a resume, a roll-back) first appends
`{"step": S, "split": "resumed"}`: earlier lines of steps above S are superseded. A re-evaluation of a
checkpoint (`--mode=evaluate`) writes its lines with `"reevaluated": <the checkpoint>` last, and its
TensorBoard scalars under `model_dir/reeval/<split>`. Reading needs no TensorFlow (trainer.plot runs without it).
"""

from __future__ import annotations

import json
import math
import os
from typing import TYPE_CHECKING, Callable, Mapping, Sequence

from trainer.errors import RunFailure, UserError

if TYPE_CHECKING:
    from trainer.files.event_writers import EventWriter

METRICS_FILE = "metrics.jsonl"
RESUMED = "resumed"  # the split of the line a resumed run starts with
REEVALUATED = "reevaluated"  # the field naming the checkpoint a re-evaluation's line is of
REEVAL_DIR = "reeval"  # the TensorBoard directory of re-evaluations, one subdirectory per split
WORKERS = "workers"  # the split of the worker watch's records: not an evaluation, a run of its own
OWN_RUNS = ("train", "eval", WORKERS)  # the splits with their own TensorBoard run; any other is an eval split
Sink = Callable[[int, str, dict[str, float]], None]  # (step, split, values)


class MetricsLog:
    """Appends metric records to every sink; a no-op on non-chief workers (`enabled`, decided once).
    The event files of `open_now` are created at once, any other split's at its first record. With
    `reevaluated` (the checkpoint's name) every record is marked as a re-evaluation of it."""

    def __init__(
        self,
        model_dir: str,
        *,
        enabled: bool = True,
        open_now: Sequence[str] = ("train", "eval"),
        reevaluated: str | None = None,
    ):
        self.enabled = enabled
        self._marker = {} if reevaluated is None else {REEVALUATED: reevaluated}
        self._path = os.path.join(model_dir, METRICS_FILE)
        self._model_dir = model_dir
        self._writers: dict[str, EventWriter] = {}
        self._sinks: list[Sink] = [self._scalars]
        if enabled:
            for split in open_now:
                self._writer(split)

    def __enter__(self) -> MetricsLog:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _writer(self, split: str) -> EventWriter:
        from trainer.files.event_writers import event_writer  # TensorFlow: the writer's only

        if split not in self._writers:
            if self._marker:
                where = os.path.join(REEVAL_DIR, split)
            else:
                where = split if split in OWN_RUNS else os.path.join("eval", split)
            writer = event_writer(os.path.join(self._model_dir, where))
            writer.init()
            self._writers[split] = writer
        return self._writers[split]

    def resumed(self, step: int) -> None:
        """A run starts at `step` (0: from scratch): if model_dir holds a history already, marks
        its lines of later steps superseded (`{"step": step, "split": "resumed"}`)."""
        if self.enabled and os.path.exists(self._path) and os.path.getsize(self._path) > 0:
            self._append({"step": int(step), "split": RESUMED})

    def record(self, step: int, split: str, values: Mapping[str, float], *, num_examples: float | None = None) -> None:
        """`values` to every sink; `num_examples` (an eval's count) to the JSON line only, last but
        the re-evaluation's marker: it marks the sidecar evaluator's lines apart from the chief's inline evals."""
        if not self.enabled:
            return
        count = {} if num_examples is None else {"num_examples": float(num_examples)}
        self._append(
            {"step": int(step), "split": split} | {k: float(v) for k, v in values.items()} | count | self._marker
        )
        for sink in self._sinks:
            sink(int(step), split, dict(values))

    def _scalars(self, step: int, split: str, values: dict[str, float]) -> None:
        import tensorflow as tf

        writer = self._writer(split)
        with writer.as_default(step=step):
            for name, value in values.items():
                tf.summary.scalar(name, value)
        if split != "train":  # rare, and what a reader waits for
            writer.flush()

    def _append(self, line: dict) -> None:
        try:  # O_APPEND, the whole line in one write: never inside a line the sidecar appends, or the chief
            with open(self._path, "a") as f:
                f.write(json.dumps(line) + "\n")
        except OSError as e:  # a full disk, a model_dir that vanished: say so in one line
            raise RunFailure(
                f"writing {self._path} failed ({e.strerror or e}); free disk space or restore "
                "model_dir, then rerun: it continues from the newest checkpoint"
            ) from e

    def subscribe(self, sink: Sink) -> None:
        """`sink(step, split, values)` gets every record from now on (MLflow's, say)."""
        self._sinks.append(sink)

    def text(self, step: int, name: str, markdown: str) -> None:
        """A text summary (e.g. the operative gin config) in the train event files."""
        if not self.enabled:
            return
        import tensorflow as tf

        with self._writers["train"].as_default(step=step):
            tf.summary.text(name, markdown)
        self._writers["train"].flush()

    def hparams(self, values: Mapping[str, bool | int | float | str], trial_id: str) -> None:
        """The run's hyperparameters as an hparams summary in `model_dir` itself (the parent of `train/`
        and `eval/`: one HParams session per run). No `hparams_config`: TensorBoard takes the first it
        finds for the whole logdir, hiding sibling runs' hparams; without one it takes their union."""
        if not self.enabled:
            return
        import tensorflow as tf
        from tensorboard.plugins.hparams import api as hp

        writer = tf.summary.create_file_writer(os.path.dirname(self._path))
        with writer.as_default():
            hp.hparams(dict(values), trial_id=trial_id)
        writer.close()

    def close(self) -> None:
        for writer in self._writers.values():
            writer.close()


def eval_line(split: str, step: int, results: Mapping[str, float], num_examples: float, label: str = "") -> str:
    """The printed line of one eval, training's and the sidecar's alike."""
    shown = "  ".join(f"{k} {v:.4f}" for k, v in results.items())
    where = "" if split == "eval" else f" on {split}"
    return f"eval{where}{label} at step {step}: {shown}  ({int(num_examples)} examples)"


def nonfinite_warning(split: str, step: int, results: Mapping[str, float]) -> str | None:
    """One line naming the split, step and eval results that are NaN or infinite (None if all are finite):
    a model non-finite on a real example of weight above 0, which no ranking or stopping rule counts."""
    bad = [f"{k} {v}" for k, v in results.items() if not math.isfinite(v)]
    if not bad:
        return None
    return (
        f"warning: eval split {split!r} at step {step}: {', '.join(bad)} (not finite: the model is NaN or inf on "
        "an example of weight above 0); best checkpoints and early stopping never count it as the best or an "
        "improvement"
    )


def read_history(model_dir: str) -> list[dict]:
    """`model_dir/metrics.jsonl` as one history: each (step, split) once, the last written, in step
    order, without superseded and `resumed` lines; a last line still being written is skipped."""
    path = os.path.join(model_dir, METRICS_FILE)
    if not os.path.isfile(path):
        raise UserError(f"no {METRICS_FILE} in {model_dir}; pass the --model_dir of a trainer.main run")
    latest: dict[tuple[int, str], dict] = {}
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                if number > 1 and not line.endswith("\n"):
                    break  # a line a running job is still writing
                raise UserError(f"{path}:{number} is not a JSON line") from None
            if not isinstance(record, dict) or not isinstance(record.get("step"), int) or "split" not in record:
                raise UserError(f'{path}:{number} is not a metrics record (it needs a "step" and a "split")')
            key = (record["step"], record["split"])
            if key[1] == RESUMED:
                latest = {k: r for k, r in latest.items() if k[0] <= key[0]}
            else:
                latest.pop(key, None)  # the last one written, in the place it was written
                latest[key] = record
    return sorted(latest.values(), key=lambda r: r["step"])
