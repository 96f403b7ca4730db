"""A model built when the module is imported (outside any strategy's scope), as a notebook habit
carries over into a gin-imported module, for tests/test_mistakes.py."""

import gin
import keras

MODEL = keras.Sequential([keras.Input((8, 8, 1)), keras.layers.Flatten(), keras.layers.Dense(10)])


@gin.configurable
def import_time_model(input_shape, num_classes):
    return MODEL
