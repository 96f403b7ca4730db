"""A relative model_dir is the same directory as its absolute path to every reader: the run's
settings resolve it once, and the library's checkpoint readers take it as given (the state file's
paths come joined to it already; joining again made `runs/a/runs/a/ckpt-N`). The entry points'
commands with relative paths: tests/test_readme.py."""

from __future__ import annotations

import os

import pytest
import tensorflow as tf

from trainer.files.checkpoints import CheckpointSaver
from trainer.loops.sidecar import checkpoints_in
from trainer.run.settings import Settings, absolute_model_dir


@pytest.mark.parametrize("async_checkpoint", [False, True])
def test_a_saver_on_a_relative_dir_restores_its_newest_checkpoint(tmp_path, monkeypatch, async_checkpoint):
    monkeypatch.chdir(tmp_path)
    value = tf.Variable(0.0)
    saver = CheckpointSaver(
        tf.train.Checkpoint(value=value), "runs/a", is_chief=True, async_checkpoint=async_checkpoint
    )
    for step in (1, 2):
        value.assign(float(step))
        saver.save(step)
    saver.wait()
    value.assign(-1.0)
    lines = []
    reader = CheckpointSaver(tf.train.Checkpoint(value=value), "runs/a", is_chief=True)
    assert reader.candidates() == ["runs/a/ckpt-2", "runs/a/ckpt-1"]
    assert reader.restore_latest(lines.append) == "runs/a/ckpt-2" and lines == []
    assert float(value.numpy()) == 2.0
    assert checkpoints_in("runs/a") == [(1, "runs/a/ckpt-1"), (2, "runs/a/ckpt-2")]
    assert sorted(os.listdir(tmp_path)) == ["runs"] and sorted(os.listdir(tmp_path / "runs")) == ["a"]


def test_settings_resolve_a_relative_model_dir_once(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert Settings(model_dir="runs/a").model_dir == str(tmp_path / "runs" / "a")
    assert Settings(model_dir=str(tmp_path / "b")).model_dir == str(tmp_path / "b")
    assert Settings().model_dir is None
    assert absolute_model_dir("gs://bucket/runs/a") == "gs://bucket/runs/a"  # a URL is left as it is


def test_a_model_dir_under_tilde_is_in_the_home_directory(tmp_path, monkeypatch):
    # `--model_dir=~/run`: the shell leaves `~` alone after `=`; a directory named `~` is never meant.
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    assert absolute_model_dir("~/run") == str(tmp_path / "home" / "run")
    assert Settings(model_dir="~/run").model_dir == str(tmp_path / "home" / "run")
