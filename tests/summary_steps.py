"""A classification step that also writes its own TensorBoard summaries after its update: a scalar
(the optimizer's step count), a histogram of the first trainable variable and an image of the
batch's first example (`with_summaries=False`: the same step without them, to compare speeds).

Gin: `import tests.summary_steps`, then `train.step_fn = @summary_step`."""

import gin
import tensorflow as tf

from trainer.task import steps


@gin.configurable
def summary_step(model, optimizer, batch, global_batch_size, with_summaries: bool = True):
    outputs = steps.classification_step(model, optimizer, batch, global_batch_size)
    if with_summaries:
        images = tf.cast(batch[0], tf.float32)
        tf.summary.scalar("optimizer_iterations", tf.cast(optimizer.iterations, tf.float32))
        tf.summary.histogram("first_weights", model.trainable_variables[0])
        tf.summary.image("first_image", images[:1])
    return outputs
