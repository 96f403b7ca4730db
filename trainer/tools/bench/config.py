"""The config a bench run measures, read and built exactly as `train` reads and builds it."""
from __future__ import annotations

from trainer import main as main_lib


def train_settings(gin_files: list[str], gin_bindings: list[str]) -> dict:
    """Parses the gin config; the `train` parameters it binds, over `train`'s defaults."""
    import gin

    from trainer.run import train as train_lib

    main_lib.parse_gin(gin_files, gin_bindings)
    return train_lib.defaults_with(gin.get_bindings("train"))


def setup(settings: dict):
    """Strategy and task (model, built optimizer, input), by `train`'s own setup."""
    from trainer.run import train as train_lib

    runtime, task = train_lib.setup_from(settings)
    return runtime.strategy, task


def train_data(dist, inp, settings: dict):
    """The train data of `inp` distributed as the loop gets it (trainer/loops/controller.py), from step 0."""
    from trainer import data

    return data.distribute_train(dist, inp, settings["global_batch_size"], settings["seed"],
                                 method=settings["distribute_method"], shard_policy=settings["shard_policy"])
