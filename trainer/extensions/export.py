"""`train.export_saved_model`: a SavedModel of the trained model at the end of training, and of
the best checkpoint where `train.keep_best` keeps some (`export/<its step>/`, if not the last).

`model_dir/export/<step>/` holds a SavedModel whose `serving_default` signature takes a batch
of the model's input, as the input function gives it: the features of a train example
(`example[0]` of a tuple example, else the whole example; a dict of features gives a dict
signature, each key an input) with a leading batch dimension of any size. It returns
`{"outputs": <the model's output>}` (or the model's own dict), the model called with
`training=False`. With `train.ema_decay` on, the EMA weights are exported.

Under multi_worker_mirrored every worker saves (as every worker saves a checkpoint, DESIGN.md
rule 6): the chief into `model_dir/export/<step>/` (written beside it, then renamed, so a
crashed export leaves no half SavedModel there), the others into a temporary directory they
delete. One model only: a dict of models (a GAN) is refused in one line, since the loop cannot
know which input each of them serves on. Not under parameter_server (refused in one line).
"""
from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any, Mapping

import tensorflow as tf

from trainer.extensions.best_checkpoints import BEST_DIR
from trainer.hooks.base import Hook, RunContext
from trainer.task.steps import call_model
from trainer.errors import UserError
from trainer.validation import check_bool

EXPORT_DIR = "export"


def check_export(export_saved_model: Any, strategy: str) -> None:
    """`train.export_saved_model` is a bool; refused under parameter_server."""
    check_bool("train.export_saved_model", export_saved_model)
    if export_saved_model and strategy == "parameter_server":
        raise UserError("train.export_saved_model is not supported with parameter_server; export from a "
                        "checkpoint with a synchronous strategy or unset train.export_saved_model")


def check_exportable(models: Any) -> None:
    """One model, not a dict of them (checked once the models exist, before anything is written)."""
    if isinstance(models, Mapping):
        raise UserError(f"train.export_saved_model exports one model, but train.model_fn returned models "
                        f"{sorted(models)}; export them yourself (tf.saved_model.save) or unset "
                        "train.export_saved_model")


def serving_spec(element_spec: Any) -> Any:
    """The batched spec of the model's input: the features of one train example, batch dimension None."""
    features = element_spec[0] if isinstance(element_spec, (tuple, list)) and len(element_spec) >= 2 else element_spec
    if isinstance(features, Mapping):
        return {str(k): tf.TensorSpec([None, *v.shape], v.dtype, name=str(k)) for k, v in features.items()}
    if isinstance(features, tf.TensorSpec):
        return tf.TensorSpec([None, *features.shape], features.dtype, name="features")
    raise UserError(f"train.export_saved_model needs the model's input to be a tensor or a dict of tensors "
                    f"(example[0] of a tuple example); the input gives {features!r}")


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


def export(model: Any, spec: Any, model_dir: str, step: int, *, is_chief: bool,
           task_name: str = "worker") -> str | None:
    """Every worker calls this; the chief's SavedModel lands in `model_dir/export/<step>` (returned;
    None on the other workers)."""
    if not is_chief:
        temp_dir = tempfile.mkdtemp(prefix=f"trainer-{task_name}-export-")
        try:
            save(model, spec, os.path.join(temp_dir, str(step)))
        finally:
            shutil.rmtree(temp_dir, ignore_errors=True)
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


class ExportHook(Hook):
    """Exports the model at the end of training (the EMA weights where `average` is given) and,
    with `best` (the run's BestCheckpointHook), the best checkpoint's model too."""

    def __init__(self, spec: Any, task_name: str, average: Any = None, best: Any = None):
        self.spec, self.task_name, self.average, self.best = spec, task_name, average, best

    def end(self, run: RunContext, step: int) -> None:
        self._export(run, step)
        best_step = self.best.kept[0]["step"] if self.best is not None and self.best.kept else None
        if best_step is None or best_step == step:
            return
        # Every worker knows the same best step (the hook decides alike on all); only the chief has
        # its checkpoint, so the others take part with the weights they hold, which they then keep.
        if not run.is_chief:
            self._export(run, best_step)
            return
        variables = _state_variables(run.model, self.average)
        held = [tf.identity(tf.convert_to_tensor(v)) for v in variables]
        checkpoint = tf.train.Checkpoint(model=run.model, **({"ema": self.average} if self.average is not None else {}))
        checkpoint.read(os.path.join(run.model_dir, BEST_DIR, self.best.kept[0]["name"])).expect_partial()
        try:
            self._export(run, best_step, what=f"the best checkpoint by {self.best.metric.name}")
        finally:
            for variable, value in zip(variables, held):
                variable.assign(value)

    def _export(self, run: RunContext, step: int, what: str = "") -> None:
        if self.average is not None:
            with self.average.swapped_in():
                path = export(run.model, self.spec, run.model_dir, step, is_chief=run.is_chief,
                              task_name=self.task_name)
        else:
            path = export(run.model, self.spec, run.model_dir, step, is_chief=run.is_chief, task_name=self.task_name)
        if run.is_chief:
            weights = " (EMA weights)" if self.average is not None else ""
            run.print_fn(f"exported SavedModel{weights}{' of ' + what if what else ''} to {path}")


def _state_variables(model: Any, average: Any) -> list:
    """What a best-checkpoint restore changes: the model's variables and the EMA's."""
    return [*getattr(model, "variables", []), *(average.averages if average is not None else [])]
