"""train.warm_start: from another run's model_dir, a checkpoint prefix or a .weights.h5 file; a
partial restore that names what matched and what did not; a shape mismatch is one error line."""

from __future__ import annotations

import os

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.support import main_in_one_process
from trainer.errors import UserError
from trainer.extensions import warm_start
from trainer.extensions.registry import Registry
from trainer.run.settings import Settings
from trainer.task import models

SMALL = ["--gin_file=gin/single.gin", "--gin_bindings=cnn.filters=(8,)", "--gin_bindings=train.steps_per_loop=10"]


def cnn(dense_units: int = 16, filters=(8,)):
    return models.cnn((8, 8, 1), 10, filters=filters, dense_units=dense_units)


def same_weights(a, b) -> bool:
    return all(np.array_equal(x.numpy(), y.numpy()) for x, y in zip(a.weights, b.weights))


def test_from_a_checkpoint_prefix_and_a_model_dir(tmp_path):
    keras.utils.set_random_seed(1)
    source = cnn()
    prefix = tf.train.Checkpoint(model=source, optimizer=keras.optimizers.Adam()).write(str(tmp_path / "ckpt-7"))
    tf.train.CheckpointManager(tf.train.Checkpoint(model=source), str(tmp_path / "run"), 1).save(7)
    for path in (prefix, str(tmp_path / "run")):
        target, lines = cnn(), []
        assert not same_weights(source, target)
        warm_start.warm_start(target, path, lines.append)
        assert same_weights(source, target)
        assert "restored 8 of the model's 8 variables" in lines[0] and lines[1].endswith("(0): -")


def mlp(*units: int):
    return keras.Sequential([keras.Input((4,)), *[keras.layers.Dense(u) for u in units]])


def test_partial_restore_names_what_did_not_match(tmp_path):
    keras.utils.set_random_seed(1)
    source = mlp(8, 3)
    prefix = tf.train.Checkpoint(model=source).write(str(tmp_path / "ckpt"))
    target, lines = mlp(8, 3, 2), []  # one more layer at the end: the first two match by place
    warm_start.warm_start(target, prefix, lines.append)
    print("\n".join(lines))
    assert "restored 4 of the model's 6 variables" in lines[0] and "_operations/1/_kernel" in lines[0]
    assert "(2):" in lines[1] and "_operations/3/_kernel" in lines[1] and lines[2].endswith("(0): -")
    assert all(np.array_equal(a.numpy(), b.numpy()) for a, b in zip(target.weights[:4], source.weights))
    lines = []
    warm_start.warm_start(mlp(8), prefix, lines.append)  # the source has more: ignored, named
    assert "restored 2 of the model's 2" in lines[0] and "(2):" in lines[2] and "_operations/2/bias" in lines[2]


def test_from_a_weights_file_partially(tmp_path):
    keras.utils.set_random_seed(1)
    source = cnn()
    path = str(tmp_path / "source.weights.h5")
    source.save_weights(path)
    target, lines = cnn(), []
    warm_start.warm_start(target, path, lines.append)
    assert same_weights(source, target) and "restored 8 of the model's 8" in lines[0]
    small = str(tmp_path / "small.weights.h5")
    mlp(8, 3).save_weights(small)
    bigger, lines = mlp(8, 3, 2), []
    warm_start.warm_start(bigger, small, lines.append)
    print("\n".join(lines))
    assert "restored 4 of the model's 6" in lines[0] and "layers/dense_2/vars/0" in lines[1]


