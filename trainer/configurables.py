"""Gin at the edge: every name a gin file may bind, registered here and nowhere else.

The library stays plain Python; this module gives its functions and classes gin names.
`python -m trainer.configurables` lists them with their parameters and one-line docs.
"""
from __future__ import annotations

import inspect
import sys

import gin

from trainer import data, devices, hooks, models, optimizers, steps
from trainer import train as train_lib

REGISTERED = {
    "train": train_lib.train,
    "cnn": models.cnn,
    "mlp": models.mlp,
    "classification_step": steps.classification_step,
    "classification_eval_step": steps.classification_eval_step,
    "make_optimizer": optimizers.make_optimizer,
    "digits": data.Digits,
    "fashion_mnist": data.FashionMnist,
    "tfrecord_files": data.TFRecordFiles,
    "synthetic": data.Synthetic,
    "devices": devices.DeviceConfig,
    "progress_logger": hooks.ProgressLogger,
    "checkpoint_hook": hooks.CheckpointHook,
    "eval_hook": hooks.EvalHook,
}
"""Gin name -> library object. Models are bound as `train.model_fn = @cnn` (called with
input_shape and num_classes), data sources and devices as instances (`@digits()`)."""

CONFIGURABLES = {name: gin.external_configurable(target, name) for name, target in REGISTERED.items()}
train = CONFIGURABLES["train"]


def describe(name: str, target) -> str:
    """`name(param=default, ...)` and the first line of the docstring."""
    signature = inspect.signature(target)
    params = ", ".join(
        p.name if p.default is inspect.Parameter.empty else f"{p.name}={p.default!r}"
        for p in signature.parameters.values()
        if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    )
    doc = (inspect.getdoc(target) or "").splitlines()
    return f"{name}({params})\n    {doc[0] if doc else ''}"


def main() -> None:
    for name, target in REGISTERED.items():
        print(describe(name, target))


if __name__ == "__main__":
    sys.exit(main())
