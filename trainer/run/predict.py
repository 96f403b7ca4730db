"""--mode=predict: a trained model's outputs over every example of a split, into one `.npz`.

    python -m trainer.main --gin_file=gin/single.gin --model_dir=D --mode=predict [--checkpoint=ckpt-N] [--weights=ema]

The run's own settings build the model (as the sidecar does, `build_eval_models`) under the run's strategy,
a checkpoint of `model_dir` is restored (the newest by default), and the eval pipeline (`distribute_eval`:
every example once, padded to whole global batches, padding weighing 0) feeds `predict_step_fn(model, batch)`
on every replica, by default the model's output (`model(x, training=False)`; each model's for a dict of them).
Each batch's outputs are gathered across replicas and workers in global-batch order, the padding dropped, and
the chief streams the rows to disk (trainer/files/predictions.py): memory does not grow with the split.
With `--weights=ema` (or another averaged weights the run keeps, `swa`) the run's task and extensions are
restored as `--mode=evaluate` restores them (`restored_run`) and the outputs are those of the model with
those weights swapped in.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import time
from typing import IO, Any, Callable, Mapping, Sequence

import keras
import tensorflow as tf

from trainer import data
from trainer.distribution import modes
from trainer.distribution.runtime import make_runtime
from trainer.errors import RunFailure, UserError, error_line
from trainer.extensions.averaged_weights import AveragedWeights
from trainer.extensions.console import LiveBar, is_terminal
from trainer.extensions.progress import format_duration
from trainer.extensions.protocol import name_of
from trainer.extensions.registry import Registry
from trainer.files.predictions import PredictionWriter, check_writable
from trainer.run.evaluate import MODEL, chosen_checkpoint, restored_run, weight_kinds
from trainer.run.settings import Settings
from trainer.run.train import checked_registry
from trainer.safety import tracing
from trainer.task import contract, precision
from trainer.task.contract import function_name
from trainer.task.steps import call_model
from trainer.task.structure import flat, named
from trainer.task.task import build_eval_models
from trainer.task.user_code import call_user, placed, user_functions

PREDICT_STEP = contract.Contract("predict.predict_step_fn", ("model", "batch"))
SINGLE_OUTPUT = "output"  # the key of a step's (or one model's) single tensor


@precision.keeps_global_policy
def predict(
    settings: Settings,
    *,
    split: str | None = None,
    input_fn: Callable | None = None,
    predict_step_fn: Callable | None = None,
    batch_size: int | None = None,
    checkpoint: str | None = None,
    output: str | None = None,
    weights: Sequence[str] = (),
    print_fn: Callable[[str], None] = print,
) -> tuple[str | None, int]:
    """Writes the outputs over `split` (default: the first eval split; with `input_fn`, an input function
    of its own called with `split`, default 'predict') at the checkpoint named `checkpoint` (`ckpt-N`, N or
    a checkpoint path; default the newest) with the weights named in `weights` (one of those the run keeps:
    'model', the default, 'ema', 'swa') into `output` (default `model_dir/predictions/<split>-ckpt-N.npz`,
    `...-ckpt-N-<weights>.npz` for averaged weights). Returns (the path written, None on other workers than
    the chief; the number of examples)."""
    modes.require_run_mode("predict", settings.strategy)
    if not settings.model_dir:
        raise UserError("--mode=predict needs --model_dir=DIR, the directory of a trained run")
    batch_size = settings.global_batch_size if batch_size is None else batch_size
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise UserError(f"predict.batch_size must be a positive integer, got {batch_size!r}")
    if predict_step_fn is not None:
        if not callable(predict_step_fn):
            raise UserError(f"predict.predict_step_fn must be a function (bind it as @name), got {predict_step_fn!r}")
        predict_step_fn = contract.adapt(predict_step_fn, PREDICT_STEP)
    kind, registry = _chosen_weights(settings, weights)
    path = chosen_checkpoint(settings.model_dir, checkpoint)
    split = split or ("predict" if input_fn is not None else settings.eval_split_names[0])
    named = f"{split}-{os.path.basename(path)}" + ("" if kind == MODEL else f"-{kind}")
    output = os.path.abspath(output or os.path.join(settings.model_dir, "predictions", f"{named}.npz"))
    check_writable(output)

    if registry is None:
        runtime = make_runtime(settings, standalone=settings.mode.coordinates_workers)
        run_input = settings.make_input()  # what the model is built from
        run_input.validate()
    else:  # the run's task and extensions, restored as --mode=evaluate restores them: the averages with the model
        runtime, task, _ = restored_run(settings, registry, path)
        run_input = task.input  # built and checked by the restored run (its counts and data cached)
    if batch_size % runtime.num_replicas:
        raise UserError(
            f"predict.batch_size {batch_size} is not divisible by the {runtime.num_replicas} replicas; "
            f"use a multiple of {runtime.num_replicas}"
        )
    inp = (
        run_input
        if input_fn is None
        else data.as_input(contract.adapt(input_fn, contract.INPUT), eval_splits=(split,), sequences=settings.sequences)
    )
    inp.print_fn = print_fn
    inp.examples(split)  # an unknown split is refused here
    count = inp.num_examples(split)
    if count == 0:
        raise UserError(f"split {split!r} has no examples: nothing to predict")
    if registry is None:
        keras.utils.set_random_seed(settings.seed)
        with runtime.strategy.scope(), user_functions({"train.model_fn": settings.model_fn}):
            models, global_step, restorer = build_eval_models(run_input, settings.model_fn)
        restore(restorer, path)
        swapped: contextlib.AbstractContextManager = contextlib.nullcontext()
    else:
        models, global_step = task.models, task.global_step
        averaged = next(e for e in registry.extensions if isinstance(e, AveragedWeights) and name_of(e) == kind)
        if not averaged.holds_weights():
            raise UserError(
                f"--weights={kind}: {os.path.basename(path)} (step {int(global_step.numpy())}) holds no {kind} "
                "weights yet; pick a later checkpoint"
            )
        swapped = averaged.swapped_in()

    predict_batch = batch_function(runtime.strategy, models, predict_step_fn, inp.examples(split).element_spec)
    dataset = data.distribute_eval(runtime.strategy, inp, batch_size, split=split, shard_policy=settings.shard_policy)
    num_batches = -(-count // batch_size)
    names = "+".join(type(m).__name__ for m in flat(models))
    where = (
        f"this process's device (a {settings.strategy} run's variables, restored without its cluster)"
        if settings.mode.coordinates_workers
        else f"strategy '{settings.strategy}' on {runtime.num_replicas} replica(s) ({runtime.num_workers} worker(s))"
    )
    if kind != MODEL:
        names += f" with the {kind} weights"
    if runtime.is_chief:
        print_fn(
            f"predicting {names} of {os.path.basename(path)} (step {int(global_step.numpy())}) on split {split!r}: "
            f"{count} examples in {num_batches} batches of {batch_size}, {where}"
        )
    progress = Progress(num_batches, settings.log_every_steps, batch_size, print_fn, enabled=runtime.is_chief)
    what = PREDICT_STEP.what if predict_step_fn else "train.model_fn"
    shown = function_name(predict_step_fn or settings.model_fn)
    with swapped, PredictionWriter(output) as writer:
        iterator = iter(dataset)
        for done in range(1, num_batches + 1):
            batch = next(iterator)
            if done == 1:  # traces: a failure of the user's code is one line
                rows = _first_batch(what, shown, functools.partial(predict_batch, batch), default=not predict_step_fn)
            else:
                rows = predict_batch(batch)
            if runtime.is_chief:
                writer.append({key: value.numpy() for key, value in rows.items()})
            progress.update(done)
        progress.finish()
        if not runtime.is_chief:
            return None, count
        writer.finish()
    print_fn(f"predictions: {output} ({writer.count} examples)")
    return output, writer.count


def _chosen_weights(settings: Settings, weights: Sequence[str]) -> tuple[str, Registry | None]:
    """The one kind of weights to predict with, and for averaged weights the run's extensions (checked as
    the run checks them); refused in one line before anything runs: a kind the run does not keep, more
    than one."""
    kinds = tuple(dict.fromkeys(weights)) or (MODEL,)
    if len(kinds) > 1:
        raise UserError(
            f"--weights={','.join(kinds)}: --mode=predict writes the outputs of one kind of weights; name one"
        )
    if kinds[0] == MODEL:
        return MODEL, None
    registry = checked_registry(settings)
    if kinds[0] not in (kept := weight_kinds(registry)):
        raise UserError(f"--weights={kinds[0]}: this run keeps no such weights (it keeps {', '.join(kept)}); name one")
    return kinds[0], registry


def restore(restorer: tf.train.Checkpoint, path: str) -> None:
    """Restores the models as the sidecar does; a checkpoint of another model is the user's to fix."""
    try:
        restorer.restore(path).expect_partial().assert_existing_objects_matched()
    except (ValueError, AssertionError) as e:
        raise UserError(
            f"checkpoint {path} does not match the model ({error_line(e)}); predict with the gin files that trained it"
        ) from e
    except tf.errors.OpError as e:
        raise RunFailure(f"checkpoint {path} cannot be read ({error_line(e)})") from e


