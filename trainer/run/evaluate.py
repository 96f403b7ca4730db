"""`--mode=evaluate`: one checkpoint of a run evaluated again, exactly as the run evaluated it.

settings -> the run's extensions (checked) -> the checkpoint, splits and weights chosen (refused before
TensorFlow runs) -> runtime -> task -> extensions attached (their checkpoint items: EMA, SWA) -> the
checkpoint restored -> the run's own evaluators (trainer/loops/build.py) traced -> each split evaluated
through `Context.evaluate`, the averaged weights through `AveragedWeights.evaluate_weights`, as inline
eval does. Same strategy, same eval data, same weights: the results are bit-equal to those the run logged
when it wrote that checkpoint. They are printed and recorded by a MetricsLog that marks each line
`"reevaluated": <checkpoint>` and writes TensorBoard under `model_dir/reeval/<split>`.
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Sequence

import tensorflow as tf

from trainer.distribution.runtime import Runtime
from trainer.errors import UserError, error_line
from trainer.extensions.averaged_weights import AveragedWeights
from trainer.extensions.context import Context
from trainer.extensions.protocol import name_of
from trainer.extensions.registry import Registry
from trainer.files.metrics_log import METRICS_FILE, REEVAL_DIR, REEVALUATED, MetricsLog
from trainer.files.run_checkpoint import RunCheckpoint
from trainer.loops.build import build_loops
from trainer.loops.sidecar import checkpoints_in
from trainer.run.settings import Settings
from trainer.run.setup import setup
from trainer.run.train import checked_registry
from trainer.task import precision
from trainer.task.task import Task

MODEL = "model"  # the --weights name of the model's own weights
_NUMBERED = re.compile(r"^(?:ckpt-)?(\d+)$")


@dataclasses.dataclass(frozen=True)
class Plan:
    """What to evaluate, decided and checked before TensorFlow runs."""

    settings: Settings  # the run's, with the eval splits chosen
    registry: Registry  # the run's extensions: their checkpoint items and averaged weights
    path: str  # the checkpoint's prefix
    name: str  # how it is named in metrics.jsonl: `ckpt-N`, or its path relative to model_dir
    weights: tuple[str, ...]  # MODEL and/or names of AveragedWeights extensions
    named_weights: bool  # the weights were named (--weights), not the run's default


def plan(
    settings: Settings, *, checkpoint: str | None = None, splits: Sequence[str] = (), weights: Sequence[str] = ()
) -> Plan:
    """Refuses (UserError) a model_dir without checkpoints, a checkpoint, split or weights the run does
    not have, and what the run itself would refuse; writes nothing."""
    registry = checked_registry(settings)  # the run's own checks, with its own eval splits
    path = chosen_checkpoint(settings.model_dir, checkpoint)
    inside = os.path.relpath(path, settings.model_dir)
    name = path if inside.startswith(os.pardir) else inside
    available = weight_kinds(registry)
    for chosen in weights:
        if chosen not in available:
            raise UserError(
                f"--weights={chosen}: this run has no such weights (it evaluates {', '.join(available)}); "
                "name some of those"
            )
    return Plan(
        settings=dataclasses.replace(settings, eval_splits=_splits(settings, splits)),
        registry=registry,
        path=path,
        name=name,
        weights=tuple(dict.fromkeys(weights)) or available,
        named_weights=bool(weights),
    )


@precision.keeps_global_policy
def evaluate(
    settings: Settings, *, checkpoint: str | None = None, splits: Sequence[str] = (), weights: Sequence[str] = ()
) -> dict[str, dict[str, float]]:
    """Evaluates the checkpoint (default: the newest in `settings.model_dir`) on every eval split (or
    `splits`) with every weights the run evaluates (or `weights`); returns the results by recorded split."""
    chosen = plan(settings, checkpoint=checkpoint, splits=splits, weights=weights)
    settings = chosen.settings
    runtime, task, context = restored_run(settings, chosen.registry, chosen.path)
    step = int(task.global_step.numpy())
    _, context.evaluators = build_loops(runtime, task, settings, start_step=step, print_fn=context.print)
    for evaluator in context.evaluators.values():
        evaluator.trace()  # a step that cannot run fails here, before anything is written
    averaged = [
        e for e in chosen.registry.extensions if isinstance(e, AveragedWeights) and name_of(e) in chosen.weights
    ]
    if chosen.named_weights and (empty := [name_of(e) for e in averaged if not e.holds_weights()]):
        raise UserError(
            f"--weights={empty[0]}: {chosen.name} (step {step}) holds no {empty[0]} weights yet; "
            "pick a later checkpoint"
        )
    averaged = [e for e in averaged if e.holds_weights()]
    shown = [MODEL] * (MODEL in chosen.weights) + [name_of(e) for e in averaged]
    if runtime.is_chief:
        context.print(
            f"evaluating {chosen.name} (step {step}) on {', '.join(settings.eval_split_names)} with the "
            f"{' and '.join(shown)} weights, strategy '{settings.strategy}'"
        )
    results: dict[str, dict[str, float]] = {}
    with MetricsLog(settings.model_dir, enabled=runtime.is_chief, open_now=(), reevaluated=chosen.name) as log:
        context.metrics_log = log
        if MODEL in chosen.weights:
            results.update(context.evaluate(step))
        for extension in averaged:
            by_split = extension.evaluate_weights(context, step)
            results.update({f"{split}_{name_of(extension)}": r for split, r in by_split.items()})
    if runtime.is_chief:
        context.print(
            f"re-evaluated {chosen.name}: appended to {os.path.join(settings.model_dir, METRICS_FILE)} "
            f'("{REEVALUATED}": "{chosen.name}") and TensorBoard {os.path.join(settings.model_dir, REEVAL_DIR)}'
        )
    return results


def weight_kinds(registry: Registry) -> tuple[str, ...]:
    """The weights a run keeps: MODEL, then the names of its AveragedWeights extensions (ema, swa)."""
    return (MODEL, *(name_of(e) for e in registry.extensions if isinstance(e, AveragedWeights)))


def restored_run(settings: Settings, registry: Registry, path: str) -> tuple[Runtime, Task, Context]:
    """The run's runtime, task and extensions at checkpoint `path`: the extensions attached first, so
    their checkpoint items (the EMA's, SWA's averages) are restored with the model."""
    runtime, task = setup(settings)
    context = Context(settings, runtime, task, registry.contributions)
    registry.attach(context)
    _restore(RunCheckpoint(task.checkpoint_items, registry.states()), path)
    return runtime, task, context


def chosen_checkpoint(model_dir: str, checkpoint: str | None) -> str:
    """The prefix of `checkpoint` (`ckpt-N`, `N`, a checkpoint's path or a directory of them; None:
    the newest in model_dir)."""
    listed = checkpoints_in(model_dir) if os.path.isdir(model_dir) else []
    if checkpoint is None:
        if not listed:
            raise UserError(
                f"no checkpoint in {model_dir}: train first, or pass the --model_dir of a run that saved one"
            )
        return listed[-1][1]
    if found := _NUMBERED.match(checkpoint):
        number = int(found.group(1))
        by_number = dict(listed)
        if number not in by_number:
            have = ", ".join(f"ckpt-{n}" for n, _ in listed) or "none"
            raise UserError(
                f"--checkpoint={checkpoint}: {model_dir} has no ckpt-{number} (it has {have}); name one of "
                "those, or a checkpoint's path"
            )
        return by_number[number]
    path = os.path.abspath(os.path.expanduser(checkpoint))
    if os.path.isdir(path) and (newest := tf.train.latest_checkpoint(path)):
        return newest
    if not tf.io.gfile.exists(path + ".index"):
        raise UserError(
            f"--checkpoint={checkpoint}: no checkpoint there (no {path}.index); pass ckpt-N, N or the path "
            "of a checkpoint (its prefix, without .index)"
        )
    return path


def _splits(settings: Settings, splits: Sequence[str]) -> tuple[str, ...]:
    """`splits` (default: the run's eval splits), checked against the input function's own where it declares them."""
    if not splits:
        return settings.eval_split_names
    known = getattr(settings.input_function, "splits", None)
    if known is not None and (unknown := [s for s in splits if s not in known]):
        raise UserError(
            f"--eval_splits={','.join(splits)}: the input function has no split {unknown[0]!r} (it has "
            f"{', '.join(known)}); name some of those"
        )
    return tuple(dict.fromkeys(splits))


def _restore(checkpoint: RunCheckpoint, path: str) -> None:
    try:
        checkpoint.restore(path)
    except tf.errors.OpError as e:
        raise UserError(f"checkpoint {path} cannot be read ({error_line(e)}); name another with --checkpoint") from e
    except (ValueError, AssertionError) as e:
        raise UserError(
            f"checkpoint {path} does not match the model ({error_line(e)}); evaluate it with the gin files "
            "of the run that wrote it"
        ) from e
