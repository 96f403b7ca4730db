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
from typing import Any, Callable, Sequence

import tensorflow as tf

from trainer import data
from trainer.task import models
from trainer.task import steps
from trainer.loops.sync import Evaluator
from trainer.files.metrics_log import METRICS_FILE
from trainer.distribution.runtime import RuntimeConfig, make_runtime
from trainer.task.task import build_eval_models
from trainer.distribution import devices
from trainer.errors import UserError

_CHECKPOINT_NUMBER = re.compile(r"-(\d+)$")


def train_settings(settings: dict[str, Any]) -> dict[str, Any]:
    """The parameters of `train` (see `train.defaults_with`) that the sidecar needs."""
    needed = ("total_steps", "global_batch_size", "seed", "model_fn", "eval_step_fn", "eval_metrics_fn", "input_fn",
              "data_source", "eval_splits", "device_config", "mixed_precision")
    return {name: settings.get(name) for name in needed}


def checkpoints_in(model_dir: str) -> list[tuple[int, str]]:
    """(number, path) of the complete checkpoints listed in model_dir's state file, oldest first."""
    state = tf.train.get_checkpoint_state(model_dir)
    if state is None:
        return []
    found = []
    for path in state.all_model_checkpoint_paths:
        if not os.path.isabs(path):
            path = os.path.join(model_dir, path)
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
    *,
    model_dir: str,
    total_steps: int = 1000,
    global_batch_size: int = 64,
    seed: int = 0,
    model_fn: Callable = models.cnn,
    eval_step_fn: Callable = steps.classification_eval_step,
    eval_metrics_fn: Callable | None = None,
    input_fn: Callable | None = None,
    data_source: Callable | None = None,
    eval_splits: Sequence[str] | None = None,
    device_config: devices.DeviceConfig | None = None,
    mixed_precision: str | None = None,
    timeout_secs: float = 600.0,
    poll_secs: float = 1.0,
    print_fn: Callable[[str], None] = print,
) -> dict[str, float]:
    """Evaluates each new checkpoint in `model_dir` until the one at `total_steps`.

    Returns the eval metrics of the last checkpoint evaluated on the first eval split (empty if none).
    """
    from trainer.run.train import make_input

    if timeout_secs <= 0 or poll_secs <= 0:
        raise UserError(f"eval_continuous timeout_secs and poll_secs must be positive, got {timeout_secs}, {poll_secs}")
    inp = make_input(input_fn, data_source, eval_splits)
    runtime = make_runtime(RuntimeConfig(device_config=device_config, mixed_precision=mixed_precision),
                           standalone=True)
    inp.validate()
    import keras

    keras.utils.set_random_seed(seed)
    model, global_step, checkpoint = build_eval_models(inp, model_fn)
    metrics = eval_metrics_fn() if eval_metrics_fn else None
    evaluators = {
        split: Evaluator(runtime.strategy, model, eval_step_fn, data.eval_dataset(inp, global_batch_size, split=split),
                         -(-inp.num_examples(split) // global_batch_size), metrics=metrics)
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
                print_fn(f"sidecar eval{where} of {os.path.basename(path)} at step {step}: {shown}  "
                         f"({int(results['num_examples'])} examples)")
            if step >= total_steps:
                print_fn(f"sidecar evaluator: reached train.total_steps {total_steps}; done")
                return last_results
