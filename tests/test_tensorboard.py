"""What TensorBoard reads from a run: train and eval scalars, the operative config, the hparams."""
from __future__ import annotations

import os

import pytest

from tests.support import read_jsonl


def _accumulator(path: str):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(path, size_guidance={"tensors": 0})  # 0: keep every event
    accumulator.Reload()
    return accumulator


def _series(accumulator, tag: str) -> dict[int, float]:
    from tensorboard.util import tensor_util

    return {e.step: float(tensor_util.make_ndarray(e.tensor_proto)) for e in accumulator.Tensors(tag)}


def test_event_files_hold_train_and_eval_scalars_and_the_operative_config(profiled_run):
    from tensorboard.util import tensor_util

    model_dir, _ = profiled_run
    records = read_jsonl(os.path.join(model_dir, "metrics.jsonl"))
    train, evals = _accumulator(os.path.join(model_dir, "train")), _accumulator(os.path.join(model_dir, "eval"))
    for metric in ("loss", "accuracy", "learning_rate", "steps_per_sec", "examples_per_sec"):
        expected = {r["step"]: r[metric] for r in records if r["split"] == "train"}
        assert list(expected) == [10, 20, 30, 40]
        assert _series(train, metric) == pytest.approx(expected), metric
    for metric in ("loss", "accuracy"):
        expected = {r["step"]: r[metric] for r in records if r["split"] == "eval"}
        assert list(expected) == [20, 40]
        assert _series(evals, metric) == pytest.approx(expected), metric
    [config] = train.Tensors("operative_config")
    text = tensor_util.make_ndarray(config.tensor_proto).item().decode()
    assert "train.total_steps = 40" in text and "profiler_hook.steps = (7, 13)" in text
    assert train.SummaryMetadata("operative_config").plugin_data.plugin_name == "text"


def test_hparams_summary_holds_the_bindings_beside_the_eval_metrics(profiled_run):
    from tensorboard.plugins.hparams import metadata

    model_dir, _ = profiled_run
    root = _accumulator(model_dir)
    assert root.Tags()["tensors"] == [metadata.SESSION_START_INFO_TAG]
    plugin_data = root.SummaryMetadata(metadata.SESSION_START_INFO_TAG).plugin_data
    assert plugin_data.plugin_name == metadata.PLUGIN_NAME
    info = metadata.parse_session_start_info_plugin_data(plugin_data.content)
    hparams = {name: value.WhichOneof("kind") and getattr(value, value.WhichOneof("kind"))
               for name, value in info.hparams.items()}
    assert info.group_name == os.path.basename(model_dir)
    assert hparams["train.total_steps"] == 40
    assert hparams["train.steps_per_loop"] == 25
    assert hparams["make_optimizer.learning_rate"] == pytest.approx(0.002)
    assert hparams["make_optimizer.name"] == "adam"
    assert hparams["train.strategy"] == "default"
    assert hparams["train.model_fn"] == "@cnn"
    assert hparams["profiler_hook.steps"] == "(7, 13)"
    assert hparams["gin_files"] == "gin/single.gin"
    # The HParams tab takes metrics from the session's sub-runs (group 'eval'): the final eval.
    evals = _accumulator(os.path.join(model_dir, "eval"))
    assert set(evals.Tags()["tensors"]) == {"loss", "accuracy"}
    assert max(_series(evals, "accuracy")) == 40
