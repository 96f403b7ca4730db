"""What TensorBoard reads from a run: train and eval scalars, the operative config, the hparams."""

from __future__ import annotations

import os

import pytest

from tests.support import read_jsonl

pytestmark = pytest.mark.slow  # every test here starts processes or trains for long


def _accumulator(path: str):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(path, size_guidance={"tensors": 0})  # 0: keep every event
    accumulator.Reload()
    return accumulator


def _series(accumulator, tag: str) -> dict[int, float]:
    from tensorboard.util import tensor_util

    return {e.step: float(tensor_util.make_ndarray(e.tensor_proto)) for e in accumulator.Tensors(tag)}


@pytest.mark.xdist_group("single_runs")
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


@pytest.mark.xdist_group("single_runs")
def test_hparams_summary_holds_the_bindings_beside_the_eval_metrics(profiled_run):
    from tensorboard.plugins.hparams import metadata

    model_dir, _ = profiled_run
    root = _accumulator(model_dir)
    assert root.Tags()["tensors"] == [metadata.SESSION_START_INFO_TAG]
    plugin_data = root.SummaryMetadata(metadata.SESSION_START_INFO_TAG).plugin_data
    assert plugin_data.plugin_name == metadata.PLUGIN_NAME
    info = metadata.parse_session_start_info_plugin_data(plugin_data.content)
    hparams = {
        name: value.WhichOneof("kind") and getattr(value, value.WhichOneof("kind"))
        for name, value in info.hparams.items()
    }
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


SUMMARY_STEP = ("--gin_bindings=import tests.summary_steps", "--gin_bindings=train.step_fn=@summary_step")
SHORT_RUN = (
    "--gin_bindings=train.total_steps=40",
    "--gin_bindings=train.steps_per_loop=25",
    "--gin_bindings=train.log_every_steps=10",
    "--gin_bindings=train.eval_every_steps=40",
    "--gin_bindings=train.checkpoint_every_steps=40",
)


def _assert_step_summaries(model_dir) -> None:
    """The step's scalar, histogram and image, once each at every log step, in the one train event
    file beside the train records; the scalar (the optimizer's count) is the step it is written at,
    and the histogram at step 40 covers exactly the first variable of ckpt-40."""
    import numpy as np
    import tensorflow as tf
    from tensorboard.util import tensor_util

    assert len(os.listdir(os.path.join(model_dir, "train"))) == 1  # one writer: TensorBoard reads the newest file
    train = _accumulator(os.path.join(model_dir, "train"))
    assert {"optimizer_iterations", "first_weights", "first_image", "loss"} <= set(train.Tags()["tensors"])
    for tag, plugin in (
        ("optimizer_iterations", "scalars"),
        ("first_weights", "histograms"),
        ("first_image", "images"),
    ):
        assert [e.step for e in train.Tensors(tag)] == [10, 20, 30, 40], tag  # one replica records, once per step
        assert train.SummaryMetadata(tag).plugin_data.plugin_name == plugin
    assert _series(train, "optimizer_iterations") == {10: 10.0, 20: 20.0, 30: 30.0, 40: 40.0}
    histogram = tensor_util.make_ndarray(train.Tensors("first_weights")[-1].tensor_proto)  # [left, right, count]
    reader = tf.train.load_checkpoint(os.path.join(model_dir, "ckpt-40"))
    weights = reader.get_tensor("optimizer/_trainable_variables/0/.ATTRIBUTES/VARIABLE_VALUE")
    assert histogram[:, 2].sum() == weights.size
    assert histogram[0, 0] == pytest.approx(weights.min()) and histogram[-1, 1] == pytest.approx(weights.max())
    width, height, _ = tensor_util.make_ndarray(train.Tensors("first_image")[-1].tensor_proto)
    assert (int(width), int(height)) == (8, 8)
    assert np.isfinite(list(_series(train, "loss").values())).all()


@pytest.fixture(scope="module")
def step_summary_runs(tmp_path_factory) -> tuple[str, dict]:
    """The summary step under mirrored, central storage and on one device, in one interpreter
    (main_in_one_process: one TensorFlow start instead of three), the 2-replica ones first (TensorFlow
    splits the CPU before its first run). (their folder, outcomes by mode); model_dir <folder>/<mode>."""
    from tests.support import main_in_one_process

    root = str(tmp_path_factory.mktemp("step_summaries"))
    cases = {
        mode: ([f"--gin_file=gin/{mode}.gin", *SUMMARY_STEP, *SHORT_RUN], os.path.join(root, mode))
        for mode in ("mirrored", "central_storage", "single")
    }
    return root, main_in_one_process(cases)


