"""Worked example: regression of a float target on scikit-learn's diabetes data (embedded, no download).

What differs from the tutorial's classifier is only what a researcher writes: an input function
of `(features float32 [10], target float32 [])`, a model with one output, a step with a Keras loss
at `reduction=None` averaged by the GLOBAL batch size (docs/design.md, rule 2), and an eval step that
returns sums. Features and target are standardised with the train split's statistics, so the
mean predictor (the train mean target) predicts 0 and its eval MSE is the eval split's mean of
squared standardised targets: reported beside the model's as `baseline_mse`.
"""

from __future__ import annotations

import dataclasses
from functools import cached_property
from typing import Mapping

import gin
import keras
import numpy as np
import tensorflow as tf

from trainer.errors import UserError
from trainer.task.steps import call_model, regularization_loss, scale_loss, weighted_sum


@gin.configurable
@dataclasses.dataclass(frozen=True)
class Diabetes:
    """442 patients, 10 features, a disease-progression target; `eval_fraction` held out by a seeded shuffle."""

    eval_fraction: float = 0.2
    seed: int = 0
    splits = ("train", "eval")

    @cached_property
    def _arrays(self) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        try:
            from sklearn.datasets import load_diabetes
        except ImportError:
            raise UserError(
                "experiments/regression reads scikit-learn's diabetes data: pip install -e '.[examples]'"
            ) from None

        x, y = load_diabetes(return_X_y=True)
        order = np.random.RandomState(self.seed).permutation(len(y))
        num_eval = int(round(len(y) * self.eval_fraction))
        train, held_out = order[num_eval:], order[:num_eval]
        x_mean, x_std = x[train].mean(axis=0), x[train].std(axis=0)
        y_mean, y_std = y[train].mean(), y[train].std()

        def scale(idx):
            return ((x[idx] - x_mean) / x_std).astype(np.float32), ((y[idx] - y_mean) / y_std).astype(np.float32)

        return {"train": scale(train), "eval": scale(held_out)}

    def __call__(self, split: str) -> tf.data.Dataset:
        """Unbatched `(features float32 [10], target float32 [])`, standardised by the train split."""
        return tf.data.Dataset.from_tensor_slices(self._arrays[split])


@gin.configurable
def regression_mlp(input_shape: tuple[int, ...], hidden: tuple[int, ...] = (32,), l2: float = 0.0) -> keras.Model:
    """A small MLP with one linear output of shape [batch, 1]."""
    reg = keras.regularizers.L2(l2) if l2 else None
    layers = [keras.Input(shape=tuple(input_shape))]
    layers += [keras.layers.Dense(width, activation="relu", kernel_regularizer=reg) for width in hidden]
    layers.append(keras.layers.Dense(1, kernel_regularizer=reg))
    return keras.Sequential(layers, name="regression_mlp")


# reduction=None: per-example losses, which the step averages by the global batch size itself.
_SQUARED_ERROR = keras.losses.MeanSquaredError(reduction=None)


@gin.configurable
def regression_step(model, optimizer, batch, global_batch_size: int) -> Mapping[str, tf.Tensor]:
    """One optimizer step on the mean squared error (+ any L2); returns this replica's share of loss and mse."""
    features, target = batch[0], batch[1]
    with tf.GradientTape() as tape:
        prediction = tf.cast(call_model(model, features, training=True), tf.float32)
        per_example = _SQUARED_ERROR(target[:, None], prediction)  # [batch]: mean over the 1 output
        loss = tf.nn.compute_average_loss(per_example, global_batch_size=global_batch_size)
        loss += regularization_loss(model)
        scaled = scale_loss(optimizer, loss)
    variables = model.trainable_variables
    optimizer.apply_gradients(zip(tape.gradient(scaled, variables), variables))
    return {"loss": loss, "mse": tf.nn.compute_average_loss(per_example, global_batch_size=global_batch_size)}


@gin.configurable
def regression_eval_step(model, batch) -> Mapping[str, tf.Tensor]:
    """Weighted sums of the model's and of the mean predictor's squared errors (padding has weight 0).

    The mean predictor predicts the train mean target, which is 0 after standardisation.
    """
    features, target, weights = batch
    prediction = tf.cast(call_model(model, features, training=False), tf.float32)[:, 0]
    return {
        "mse": weighted_sum(tf.square(prediction - target), weights),
        "baseline_mse": weighted_sum(tf.square(target), weights),
        "num_examples": tf.reduce_sum(weights),
    }
