"""A step declares how each output combines across replicas and steps (trainer.combine): a max
logit and the norms of the all-reduced gradient read the same on one device, on two mirrored
replicas, on two multi-worker processes and under parameter_server, inside one compiled call of
several steps, across calls and over the micro-batches of gradient accumulation,
and the loss-scaling guard checks only the shares. Undeclared, the same max is refused by the
guard; a declaration of an output the step does not return is one error line."""

from __future__ import annotations

import os

import numpy as np
import pytest

import trainer
from tests.support import launch_workers, read_jsonl, refused_in_one_process, run_main
from trainer.errors import UserError

pytestmark = pytest.mark.xdist_group("combine")

KEYS = ("loss", "max_logit", "min_logit", "hidden_grad_norm", "output_grad_norm")
COMMON = [
    f"--gin_bindings={b}"
    for b in (
        "import tests.combine_steps",
        "train.step_fn = @diagnostic_step",
        "train.model_fn = @mlp",
        "mlp.hidden = (16,)",
        "train.total_steps = 6",
        "train.eval_every_steps = 6",
        "train.checkpoint_every_steps = 6",
        "make_optimizer.name = 'sgd'",
        "make_optimizer.learning_rate = 0.5",
    )
]


def train_records(tmp_path, name: str, *args: str, timeout: float = 150) -> tuple[dict[int, dict], str]:
    model_dir = str(tmp_path / name)
    proc = run_main(*args, *COMMON, f"--model_dir={model_dir}", timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    records = read_jsonl(os.path.join(model_dir, "metrics.jsonl"))
    return {r["step"]: r for r in records if r["split"] == "train"}, proc.stdout


def interval(per_step: dict[int, dict], steps: range) -> dict[str, float]:
    """What a record over `steps` must say: max and min over them, the rest averaged."""
    values = {k: [per_step[s][k] for s in steps] for k in KEYS}
    return {
        "max_logit": max(values["max_logit"]),
        "min_logit": min(values["min_logit"]),
        **{k: float(np.mean(values[k])) for k in ("loss", "hidden_grad_norm", "output_grad_norm")},
    }


def assert_close(record: dict, expected: dict, what: str) -> None:
    for k, v in expected.items():
        assert abs(record[k] - v) <= 1e-5 * max(1.0, abs(v)), (what, k, record[k], v)


@pytest.fixture(scope="module")
def expected(tmp_path_factory) -> dict[int, dict[str, float]]:
    """One device, one step per call and record: what the records of steps 1-3 and 4-6 must say."""
    per_step, _ = train_records(
        tmp_path_factory.mktemp("combine"),
        "single_per_step",
        "--gin_file=gin/single.gin",
        "--gin_bindings=train.steps_per_loop = 1",
        "--gin_bindings=train.log_every_steps = 1",
    )
    expected = {3: interval(per_step, range(1, 4)), 6: interval(per_step, range(4, 7))}
    assert expected[3]["max_logit"] != np.mean([per_step[s]["max_logit"] for s in (1, 2, 3)])  # the max differs
    return expected


def assert_records(records: dict[int, dict], expected: dict[int, dict], name: str, keys=KEYS) -> None:
    assert sorted(records) == [3, 6], (name, sorted(records))
    for step in (3, 6):
        assert_close(records[step], {k: expected[step][k] for k in keys}, f"{name} at step {step}")


PER_3 = ["--gin_bindings=train.steps_per_loop = 3", "--gin_bindings=train.log_every_steps = 3"]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_diagnostics_read_the_same_on_one_and_two_replicas_and_over_calls_and_micro_batches(expected, tmp_path):
    # one device, one step per call: the progress hook combines three calls into one record
    calls, _ = train_records(
        tmp_path,
        "single_calls",
        "--gin_file=gin/single.gin",
        "--gin_bindings=train.steps_per_loop = 1",
        "--gin_bindings=train.log_every_steps = 3",
    )
    assert_records(calls, expected, "single, calls of one step")
    # two replicas, three steps per compiled call: combined on device, across replicas and steps
    mirrored, stdout = train_records(tmp_path, "mirrored", "--gin_file=gin/mirrored.gin", *PER_3)
    assert "loss-scaling check passed" in stdout, stdout[-2000:]
    assert_records(mirrored, expected, "mirrored")
    # two micro-batches per update: the max and min over them (a micro-batch's gradient norm is its own)
    accumulated, _ = train_records(
        tmp_path, "accumulated", "--gin_file=gin/single.gin", "--gin_bindings=train.grad_accum_steps = 2", *PER_3
    )
    assert_records(accumulated, expected, "accumulated", keys=("loss", "max_logit", "min_logit"))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_diagnostics_read_the_same_under_parameter_server(expected, tmp_path):
    # one worker: closures of 2 and 1 steps, combined on the coordinator
    ps, _ = train_records(
        tmp_path, "ps", "--gin_file=gin/ps.gin", "--gin_bindings=local_cluster.num_workers = 1", *PER_3, timeout=250
    )
    assert_records(ps, expected, "parameter_server")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_diagnostics_read_the_same_on_two_multi_worker_processes(expected, tmp_path):
    # max and min of the other process's replica: gathered across processes
    model_dir = str(tmp_path / "mwms")
    launch_workers("--gin_file=gin/mwms.gin", *COMMON, *PER_3, f"--model_dir={model_dir}", timeout=250)
    records = read_jsonl(os.path.join(model_dir, "metrics.jsonl"))
    assert_records({r["step"]: r for r in records if r["split"] == "train"}, expected, "multi_worker_mirrored")


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_an_undeclared_max_is_refused_by_the_guard_and_a_misnamed_declaration_is_one_line(tmp_path):
    errors = refused_in_one_process(  # both in one interpreter, mirrored first: single leaves the CPU as it is
        tmp_path,
        {
            "undeclared": [
                "--gin_file=gin/mirrored.gin",
                *COMMON,
                "--gin_bindings=train.step_fn = @undeclared_max_step",
            ],
            "misnamed": ["--gin_file=gin/single.gin", *COMMON, "--gin_bindings=train.step_fn = @misnamed_step"],
        },
    )
    error = errors["undeclared"]
    assert error.startswith("error: loss scaling: step output 'max_logit' summed over 2 replicas is 2 times"), error
    assert '@trainer.combine(max_logit="mean")' in error and "compute_average_loss" not in error, error
    error = errors["misnamed"]
    assert error.startswith(
        "error: train.step_fn declares how output 'max_logits' combines, but returns no such "
        "output (it returns loss, max_logit, min_logit, hidden_grad_norm, output_grad_norm)"
    ), error


def test_the_declaration_survives_gin_bindings_and_the_loop_s_adaptation():
    """Decorated over gin's wrapper or under it, with bindings or without, the rule reaches the loop."""
    import gin

    from trainer.task import combine, contract
    from trainer.tools import gin_functions

    @trainer.combine(max_logit="max")
    @gin.configurable("test_combine_outer_step")
    def outer(model, optimizer, loss_weight, batch, global_batch_size):
        return {}

    @gin.configurable("test_combine_inner_step")
    @trainer.combine(max_logit="min")
    def inner(model, optimizer, batch, global_batch_size, scale=1.0):
        return {}

    gin.clear_config()
    try:
        gin.external_configurable(lambda **kw: kw, "test_combine_probe")
        gin.parse_config(
            "test_combine_outer_step.loss_weight = 0.5\ntest_combine_probe.a = @test_combine_outer_step\n"
            "test_combine_probe.b = @test_combine_inner_step"
        )
        refs = gin.get_bindings("test_combine_probe", resolve_references=False)
        for ref, kind in ((refs["a"], "max"), (refs["b"], "min")):
            plain = gin_functions.plain_function(ref, supplied=contract.STEP.names)
            assert combine.rule_of(contract.adapt(plain, contract.STEP)) == {"max_logit": kind}
    finally:
        gin.clear_config()


def test_an_unknown_kind_is_one_error_line():
    with pytest.raises(
        UserError,
        match=r"^trainer.combine gives output 'max_logit' the kind 'maximum'; use one of "
        r"share, mean, max, min$",
    ):
        trainer.combine(max_logit="maximum")