@pytest.mark.timeout(300)
@pytest.mark.xdist_group("step_summary_runs")
@pytest.mark.parametrize("mode", ["single", "mirrored", "central_storage"])
def test_summaries_inside_the_step_are_written_at_the_log_interval(step_summary_runs, mode):
    """Must-show 7: scalar, histogram and image summaries the step writes land in the chief's train
    event file at steps 10, 20, 30, 40 (log_every_steps 10), from replica 0 only on 2 replicas."""
    root, outcomes = step_summary_runs
    assert outcomes[mode]["code"] == 0, outcomes[mode]["stderr"][-4000:]
    _assert_step_summaries(os.path.join(root, mode))


@pytest.mark.timeout(300)
def test_summaries_inside_the_step_are_the_chiefs_alone_under_multi_worker(tmp_path):
    """Two MultiWorkerMirrored processes: the chief writes the step's summaries (replica 0 is its
    own), the other worker traces none (a no-op writer) and writes no event file."""
    from tests.support import launch_workers

    model_dir = tmp_path / "run"
    launch_workers("--gin_file=gin/mwms.gin", *SUMMARY_STEP, *SHORT_RUN, f"--model_dir={model_dir}")
    _assert_step_summaries(model_dir)


@pytest.mark.timeout(200)
def test_summaries_inside_the_step_are_one_line_under_parameter_servers_and_xla(tmp_path):
    """Where they cannot be written they are refused in one line, never dropped: under
    parameter_server (the step runs on the workers) and under train.jit_compile (XLA compiles no
    summary op). A run refused after the loop was traced (a broken eval step) leaves model_dir
    empty although the traced loop holds the train event writer: its file is made at the first call."""
    from tests.support import refused_in_one_process, refused_run

    (tmp_path / "ps").mkdir()
    line = refused_run(
        tmp_path / "ps", "--gin_file=gin/ps.gin", *SUMMARY_STEP, "--gin_bindings=local_cluster.num_workers=1"
    )
    assert "summary_step writes tf.summary inside the step, which parameter_server cannot record" in line
    assert "return the value from the step" in line
    lines = refused_in_one_process(  # both in one interpreter
        tmp_path,
        {
            "xla": ["--gin_file=gin/single.gin", *SUMMARY_STEP, "--gin_bindings=train.jit_compile=True"],
            "eval": [
                "--gin_file=gin/single.gin",
                *SUMMARY_STEP,
                "--gin_bindings=import tests.broken_functions",
                "--gin_bindings=train.eval_step_fn=@no_count_eval_step",
            ],
        },
    )
    assert "which XLA cannot compile (train.jit_compile)" in lines["xla"]
    assert "no_count_eval_step" in lines["eval"]


def test_one_record_reaches_the_json_line_the_event_files_and_every_sink(tmp_path):
    """The one metric writer (training, its evals and the sidecar evaluator write through it): an
    eval's count lands in the JSON line only, last; an eval split of its own under eval/<split>, the
    worker watch's records (not an evaluation) in a run of their own."""
    from trainer.files.metrics_log import MetricsLog, eval_line

    seen = []
    with MetricsLog(str(tmp_path), open_now=()) as log:
        log.subscribe(lambda step, split, values: seen.append((step, split, values)))
        log.record(200, "eval", {"loss": 0.5, "accuracy": 0.875}, num_examples=359)
        log.record(200, "test", {"loss": 0.25})
        log.record(200, "workers", {"worker/1/rss_mb": 300.0})
    assert read_jsonl(tmp_path / "metrics.jsonl") == [
        {"step": 200, "split": "eval", "loss": 0.5, "accuracy": 0.875, "num_examples": 359.0},
        {"step": 200, "split": "test", "loss": 0.25},
        {"step": 200, "split": "workers", "worker/1/rss_mb": 300.0},
    ]
    assert seen[:2] == [(200, "eval", {"loss": 0.5, "accuracy": 0.875}), (200, "test", {"loss": 0.25})]
    assert sorted(os.listdir(tmp_path)) == ["eval", "metrics.jsonl", "workers"]  # no train event file opened
    assert _series(_accumulator(str(tmp_path / "eval")), "accuracy") == {200: 0.875}
    assert "num_examples" not in _accumulator(str(tmp_path / "eval")).Tags()["tensors"]
    assert _series(_accumulator(str(tmp_path / "eval" / "test")), "loss") == {200: 0.25}
    assert _series(_accumulator(str(tmp_path / "workers")), "worker/1/rss_mb") == {200: 300.0}
    assert eval_line("test", 200, {"loss": 0.25}, 359, " of ckpt-200") == (
        "eval on test of ckpt-200 at step 200: loss 0.2500  (359 examples)"
    )
