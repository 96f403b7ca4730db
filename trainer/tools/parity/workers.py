"""What one worker process of a multi-process comparison does; results travel as .npz/.json files.

Each builds through `train`'s own setup (trainer/run/setup.py) in its own process: the multi-worker
and parameter-server strategies own their process, and the tf_keras side needs `keras` to be
tf_keras from the start.
"""

from __future__ import annotations

import dataclasses
import os

from trainer import data
from trainer.distribution import devices
from trainer.distribution.runtime import Runtime
from trainer.errors import UserError
from trainer.run.settings import Settings
from trainer.run.setup import setup
from trainer.tools.parity import runs
from trainer.tools.parity.config import ParityConfig


def embedded_cluster(settings: Settings):
    """parameter_server: a local cluster coordinated by this process; otherwise nothing."""
    from trainer import configurables
    from trainer.distribution import local_cluster

    return local_cluster.cluster_for(settings.strategy, configurables.local_cluster, print_fn=print)


def ps_chunk(runtime: Runtime, settings: Settings) -> int:
    """Steps per loop call: one (step-by-step losses), except a whole loop's with several ps workers."""
    if runtime.mode.coordinates_workers and data.num_workers(runtime.strategy) > 1:
        return settings.steps_per_loop
    return 1


def worker_ours(settings: Settings, steps: int, work_dir: str) -> None:
    """Our loop; the chief saves the results. Multi-worker: one of the launched workers.

    parameter_server: this process coordinates its own embedded cluster.
    """
    with embedded_cluster(settings):
        runtime, task = setup(settings)
        model = runs.single_model(task)
        initial = runs.weights(model)
        losses = runs.run_ours(runtime, task, settings, steps, chunk=ps_chunk(runtime, settings))
        if runtime.is_chief:
            runs.save(
                os.path.join(work_dir, "ours"),
                losses=losses,
                replicas=runtime.num_replicas,
                iterations=int(task.optimizers.iterations.numpy()),
                arrays={"initial": initial, "final": runs.weights(model)},
            )
    print(f"ours: {steps} steps on {runtime.num_replicas} replicas, last loss {losses[-1]:.6f}", flush=True)


def worker_tf_keras_fit(settings: Settings, config: ParityConfig, steps: int, work_dir: str) -> None:
    """tf_keras fit from ours' initial weights, on the same strategy; the chief saves the results.

    `keras` is tf_keras in this process, so `setup` builds tf_keras model and optimizer
    with the configured functions (unwrapped: tf_keras parity refuses mixed precision).
    """
    from trainer.tools.parity import fit

    _, arrays = runs.load(os.path.join(work_dir, "ours"))
    with embedded_cluster(settings):
        runtime, task = setup(settings)
        model = runs.single_model(task)
        with runtime.strategy.scope():
            model.set_weights(arrays["initial"])
        if runtime.mode.coordinates_workers:
            losses = fit.run_fit_ps(runtime, task, settings, config, steps, chunk=ps_chunk(runtime, settings))
        else:
            losses = fit.run_fit(runtime, task, settings, config, steps)
        if runtime.is_chief:
            runs.save(
                os.path.join(work_dir, "tf_keras_fit"),
                losses=losses,
                replicas=runtime.num_replicas,
                iterations=int(task.optimizers.iterations.numpy()),
                arrays={"final": runs.weights(model)},
            )
    print(f"tf_keras fit: {steps} steps on {runtime.num_replicas} replicas, last loss {losses[-1]:.6f}", flush=True)


def worker_replicas(settings: Settings, steps: int, work_dir: str, count: int) -> None:
    """Our loop on `count` logical CPUs under MirroredStrategy, from the first count's initial weights."""
    if count < 1 or settings.global_batch_size % count:
        raise UserError(f"--replicas: {count} does not divide train.global_batch_size {settings.global_batch_size}")
    device_config = dataclasses.replace(
        settings.device_config or devices.DeviceConfig(), logical_cpus=count, logical_cpus_without_gpu=0
    )
    runtime, task = setup(
        dataclasses.replace(settings, strategy="mirrored", device_config=device_config, parameter_server=None)
    )
    model = runs.single_model(task)
    init_path = os.path.join(work_dir, "initial")
    if runs.exists(init_path):
        _, arrays = runs.load(init_path)
        with runtime.strategy.scope():
            model.set_weights(arrays["initial"])
    else:
        runs.save(init_path, losses=[], arrays={"initial": runs.weights(model)})
    losses = runs.run_ours(runtime, task, settings, steps)
    runs.save(os.path.join(work_dir, f"replicas{count}"), losses=losses, arrays={"final": runs.weights(model)})
