"""`train.export_saved_model`: a SavedModel of the trained model at the end of training, and of
the best checkpoint where `train.keep_best` keeps some (`export/<its step>/`, if not the last).

`model_dir/export/<step>/`'s `serving_default` takes a batch of the model's features (`example[0]`
of a tuple example, else the example; a dict gives a dict signature) and returns `{"outputs": ...}`
(or the model's own dict), with `training=False`; with `train.ema_decay`, the EMA weights.

Every worker saves (as for a checkpoint, docs/design.md rule 6): the chief beside the final
directory, then renamed (no half SavedModel), the others into a temp dir they delete. A dict of
models is refused (which input each serves on is unknown), as is parameter_server.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import tempfile
from typing import Any, Callable, ContextManager, Mapping

import tensorflow as tf

from trainer.distribution import modes
from trainer.errors import UserError
from trainer.extensions.best_checkpoints import BEST_CHECKPOINT, BestCheckpoint
from trainer.extensions.context import Context
from trainer.extensions.protocol import Extension
from trainer.task.steps import call_model

EXPORT_DIR = "export"
EXPORT_WEIGHTS = "export_weights"


def check_exportable(models: Any) -> None:
    """One model, not a dict of them (checked once the models exist, before anything is written)."""
    if isinstance(models, Mapping):
        raise UserError(
            f"train.export_saved_model exports one model, but train.model_fn returned models "
            f"{sorted(models)}; export them yourself (tf.saved_model.save) or unset "
            "train.export_saved_model"
        )


def serving_spec(element_spec: Any) -> Any:
    """The batched spec of the model's input: the features of one train example, batch dimension None."""
    features = element_spec[0] if isinstance(element_spec, (tuple, list)) and len(element_spec) >= 2 else element_spec
    if isinstance(features, Mapping):
        return {str(k): tf.TensorSpec([None, *v.shape], v.dtype, name=str(k)) for k, v in features.items()}
    if isinstance(features, tf.TensorSpec):
        return tf.TensorSpec([None, *features.shape], features.dtype, name="features")
    raise UserError(
        f"train.export_saved_model needs the model's input to be a tensor or a dict of tensors "
        f"(example[0] of a tuple example); the input gives {features!r}"
    )


def save(model: Any, spec: Any, path: str) -> None:
    """Writes `model` as a SavedModel at `path` with a `serving_default` signature on `spec`."""
    module = tf.Module()
    module.model = model
    module.model_variables = list(getattr(model, "variables", []))  # tracked even if the model is not

    @tf.function(input_signature=[spec])
    def serve(features):
        outputs = call_model(model, features, training=False)
        return dict(outputs) if isinstance(outputs, Mapping) else {"outputs": outputs}

    module.serve = serve
    tf.saved_model.save(module, path, signatures={"serving_default": serve.get_concrete_function()})


def export(
    model: Any, spec: Any, model_dir: str, step: int, *, is_chief: bool, task_name: str = "worker"
) -> str | None:
    """Every worker calls this; the chief's SavedModel lands in `model_dir/export/<step>` (returned;
    None on the other workers)."""
    if not is_chief:
        with tempfile.TemporaryDirectory(prefix=f"trainer-{task_name}-export-", ignore_cleanup_errors=True) as temp:
            save(model, spec, os.path.join(temp, str(step)))
        return None
    root = os.path.join(model_dir, EXPORT_DIR)
    os.makedirs(root, exist_ok=True)
    final = os.path.join(root, str(step))
    partial = tempfile.mkdtemp(prefix=f".{step}-partial-", dir=root)
    try:
        save(model, spec, partial)
        if os.path.exists(final):
            shutil.rmtree(final)
        os.replace(partial, final)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return final


@dataclasses.dataclass(frozen=True)
class ExportWeights:
    """Named value `EXPORT_WEIGHTS`: weights to export instead of the trained ones (an EMA, SWA):
    held by the model inside `swapped_in()`, read from a best checkpoint's `checkpoint_items`."""

    label: str
    swapped_in: Callable[[], ContextManager]
    checkpoint_items: Mapping[str, Any]


class Export(Extension):
    """Exports the model at the end of training (the weights another extension offers as
    `EXPORT_WEIGHTS`, if any) and the best checkpoint's model too (`BEST_CHECKPOINT`, if offered)."""

    name = "export"
    setting = "train.export_saved_model"
    supports = modes.SYNCHRONOUS
    unsupported_reason = "the model lives on the ps tasks"
    unsupported_fix = "export from a checkpoint with a synchronous strategy or unset train.export_saved_model"
    after = ("checkpoint", "best_checkpoints")  # the last checkpoint and the final ranking come first

    def attach(self, context: Context) -> None:
        check_exportable(context.task.models)
        self.spec = serving_spec(context.task.input.element_spec)

    def end(self, context: Context, step: int) -> None:
        weights: ExportWeights | None = context.values.get(EXPORT_WEIGHTS)
        self._export(context, step, weights)
        best: BestCheckpoint | None = context.values[BEST_CHECKPOINT]() if BEST_CHECKPOINT in context.values else None
        if best is None or best.step == step:
            return
        # Every worker knows the same best step (the ranking is decided alike on all); only the chief
        # has its checkpoint, so the others take part with the weights they hold, which they then keep.
        if not context.runtime.is_chief:
            self._export(context, best.step, weights)
            return
        items = dict(weights.checkpoint_items) if weights is not None else {}
        variables = [*getattr(context.task.models, "variables", []), *(v for t in items.values() for v in t.variables)]
        held = [tf.identity(tf.convert_to_tensor(v)) for v in variables]
        tf.train.Checkpoint(model=context.task.models, **items).read(best.path).expect_partial()
        try:
            self._export(context, best.step, weights, what=f"the best checkpoint by {best.metric}")
        finally:
            for variable, value in zip(variables, held):
                variable.assign(value)

    def _export(self, context: Context, step: int, weights: ExportWeights | None, what: str = "") -> None:
        with weights.swapped_in() if weights is not None else contextlib.nullcontext():
            path = export(
                context.task.models,
                self.spec,
                context.settings.model_dir,
                step,
                is_chief=context.runtime.is_chief,
                task_name=context.runtime.cluster.task_name,
            )
        if context.runtime.is_chief:
            label = f" ({weights.label})" if weights is not None else ""
            context.print(f"exported SavedModel{label}{' of ' + what if what else ''} to {path}")
