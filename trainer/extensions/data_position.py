"""The data position in the checkpoint: where in the train data a run stands, and what a restart guarantees.

Every checkpoint holds, beside the model, the examples trained (global step x global batch: positions
`[0, examples)` of the one global order, trainer/data/order.py) and what that position is a position in:
the train split's size, the seed and the global batch (and the bucket window where examples of any length are
bucketed, trainer/data/sequences.py). Every worker writes the same numbers (they come from
the global step and the settings). A resumed run whose data or seed differ would find another order
behind the same position: refused in one line, or, with `train.allow_resume_changes`, said in one line
(the run goes on at its global step's batch of the new order).

What a restart guarantees depends on the data (docs/your-data.md): a split held in memory (random access:
arrays, or TFRecord files that fit, held as their serialized records)
resumes at exactly the next example on any worker count and under every strategy; a stream resumes by
reading past the batches trained, exact only where the stream itself is the same (one pipeline reading the
same data in the same order, a deterministic input function); the tf.data service hands out its stream
at most once. A run whose restart is not exact says so in one line at its start.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from trainer.data.inputs import Input
from trainer.data.pipeline import held_train
from trainer.data.tfrecord import TFRecordFiles
from trainer.errors import UserError
from trainer.extensions.context import Context
from trainer.extensions.protocol import Extension
from trainer.loops.build import data_choice

INDEXED, STREAM, SERVICE = "indexed", "stream", "service"
HOW_TO_GET_EXACT = (
    "for an exact restart, let the train split be held in memory: return it from tensors "
    "(tf.data.Dataset.from_tensor_slices, known size, under 2 GiB), give the input function an "
    "`arrays(split)` attribute, or give TFRecord files as tfrecord_files (held where they fit "
    "tfrecord_files.max_memory_bytes)"
)


def kind_of(context: Context) -> str:
    """How the run reads its train data: by index from memory, as a stream, or from the tf.data service."""
    settings = context.settings
    if settings.data_service:
        return SERVICE
    return INDEXED if held_train(context.task.input, settings.shard_policy) is not None else STREAM


def how_to_get_exact(inp: Input, shard_policy: str) -> str:
    """How to make this run's train data exact: the general way, or what holds these TFRecord files."""
    files = inp.input_fn
    if not isinstance(files, TFRecordFiles):
        return HOW_TO_GET_EXACT
    if shard_policy.upper() == "FILE":
        return (
            "for an exact restart, set train.shard_policy to 'AUTO' or 'DATA': 'FILE' has each worker read its own "
            "TFRecord files, where the others hold them in memory and gather every global batch by index"
        )
    size = sum(tf.io.gfile.stat(f).length for f in files.files("train"))
    if size <= files.max_memory_bytes:
        return "for an exact restart, let these TFRecord files be held in memory (they fit tfrecord_files.max_memory_bytes)"
    return (
        f"for an exact restart, raise tfrecord_files.max_memory_bytes ({files.max_memory_bytes}) to at least the "
        f"train files' {size} bytes where memory allows: files that fit are held as their records and read by index"
    )


def guarantee(
    kind: str, *, asynchronous: bool, workers: int, deterministic: bool, how: str = HOW_TO_GET_EXACT
) -> str | None:
    """The one line a run prints about what a restart guarantees, None where it is exact on any worker count;
    `how` says how to make it exact."""
    if kind == INDEXED:
        return None
    if kind == SERVICE:
        return (
            "data: read from the tf.data service, which hands out its stream at most once and keeps its own "
            "position: after a restart some examples of the interrupted pass come again or are left out "
            f"(at-most-once per service job); {how}, and turn train.data_service off"
        )
    if asynchronous and workers > 1:
        return (
            f"data: a stream read by each of {workers} parameter-server workers from its own copy: after a "
            "restart some examples of the interrupted pass come again and some are left out (approximate); "
            f"{how}"
        )
    if not deterministic:
        return (
            "data: a stream from an input function marked deterministic = False: a restart skips the batches "
            f"trained, but not the same examples (approximate); {how}"
        )
    return (
        "data: a stream without random access: a restart reads past the batches trained (exact only on the "
        f"same worker count, and slow to skip far); {how}"
    )


class DataPosition(Extension):
    """Keeps the data position in every checkpoint, checks it at restore, and says what a restart guarantees."""

    name = "data_position"

    def __init__(self) -> None:
        self._context: Context | None = None
        self._saved: dict[str, Any] | None = None
        self._identity: dict[str, Any] = {}
        self._path_line = ""

    def attach(self, context: Context) -> None:
        self._context = context

    def state_dict(self) -> dict[str, Any]:
        """{} until `restored` (a run that only evaluates a checkpoint reads no train data)."""
        if not self._identity:
            return {}
        step = int(self._context.task.global_step.numpy())
        return {"examples": step * self._identity["global_batch_size"], "order": self._kind, **self._identity}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._saved = state or None

    def restored(self, context: Context, path: str | None) -> None:
        settings = context.settings
        self._kind = kind_of(context)
        self._identity = {
            "num_examples": context.task.input.num_examples("train"),
            "seed": settings.seed,
            "global_batch_size": settings.global_batch_size,
        }
        if window := context.task.input.sequences.bucket_window:  # bucketing orders within windows of batches
            self._identity["bucket_window"] = window
        if path is not None and self._saved is not None:
            self._check_unchanged(context, path)
        self._path_line = data_choice(context.task.input, settings)[0].line
        line = guarantee(
            self._kind,
            asynchronous=not context.runtime.mode.synchronous,
            workers=context.runtime.num_workers,
            deterministic=context.task.input.deterministic,
            how=how_to_get_exact(context.task.input, settings.shard_policy) if self._kind != INDEXED else "",
        )
        if line and context.runtime.is_chief:
            context.print(line)

    def begin(self, context: Context) -> None:
        """Says which path the train data take (trainer/data/device.py) once training starts: a refused run
        says only its refusal."""
        if context.runtime.is_chief and self._path_line:
            context.print(self._path_line)

    def _check_unchanged(self, context: Context, path: str) -> None:
        saved = self._saved
        changed = [
            f"{key} {saved[key]} -> {value}"
            for key, value in self._identity.items()
            if key in saved and saved[key] != value
        ]
        if not changed:
            return
        step = int(context.task.global_step.numpy())
        was = f"{saved.get('examples')} examples into the order of {saved.get('num_examples')} train examples"
        if not context.settings.allow_resume_changes:
            raise UserError(
                f"{path} is {was}, and this run's data differ ({'; '.join(changed)}), so that position would "
                "name other examples; resume with the original data and train.seed, use a fresh --model_dir, "
                "or set train.allow_resume_changes = True"
            )
        if context.runtime.is_chief:
            context.print(
                f"data changed since {path} ({'; '.join(changed)}), with train.allow_resume_changes: going on at "
                f"global batch {step} of the new order (example position {step * context.settings.global_batch_size}); "
                "in the epoch under way some examples may come twice and some not at all"
            )
