"""Worked example: a functional Keras model with two named inputs, fed dict examples.

Examples are `({'image': float32 [8, 8, 1], 'stats': float32 [16]}, label int32)`: the digits
(trainer's embedded `Digits`, same split) with each image's row and column means as a second
input. The model reads both shapes from `element_spec`; the built-in `classification_step` and
`classification_eval_step` work unchanged, since they pass `batch[0]` (here the dict) to the model.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import gin
import keras
import tensorflow as tf

from trainer import data


def _with_stats(image: tf.Tensor, label: tf.Tensor) -> tuple[dict[str, tf.Tensor], tf.Tensor]:
    """The image and its 8 row means and 8 column means, as named features."""
    pixels = image[..., 0]
    stats = tf.concat([tf.reduce_mean(pixels, axis=1), tf.reduce_mean(pixels, axis=0)], axis=0)
    return {"image": image, "stats": stats}, label


@gin.configurable
@dataclasses.dataclass(frozen=True)
class TwoInputs:
    """The embedded digits as two named inputs; `seed` and `eval_fraction` choose the split as in `Digits`."""

    eval_fraction: float = 0.2
    seed: int = 0
    splits = ("train", "eval")
    num_classes = 10

    def __call__(self, split: str) -> tf.data.Dataset:
        """Unbatched `({'image', 'stats'}, label int32)` of `split`."""
        digits = data.Digits(eval_fraction=self.eval_fraction, seed=self.seed)
        return digits(split).map(_with_stats)


@gin.configurable
def two_input_model(element_spec: Any, num_classes: int, *, filters: int = 16, units: int = 32) -> keras.Model:
    """A conv branch on 'image', a dense branch on 'stats', concatenated; returns logits."""
    features = element_spec[0]
    image = keras.Input(shape=tuple(features["image"].shape), name="image")
    stats = keras.Input(shape=tuple(features["stats"].shape), name="stats")
    seen = keras.layers.Conv2D(filters, 3, padding="same", activation="relu")(image)
    seen = keras.layers.MaxPooling2D(2)(seen)
    seen = keras.layers.Flatten()(seen)
    summary = keras.layers.Dense(units, activation="relu")(stats)
    joined = keras.layers.Concatenate()([seen, summary])
    hidden = keras.layers.Dense(units, activation="relu")(joined)
    logits = keras.layers.Dense(num_classes)(hidden)
    return keras.Model(inputs={"image": image, "stats": stats}, outputs=logits, name="two_input_model")
