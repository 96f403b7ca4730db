"""A wide-and-deep model for the parameter-server tests: embedding tables as a `tf.Module` (whose
variables a `variable_partitioner` may shard across ps tasks) beside a small Keras tower, in a
dict of models, with its own train and eval steps.

Each 8x8 digit is 64 (pixel, grey level) ids: pixel p at level l (0..16) is id `p * 17 + l`. The
tables map ids to vectors; their mean over the image's pixels goes through the tower.

Gin: `import tests.wide_deep_model`, then `train.model_fn = @wide_and_deep`,
`train.step_fn = @wide_and_deep_step`, `train.eval_step_fn = @wide_and_deep_eval_step`.
"""

from __future__ import annotations

import math

import gin
import keras
import tensorflow as tf

LEVELS = 17


class EmbeddingTables(tf.Module):
    """One table of `num_ids` vectors of `dim`, looked up with `tf.nn.embedding_lookup` (which takes a
    sharded variable as it takes a whole one)."""

    def __init__(self, num_ids: int, dim: int, seed: int = 0):
        super().__init__(name="tables")
        self.table = tf.Variable(tf.random.stateless_normal([num_ids, dim], seed=[seed, 1]) * 0.1, name="table")

    def __call__(self, ids: tf.Tensor) -> tf.Tensor:
        return tf.nn.embedding_lookup(self.table, ids)


class KerasEmbeddingsInModule(tf.Module):
    """The mistake: Keras `Embedding` layers held by a `tf.Module`."""

    def __init__(self, num_ids: int, dim: int):
        super().__init__(name="tables")
        self.embeddings = [keras.layers.Embedding(num_ids, dim)]

    def __call__(self, ids: tf.Tensor) -> tf.Tensor:
        return self.embeddings[0](ids)


@gin.configurable
def wide_and_deep(
    input_shape, num_classes, dim: int = 16, hidden: int = 32, keras_tables: bool = False
) -> dict[str, tf.Module]:
    """`{"tables": EmbeddingTables, "tower": keras.Sequential}` (`keras_tables`: the mistake above)."""
    num_ids = math.prod(input_shape) * LEVELS
    tables = KerasEmbeddingsInModule(num_ids, dim) if keras_tables else EmbeddingTables(num_ids, dim)
    tower = keras.Sequential(
        [keras.Input((dim,)), keras.layers.Dense(hidden, activation="relu"), keras.layers.Dense(num_classes)],
        name="tower",
    )
    return {"tables": tables, "tower": tower}


def _logits(model, images: tf.Tensor, *, training: bool) -> tf.Tensor:
    pixels = tf.reshape(images, [tf.shape(images)[0], -1])
    levels = tf.cast(tf.round(pixels * (LEVELS - 1)), tf.int32)
    ids = levels + tf.range(tf.shape(pixels)[1]) * LEVELS
    return model["tower"](tf.reduce_mean(model["tables"](ids), axis=1), training=training)


@gin.configurable
def wide_and_deep_step(model, optimizer, batch, global_batch_size):
    images, labels = batch
    variables = list(model["tables"].trainable_variables) + list(model["tower"].trainable_variables)
    with tf.GradientTape() as tape:
        per_example = tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=tf.cast(labels, tf.int32), logits=_logits(model, images, training=True)
        )
        loss = tf.nn.compute_average_loss(per_example, global_batch_size=global_batch_size)
    optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables))
    return {"loss": loss}


@gin.configurable
def wide_and_deep_eval_step(model, batch):
    images, labels, weights = batch
    labels = tf.cast(labels, tf.int32)
    weights = tf.cast(weights, tf.float32)
    logits = _logits(model, images, training=False)
    per_example = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits)
    correct = tf.cast(tf.equal(tf.argmax(logits, -1, output_type=tf.int32), labels), tf.float32)
    return {
        "loss": tf.reduce_sum(per_example * weights),
        "accuracy": tf.reduce_sum(correct * weights),
        "num_examples": tf.reduce_sum(weights),
    }
