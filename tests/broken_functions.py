"""User functions with the mistakes researchers make, for tests/test_mistakes.py."""

import gin
import keras
import numpy as np
import tensorflow as tf

from trainer.extensions import Extension
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
    return {
        "generator": optimizers.make_optimizer(global_batch_size=global_batch_size, total_steps=total_steps),
        "critic": optimizers.make_optimizer(global_batch_size=global_batch_size, total_steps=total_steps),
    }


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


def _images(n: int = 256):
    return tf.random.stateless_uniform([n, 8, 8, 1], seed=[1, 2])


@gin.configurable
def missing_file_input(split):
    arrays = np.load(f"/nonexistent/digits-{split}.npz")
    return tf.data.Dataset.from_tensor_slices((arrays["x"], arrays["y"]))


@gin.configurable
def input_without_split():
    return tf.data.Dataset.from_tensor_slices((_images(), tf.zeros([256], tf.int32)))


@gin.configurable
def endless_generator_input(split):
    def examples():
        i = 0
        while True:
            yield np.full([8, 8, 1], i % 3, np.float32), i % 10
            i += 1

    return tf.data.Dataset.from_generator(
        examples, output_signature=(tf.TensorSpec([8, 8, 1], tf.float32), tf.TensorSpec([], tf.int32))
    )


@gin.configurable
def generator_input(split):
    """A finite Python generator: fine in the trainer's process, not on the tf.data service's workers."""

    def examples():
        for i in range(256):
            yield np.full([8, 8, 1], i % 3, np.float32), i % 10

    return tf.data.Dataset.from_generator(
        examples, output_signature=(tf.TensorSpec([8, 8, 1], tf.float32), tf.TensorSpec([], tf.int32))
    )


@gin.configurable
def string_label_input(split):
    names = tf.constant(["zero", "one", "two", "three"])
    return tf.data.Dataset.from_tensor_slices((_images(), tf.gather(names, tf.range(256) % 4)))


@gin.configurable
def one_based_label_input(split):
    return tf.data.Dataset.from_tensor_slices((_images(), tf.range(256) % 10 + 1))


one_based_label_input.num_classes = 10


@gin.configurable
def dict_input(split):
    datasets = {
        "train": tf.data.Dataset.from_tensor_slices((_images(), tf.range(256) % 10)),
        "eval": tf.data.Dataset.from_tensor_slices((_images(64), tf.range(64) % 10)),
    }
    return datasets[split]


class RaisingCallback(keras.callbacks.Callback):
    def on_train_begin(self, logs=None):
        self.history = {}["loss"]


@gin.configurable
def raising_callback():
    return RaisingCallback()


class MisspeltExtension(Extension):
    name = "misspelt"

    def atach(self, context):
        self.weights = context.task.models.trainable_variables

    def after_loop(self, context, step, metrics):
        print(len(self.weights))


@gin.configurable
def misspelt_extension():
    return MisspeltExtension()


@gin.configurable
def raising_model(input_shape, num_classes):
    layers = [keras.layers.Flatten(), keras.layers.Dense(num_classes)]
    return keras.Sequential([keras.Input(input_shape), *layers, layers[2]])


class _CallRaises(keras.Model):
    """A subclassed model whose own `call` has a bug: it raises while the run builds the model."""

    def __init__(self, num_classes):
        super().__init__()
        self.dense = keras.layers.Dense(num_classes)

    def call(self, x):
        return self.dense(x)[:, self.missing_index]


@gin.configurable
def model_whose_call_raises(input_shape, num_classes):
    return _CallRaises(num_classes)


class _WrongSideInput(keras.layers.Layer):
    """A layer whose training-only branch gives a Dense built for 7 features the batch's 64: fine when the
    run builds the model (inference), raising in the traced train step."""

    def __init__(self):
        super().__init__()
        self.side = keras.layers.Dense(3, name="side")

    def build(self, input_shape):
        self.side.build((None, 7))

    def call(self, x, training=False):
        return self.side(x) if training else x


class _NoTraining(keras.layers.Layer):
    """A layer whose own call raises in training."""

    def call(self, x, training=False):
        if training:
            raise ValueError("_NoTraining has no training branch")
        return x


@gin.configurable
def model_whose_layer_fails_in_training(input_shape, num_classes, layer="wrong_side_input"):
    middle = {"wrong_side_input": _WrongSideInput, "no_training": _NoTraining}[layer]()
    return keras.Sequential([keras.Input(input_shape), keras.layers.Flatten(), middle, keras.layers.Dense(num_classes)])


@gin.configurable
def id_input(split):
    """(x, y, example_id): an int64 id where the built-in steps take the sample weight."""
    return tf.data.Dataset.from_tensor_slices((_images(), tf.range(256) % 10, tf.range(256, dtype=tf.int64)))


id_input.num_classes = 10


@gin.configurable
def unlabelled_dict_input(split):
    """Dict examples with the label among the features: the built-in steps find no label."""
    return tf.data.Dataset.from_tensor_slices({"image": _images(), "label": tf.range(256) % 10})


@gin.configurable
def narrow_model(input_shape, num_classes):
    """5 outputs whatever num_classes is: labels 5..9 have no logit."""
    return keras.Sequential([keras.Input(input_shape), keras.layers.Flatten(), keras.layers.Dense(5)])
