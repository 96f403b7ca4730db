"""A sidecar evaluator: evaluates every checkpoint of a run as it appears, beside the training.

    python -m trainer.main --gin_file=gin/ps.gin --mode=eval_continuous --model_dir=D

It reads the same gin config as the training run (model, data, eval step, batch size,
total steps come from the `train.*` bindings), builds the model on this process's first
device, whatever strategy trained it, and waits for checkpoints in D. Each checkpoint
is evaluated once, in step order, over the whole eval set (each example once), even
when several appeared since the last look; it stops after the checkpoint at
`train.total_steps`, or after `timeout_secs` without a new checkpoint.

Per checkpoint it appends one line to D/metrics.jsonl,
`{"step": N, "split": "eval", "loss": ..., "accuracy": ..., "num_examples": ...}`
(`num_examples` marks the sidecar's lines apart from the chief's inline eval), with one
O_APPEND write of the whole line, so lines never interleave with the chief's appends;
and the same scalars to TensorBoard under D/eval.

Checkpoints are found through the `checkpoint` state file, which the chief rewrites
only after a checkpoint is complete. One deleted (max_to_keep) before it was read is
reported and skipped.
"""

from __future__ import annotations

import json
import os
import re
import time
from typing import TYPE_CHECKING, Callable

import keras
import tensorflow as tf

from trainer import data
from trainer.distribution.runtime import make_runtime
from trainer.errors import UserError
from trainer.files.metrics_log import METRICS_FILE
from trainer.loops.evaluator import Evaluator, make_metrics
from trainer.task.task import build_eval_models

if TYPE_CHECKING:
    from trainer.run.settings import Settings

_CHECKPOINT_NUMBER = re.compile(r"-(\d+)$")


def checkpoints_in(model_dir: str) -> list[tuple[int, str]]:
    """(number, path) of the complete checkpoints listed in model_dir's state file, oldest first
    (tf.train.get_checkpoint_state has joined model_dir to each relative path already)."""
    state = tf.train.get_checkpoint_state(model_dir)
    if state is None:
        return []
    found = []
    for path in state.all_model_checkpoint_paths:
        if match := _CHECKPOINT_NUMBER.search(path):
            found.append((int(match.group(1)), path))
    return sorted(found)


def append_line(path: str, record: dict) -> None:
    """One write of one whole line with O_APPEND: safe beside another process appending."""
    line = (json.dumps(record) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def evaluate_continuously(
    settings: Settings,
    *,
    timeout_secs: float = 600.0,
    poll_secs: float = 1.0,
    print_fn: Callable[[str], None] = print,
) -> dict[str, float]:
    """Evaluates each new checkpoint in `settings.model_dir` until the one at `settings.total_steps`.

    Returns the eval metrics of the last checkpoint evaluated on the first eval split (empty if none).
    """
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
    writers: dict = {}

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
                if split not in writers:
                    where = "eval" if split == "eval" else os.path.join("eval", split)
                    writers[split] = tf.summary.create_file_writer(os.path.join(model_dir, where))
                append_line(os.path.join(model_dir, METRICS_FILE), {"step": step, "split": split} | results)
                with writers[split].as_default(step=step):
                    for name, value in results.items():
                        if name != "num_examples":
                            tf.summary.scalar(name, value)
                writers[split].flush()
                if index == 0:
                    last_results = results
                shown = "  ".join(f"{k} {v:.4f}" for k, v in results.items() if k != "num_examples")
                where = "" if split == "eval" else f" on {split}"
                print_fn(
                    f"sidecar eval{where} of {os.path.basename(path)} at step {step}: {shown}  "
                    f"({int(results['num_examples'])} examples)"
                )
            if step >= total_steps:
                print_fn(f"sidecar evaluator: reached train.total_steps {total_steps}; done")
                return last_results