def batch_function(
    strategy: tf.distribute.Strategy, models: Any, predict_step_fn: Callable | None, example_spec: Any
) -> Callable[[Any], dict[str, tf.Tensor]]:
    """One global batch (the example weighed, as the eval pipeline gives it) -> its outputs by key, gathered
    from every replica in global-batch order, the padding (weight 0) dropped."""
    takes_tuple = type(example_spec) is tuple  # `with_weight` appended the weight to the tuple itself
    name = function_name(predict_step_fn) if predict_step_fn else ""

    def replica_fn(batch):
        batch = placed(batch)
        example = tuple(batch[:-1]) if takes_tuple else batch[0]
        if predict_step_fn is None:
            outputs = model_outputs(models, example)
        else:
            outputs = call_user(predict_step_fn, models, example)
        return checked_outputs(outputs, name), batch[-1]

    def predict_batch(batch):
        outputs, weight = strategy.run(replica_fn, args=(batch,))
        real = strategy.gather(weight, axis=0) > 0
        return {key: tf.boolean_mask(strategy.gather(value, axis=0), real) for key, value in outputs.items()}

    return tf.function(predict_batch, autograph=False)


@tf.autograph.experimental.do_not_convert
def _first_batch(what: str, shown: str, trace: Callable[[], Any], *, default: bool) -> Any:
    """The first batch's outputs (traced); where the default step cannot call the model(s) on the
    features (a GAN's generator takes noise), the line says how to choose the outputs instead."""
    try:
        return tracing.traced(what, shown, trace)
    except UserError as e:
        if not default or e.__cause__ is None:
            raise
        raise UserError(
            f"--mode=predict calls the model(s) of train.model_fn = @{shown} on each batch's features "
            f"(model(x, training=False)) by default, and that failed ({error_line(e.__cause__)}); bind "
            "predict.predict_step_fn = @your_function(model, batch) to say what to predict"
        ) from e.__cause__


