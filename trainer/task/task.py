"""The task: what is trained (models, optimizers, steps, input), built under the scope.

`model_fn` may return a Keras model, a `tf.Module` or a dict of them (a GAN); `optimizer_fn` one optimizer
or a dict; the steps receive them as returned. All state is created under `strategy.scope()` and built
before the first step (docs/design.md rule 1: a Keras 3 optimizer built lazily inside tf.function fails
under Mirrored), and goes into one checkpoint. `model_fn` and `optimizer_fn` get only the keyword arguments
they declare among MODEL_ARGUMENTS and OPTIMIZER_ARGUMENTS.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from typing import Any, Callable, Mapping

import tensorflow as tf

from trainer import data
from trainer.distribution.runtime import Runtime
from trainer.errors import UserError, error_line
from trainer.task import layer_state, precision, user_code
from trainer.task.contract import function_name
from trainer.task.steps import call_model
from trainer.task.structure import flat, keras_layers_held, named, trainable_variables

MODEL_ARGUMENTS = ("input_shape", "num_classes", "element_spec")
OPTIMIZER_ARGUMENTS = ("global_batch_size", "total_steps")
_MISSING_ARGUMENT = re.compile(r"missing \d+ required (?:positional|keyword-only) arguments?")


def call_with_declared(fn: Callable, available: Mapping[str, Any], *, what: str) -> Any:
    """Calls `fn` with those of `available` that it declares (all if it takes **kwargs); a declared one without
    a default that is not available (None) and that no gin binding supplies is refused in one line."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        params = {}
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    kwargs = {k: v for k, v in available.items() if v is not None and (takes_any or k in params)}
    unsupplied = [
        k
        for k, p in params.items()
        if k in available
        and k not in kwargs
        and p.default is inspect.Parameter.empty
        and p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    ]
    try:
        return fn(**kwargs)
    except TypeError as error:
        text = str(error)
        if not _MISSING_ARGUMENT.search(text):
            raise
        names = unsupplied or re.findall(r"'(\w+)'", text.split("argument", 1)[-1]) or ["?"]
        offered = ", ".join(available)
        raise UserError(
            f"{what} {function_name(fn)} needs parameter '{names[0]}', which the loop cannot supply (it passes only "
            f"those of {offered} that it knows); give '{names[0]}' a default or bind it in gin "
            f"({function_name(fn)}.{names[0]} = ...)"
        ) from error


def make_models(model_fn: Callable, inp: data.Input) -> Any:
    available = {"input_shape": inp.input_shape, "num_classes": inp.num_classes, "element_spec": inp.element_spec}
    models = call_with_declared(model_fn, available, what="train.model_fn")
    for model in flat(models):
        if not isinstance(model, tf.Module) and not hasattr(model, "trainable_variables"):
            raise UserError(
                f"train.model_fn {function_name(model_fn)} returned {type(model).__name__}, not a Keras "
                "model, a tf.Module or a dict of them"
            )
    return models


def build_by_calling(models: Any, model_fn: Callable, inp: data.Input) -> None:
    """Builds every model not built yet by calling it once, in inference mode, on zeros shaped as the train
    features (docs/design.md rule 16: Keras 3's `build(shape)` creates no sublayer's variables)."""
    spec = inp.element_spec
    features = spec[0] if isinstance(spec, (tuple, list)) and len(spec) >= 2 else spec
    # A feature of unknown length is built on examples of length 1.
    zeros = tf.nest.map_structure(lambda s: tf.zeros([2, *(d or 1 for d in s.shape)], s.dtype), features)
    for key, model in named(models, default="").items():
        built = getattr(model, "built", None)
        if built or (built is None and getattr(model, "variables", None)):
            continue
        which = f"{f'model {key!r}' if key else 'the model'} of train.model_fn {function_name(model_fn)}"
        shapes = tf.nest.map_structure(lambda s: [None, *s.shape], features)
        try:
            call_model(model, zeros, training=False)
        except Exception as error:  # noqa: BLE001  (the user's model: its failure is theirs to fix)
            if own := user_code.own_frame_names(error):  # a bug in the model's own code, not a missing build
                raise user_code.raised_by(
                    error, own[-1], f"{own[-1]}, called on a batch of the train features {shapes} to build {which},"
                ) from error
            raise UserError(
                f"{which} is not built, and calling it on a batch of the train features {shapes} to "
                f"build it failed ({error_line(error)}); build it in model_fn (a keras.Input, or a "
                "call on a batch of its real inputs)"
            ) from error
        if not getattr(model, "trainable_variables", None):
            if held := keras_layers_held(model):
                raise UserError(
                    f"{which} is a tf.Module holding Keras layers ({', '.join(held)}), whose weights "
                    "tf.Module does not collect: its trainable_variables finds only tf.Variables and "
                    "nested tf.Modules, and a Keras 3 layer is neither (keras.Variable wraps a "
                    "tf.Variable); subclass keras.Layer or keras.Model instead of tf.Module (Keras tracks "
                    "its sublayers' weights), or hold tf.Variables (tf.nn.embedding_lookup on one, which a "
                    "variable_partitioner can shard)"
                )
            raise UserError(
                f"{which} has no trainable variables even after a call on a batch of the train features "
                f"{shapes}; a model needs weights to train: create them in model_fn"
            )


