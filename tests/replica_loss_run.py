"""`python -m tests.replica_loss_run MODES`: the models of tests/replica_loss_models.py trained 30 SGD steps
on one device and under each strategy of MODES (comma-separated), with every replica given the same
slice S of 16 examples per step while one device gets S alone. A correct run then computes exactly one
device's numbers: the replicas' model-call losses (`model.losses`, scaled as the step contract wants)
sum to one device's, and the weights end the same. Prints one JSON line (from the chief only under
multi_worker_mirrored, whose workers read TF_CONFIG).
"""

from __future__ import annotations

import json
import sys

import numpy as np


def main(modes: list[str]) -> None:
    from trainer.distribution import devices, strategies

    if modes != ["multi_worker_mirrored"]:
        devices.configure_devices(devices.DeviceConfig(logical_cpus_without_gpu=2))
    import keras
    import tensorflow as tf

    from tests import replica_loss_models as models
    from trainer import data
    from trainer.task import layer_state, steps

    made = {name: strategies.make_strategy(name) for name in modes}  # before any op: collectives need it
    source = data.Digits()
    slice_size, num_steps = 16, 30
    batches = iter(data.train_dataset(source, slice_size, 0))
    slices = [next(batches) for _ in range(num_steps)]
    kinds = {
        "sequential": (models.bn_activity_model, steps.classification_step),
        "subclassed": (models.bn_dropout_add_loss_model, models.compute_loss_step),
    }

    def measured(step):
        def run(model, optimizer, batch, global_batch_size):
            outputs = dict(step(model, optimizer, batch, global_batch_size))
            outputs["model_losses"] = steps.regularization_loss(model)  # read in the replica, after the step
            return outputs

        return run

    def train(strategy, kind):
        model_fn, step = kinds[kind]
        keras.utils.set_random_seed(0)
        with strategy.scope(), layer_state.model_creation_scope(strategy):
            model = model_fn(source.input_shape, source.num_classes)
        layer_state.separate_replica_losses(strategy, model)  # as build_task does
        with strategy.scope():
            optimizer = keras.optimizers.SGD(0.1)
            optimizer.build(model.trainable_variables)
        initial = [np.array(w.numpy()) for w in model.weights]
        global_batch_size = slice_size * strategy.num_replicas_in_sync
        step = measured(step)

        @tf.function
        def one_step(values):
            outputs = strategy.run(step, args=(model, optimizer, values, global_batch_size))
            return {k: strategy.reduce("SUM", v, axis=None) for k, v in outputs.items()}

        record = {"loss": [], "model_losses": []}
        for batch in slices:
            outputs = one_step(strategy.experimental_distribute_values_from_function(lambda _, b=batch: b))
            for key in record:
                record[key].append(float(outputs[key]))
        return record, initial, [np.array(w.numpy()) for w in model.weights]

    result = {}
    for kind in kinds:
        reference, initial, reference_weights = train(tf.distribute.get_strategy(), kind)
        for name, strategy in made.items():
            record, _, weights = train(strategy, kind)
            result[f"{name}/{kind}"] = {
                "replicas": strategy.num_replicas_in_sync,
                "model_losses": record["model_losses"][:3],
                "one_device_model_losses": reference["model_losses"][:3],
                "model_losses_diff": max(abs(a - b) for a, b in zip(record["model_losses"], reference["model_losses"])),
                "loss_diff": max(abs(a - b) for a, b in zip(record["loss"], reference["loss"])),
                "weights_diff": max(float(np.abs(a - b).max()) for a, b in zip(weights, reference_weights)),
                "trained": max(float(np.abs(a - b).max()) for a, b in zip(initial, reference_weights)),
            }
    chief = all(
        s.cluster_resolver is None or s.cluster_resolver.task_id in (None, 0)
        for s in made.values()
        if hasattr(s, "cluster_resolver")
    )
    if chief:
        print(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1].split(","))
