"""The tutorial's CNN and an MLP; any other Keras 3 model or tf.Module plugs in through `model_fn`."""

from __future__ import annotations

import math

import keras

from trainer.errors import UserError
from trainer.validation import check_choice, check_int, check_ints, check_number


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
    pool_padding: str = "same",
) -> keras.Model:
    """The tutorial CNN: 3x [Conv 3x3 same relu x2, MaxPool 2], Flatten, Dense relu, Dense.

    `pool_padding` 'same' fits any image (8x8 digits shrink to 4, 2, 1); 'valid' (the tutorial's) drops an odd
    last row and column. It returns logits: the tutorial's softmax + loss, as Keras computes it (from
    probabilities the loss would be clipped, capping a confident mistake's loss and losing its gradient).
    """
    _check("cnn", filters, "filters", dropout)
    check_int("cnn.dense_units", dense_units)
    check_choice("cnn.pool_padding", pool_padding, ("same", "valid"))
    if len(input_shape) == 2:
        input_shape = (*input_shape, 1)
    if pool_padding == "valid" and min(input_shape[:2]) < 2 ** len(filters):
        raise UserError(
            f"cnn.pool_padding = 'valid' pools the {input_shape[0]}x{input_shape[1]} images to nothing "
            f"in {len(filters)} blocks: use 'same' or fewer cnn.filters"
        )
    reg = _regularizer("cnn", l2)
    layers = [keras.Input(shape=tuple(input_shape))]
    for width in filters:
        layers += [
            keras.layers.Conv2D(width, 3, padding="same", activation="relu", kernel_regularizer=reg),
            keras.layers.Conv2D(width, 3, padding="same", activation="relu", kernel_regularizer=reg),
            keras.layers.MaxPooling2D(2, padding=pool_padding),
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
    return sum(math.prod(v.shape) for v in model.trainable_variables)
