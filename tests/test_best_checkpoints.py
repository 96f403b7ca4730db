"""The best K checkpoints (train.keep_best) in model_dir/best: the K best by the metric, checked
against metrics.jsonl's eval records; kept across a restart; under parameter_server too."""

from __future__ import annotations

import json
import os
import random

import pytest
import tensorflow as tf

from tests.support import read_jsonl, run_main
from tests.test_early_stopping import (
    BEST_2,
    KILLABLE,
    NEVER_IMPROVES,
    SHORT,
    best_steps,
    killed_and_restarted,
    top_k_steps,
)

pytestmark = pytest.mark.slow  # every test here starts processes or trains for long


def bind(**values) -> list[str]:
    return [f"--gin_bindings=train.{k}={v}" for k, v in values.items()]


@pytest.mark.timeout(240)
def test_the_k_best_by_loss_survive_a_restart_and_stray_files_are_removed(tmp_path):
    model_dir = str(tmp_path / "run")
    best_dir = os.path.join(model_dir, "best")
    by_loss = ["--gin_bindings=train.keep_best=3", "--gin_bindings=train.best_metric='loss'"]
    first = run_main(
        "--gin_file=gin/single.gin", f"--model_dir={model_dir}", *SHORT, *by_loss, *bind(total_steps=100), timeout=200
    )
    assert first.returncode == 0, first.stderr[-3000:]
    evals = {r["step"]: r["loss"] for r in read_jsonl(os.path.join(model_dir, "metrics.jsonl")) if r["split"] == "eval"}
    assert sorted(evals) == [20, 40, 60, 80, 100]
    lowest = sorted(evals, key=lambda s: (evals[s], s))[:3]
    assert best_steps(model_dir) == lowest
    assert tf.train.latest_checkpoint(best_dir) == os.path.join(best_dir, f"ckpt-{lowest[0]}")
    with open(os.path.join(best_dir, "ckpt-999.index"), "w"):  # as a save that crashed before its state
        pass
    second = run_main(
        "--gin_file=gin/single.gin", f"--model_dir={model_dir}", *SHORT, *by_loss, *bind(total_steps=160), timeout=200
    )
    assert second.returncode == 0, second.stderr[-3000:]
    evals = {r["step"]: r["loss"] for r in read_jsonl(os.path.join(model_dir, "metrics.jsonl")) if r["split"] == "eval"}
    assert best_steps(model_dir) == sorted(evals, key=lambda s: (evals[s], s))[:3]
    expected = {f"ckpt-{s}.{ext}" for s in best_steps(model_dir) for ext in ("index", "data-00000-of-00001")}
    assert set(os.listdir(best_dir)) == expected | {"best.json", "checkpoint"}
    # A best checkpoint is a whole checkpoint of the run: its global step is the step it is named by.
    reader = tf.train.load_checkpoint(os.path.join(best_dir, f"ckpt-{best_steps(model_dir)[0]}"))
    assert reader.get_tensor("global_step/.ATTRIBUTES/VARIABLE_VALUE") == best_steps(model_dir)[0]


@pytest.mark.timeout(240)
def test_an_unknown_metric_is_one_line_naming_the_outputs(tmp_path):
    proc = run_main(
        "--gin_file=gin/single.gin",
        f"--model_dir={tmp_path / 'run'}",
        *SHORT,
        "--gin_bindings=train.keep_best=1",
        "--gin_bindings=train.best_metric='top5'",
        timeout=200,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert (
        last == "error: train.best_metric 'top5' is not an output of eval split 'eval'; its outputs are "
        "['accuracy', 'loss'] (write '<split>/<name>' for another split)"
    ), last


@pytest.mark.timeout(300)
def test_best_checkpoints_and_early_stopping_under_parameter_server(tmp_path):
    model_dir = str(tmp_path / "run")
    proc = run_main("--gin_file=gin/ps.gin", f"--model_dir={model_dir}", *SHORT, *BEST_2, *NEVER_IMPROVES, timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "early stopping at step 60: loss" in proc.stdout, proc.stdout[-3000:]
    assert os.path.exists(os.path.join(model_dir, "ckpt-60.index"))
    assert best_steps(model_dir) == top_k_steps(model_dir, 2)
    refused = run_main(
        "--gin_file=gin/ps.gin",
        f"--model_dir={tmp_path / 'other'}",
        *SHORT,
        "--gin_bindings=train.keras_callbacks=[@keras.callbacks.TerminateOnNaN()]",
        timeout=200,
    )
    assert refused.returncode == 2
    assert refused.stderr.strip().splitlines()[-1] == (
        "error: train.keras_callbacks is not supported with parameter_server (fit's callbacks expect one "
        "synchronous model); it works with the synchronous strategies: use train.early_stopping there"
    )
    assert not os.path.exists(tmp_path / "other") or not os.listdir(tmp_path / "other")


@pytest.mark.timeout(500)
def test_a_killed_and_restarted_run_holds_the_best_checkpoints_an_uninterrupted_one_does(tmp_path):
    """The ranking is in the checkpoint: by the highest loss the best evals are the first ones (10, 20),
    which a resumed run that forgot its ranking (restarting from 30) would never see again."""
    flags = [
        "--gin_file=gin/single.gin",
        *KILLABLE,
        "--gin_bindings=train.total_steps=80",
        "--gin_bindings=train.keep_best=2",
        "--gin_bindings=train.best_metric='loss'",
        "--gin_bindings=train.best_mode='max'",
    ]
    reference_dir, resumed_dir = str(tmp_path / "reference"), str(tmp_path / "resumed")
    reference = run_main(*flags, f"--model_dir={reference_dir}", timeout=200)
    assert reference.returncode == 0, reference.stderr[-3000:]
    restart = killed_and_restarted(flags, resumed_dir, kill_at=random.Random().choice([40, 50, 70]))
    assert restart.returncode == 0, restart.stderr[-3000:]
    assert "continuing from step" in restart.stdout
    assert best_steps(reference_dir) == [10, 20]  # the highest losses: the first evals
    assert best_steps(resumed_dir) == best_steps(reference_dir)
    assert sorted(os.listdir(os.path.join(resumed_dir, "best"))) == sorted(
        os.listdir(os.path.join(reference_dir, "best"))
    )
    with (
        open(os.path.join(resumed_dir, "best", "best.json")) as a,
        open(os.path.join(reference_dir, "best", "best.json")) as b,
    ):
        assert json.load(a) == json.load(b)
