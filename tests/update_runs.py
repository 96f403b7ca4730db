"""Helpers of tests/test_accumulation.py and tests/test_clipping.py: SGD runs of the real loop with
`train.grad_accum_steps` / `train.clip_global_norm`, and an optimizer with Keras' own clipping for gin."""

from __future__ import annotations

import json
import sys

import gin
import keras
import numpy as np

GLOBAL_BATCH, STEPS, CLIP = 64, 20, 0.05


@gin.configurable
def keras_clipping_sgd(global_clipnorm: float = 1.0):
    """SGD with Keras' own global_clipnorm, which the loop refuses on more than one replica."""
    return keras.optimizers.SGD(0.1, global_clipnorm=global_clipnorm)


def max_difference(a, b) -> float:
    return float(max(np.abs(np.asarray(x) - np.asarray(y)).max() for x, y in zip(a, b)))


def main(replicas: int, runs: list[tuple[int, float | None]]) -> None:
    """Trains STEPS SGD steps on `replicas` (1: the default strategy) for each (K, clip) of `runs`,
    from the same initial weights over the same batches; prints one JSON line of the results."""
    from trainer.distribution import devices

    devices.configure_devices(devices.DeviceConfig(logical_cpus=max(replicas, 1)))
    import tensorflow as tf

    from trainer import data
    from trainer.loops.sync import TrainLoop
    from trainer.task import steps
    from trainer.update import accumulation

    source = data.Digits()
    # One MirroredStrategy per process: two of different sizes in one process share collective keys.
    strategy = (
        tf.distribute.get_strategy()
        if replicas == 1
        else tf.distribute.MirroredStrategy([d.name for d in tf.config.list_logical_devices("CPU")])
    )
    keras.utils.set_random_seed(0)

    def make_model():
        return keras.Sequential(
            [
                keras.Input(source.input_shape),
                keras.layers.Flatten(),
                keras.layers.Dense(16, activation="relu"),
                keras.layers.Dense(source.num_classes),
            ]
        )

    initial = make_model().get_weights()
    results = []
    for k, clip in runs:
        with strategy.scope():
            model = make_model()
            model.set_weights(initial)
            optimizer = keras.optimizers.SGD(0.5)
            optimizer.build(model.trainable_variables)
            step = tf.Variable(
                0, dtype=tf.int64, trainable=False, aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA
            )
        options = accumulation.UpdateOptions(grad_accum_steps=k, clip_global_norm=clip)
        accumulation.prepare(
            options, optimizer, num_replicas=strategy.num_replicas_in_sync, global_batch_size=GLOBAL_BATCH
        )
        loop = TrainLoop(
            strategy,
            model,
            optimizer,
            accumulation.update_step(steps.classification_step, options),
            GLOBAL_BATCH,
            data.distribute_train(strategy, source, GLOBAL_BATCH, seed=0),
            step,
        )
        outputs = [loop.run(1) for _ in range(STEPS)]
        results.append(
            {
                "weights": [w.tolist() for w in model.get_weights()],
                "outputs": outputs,
                "global_step": int(step.numpy()),
                "iterations": int(optimizer.iterations.numpy()),
                "moved": max_difference(initial, model.get_weights()),
            }
        )
    print(json.dumps({"replicas": strategy.num_replicas_in_sync, "runs": results}))


if __name__ == "__main__":
    main(int(sys.argv[1]), json.loads(sys.argv[2]))
