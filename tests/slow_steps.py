"""One worker made slow on purpose: the TF_CONFIG task whose index is in $SLOW_TASK burns CPU in
every step (`slow_on_one_task_step`, its update unchanged), as a worker on a slower or busier
machine would, and with `hang_on_slow_task` stops answering after a step, as a worker stuck in
its own code would."""

import json
import os
import time

import gin
import tensorflow as tf

from trainer.extensions import Extension
from trainer.task import steps


def _is_slow_task() -> bool:
    task = json.loads(os.environ.get("TF_CONFIG", "{}")).get("task", {}).get("index")
    return str(task) == os.environ.get("SLOW_TASK")


def _burn(seconds: float) -> None:
    until = time.thread_time() + seconds
    while time.thread_time() < until:
        pass


@gin.configurable
def slow_on_one_task_step(model, optimizer, batch, global_batch_size, cpu_secs=0.03):
    outputs = steps.classification_step(model, optimizer, batch, global_batch_size)
    if not _is_slow_task():
        return outputs
    burnt = tf.py_function(lambda: _burn(cpu_secs) or 0.0, [], tf.float32)
    with tf.control_dependencies([burnt]):
        return {name: tf.identity(value) for name, value in outputs.items()}


@gin.configurable
class HangOnSlowTask(Extension):
    """After loop call ending at `step`, the slow task sleeps `secs` before it goes on."""

    name = "hang_on_slow_task"

    def __init__(self, step: int, secs: float = 120.0):
        self.step, self.secs = step, secs

    def after_loop(self, context, step, metrics):
        if step == self.step and _is_slow_task():
            time.sleep(self.secs)
