"""A small GAN on the 8x8 digits: two models, two optimizers, one step that trains D then G.

What it shows of the loop: `model_fn` returns a dict of Keras models, `optimizer_fn` a dict of
optimizers keyed like them (the loop builds each with its own model's variables, under the
scope), and the step receives both dicts as returned. Losses follow the step contract: per
example, averaged with `tf.nn.compute_average_loss` over the GLOBAL batch, so SUM over
replicas is the global-batch mean and the run trains the same on 1 or N replicas.

Noise comes from `tf.random.normal` inside the step, not from `keras.random` with a
`SeedGenerator`: under MirroredStrategy a seed generator's state is a mirrored variable that
every replica reads alike, so every replica would draw the SAME noise (half the variety of
fakes on 2 replicas), while each replica's stateful `tf.random` op draws its own. The price:
that RNG state is not in the checkpoint, so a resumed run draws different (equally random)
noise than an unbroken one would.

Gin (experiments/gan/gan.gin): `import experiments.gan.gan`, then
`train.model_fn = @gan_models`, `train.optimizer_fn = @gan_optimizers`,
`train.step_fn = @gan_step`, `train.eval_step_fn = @gan_eval_step`.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import gin
import keras
import numpy as np
import tensorflow as tf

from trainer.task.steps import scale_loss, weighted_sum


@gin.configurable
def gan_models(input_shape: Sequence[int], noise_dim: int = 16, hidden: int = 128) -> dict[str, keras.Model]:
    """A two-layer generator (noise -> image in [-1, 1]) and a two-layer discriminator (image -> logit)."""
    pixels = int(np.prod(input_shape))
    generator = keras.Sequential(
        [
            keras.Input((noise_dim,)),
            keras.layers.Dense(hidden, activation="relu"),
            keras.layers.Dense(pixels, activation="tanh"),
            keras.layers.Reshape(tuple(input_shape)),
        ],
        name="generator",
    )
    discriminator = keras.Sequential(
        [
            keras.Input(tuple(input_shape)),
            keras.layers.Flatten(),
            keras.layers.Dense(hidden),
            keras.layers.LeakyReLU(0.2),
            keras.layers.Dense(1),
        ],
        name="discriminator",
    )
    return {"generator": generator, "discriminator": discriminator}


@gin.configurable
def gan_optimizers(learning_rate: float = 1e-3, beta_1: float = 0.5) -> dict[str, keras.optimizers.Optimizer]:
    """One Adam per model, keyed like `gan_models` (beta_1 = 0.5, the usual GAN choice)."""
    return {name: keras.optimizers.Adam(learning_rate, beta_1=beta_1) for name in ("generator", "discriminator")}


def _real_images(batch) -> tf.Tensor:
    """The batch's images (its first element), from the digits' [0, 1] to the generator's [-1, 1]."""
    return tf.cast(batch[0], tf.float32) * 2.0 - 1.0


def _fakes(generator: keras.Model, count: tf.Tensor, *, training: bool) -> tf.Tensor:
    noise = tf.random.normal(tf.stack([count, generator.input_shape[-1]]))
    return generator(noise, training=training)


def _logits(discriminator: keras.Model, images: tf.Tensor, *, training: bool) -> tf.Tensor:
    return tf.cast(tf.reshape(discriminator(images, training=training), [-1]), tf.float32)


def _cross_entropy(logits: tf.Tensor, target: float) -> tf.Tensor:
    """Per-example sigmoid cross-entropy against a constant target (1 = real, 0 = fake)."""
    return tf.nn.sigmoid_cross_entropy_with_logits(labels=tf.fill(tf.shape(logits), target), logits=logits)


def _apply(optimizer, tape: tf.GradientTape, loss: tf.Tensor, model: keras.Model) -> None:
    variables = model.trainable_variables
    optimizer.apply_gradients(zip(tape.gradient(scale_loss(optimizer, loss), variables), variables))


@gin.configurable
def gan_step(
    model: Mapping[str, keras.Model], optimizer: Mapping, batch, global_batch_size: int
) -> dict[str, tf.Tensor]:
    """One discriminator update on real and fake images, then one generator update against it.

    Each value is this replica's share of the global-batch mean (SUM over replicas = global).
    """
    generator, discriminator = model["generator"], model["discriminator"]
    real = _real_images(batch)
    count = tf.shape(real)[0]
    with tf.GradientTape() as tape:
        real_logits = _logits(discriminator, real, training=True)
        fake_logits = _logits(discriminator, _fakes(generator, count, training=True), training=True)
        per_example = _cross_entropy(real_logits, 1.0) + _cross_entropy(fake_logits, 0.0)
        d_loss = tf.nn.compute_average_loss(per_example, global_batch_size=global_batch_size)
    _apply(optimizer["discriminator"], tape, d_loss, discriminator)
    with tf.GradientTape() as tape:  # the generator is judged by the discriminator just updated
        fooled = _logits(discriminator, _fakes(generator, count, training=True), training=True)
        g_loss = tf.nn.compute_average_loss(_cross_entropy(fooled, 1.0), global_batch_size=global_batch_size)
    _apply(optimizer["generator"], tape, g_loss, generator)
    return {
        "d_loss": d_loss,
        "g_loss": g_loss,
        "d_real_accuracy": tf.reduce_sum(tf.cast(real_logits > 0, tf.float32)) / global_batch_size,
        "d_fake_accuracy": tf.reduce_sum(tf.cast(fake_logits < 0, tf.float32)) / global_batch_size,
    }


@gin.configurable
def gan_eval_step(model: Mapping[str, keras.Model], batch) -> dict[str, tf.Tensor]:
    """Sums over this replica's real examples (weight 1; padding has weight 0 and counts nowhere).

    One fake per real example: d_loss, g_loss and the discriminator's accuracy on both.
    """
    generator, discriminator = model["generator"], model["discriminator"]
    weights = tf.cast(batch[-1], tf.float32)
    real = _real_images(batch)
    real_logits = _logits(discriminator, real, training=False)
    fake_logits = _logits(discriminator, _fakes(generator, tf.shape(real)[0], training=False), training=False)
    return {
        "d_loss": weighted_sum(_cross_entropy(real_logits, 1.0) + _cross_entropy(fake_logits, 0.0), weights),
        "g_loss": weighted_sum(_cross_entropy(fake_logits, 1.0), weights),
        "d_real_accuracy": weighted_sum(tf.cast(real_logits > 0, tf.float32), weights),
        "d_fake_accuracy": weighted_sum(tf.cast(fake_logits < 0, tf.float32), weights),
        "num_examples": tf.reduce_sum(weights),
    }
