"""A step that is slow on one worker only: the TF_CONFIG task whose index is in $SLOW_TASK burns
`cpu_secs` of CPU in every step beside the classification step (its update unchanged), as a
worker on a slower or busier machine would."""

import json
import os
import time

import gin
import tensorflow as tf

from trainer.task import steps


def _burn(seconds: float) -> None:
    until = time.thread_time() + seconds
    while time.thread_time() < until:
        pass


@gin.configurable
def slow_on_one_task_step(model, optimizer, batch, global_batch_size, cpu_secs=0.03):
    outputs = steps.classification_step(model, optimizer, batch, global_batch_size)
    task = json.loads(os.environ.get("TF_CONFIG", "{}")).get("task", {}).get("index")
    if str(task) != os.environ.get("SLOW_TASK"):
        return outputs
    burnt = tf.py_function(lambda: _burn(cpu_secs) or 0.0, [], tf.float32)
    with tf.control_dependencies([burnt]):
        return {name: tf.identity(value) for name, value in outputs.items()}
