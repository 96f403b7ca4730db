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

import inspect
import json
import os
import re
import time
from typing import Any, Callable

import tensorflow as tf

from trainer import data
from trainer.distribution import devices
from trainer.core import models, steps
from trainer.errors import UserError
from trainer.core.loop import Evaluator
from trainer.core.metrics_log import METRICS_FILE

_CHECKPOINT_NUMBER = re.compile(r"-(\d+)$")


def train_settings(train_fn: Callable, bindings: dict[str, Any]) -> dict[str, Any]:
    """The parameters of `train` the sidecar needs: its gin bindings over its defaults."""
    defaults = {
        name: p.default for name, p in inspect.signature(train_fn).parameters.items()
        if p.default is not inspect.Parameter.empty
    }
    settings = defaults | bindings
    needed = ("total_steps", "global_batch_size", "seed", "model_fn", "eval_step_fn", "data_source", "device_config")
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
    data_source: data.DataSource | None = None,
    device_config: devices.DeviceConfig | None = None,
    timeout_secs: float = 600.0,
    poll_secs: float = 1.0,
    print_fn: Callable[[str], None] = print,
) -> dict[str, float]:
    """Evaluates each new checkpoint in `model_dir` until the one at `total_steps`.

    Returns the eval metrics of the last checkpoint evaluated (empty if none).
    """
    if timeout_secs <= 0 or poll_secs <= 0:
        raise UserError(f"eval_continuous timeout_secs and poll_secs must be positive, got {timeout_secs}, {poll_secs}")
    source = data_source if data_source is not None else data.Digits()
    source.validate()
    devices.configure_devices(device_config or devices.DeviceConfig())
    import keras

    keras.utils.set_random_seed(seed)
    model = model_fn(source.input_shape, source.num_classes)
    global_step = tf.Variable(0, dtype=tf.int64, trainable=False, name="global_step")
    checkpoint = tf.train.Checkpoint(model=model, global_step=global_step)
    eval_data = data.eval_dataset(source, global_batch_size)
    num_batches = -(-source.num_examples("eval") // global_batch_size)
    evaluator = Evaluator(tf.distribute.get_strategy(), model, eval_step_fn, eval_data, num_batches)
    writer = None

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
            results = evaluator.evaluate()
            if writer is None:
                writer = tf.summary.create_file_writer(os.path.join(model_dir, "eval"))
            append_line(os.path.join(model_dir, METRICS_FILE), {"step": step, "split": "eval"} | results)
            with writer.as_default(step=step):
                for name, value in results.items():
                    if name != "num_examples":
                        tf.summary.scalar(name, value)
            writer.flush()
            last_results = results
            shown = "  ".join(f"{k} {v:.4f}" for k, v in results.items() if k != "num_examples")
            print_fn(f"sidecar eval of {os.path.basename(path)} at step {step}: {shown}  ({int(results['num_examples'])} examples)")
            if step >= total_steps:
                print_fn(f"sidecar evaluator: reached train.total_steps {total_steps}; done")
                return last_results
