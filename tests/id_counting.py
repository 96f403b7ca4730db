"""A run that counts which examples it trained on, for tests/test_data_service.py and tests/test_data_position.py.

Example i is `(x, i)`; the model holds `seen`, how often each id was in a trained batch, which the
step adds to (summed across workers on the ps) and the checkpoint keeps, so a test reads from the
newest checkpoint exactly which examples the run consumed.

`write_tfrecords(out_dir)` writes the same examples as TFRecord files, and `tfrecord_bindings` the gin lines
that read them (`tfrecord_files` with the features `x` and `label`).

Gin: `import tests.id_counting`, `train.input_fn = @ids`, `train.model_fn = @id_counter`,
`train.step_fn = @counting_step`, `train.eval_step_fn = @counting_eval_step`; `PauseAt` holds a run
at a step for a test to signal it there.
"""

from __future__ import annotations

import time

import gin
import tensorflow as tf

from trainer.extensions import Extension

NUM_IDS = 512


# The command-line bindings of a counting run (global batch 8); each test adds its steps and strategy.
COUNTING_RUN = [
    "--gin_bindings=import tests.id_counting",
    "--gin_bindings=train.input_fn = @ids",
    "--gin_bindings=train.model_fn = @id_counter",
    "--gin_bindings=train.step_fn = @counting_step",
    "--gin_bindings=train.eval_step_fn = @counting_eval_step",
    "--gin_bindings=train.global_batch_size = 8",
]


@gin.configurable
def ids(split: str) -> tf.data.Dataset:
    count = NUM_IDS if split == "train" else 16
    ids = tf.range(count, dtype=tf.int64)
    return tf.data.Dataset.from_tensor_slices((tf.cast(ids, tf.float32)[:, None] / count, ids))


def write_tfrecords(out_dir: str, num_shards: int = 3) -> list[str]:
    """`ids`' examples as TFRecord files `{split}-{shard}.tfrecord`, example i in shard i % num_shards (as
    trainer.write_tfrecords writes them, so they read back in order); returns the train and eval patterns."""
    for split in ("train", "eval"):
        writers = [tf.io.TFRecordWriter(f"{out_dir}/{split}-{k}.tfrecord") for k in range(num_shards)]
        for i, (x, label) in enumerate(ids(split).as_numpy_iterator()):
            feature = {
                "x": tf.train.Feature(float_list=tf.train.FloatList(value=x.tolist())),
                "label": tf.train.Feature(int64_list=tf.train.Int64List(value=[int(label)])),
            }
            writers[i % num_shards].write(
                tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString()
            )
        for writer in writers:
            writer.close()
    return [f"{out_dir}/train-*.tfrecord", f"{out_dir}/eval-*.tfrecord"]


def tfrecord_bindings(out_dir: str) -> list[str]:
    """The flags that train the counting run on the files `write_tfrecords(out_dir)` wrote."""
    train, eval_ = write_tfrecords(out_dir)
    return [
        "--gin_bindings=train.input_fn = @tfrecord_files()",
        f"--gin_bindings=tfrecord_files.train_pattern = '{train}'",
        f"--gin_bindings=tfrecord_files.eval_pattern = '{eval_}'",
        "--gin_bindings=tfrecord_files.features = {'x': @float_feature(), 'label': @int64_feature()}",
        "--gin_bindings=float_feature.shape = (1,)",
    ]


class IdCounter(tf.Module):
    def __init__(self):
        super().__init__(name="id_counter")
        self.w = tf.Variable(0.0, name="w")
        self.seen = tf.Variable(
            tf.zeros([NUM_IDS], tf.int64), trainable=False, name="seen", aggregation=tf.VariableAggregation.SUM
        )


@gin.configurable
def id_counter() -> IdCounter:
    return IdCounter()


@gin.configurable
def counting_step(model, optimizer, batch, global_batch_size):
    x, ids = batch
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(tf.square(model.w * x[:, 0] - 1.0)) / global_batch_size
    optimizer.apply_gradients(zip(tape.gradient(loss, [model.w]), [model.w]))
    model.seen.assign_add(tf.math.bincount(tf.cast(ids, tf.int32), minlength=NUM_IDS, dtype=tf.int64))
    return {"loss": loss}


@gin.configurable
def counting_eval_step(model, batch):
    x, _, weight = batch
    return {"loss": tf.reduce_sum(weight * tf.square(model.w * x[:, 0] - 1.0)), "num_examples": tf.reduce_sum(weight)}


def seen(model_dir: str):
    """`seen` in the newest checkpoint of `model_dir`."""
    reader = tf.train.load_checkpoint(model_dir)
    (key,) = [k for k in reader.get_variable_to_shape_map() if "seen" in k and "OPTIMIZER" not in k]
    return reader.get_tensor(key)


@gin.configurable
class PauseAt(Extension):
    """After the loop call (and any checkpoint) ending at `step`, prints `paused at step N` and sleeps
    `secs`: a test signals the group then, at a known step, with nothing in flight."""

    name = "pause_at"
    after = ("checkpoint",)

    def __init__(self, step: int = 48, secs: float = 60.0):
        self.step, self.secs = step, secs

    def after_loop(self, context, step, metrics):
        if step == self.step:
            print(f"paused at step {step}", flush=True)
            time.sleep(self.secs)
