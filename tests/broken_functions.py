"""User functions with the mistakes researchers make, for tests/test_mistakes.py."""
import gin
import keras
import tensorflow as tf

from trainer.task import optimizers


@gin.configurable
def list_step(model, optimizer, batch, global_batch_size):
    return [tf.constant(1.0)]


@gin.configurable
def vector_step(model, optimizer, batch, global_batch_size):
    return {"loss": tf.zeros([3])}


@gin.configurable
def string_step(model, optimizer, batch, global_batch_size):
    return {"loss": tf.constant("low")}


@gin.configurable
def no_count_eval_step(model, batch):
    return {"loss": tf.reduce_sum(batch[2])}


@gin.configurable
def list_eval_step(model, batch):
    return [tf.reduce_sum(batch[2])]


@gin.configurable
def model_with_unknown_parameter(input_shape, num_classes, vocabulary):
    return keras.Sequential([keras.Input(input_shape), keras.layers.Flatten(), keras.layers.Dense(num_classes)])


@gin.configurable
def model_of_wrong_input(input_shape, num_classes):
    return keras.Sequential([keras.Input((5,)), keras.layers.Dense(num_classes)])


@gin.configurable
def not_a_model(input_shape, num_classes):
    return 3


@gin.configurable
def two_optimizers(global_batch_size, total_steps):
    return {"generator": optimizers.make_optimizer(global_batch_size=global_batch_size, total_steps=total_steps),
            "critic": optimizers.make_optimizer(global_batch_size=global_batch_size, total_steps=total_steps)}


@gin.configurable
def batched_input(split):
    return tf.data.Dataset.from_tensor_slices((tf.zeros([100, 8, 8, 1]), tf.zeros([100], tf.int32))).batch(10)


@gin.configurable
def list_input(split):
    return [1, 2, 3]


@gin.configurable
def random_input(split):
    return tf.data.Dataset.range(300).map(lambda i: (tf.random.uniform([8, 8, 1]), tf.cast(i % 10, tf.int32)))


random_input.deterministic = False
random_input.num_classes = 10


@gin.configurable
def none_optimizer(global_batch_size, total_steps):
    return None


@gin.configurable
def none_model(input_shape, num_classes):
    return None


@gin.configurable
def none_step(model, optimizer, batch, global_batch_size):
    return None


@gin.configurable
def list_metrics():
    return [keras.metrics.AUC()]


@gin.configurable
def number_metrics():
    return {"auc": 3}
