"""A WGAN-style step for experiments/gan's models: `n_critic` discriminator updates, then one
generator update. `for _ in tf.range(n_critic)` (a graph while loop: TensorFlow runs an update
inside one on one device only) or, with `unrolled=True`, `for _ in range(n_critic)` (a Python
loop, traced n_critic times: every strategy).

Gin: `import tests.critic_steps`, then experiments/gan/gan.gin and `train.step_fn = @critic_loop_step`."""

import gin
import tensorflow as tf

from experiments.gan.gan import _apply, _cross_entropy, _fakes, _logits, _real_images


@gin.configurable
def critic_loop_step(model, optimizer, batch, global_batch_size, n_critic: int = 2, unrolled: bool = False):
    generator, discriminator = model["generator"], model["discriminator"]
    real = _real_images(batch)
    count = tf.shape(real)[0]
    d_loss = tf.constant(0.0)
    for _ in range(n_critic) if unrolled else tf.range(n_critic):
        with tf.GradientTape() as tape:
            fake_logits = _logits(discriminator, _fakes(generator, count, training=True), training=True)
            per_example = _cross_entropy(_logits(discriminator, real, training=True), 1.0) + _cross_entropy(
                fake_logits, 0.0
            )
            d_loss = tf.nn.compute_average_loss(per_example, global_batch_size=global_batch_size)
        _apply(optimizer["discriminator"], tape, d_loss, discriminator)
    with tf.GradientTape() as tape:
        fooled = _logits(discriminator, _fakes(generator, count, training=True), training=True)
        g_loss = tf.nn.compute_average_loss(_cross_entropy(fooled, 1.0), global_batch_size=global_batch_size)
    _apply(optimizer["generator"], tape, g_loss, generator)
    return {"d_loss": d_loss, "g_loss": g_loss}
