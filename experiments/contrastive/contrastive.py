"""Supervised contrastive learning: a step whose loss takes its negatives from the whole global batch.

Each replica embeds its share of the batch, gathers every replica's embeddings and labels with
`tf.distribute.get_replica_context().all_gather`, and scores its own examples against all of
them (Khosla et al., 2020: the positives of an example are the other examples of its class).
The loss is each example's share of the global-batch mean, as every step's is, so the same step
trains the same weights on any number of replicas; the gradient flows back through the gather to
the replica that embedded each example. Under parameter_server, where workers run on their own
and no replica context spans them, the run refuses the step in one line.
"""

from __future__ import annotations

import gin
import keras
import tensorflow as tf

from trainer.task.steps import weighted_sum


@gin.configurable
def embedding_mlp(input_shape, *, width: int = 64, dimension: int = 32) -> keras.Model:
    """An MLP that maps an image to an embedding (not normalised)."""
    return keras.Sequential(
        [
            keras.Input(input_shape),
            keras.layers.Flatten(),
            keras.layers.Dense(width, activation="relu"),
            keras.layers.Dense(dimension),
        ],
        name="embedding_mlp",
    )


def supervised_contrastive(
    z: tf.Tensor,
    labels: tf.Tensor,
    z_all: tf.Tensor,
    labels_all: tf.Tensor,
    offset: tf.Tensor,
    temperature: float,
    real_all: tf.Tensor | None = None,
) -> tf.Tensor:
    """Per-example loss of the examples (`z`, `labels`) against every example of the batch (`*_all`);
    `offset`: where this replica's examples sit in the gathered batch (left out as their own pair);
    `real_all`: 1 for the batch's real examples, 0 for eval padding (neither positive nor negative)."""
    n, total = tf.shape(z)[0], tf.shape(z_all)[0]
    logits = tf.matmul(z, z_all, transpose_b=True) / temperature
    own = tf.one_hot(offset + tf.range(n), total)  # an example is not its own positive or negative
    left_out = own if real_all is None else tf.maximum(own, 1.0 - real_all[None, :])
    logits = logits - 1e9 * left_out
    positives = tf.cast(tf.equal(labels[:, None], labels_all[None, :]), tf.float32) * (1.0 - left_out)
    log_prob = logits - tf.reduce_logsumexp(logits, axis=1, keepdims=True)
    count = tf.maximum(tf.reduce_sum(positives, axis=1), 1.0)
    return -tf.reduce_sum(positives * log_prob, axis=1) / count


@gin.configurable
def contrastive_step(model, optimizer, batch, global_batch_size, temperature: float = 0.1):
    images, labels = batch[0], tf.cast(batch[1], tf.int32)
    context = tf.distribute.get_replica_context()
    with tf.GradientTape() as tape:
        z = tf.math.l2_normalize(model(images, training=True), axis=-1)
        z_all = context.all_gather(z, axis=0)
        labels_all = context.all_gather(labels, axis=0)
        offset = tf.cast(context.replica_id_in_sync_group, tf.int32) * tf.shape(z)[0]
        per_example = supervised_contrastive(z, labels, z_all, labels_all, offset, temperature)
        loss = tf.nn.compute_average_loss(per_example, global_batch_size=global_batch_size)
    optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
    return {"loss": loss}


@gin.configurable
def contrastive_eval_step(model, batch, temperature: float = 0.1):
    """The same loss over each eval batch (gathered across replicas: the same on any replica count),
    and how often an example's nearest other example is of its class."""
    images, labels, weights = batch
    context = tf.distribute.get_replica_context()
    z = tf.math.l2_normalize(model(images, training=False), axis=-1)
    labels = tf.cast(labels, tf.int32)
    z_all, labels_all = context.all_gather(z, axis=0), context.all_gather(labels, axis=0)
    real_all = context.all_gather(tf.cast(weights, tf.float32), axis=0)
    offset = tf.cast(context.replica_id_in_sync_group, tf.int32) * tf.shape(z)[0]
    per_example = supervised_contrastive(z, labels, z_all, labels_all, offset, temperature, real_all)
    own = tf.one_hot(offset + tf.range(tf.shape(z)[0]), tf.shape(z_all)[0])
    similarity = tf.matmul(z, z_all, transpose_b=True) - 1e9 * tf.maximum(own, 1.0 - real_all[None, :])
    nearest = tf.gather(labels_all, tf.argmax(similarity, axis=1, output_type=tf.int32))
    hits = tf.cast(tf.equal(nearest, labels), tf.float32)
    return {
        "loss": weighted_sum(per_example, weights),
        "nearest_neighbour_accuracy": weighted_sum(hits, weights),
        "num_examples": tf.reduce_sum(weights),
    }