def model_outputs(models: Any, example: Any) -> Any:
    """The default step: the model's output on the batch's features (`x` of `(x, y, ...)`, else the whole
    example), each model's by key for a dict of them."""
    features = example[0] if isinstance(example, tuple) and len(example) >= 2 else example
    if isinstance(models, Mapping):
        return {key: call_model(model, features, training=False) for key, model in named(models, "").items()}
    return call_model(models, features, training=False)


def output_keys(outputs: Any, prefix: str = "") -> dict[str, Any]:
    """`{key: leaf}` of a nested structure: dict keys and list indices joined by '/', a lone leaf `output`."""
    if isinstance(outputs, Mapping):
        items = [(str(key), outputs[key]) for key in sorted(outputs, key=str)]
    elif isinstance(outputs, (list, tuple)):
        items = [(str(index), value) for index, value in enumerate(outputs)]
    else:
        return {prefix or SINGLE_OUTPUT: outputs}
    return {
        key: leaf for part, value in items for key, leaf in output_keys(value, f"{prefix}/{part}".lstrip("/")).items()
    }


def checked_outputs(outputs: Any, name: str) -> dict[str, tf.Tensor]:
    """The step's outputs by key, each a numeric tensor with one row per example (bfloat16 as float32,
    which NumPy reads); else one UserError line."""
    what = f"{PREDICT_STEP.what} {name}" if name else "the model"
    leaves = output_keys(outputs)
    if not leaves:
        raise UserError(f"{what} returned an empty {type(outputs).__name__}; return a tensor or a dict of tensors")
    checked = {}
    for key, leaf in leaves.items():
        if not tf.is_tensor(leaf):
            raise UserError(
                f"{what} returned {type(leaf).__name__} at {key!r}, not a tensor; return a tensor, or a dict/list "
                "of tensors, with one row per example of the batch"
            )
        if leaf.shape.rank == 0 or not (leaf.dtype.is_floating or leaf.dtype.is_integer or leaf.dtype.is_bool):
            raise UserError(
                f"{what} returned {'a scalar' if leaf.shape.rank == 0 else leaf.dtype.name} at {key!r}; each "
                "output must be numbers (or booleans) with one row per example of the batch"
            )
        checked[key] = tf.cast(leaf, tf.float32) if leaf.dtype == tf.bfloat16 else leaf
    return checked


class Progress:
    """Progress as in training: on a terminal the live bar, elsewhere a line every `every` batches, with
    steps/s (not counting the first batch, which traced) and the ETA."""

    def __init__(
        self,
        total: int,
        every: int,
        batch_size: int,
        print_fn: Callable[[str], None],
        *,
        enabled: bool,
        stream: IO[str] | None = None,
    ):
        self.total, self.every, self.batch_size, self.print_fn = total, every, batch_size, print_fn
        self.enabled = enabled
        stream = stream or sys.stdout
        self._bar = LiveBar(stream) if enabled and is_terminal(stream) else None
        self._paced_from: tuple[int, float] | None = None

    def update(self, done: int) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if self._paced_from is None:
            self._paced_from = (done, now)
        first, since = self._paced_from
        rate = (done - first) / (now - since) if done > first and now > since else None
        eta = format_duration((self.total - done) / rate) if rate else None
        if self._bar is not None:
            self._bar.draw(self._bar.render(done, self.total, {}, steps_per_sec=rate, eta=eta))
        elif done % self.every == 0 or done == self.total:
            pace = f"  {rate:.1f} steps/s  {rate * self.batch_size:.0f} ex/s" if rate else ""
            self.print_fn(f"predict step {done}/{self.total}{pace}  ETA {eta or '?'}")

    def finish(self) -> None:
        if self._bar is not None:
            self._bar.finish()
