"""The tutorial's CNN and an MLP; any other Keras 3 model or tf.Module plugs in through `model_fn`."""
from __future__ import annotations

import math

import keras

from trainer.validation import check_int, check_ints, check_number


def _regularizer(name: str, l2: float):
    check_number(f"{name}.l2", l2, strictly=False)
    return keras.regularizers.L2(l2) if l2 else None


def _check(name: str, widths, width_name: str, dropout: float) -> None:
    check_ints(f"{name}.{width_name}", widths)
    check_number(f"{name}.dropout", dropout, strictly=False, below=1.0)


def cnn(
    input_shape: tuple[int, ...],
    num_classes: int,
    *,
    filters: tuple[int, ...] = (32, 64, 64),
    dense_units: int = 128,
    dropout: float = 0.0,
    l2: float = 0.0,
) -> keras.Model:
    """The tutorial CNN: 3x [Conv 3x3 same relu x2, MaxPool 2], Flatten, Dense relu, Dense.

    Pooling uses 'same' padding so the model fits any image of at least 1x1 (8x8 digits
    shrink to 4, 2, 1); the last layer returns logits.
    """
    _check("cnn", filters, "filters", dropout)
    check_int("cnn.dense_units", dense_units)
    if len(input_shape) == 2:
        input_shape = (*input_shape, 1)
    reg = _regularizer("cnn", l2)
    layers = [keras.Input(shape=tuple(input_shape))]
    for width in filters:
        layers += [
            keras.layers.Conv2D(width, 3, padding="same", activation="relu", kernel_regularizer=reg),
            keras.layers.Conv2D(width, 3, padding="same", activation="relu", kernel_regularizer=reg),
            keras.layers.MaxPooling2D(2, padding="same"),
        ]
    layers += [
        keras.layers.Flatten(),
        keras.layers.Dense(dense_units, activation="relu", kernel_regularizer=reg),
    ]
    if dropout:
        layers.append(keras.layers.Dropout(dropout))
    layers.append(keras.layers.Dense(num_classes, kernel_regularizer=reg))
    return keras.Sequential(layers, name="cnn")


def mlp(
    input_shape: tuple[int, ...],
    num_classes: int,
    *,
    hidden: tuple[int, ...] = (256, 128),
    dropout: float = 0.0,
    l2: float = 0.0,
) -> keras.Model:
    """A multi-layer perceptron over the flattened input; returns logits."""
    _check("mlp", hidden, "hidden", dropout)
    reg = _regularizer("mlp", l2)
    layers = [keras.Input(shape=tuple(input_shape)), keras.layers.Flatten()]
    for width in hidden:
        layers.append(keras.layers.Dense(width, activation="relu", kernel_regularizer=reg))
        if dropout:
            layers.append(keras.layers.Dropout(dropout))
    layers.append(keras.layers.Dense(num_classes, kernel_regularizer=reg))
    return keras.Sequential(layers, name="mlp")


def num_parameters(model) -> int:
    """Total number of trainable scalars, for the run record."""
    return sum(math.prod(v.shape) for v in model.trainable_variables)
