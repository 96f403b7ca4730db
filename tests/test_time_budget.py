"""train.max_time_secs: a run whose budget is spent stops after that loop call, saves that step,
says so in one line and exits 0; the same command continues it to the weights of a run that never
stopped. Under 2 MultiWorkerMirrored workers the stop is agreed: only the chief's budget runs out,
and both stop at its step."""

from __future__ import annotations

import os

import numpy as np
import pytest

from tests.support import launch_workers, read_jsonl, run_python
from tests.test_multiworker import model_weights, trainer_pids_for
from trainer.errors import UserError
from trainer.extensions import built_in
from trainer.run.settings import Settings

# A budget long spent when the first loop call ends (building and tracing the run take longer).
SPENT = 0.001
COMMON = [
    "train.model_fn = @mlp",
    "train.total_steps = 6",
    "train.steps_per_loop = 2",
    "train.checkpoint_every_steps = 4",
    "train.eval_every_steps = 4",
    "train.log_every_steps = 2",
    "train.global_batch_size = 32",
]
SINGLE = """
import json, os
import gin, keras
from trainer import configurables, main

lines = {{}}
for name, model_dir, budget in (("spent", "run", {spent}), ("rerun", "run", 600.0), ("reference", "reference", None)):
    gin.clear_config()
    keras.backend.clear_session()  # layer names as in a fresh process: the run record lets it resume
    main.parse_gin(["gin/single.gin"], {common!r})
    lines[name] = []
    configurables.train(model_dir=os.path.join({out!r}, model_dir), max_time_secs=budget, print_fn=lines[name].append)
print(json.dumps(lines))
"""

pytestmark = pytest.mark.xdist_group("time_budget")  # the single runs are the two workers' reference


@pytest.fixture(scope="module")
def single_runs(tmp_path_factory) -> tuple[str, dict[str, list[str]]]:
    """In one process: a run stopped by a spent budget, its rerun with a budget it does not reach, and
    a run without a budget in another model_dir; returns their directory and each one's lines."""
    out = str(tmp_path_factory.mktemp("budget"))
    return out, run_python(SINGLE.format(out=out, spent=SPENT, common=COMMON), timeout=180)


def test_the_budget_is_a_positive_number_or_none():
    for value in (0, -1.0, "600", True):
        with pytest.raises(UserError, match=rf"^train.max_time_secs must be a number > 0 or None, got {value!r}$"):
            built_in.participants(Settings(max_time_secs=value))
    assert "time_budget" not in [e.name for e in built_in.participants(Settings())]
    assert "time_budget" in [e.name for e in built_in.participants(Settings(max_time_secs=1))]


@pytest.mark.timeout(200)
def test_a_spent_budget_saves_that_step_and_the_rerun_ends_as_an_uninterrupted_run(single_runs):
    out, lines = single_runs
    run, reference = os.path.join(out, "run"), os.path.join(out, "reference")
    assert lines["spent"][-1] == (
        f"time budget: {lines['spent'][-1].split()[2]} s spent of train.max_time_secs {SPENT:g} at step 2; "
        "saved ckpt-2; rerun the same command to continue (with a fresh budget)"
    ), lines["spent"]
    assert f"restored {run}/ckpt-2; continuing from step 2" in lines["rerun"]
    assert not any(line.startswith("time budget") for line in lines["rerun"] + lines["reference"])
    records = read_jsonl(os.path.join(run, "metrics.jsonl"))
    stopped = records[: next(i for i, r in enumerate(records) if r["split"] == "resumed")]
    assert [(r["step"], r["split"]) for r in stopped] == [(2, "train"), (2, "eval")]  # the final eval at the stop
    expected, got = model_weights(reference), model_weights(run)
    assert expected.keys() == got.keys() and expected
    for name in expected:
        np.testing.assert_array_equal(got[name], expected[name], err_msg=name)
    trained = [(r["step"], r["loss"]) for r in records if r["split"] == "train" and r["step"] > 2]
    assert (
        trained
        == [
            (r["step"], r["loss"])
            for r in read_jsonl(os.path.join(reference, "metrics.jsonl"))
            if r["split"] == "train"
        ][1:]
    )


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_two_workers_stop_together_when_one_budget_runs_out_and_the_rerun_continues(tmp_path, single_runs):
    model_dir, reference = str(tmp_path / "run"), os.path.join(single_runs[0], "reference")
    common = [f"--gin_bindings={binding}" for binding in COMMON]
    budget = ["--gin_bindings=import tests.chief_budget", "--gin_bindings=train.max_time_secs=@chief_budget()"]
    launch = ("--gin_file=gin/mwms.gin", f"--model_dir={model_dir}")
    stopped = launch_workers(*launch, *common, *budget)
    said = [line for line in stopped.stdout.splitlines() if "time budget:" in line]
    assert len(said) == 1 and said[0].startswith("[worker 0] time budget:"), stopped.stdout[-4000:]
    assert "at step 2; saved ckpt-2; rerun the same command" in said[0]
    assert sorted(n for n in os.listdir(model_dir) if n.endswith(".index")) == ["ckpt-2.index"]
    rerun = launch_workers(*launch, *common)
    assert f"restored {model_dir}/ckpt-2; continuing from step 2" in rerun.stdout
    assert not trainer_pids_for(model_dir)
    expected, got = model_weights(reference), model_weights(model_dir)
    assert expected.keys() == got.keys() and expected
    for name in expected:  # the uninterrupted single run's, as two workers match one process: reduction order only
        np.testing.assert_allclose(got[name], expected[name], rtol=0, atol=1e-6, err_msg=name)