def test_shape_mismatch_and_bad_paths_are_user_errors(tmp_path):
    prefix = tf.train.Checkpoint(model=cnn(dense_units=16)).write(str(tmp_path / "ckpt"))
    with pytest.raises(UserError, match=r"_operations/5/_kernel has shape \[128, 16\] there but \[128, 32\]"):
        warm_start.warm_start(cnn(dense_units=32), prefix)
    for bad in (str(tmp_path / "nothing"), str(tmp_path), str(tmp_path / "x.weights.h5")):
        with pytest.raises(UserError, match="train.warm_start"):
            warm_start.WarmStart(bad)
    with pytest.raises(UserError, match="not supported with parameter_server"):
        Registry([warm_start.WarmStart(prefix)], Settings(strategy="parameter_server"))


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_a_run_warm_starts_fresh_only_and_a_mismatch_exits_2(tmp_path):
    """The four runs in turn in one interpreter (main_in_one_process)."""
    source, target, wrong = str(tmp_path / "source"), str(tmp_path / "target"), str(tmp_path / "wrong")
    os.makedirs(wrong)
    warm = f"--gin_bindings=train.warm_start='{source}'"
    outcomes = main_in_one_process(
        {
            "source": ([*SMALL, "--gin_bindings=train.total_steps=30"], source),
            "warm": ([*SMALL, warm, "--gin_bindings=train.total_steps=10"], target),
            "resumed": ([*SMALL, warm, "--gin_bindings=train.total_steps=20"], target),  # has its own checkpoint
            "mismatch": ([*SMALL, warm, "--gin_bindings=cnn.dense_units=32"], wrong),
        },
        timeout=180,
    )
    for name in ("source", "warm", "resumed"):
        assert outcomes[name]["code"] == 0, outcomes[name]["stderr"][-3000:]
    stdout = outcomes["warm"]["stdout"]
    assert f"warm start from {source}/ckpt-30: restored 8 of the model's 8 variables" in stdout
    first_loss = float(stdout.split("eval at step 10: loss ")[1].split()[0])
    assert first_loss < 1.0  # from the 30 steps of the source run, not from scratch
    assert "warm start" not in outcomes["resumed"]["stdout"] and "restored" in outcomes["resumed"]["stdout"]

    mismatch = outcomes["mismatch"]
    assert mismatch["code"] == 2, mismatch["stderr"][-2000:]
    errors = [line for line in mismatch["stderr"].splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "has shape" in errors[0], errors
    assert mismatch["unchanged"]


def gan():
    from experiments.gan.gan import gan_models

    return gan_models((8, 8, 1), hidden=16)


def test_one_model_of_a_dict_by_its_key(tmp_path):
    """A GAN's generator from another GAN run (its generator), from a run of the generator alone, and from a
    weights file; the discriminator keeps its initial weights every time."""
    keras.utils.set_random_seed(1)
    source = gan()
    gan_prefix = tf.train.Checkpoint(model=source, optimizer=keras.optimizers.Adam()).write(str(tmp_path / "gan"))
    alone_prefix = tf.train.Checkpoint(model=source["generator"]).write(str(tmp_path / "alone"))
    weights = str(tmp_path / "generator.weights.h5")
    source["generator"].save_weights(weights)
    for path in (gan_prefix, alone_prefix, weights):
        target, lines = gan(), []
        initial = [w.numpy() for w in target["discriminator"].weights]
        assert not same_weights(source["generator"], target["generator"])
        warm_start.warm_start(target, {"generator": path}, lines.append)
        assert same_weights(source["generator"], target["generator"]), path
        assert all(np.array_equal(a, b.numpy()) for a, b in zip(initial, target["discriminator"].weights))
        assert (
            f"warm start of model 'generator' from {path}: restored 4 of model 'generator''s 4 variables" in lines[0]
        ), lines
        assert lines[1].endswith("(0): -")
        if path == gan_prefix:  # the source's discriminator is neither restored nor listed as unused
            assert lines[2].endswith("(0): -"), lines
    # A whole GAN run as one path still fills both; the dict form names only models the run has.
    target, lines = gan(), []
    warm_start.warm_start(target, gan_prefix, lines.append)
    assert same_weights(source["generator"], target["generator"]) and "restored 8 of the model's 8" in lines[0]
    with pytest.raises(UserError, match=r"none of its 4 variables .* name that model: train.warm_start = \{'<key>'"):
        warm_start.warm_start(gan(), alone_prefix)
    with pytest.raises(UserError, match=r"names model\(s\) 'student'.* returns 'discriminator', 'generator'"):
        warm_start.warm_start(gan(), {"student": gan_prefix})
    with pytest.raises(UserError, match="names models by key, but this run's model_fn returns one model"):
        warm_start.warm_start(cnn(), {"generator": gan_prefix})
    with pytest.raises(UserError, match=r"a dict of models: name the one it is for, train.warm_start = \{'<key>'"):
        warm_start.warm_start(gan(), weights)
    for bad in ({}, {"generator": ""}, {"": gan_prefix}, {"generator": str(tmp_path / "nothing")}):
        with pytest.raises(UserError, match="train.warm_start"):
            warm_start.WarmStart(bad)


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_a_gan_run_warm_starts_its_generator_only(tmp_path):
    gan_gin = [
        "--gin_file=gin/single.gin",
        "--gin_file=experiments/gan/gan.gin",
        "--gin_bindings=gan_models.hidden=16",
        "--gin_bindings=train.steps_per_loop=10",
        "--gin_bindings=train.eval_every_steps=10",
        "--gin_bindings=train.checkpoint_every_steps=10",
        "--gin_bindings=train.total_steps=10",
    ]
    source, target = str(tmp_path / "source"), str(tmp_path / "target")
    warm = [f"--gin_bindings=train.warm_start={{'generator': '{source}'}}", "--gin_bindings=train.total_steps=10"]
    # The source run, then the warm-started one, in turn in one interpreter.
    outcomes = main_in_one_process({"source": (gan_gin, source), "target": ([*gan_gin, *warm], target)}, timeout=180)
    for outcome in outcomes.values():
        assert outcome["code"] == 0, outcome["stderr"][-3000:]
    stdout = outcomes["target"]["stdout"]
    assert (
        f"warm start of model 'generator' from {source}/ckpt-10: restored 4 of model 'generator''s 4 variables"
        in stdout
    ), stdout[-3000:]
