"""Steps and a model with state beyond the model's weights and the optimizer's slots, for the loss-scaling
check's "leaves no trace" tests (tests/test_guard_state.py): a Keras metric updated in the step, a
`tf.random.Generator` drawn from, a `tf.Module` variable written, per-replica (ON_READ) accumulators,
noise keyed by the replica id, an undeclared running accuracy and Keras variables as outputs."""

from __future__ import annotations

import functools

import gin
import keras
import tensorflow as tf

import trainer

SUM, ON_READ = tf.VariableAggregation.SUM, tf.VariableSynchronization.ON_READ


class Totals(tf.Module):
    """What the step writes beside the model: a running sum of the noise it drew."""

    def __init__(self):
        super().__init__()
        self.noise = tf.Variable(0.0, trainable=False)


@gin.configurable
def stateful_model(input_shape, num_classes):
    """A small dense classifier holding a Keras metric, a random generator and a tf.Module."""
    model = keras.Sequential([keras.Input(input_shape), keras.layers.Flatten(), keras.layers.Dense(num_classes)])
    model.train_accuracy = keras.metrics.SparseCategoricalAccuracy(name="train_accuracy")
    model.generator = tf.random.Generator.from_seed(7)
    model.totals = Totals()
    return model


def _loss(model, images, labels, global_batch_size):
    logits = model(images, training=True)
    per_example = keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True)
    return tf.nn.compute_average_loss(per_example, global_batch_size=global_batch_size), logits


def _update(model, optimizer, tape, loss):
    variables = model.trainable_variables
    optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables))


@gin.configurable
@trainer.combine(noise="mean", seen="max")
def stateful_step(model, optimizer, batch, global_batch_size):
    """Updates the metric, draws from the generator, adds the draw to the tf.Module's variable; returns the
    metric's count (a Keras variable) and the draw."""
    images, labels = batch
    with tf.GradientTape() as tape:
        loss, logits = _loss(model, images, labels, global_batch_size)
    _update(model, optimizer, tape, loss)
    model.train_accuracy.update_state(labels, logits)
    noise = model.generator.normal([])
    model.totals.noise.assign_add(noise)
    return {"loss": loss, "noise": noise, "seen": model.train_accuracy.count}


@gin.configurable
def replica_keyed_noise_step(model, optimizer, batch, global_batch_size):
    """Input noise drawn statelessly from (step, replica id): distinct on each replica, the same on a resume."""
    images, labels = batch
    replica = tf.distribute.get_replica_context().replica_id_in_sync_group
    seed = tf.stack([tf.cast(optimizer.iterations, tf.int32), tf.cast(replica, tf.int32)])
    images = images + 0.1 * tf.random.stateless_normal(tf.shape(images), seed=seed)
    with tf.GradientTape() as tape:
        loss, _ = _loss(model, images, labels, global_batch_size)
    _update(model, optimizer, tape, loss)
    return {"loss": loss}


@gin.configurable
def running_accuracy_step(model, optimizer, batch, global_batch_size):
    """Returns the metric's running accuracy without declaring how it combines: no share."""
    images, labels = batch
    with tf.GradientTape() as tape:
        loss, logits = _loss(model, images, labels, global_batch_size)
    _update(model, optimizer, tape, loss)
    model.train_accuracy.update_state(labels, logits)
    return {"loss": loss, "accuracy": model.train_accuracy.result()}


@gin.configurable
@trainer.combine(iterations="max")
def iterations_step(model, optimizer, batch, global_batch_size):
    """Returns a Keras 3 variable (its dtype a string) and a Python number as outputs."""
    images, labels = batch
    with tf.GradientTape() as tape:
        loss, _ = _loss(model, images, labels, global_batch_size)
    _update(model, optimizer, tape, loss)
    return {"loss": loss, "iterations": optimizer.iterations, "zero": 0.0}


@gin.configurable
def text_output_step(model, optimizer, batch, global_batch_size):
    """Returns a string: no number."""
    images, labels = batch
    with tf.GradientTape() as tape:
        loss, _ = _loss(model, images, labels, global_batch_size)
    _update(model, optimizer, tape, loss)
    return {"loss": loss, "note": tf.constant("fine")}


@gin.configurable
def accumulating_model(input_shape, num_classes):
    """stateful_model with per-replica gradient buffers (ON_READ, SUM), TensorFlow's per-replica state."""
    model = stateful_model(input_shape, num_classes)
    model.totals.buffers = [
        tf.Variable(tf.zeros(v.shape), trainable=False, synchronization=ON_READ, aggregation=SUM)
        for v in model.trainable_variables
    ]
    return model


@gin.configurable
def accumulating_step(model, optimizer, batch, global_batch_size):
    """Adds this replica's gradients to its buffers, applies them from there and clears them."""
    images, labels = batch
    with tf.GradientTape() as tape:
        loss, _ = _loss(model, images, labels, global_batch_size)
    variables = model.trainable_variables
    buffers = model.totals.buffers
    for buffer, gradient in zip(buffers, tape.gradient(loss, variables)):
        buffer.assign_add(gradient)
    optimizer.apply_gradients(zip([tf.identity(b) for b in buffers], variables))
    for buffer in buffers:
        buffer.assign(tf.zeros_like(buffer))
    return {"loss": loss}


@gin.configurable
def listed_buffer_model(input_shape, num_classes):
    """stateful_model with a Python list of variables set on the Keras model: no checkpoint holds it."""
    model = stateful_model(input_shape, num_classes)
    model.buffers = [tf.Variable(0.0, trainable=False)]
    return model


@gin.configurable
def listed_buffer_step(model, optimizer, batch, global_batch_size):
    """Counts its steps in `model.buffers[0]`."""
    images, labels = batch
    with tf.GradientTape() as tape:
        loss, _ = _loss(model, images, labels, global_batch_size)
    _update(model, optimizer, tape, loss)
    model.buffers[0].assign_add(1.0)
    return {"loss": loss}


@gin.configurable
@functools.cache
def bound_metrics():
    """Train metrics made by a function the user binds (train.train_metrics_fn), the same objects on each call."""
    return {"bound_accuracy": keras.metrics.SparseCategoricalAccuracy(name="bound_accuracy")}


@gin.configurable
def bound_metric_step(model, optimizer, batch, global_batch_size):
    """Updates the model's metric and the bound one alike: their results must be equal."""
    images, labels = batch
    with tf.GradientTape() as tape:
        loss, logits = _loss(model, images, labels, global_batch_size)
    _update(model, optimizer, tape, loss)
    model.train_accuracy.update_state(labels, logits)
    bound_metrics()["bound_accuracy"].update_state(labels, logits)
    return {"loss": loss}