def make_optimizers(optimizer_fn: Callable, *, global_batch_size: int, total_steps: int, policy: str) -> Any:
    """`optimizer_fn`'s optimizers, checked, each wrapped for loss scaling where the policy needs it."""
    optimizers = call_with_declared(
        optimizer_fn, {"global_batch_size": global_batch_size, "total_steps": total_steps}, what="train.optimizer_fn"
    )
    for key, optimizer in named(optimizers, default="").items():
        if not callable(getattr(optimizer, "apply_gradients", None)):
            shown = f"{{{key!r}: {type(optimizer).__name__}, ...}}" if key else type(optimizer).__name__
            raise UserError(
                f"train.optimizer_fn {function_name(optimizer_fn)} returned {shown}, not an optimizer; "
                "return a Keras optimizer (or a dict of them keyed like the models)"
            )
    if isinstance(optimizers, Mapping):
        return {k: precision.wrap_optimizer(o, policy) for k, o in optimizers.items()}
    return precision.wrap_optimizer(optimizers, policy)


def build_optimizers(models: Any, optimizers: Any) -> None:
    """Creates every optimizer's variables now, under the scope: one optimizer trains every model, a dict of
    them the models of the same keys."""
    if not isinstance(optimizers, Mapping):
        if hasattr(optimizers, "build"):
            optimizers.build(trainable_variables(models))
        return
    model_keys = set(models) if isinstance(models, Mapping) else set()
    if not set(optimizers) <= model_keys:
        raise UserError(
            f"train.optimizer_fn returned optimizers {sorted(optimizers)} but train.model_fn returned "
            f"{'models ' + str(sorted(model_keys)) if model_keys else 'one model'}: key each optimizer like the "
            "model it trains, so it can be built with that model's variables before the first step"
        )
    for key, optimizer in optimizers.items():
        if hasattr(optimizer, "build"):
            optimizer.build(list(models[key].trainable_variables))


@dataclasses.dataclass
class Task:
    """What is trained, built under the scope; `checkpoint_items` hold all of its state (extensions
    add theirs, trainer/extensions/protocol.py) and become the run's checkpoint."""

    models: Any
    optimizers: Any
    step_fn: Callable
    eval_step_fn: Callable
    input: data.Input
    global_step: tf.Variable
    checkpoint_items: dict[str, Any]


def build_task(
    runtime: Runtime,
    inp: data.Input,
    *,
    model_fn: Callable,
    optimizer_fn: Callable,
    step_fn: Callable,
    eval_step_fn: Callable,
    global_batch_size: int,
    total_steps: int,
) -> Task:
    with runtime.strategy.scope(), layer_state.model_creation_scope(runtime.strategy):
        models = make_models(model_fn, inp)
        build_by_calling(models, model_fn, inp)  # before the optimizers are built and the checkpoint made
        layer_state.separate_replica_losses(runtime.strategy, models)
    with runtime.strategy.scope():
        optimizers = make_optimizers(
            optimizer_fn, global_batch_size=global_batch_size, total_steps=total_steps, policy=runtime.policy
        )
        build_optimizers(models, optimizers)  # rule 1: never lazily inside tf.function
        aggregation = tf.VariableAggregation.ONLY_FIRST_REPLICA
        global_step = tf.Variable(0, dtype=tf.int64, trainable=False, name="global_step", aggregation=aggregation)
    random_state = layer_state.random_states(models)
    items = {"model": models, "optimizer": optimizers, "global_step": global_step, "random_state": random_state}
    return Task(models, optimizers, step_fn, eval_step_fn, inp, global_step, items)


def build_eval_models(inp: data.Input, model_fn: Callable) -> tuple[Any, tf.Variable, tf.train.Checkpoint]:
    """Models and a global step for evaluation only (the sidecar): no optimizer, no strategy."""
    models = make_models(model_fn, inp)
    build_by_calling(models, model_fn, inp)
    global_step = tf.Variable(0, dtype=tf.int64, trainable=False, name="global_step")
    return models, global_step, tf.train.Checkpoint(model=models, global_step=global_step)
