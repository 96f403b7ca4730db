"""Our side of a parity run, and the files that carry results between processes.

Our side is the real thing: `train`'s own setup (trainer/run/setup.py) and the core's choice of loop
(trainer/loops/build.py), with the configured model, optimizer, step and input. Written
against the `keras` module, so that a tf_keras process can import it too.
"""

from __future__ import annotations

import json
import os
from typing import Mapping

import numpy as np
import tensorflow as tf

from trainer import data
from trainer.distribution.runtime import Runtime
from trainer.errors import UserError
from trainer.loops.build import build_loops
from trainer.loops.evaluator import Evaluator, make_metrics
from trainer.run.settings import Settings
from trainer.task.task import Task, build_eval_models


def settings_from_gin() -> Settings:
    """The parsed gin config's `train` bindings as the run's Settings."""
    from trainer import configurables

    return configurables.settings_from_gin()


def single_model(task: Task):
    """The one model fit can train (fit knows nothing of a dict of models or optimizers)."""
    if isinstance(task.models, Mapping) or isinstance(task.optimizers, Mapping):
        raise UserError(
            "parity compares with Keras fit, which trains one model with one optimizer; this "
            "train.model_fn/optimizer_fn returns a dict of them"
        )
    return task.models


def run_ours(runtime: Runtime, task: Task, settings: Settings, steps: int, chunk: int = 1) -> list[float]:
    """`steps` steps of the loop `train` would choose, `chunk` steps per call; the 'loss' of each call.

    One step per call gives step-by-step losses. Under parameter_server with several workers
    a call of `steps_per_loop` steps spreads its closures over the workers, as in training.
    """
    loop, _ = build_loops(runtime, task, settings, start_step=0)
    losses = []
    for start in range(0, steps, chunk):
        outputs = loop.run(min(chunk, steps - start))
        if "loss" not in outputs:
            raise UserError(
                f"the step returns {sorted(outputs)} but no 'loss'; parity compares the 'loss' "
                "output with Keras fit's loss"
            )
        losses.append(outputs["loss"])
    return losses


def evaluate(settings: Settings, weights_list: list[np.ndarray]) -> dict[str, float]:
    """The configured eval step over the first eval split, on this process's device, with these weights."""
    inp = settings.make_input()
    model, _, _ = build_eval_models(inp, settings.model_fn)
    model.set_weights(weights_list)
    split, gb = inp.eval_splits[0], settings.global_batch_size
    metrics = make_metrics(settings.eval_metrics_fn)
    return Evaluator(
        tf.distribute.get_strategy(),
        model,
        settings.eval_step_fn,
        data.eval_dataset(inp, gb, split=split),
        -(-inp.num_examples(split) // gb),
        metrics=metrics,
    ).evaluate()


def weights(model) -> list[np.ndarray]:
    """The model's weights in its own order (the same order for Keras 3 and tf_keras)."""
    return [np.asarray(w) for w in model.get_weights()]


def copy_state(source_model, target_model) -> None:
    """Every variable (weights and seed-generator states) of one model into a twin."""
    for a, b in zip(source_model.variables, target_model.variables, strict=True):
        b.assign(np.asarray(a.numpy()))


def save(path: str, *, losses: list[float], arrays: dict[str, list[np.ndarray]], **meta) -> None:
    """`path`.json (losses and meta) and `path`.npz (named lists of arrays)."""
    flat = {f"{name}/{i}": a for name, values in arrays.items() for i, a in enumerate(values)}
    np.savez(path + ".npz", **flat)
    with open(path + ".json", "w") as f:
        json.dump({"losses": losses, **meta}, f)


def load(path: str) -> tuple[dict, dict[str, list[np.ndarray]]]:
    with open(path + ".json") as f:
        meta = json.load(f)
    arrays: dict[str, list] = {}
    with np.load(path + ".npz") as stored:
        keys = sorted(stored.files, key=lambda k: (k.rsplit("/", 1)[0], int(k.rsplit("/", 1)[1])))
        for key in keys:
            arrays.setdefault(key.rsplit("/", 1)[0], []).append(stored[key])
    return meta, arrays


def exists(path: str) -> bool:
    return os.path.exists(path + ".json") and os.path.exists(path + ".npz")
