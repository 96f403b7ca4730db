"""A binary task scored by ROC AUC: is an 8x8 digit a 5-9 (1) or a 0-4 (0)?

What it shows of the loop: a user input function (`small_or_large_digits(split)`, unbatched
`(image, label)` with a float 0/1 label), a model with one output logit, a train step of
sigmoid cross-entropy, and an eval metric that is not a per-example mean: ROC AUC, from a
Keras metric object. `auc_metrics()` creates it (the loop calls it under the strategy's scope,
resets it before each eval pass and reads `result()` after); `auc_eval_step` updates it with
this replica's probabilities, each weighted by the example's weight, so the weight-0 padding
of the last eval batch counts nowhere. Its confusion counts are variables summed across
replicas, so the AUC of a 2-replica eval is that of the whole eval split.

`keras.metrics.AUC` buckets the probabilities at `num_thresholds` evenly spaced thresholds;
with 10,000 it matches scikit-learn's exact `roc_auc_score` on the same predictions within
1e-3 (tests/test_examples_b.py checks it on a 2-replica run).

Gin (experiments/auc/auc.gin): `import experiments.auc.auc`, then `train.input_fn =
@small_or_large_digits`, `train.model_fn = @auc_mlp`, `train.step_fn = @binary_step`,
`train.eval_step_fn = @auc_eval_step`, `train.eval_metrics_fn = @auc_metrics`.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import gin
import keras
import numpy as np
import tensorflow as tf

from trainer import data
from trainer.task.steps import call_model, regularization_loss, scale_loss, weighted_sum

FIRST_POSITIVE_DIGIT = 5


@gin.configurable
def small_or_large_digits(split: str) -> tf.data.Dataset:
    """The built-in digits' `split` as (image float32 8x8x1, label float32: 1.0 for 5-9, 0.0 for 0-4)."""
    images, digits = data.Digits().arrays(split)
    return tf.data.Dataset.from_tensor_slices((images, (digits >= FIRST_POSITIVE_DIGIT).astype(np.float32)))


@gin.configurable
def auc_mlp(input_shape: Sequence[int], hidden: int = 16) -> keras.Model:
    """Flatten, one hidden ReLU layer (none if `hidden` is 0: logistic regression), one logit."""
    layers = [keras.Input(tuple(input_shape)), keras.layers.Flatten()]
    layers += [keras.layers.Dense(hidden, activation="relu")] if hidden else []
    return keras.Sequential([*layers, keras.layers.Dense(1)], name="auc_mlp")


def _logits(model, images: tf.Tensor, *, training: bool) -> tf.Tensor:
    return tf.cast(tf.reshape(call_model(model, images, training=training), [-1]), tf.float32)


@gin.configurable
def binary_step(model, optimizer, batch, global_batch_size: int) -> dict[str, tf.Tensor]:
    """One step of sigmoid cross-entropy; loss and accuracy as this replica's share of the global mean."""
    images, labels = batch[0], tf.cast(batch[1], tf.float32)
    with tf.GradientTape() as tape:
        logits = _logits(model, images, training=True)
        per_example = tf.nn.sigmoid_cross_entropy_with_logits(labels=labels, logits=logits)
        loss = tf.nn.compute_average_loss(per_example, global_batch_size=global_batch_size)
        loss += regularization_loss(model)
    variables = model.trainable_variables
    optimizer.apply_gradients(zip(tape.gradient(scale_loss(optimizer, loss), variables), variables))
    correct = tf.cast(tf.equal(tf.cast(logits > 0, tf.float32), labels), tf.float32)
    return {"loss": loss, "accuracy": tf.reduce_sum(correct) / global_batch_size}


@gin.configurable
def auc_metrics(num_thresholds: int = 10000) -> dict[str, keras.metrics.Metric]:
    """The eval's Keras metric objects: ROC AUC from `num_thresholds` buckets."""
    return {"auc": keras.metrics.AUC(num_thresholds=num_thresholds)}


@gin.configurable
def auc_eval_step(model, batch, metrics: Mapping[str, keras.metrics.Metric]) -> dict[str, tf.Tensor]:
    """Updates the AUC with this replica's weighted probabilities; returns sums of loss and weights."""
    images, labels, weights = batch[0], tf.cast(batch[1], tf.float32), tf.cast(batch[2], tf.float32)
    logits = _logits(model, images, training=False)
    metrics["auc"].update_state(labels, tf.sigmoid(logits), sample_weight=weights)
    per_example = tf.nn.sigmoid_cross_entropy_with_logits(labels=labels, logits=logits)
    return {"loss": weighted_sum(per_example, weights), "num_examples": tf.reduce_sum(weights)}
