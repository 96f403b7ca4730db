"""The loss-scaling check before step 1 leaves no trace and refuses only what trains wrong (issue 50).

The check runs the user's step on N replicas and on one before step 1; every variable the traced step reads or
writes (a Keras metric's, a tf.random.Generator's state, a tf.Module's), not only the model's and optimizer's,
must be as it was after it. A run with the check on and one with it off, straight or
resumed, must log the same first interval (the metric's count, the noise drawn) and end with the same
variables, under mirrored (one interpreter) and on two MultiWorkerMirrored processes. Steps of
tests/stateful_steps.py.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from tests.support import launch_workers, main_in_one_process, read_jsonl
from trainer.safety import scaling_findings

pytestmark = pytest.mark.xdist_group("guard_state")

STATEFUL = [
    f"--gin_bindings={b}"
    for b in (
        "import tests.stateful_steps",
        "train.model_fn = @stateful_model",
        "train.step_fn = @stateful_step",
        "train.global_batch_size = 32",
        "train.log_every_steps = 2",
        "train.checkpoint_every_steps = 3",
        "train.eval_every_steps = 100",
    )
]


def steps(total: int, check: bool = True) -> list[str]:
    return [f"--gin_bindings=train.total_steps = {total}", f"--gin_bindings=train.check_loss_scaling = {check}"]


def train_records(model_dir: str) -> dict[int, dict]:
    keep = ("loss", "noise", "seen", "train_accuracy")
    return {
        r["step"]: {k: r[k] for k in keep}
        for r in read_jsonl(os.path.join(model_dir, "metrics.jsonl"))
        if r["split"] == "train"
    }


def final_variables(model_dir: str) -> dict[str, np.ndarray]:
    import tensorflow as tf

    reader = tf.train.load_checkpoint(model_dir)
    skip = ("save_counter", "_CHECKPOINTABLE_OBJECT_GRAPH")
    return {n: reader.get_tensor(n) for n in reader.get_variable_to_shape_map() if not n.startswith(skip)}


def assert_same_run(straight: str, other: str, *, resumed_at_3: bool = False) -> None:
    """The same train records, bit for bit, and the same final checkpoint (weights, slots, metric, noise sum,
    generator state). Resumed at step 3, the record of step 4 means that step alone, but the metric's count and
    result at its boundary cover steps 3 and 4 (its state at step 3 checkpointed)."""
    records, others = train_records(straight), train_records(other)
    assert records[2]["seen"] == records[4]["seen"] == 2 * 16  # 2 steps of 16 examples per replica, reset at 2
    if resumed_at_3:
        assert others[2] == records[2], (others, records)
        assert {k: others[4][k] for k in ("seen", "train_accuracy")} == {
            k: records[4][k] for k in ("seen", "train_accuracy")
        }, (others, records)
    else:
        assert others == records, (others, records)
    variables, other_variables = final_variables(straight), final_variables(other)
    assert variables.keys() == other_variables.keys()
    assert any("generator" in name for name in variables) and any("totals" in name for name in variables)
    assert any("train_metrics" in name for name in variables)
    for name, value in variables.items():
        assert np.array_equal(value, other_variables[name]), name


MIRRORED = ["--gin_file=gin/mirrored.gin", *STATEFUL]


@pytest.fixture(scope="module")
def mirrored_runs(tmp_path_factory) -> tuple[str, dict[str, dict]]:
    """Under mirrored, in one interpreter: the check on and off, a run stopped at step 3 and resumed with the
    check on, and the other steps of tests/stateful_steps.py."""
    root = tmp_path_factory.mktemp("guard_state")
    bind = lambda *b: [f"--gin_bindings={x}" for x in b]  # noqa: E731
    cases = {
        "on": [*MIRRORED, *steps(4)],
        "off": [*MIRRORED, *steps(4, check=False)],
        "resumed_first": [*MIRRORED, *steps(3)],
        "resumed": [*MIRRORED, *steps(4)],
        "accumulating": [
            *MIRRORED,
            *steps(2),
            *bind("train.model_fn = @accumulating_model", "train.step_fn = @accumulating_step"),
        ],
        "iterations": [*MIRRORED, *steps(2), *bind("train.step_fn = @iterations_step")],
        "text_output": [*MIRRORED, *steps(2), *bind("train.step_fn = @text_output_step")],
        "bound_metric": [
            *MIRRORED,
            *steps(4),
            *bind("train.step_fn = @bound_metric_step", "train.train_metrics_fn = @bound_metrics"),
        ],
        "replica_noise": [*MIRRORED, *steps(2), *bind("train.step_fn = @replica_keyed_noise_step")],
        "running_accuracy": [*MIRRORED, *steps(2), *bind("train.step_fn = @running_accuracy_step")],
        "listed_buffer": [
            *MIRRORED,
            *steps(2),
            *bind("train.model_fn = @listed_buffer_model", "train.step_fn = @listed_buffer_step"),
        ],
    }
    model_dirs = {name: str(root / ("resumed" if name.startswith("resumed") else name)) for name in cases}
    for path in set(model_dirs.values()):
        os.makedirs(path, exist_ok=True)
    outcomes = main_in_one_process({name: (args, model_dirs[name]) for name, args in cases.items()}, timeout=500)
    return str(root), outcomes


@pytest.mark.slow
@pytest.mark.timeout(520)
def test_under_mirrored_the_check_leaves_no_trace_straight_or_resumed(mirrored_runs):
    root, outcomes = mirrored_runs
    for name in ("on", "off", "resumed_first", "resumed"):
        assert outcomes[name]["code"] == 0, (name, outcomes[name]["stderr"][-3000:])
    assert "loss-scaling check passed" in outcomes["on"]["stdout"]
    assert "restored" in outcomes["resumed"]["stdout"] and "loss-scaling check passed" in outcomes["resumed"]["stdout"]
    assert_same_run(os.path.join(root, "off"), os.path.join(root, "on"))
    assert_same_run(os.path.join(root, "off"), os.path.join(root, "resumed"), resumed_at_3=True)


@pytest.mark.slow
@pytest.mark.timeout(520)
def test_per_replica_buffers_are_skipped_by_the_check_in_one_line_and_train(mirrored_runs):
    _, outcomes = mirrored_runs
    outcome = outcomes["accumulating"]
    assert outcome["code"] == 0 and "Traceback" not in outcome["stderr"], outcome["stderr"][-3000:]
    lines = [line for line in outcome["stdout"].splitlines() if "loss scaling not checked" in line]
    assert len(lines) == 1 and "per-replica variable (synchronization=ON_READ" in lines[0], outcome["stdout"]
    assert "step 2/2" in outcome["stdout"]


@pytest.mark.slow
@pytest.mark.timeout(520)
def test_noise_keyed_by_the_replica_passes_and_a_running_accuracy_is_told_to_declare_itself(mirrored_runs):
    _, outcomes = mirrored_runs
    outcome = outcomes["replica_noise"]
    assert outcome["code"] == 0, outcome["stderr"][-3000:]
    assert (
        "loss-scaling check passed: the step's outputs differ between replicas on the same examples (randomness "
        "keyed by the replica id); 2 times replica 0's match one replica"
    ) in outcome["stdout"]
    outcome = outcomes["running_accuracy"]
    error = outcome["stderr"].strip().splitlines()[-1]
    assert outcome["code"] == 2 and outcome["unchanged"], outcome["stderr"][-3000:]
    assert error.startswith("error: loss scaling: step output 'accuracy' summed over 2 replicas is 2 times"), error
    assert '@trainer.combine(accuracy="mean")' in error and "compute_average_loss" not in error, error


@pytest.mark.slow
@pytest.mark.timeout(520)
def test_a_keras_variable_and_a_python_number_are_outputs_and_a_string_is_refused_by_name(mirrored_runs):
    _, outcomes = mirrored_runs
    outcome = outcomes["iterations"]
    assert outcome["code"] == 0, outcome["stderr"][-3000:]
    assert "iterations 2.0000" in outcome["stdout"] and "zero 0.0000" in outcome["stdout"], outcome["stdout"]
    outcome = outcomes["text_output"]
    error = outcome["stderr"].strip().splitlines()[-1]
    assert outcome["code"] == 2 and outcome["unchanged"], outcome["stderr"][-3000:]
    assert error.startswith("error: train.step_fn output 'note' is () of string; each output must be a scalar"), error
    assert "input" not in error


@pytest.mark.slow
@pytest.mark.timeout(520)
def test_state_no_checkpoint_holds_is_named_at_the_first_loop_call(mirrored_runs):
    _, outcomes = mirrored_runs
    outcome = outcomes["listed_buffer"]
    assert outcome["code"] == 0, outcome["stderr"][-3000:]
    warnings = [line for line in outcome["stdout"].splitlines() if line.startswith("warning: the step writes")]
    assert warnings == [
        "warning: the step writes model.buffers[0], which no checkpoint holds (a Python list or dict of variables "
        "on a Keras 3 model is not tracked), so a resumed run starts it anew; keep it in a tf.Module set as a model "
        "attribute (model.state = tf.Module(); model.state.buffers = [...]) or as a variable attribute of its own"
    ], outcome["stdout"]
    assert "warning: the step writes" not in outcomes["on"]["stdout"]  # its tf.Module and generator are saved


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_on_two_multiworker_processes_the_check_leaves_no_trace_across_a_resume(tmp_path):
    resumed, straight = str(tmp_path / "resumed"), str(tmp_path / "straight")
    common = ["--gin_file=gin/mwms.gin", *STATEFUL]
    launch_workers(*common, *steps(3), f"--model_dir={resumed}", timeout=180)
    proc = launch_workers(*common, *steps(4), f"--model_dir={resumed}", timeout=180)
    assert "loss-scaling check passed" in proc.stdout
    launch_workers(*common, *steps(4, check=False), f"--model_dir={straight}", timeout=180)
    assert_same_run(straight, resumed, resumed_at_3=True)


def test_an_output_off_by_the_replica_count_while_the_gradients_match_is_no_share():
    g = np.array([0.3, -0.4])
    findings = scaling_findings.compare(({"acc": 1.0}, [g]), ({"acc": 0.5}, [g]), ({"acc": 0.5}, [g]), 2, 0.0)
    assert [f.mistake for f in findings] == ["not_a_share"]
    text = scaling_findings.message(findings[0], 2)
    assert '@trainer.combine(acc="mean")' in text and "compute_average_loss" not in text
    # the gradients scaled wrong too: the loss is, and the advice stays
    findings = scaling_findings.compare(({"loss": 1.0}, [2 * g]), ({"loss": 0.5}, [g]), ({"loss": 0.5}, [g]), 2, 0.0)
    assert findings[0].mistake == "per_replica_mean"
    assert "compute_average_loss" in scaling_findings.message(findings[0], 2)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_on_two_multiworker_processes_per_replica_buffers_are_skipped_in_one_line_and_train(tmp_path):
    accumulating = [
        "--gin_bindings=train.model_fn = @accumulating_model",
        "--gin_bindings=train.step_fn = @accumulating_step",
    ]
    proc = launch_workers(
        "--gin_file=gin/mwms.gin", *STATEFUL, *steps(2), *accumulating, f"--model_dir={tmp_path / 'run'}", timeout=250
    )
    skipped = [line for line in proc.stdout.splitlines() if "loss scaling not checked" in line]
    assert skipped and all("per-replica variable (synchronization=ON_READ" in line for line in skipped), proc.stdout
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
@pytest.mark.timeout(520)
def test_a_metric_made_by_a_bound_function_is_read_and_reset_as_the_model_s(mirrored_runs):
    root, outcomes = mirrored_runs
    assert outcomes["bound_metric"]["code"] == 0, outcomes["bound_metric"]["stderr"][-3000:]
    records = [r for r in read_jsonl(os.path.join(root, "bound_metric", "metrics.jsonl")) if r["split"] == "train"]
    assert [r["step"] for r in records] == [2, 4]
    assert all(r["bound_accuracy"] == r["train_accuracy"] for r in records), records
    assert records[0]["train_accuracy"] != records[1]["train_accuracy"]
