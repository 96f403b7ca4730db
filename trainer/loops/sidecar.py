"""A sidecar evaluator: evaluates every checkpoint of a run as it appears, beside the training.

    python -m trainer.main --gin_file=gin/ps.gin --mode=eval_continuous --model_dir=D

It reads the training's gin config, builds the model on this process's first device whatever
strategy trained it, and evaluates each complete checkpoint (named in the `checkpoint` state file)
once, in step order, over the whole eval set, until the one at `train.total_steps` or
`timeout_secs` without a new one; one deleted before it was read is skipped. Results go through the
training's own MetricsLog (their `num_examples` marks them apart from the chief's inline evals).
"""

from __future__ import annotations

import os
import re
import time
from typing import TYPE_CHECKING, Callable

import keras
import tensorflow as tf

from trainer import data
from trainer.distribution.runtime import make_runtime
from trainer.errors import UserError
from trainer.files.checkpoints import listed_checkpoints
from trainer.files.metrics_log import MetricsLog, eval_line, nonfinite_warning
from trainer.loops.evaluator import Evaluator, make_metrics
from trainer.task.task import build_eval_models

if TYPE_CHECKING:
    from trainer.run.settings import Settings

_NUMBER = re.compile(r"-(\d+)$")


def checkpoints_in(model_dir: str) -> list[tuple[int, str]]:
    """(number, path) of the complete checkpoints in model_dir, oldest first."""
    return sorted((int(m.group(1)), path) for path in listed_checkpoints(model_dir) if (m := _NUMBER.search(path)))


def evaluate_continuously(
    settings: Settings, *, timeout_secs: float = 600.0, poll_secs: float = 1.0, print_fn: Callable[[str], None] = print
) -> dict[str, float]:
    """Evaluates each new checkpoint in `settings.model_dir` until the one at `settings.total_steps`;
    returns the first eval split's results of the last one evaluated ({} if none)."""
    if timeout_secs <= 0 or poll_secs <= 0:
        raise UserError(f"eval_continuous timeout_secs and poll_secs must be positive, got {timeout_secs}, {poll_secs}")
    model_dir, total_steps, global_batch_size = settings.model_dir, settings.total_steps, settings.global_batch_size
    inp = settings.make_input()
    runtime = make_runtime(settings, standalone=True)
    inp.validate()
    keras.utils.set_random_seed(settings.seed)
    model, global_step, checkpoint = build_eval_models(inp, settings.model_fn)
    metrics = make_metrics(settings.eval_metrics_fn)
    evaluators = {
        split: Evaluator(
            runtime.strategy,
            model,
            settings.eval_step_fn,
            data.eval_dataset(inp, global_batch_size, split=split),
            -(-inp.num_examples(split) // global_batch_size),
            metrics=metrics,
        )
        for split in inp.eval_splits
    }
    with MetricsLog(model_dir, open_now=()) as log:
        print_fn(f"sidecar evaluator: waiting for checkpoints in {model_dir} (until step {total_steps})")
        last_number, last_results = -1, {}
        idle_since = time.monotonic()
        while True:
            new = [(n, path) for n, path in checkpoints_in(model_dir) if n > last_number]
            if not new:
                if time.monotonic() - idle_since > timeout_secs:
                    print_fn(
                        f"sidecar evaluator: no new checkpoint in {model_dir} for {timeout_secs:.0f} s; "
                        f"stopping (last evaluated: {last_number if last_number >= 0 else 'none'})"
                    )
                    return last_results
                time.sleep(poll_secs)
                continue
            for number, path in new:
                last_number, idle_since = number, time.monotonic()
                try:
                    checkpoint.restore(path).expect_partial().assert_existing_objects_matched()
                except (tf.errors.NotFoundError, tf.errors.DataLossError) as e:
                    print_fn(f"sidecar evaluator: {path} went away before it was read ({type(e).__name__}); skipped")
                    continue
                step = int(global_step.numpy())
                for index, (split, evaluator) in enumerate(evaluators.items()):
                    results = evaluator.evaluate()
                    num_examples = results.pop("num_examples")
                    log.record(step, split, results, num_examples=num_examples)
                    if index == 0:
                        last_results = results
                    print_fn(
                        "sidecar " + eval_line(split, step, results, num_examples, f" of {os.path.basename(path)}")
                    )
                    if warning := nonfinite_warning(split, step, results):
                        print_fn(warning)
                if step >= total_steps:
                    print_fn(f"sidecar evaluator: reached train.total_steps {total_steps}; done")
                    return last_results
