"""The config a bench run measures, read and built exactly as `train` reads and builds it."""

from __future__ import annotations

from trainer import gin_flags


def train_settings(gin_files: list[str], gin_bindings: list[str]):
    """Parses the gin config; the run's Settings as `train` would get them."""
    from trainer import configurables

    gin_flags.parse_gin(gin_files, gin_bindings)
    return configurables.settings_from_gin()


def refuse_asynchronous(settings, what: str) -> None:
    """The bench compares local steps: a mode whose steps are remote closures is refused in one line."""
    from trainer.distribution import modes

    modes.require(
        f"train.strategy for {what}",
        modes.SYNCHRONOUS,
        settings.strategy,
        reason="its steps are asynchronous closures on remote workers, not comparable with a local bare "
        "step, and Keras 3 fit cannot run there",
        fix="measure a synchronous config",
    )


def setup(settings):
    """Strategy and task (model, built optimizer, input), by `train`'s own setup."""
    from trainer.run.setup import setup as run_setup

    runtime, task = run_setup(settings)
    return runtime.strategy, task


def train_data(dist, inp, settings):
    """The train data of `inp` as a distributed dataset, the loop's recipe (trainer/loops/build.py), from step 0:
    what the peers (Orbit, the input bench) read."""
    from trainer.loops.build import distributed_train_data

    return distributed_train_data(dist, inp, settings)


def loop_data(dist, inp, settings):
    """The train data as the synchronous loop reads it, from step 0: the split held on the devices where
    it fits (trainer/data/device.py), else `train_data`."""
    from trainer.loops.build import train_batches

    return train_batches(dist, inp, settings)
