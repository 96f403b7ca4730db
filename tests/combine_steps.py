"""Steps with diagnostics that are no share of a global-batch mean, declared with trainer.combine,
for tests/test_combine.py."""

import gin
import tensorflow as tf

import trainer
from trainer.task.steps import call_model


@gin.configurable
@trainer.combine(max_logit="max", min_logit="min", hidden_grad_norm="mean", output_grad_norm="mean")
def diagnostic_step(model, optimizer, batch, global_batch_size):
    """Cross-entropy, plus the largest and smallest logit of the global batch and the norms of two
    layers' kernels' gradients after the sum across replicas (the same on every replica)."""
    images, labels = batch[0], tf.cast(batch[1], tf.int32)
    with tf.GradientTape() as tape:
        logits = call_model(model, images, training=True)
        per_example = tf.nn.sparse_softmax_cross_entropy_with_logits(labels, logits)
        loss = tf.nn.compute_average_loss(per_example, global_batch_size=global_batch_size)
    variables = model.trainable_variables
    grads = tape.gradient(loss, variables)
    context = tf.distribute.get_replica_context()
    summed = context.all_reduce(tf.distribute.ReduceOp.SUM, grads) if context.num_replicas_in_sync > 1 else grads
    kernels = [g for g, v in zip(summed, variables) if len(v.shape) == 2]
    optimizer.apply_gradients(zip(grads, variables))
    return {
        "loss": loss,
        "max_logit": tf.reduce_max(logits),
        "min_logit": tf.reduce_min(logits),
        "hidden_grad_norm": tf.norm(kernels[0]),
        "output_grad_norm": tf.norm(kernels[-1]),
    }


@gin.configurable
@trainer.combine(max_logits="max")
def misnamed_step(model, optimizer, batch, global_batch_size):
    """Declares an output it does not return."""
    return diagnostic_step.__wrapped__(model, optimizer, batch, global_batch_size)


@gin.configurable
def undeclared_max_step(model, optimizer, batch, global_batch_size):
    """The same diagnostics, undeclared: every output is taken for a share."""
    return diagnostic_step.__wrapped__(model, optimizer, batch, global_batch_size)
