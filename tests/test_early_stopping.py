"""Early stopping (train.early_stopping): the rule, a stopped run's rerun, and 2 MultiWorkerMirrored
workers that stop at the same step, both exit 0, with the best-K directory checked against metrics.jsonl."""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys

import pytest

from tests.support import REPO, launch_workers, main_in_one_process, read_jsonl, run_main, subprocess_env
from tests.test_multiworker import trainer_pids_for
from tests.test_resume import held_at, kill_group, wait_for_step
from trainer.extensions.early_stopping import EarlyStop
from trainer.extensions.monitoring import monitored

# A metric that stops improving: no change of the eval loss beats min_delta 100, so the first
# eval is the best and the run stops `patience` evals later.
NEVER_IMPROVES = [
    "--gin_bindings=train.early_stopping=@early_stopping()",
    "--gin_bindings=early_stopping.patience=2",
    "--gin_bindings=early_stopping.min_delta=100.0",
]
SHORT = [
    "--gin_bindings=train.model_fn=@mlp",
    "--gin_bindings=train.total_steps=200",
    "--gin_bindings=train.eval_every_steps=20",
    "--gin_bindings=train.checkpoint_every_steps=100",
    "--gin_bindings=train.steps_per_loop=10",
    "--gin_bindings=train.log_every_steps=20",
]
BEST_2 = [
    "--gin_bindings=train.keep_best=2",
    "--gin_bindings=train.best_metric='accuracy'",
    "--gin_bindings=train.best_mode='max'",
]


def top_k_steps(model_dir: str, k: int, key: str = "accuracy") -> list[int]:
    """The steps of the k best eval records (max, ties: the earlier step), from metrics.jsonl."""
    evals = {r["step"]: r[key] for r in read_jsonl(os.path.join(model_dir, "metrics.jsonl")) if r["split"] == "eval"}
    return [s for s, _ in sorted(evals.items(), key=lambda item: (-item[1], item[0]))[:k]]


def best_steps(model_dir: str) -> list[int]:
    with open(os.path.join(model_dir, "best", "best.json")) as f:
        return [e["step"] for e in json.load(f)["kept"]]


def test_the_rule_is_keras_rule_and_a_function_of_the_history():
    hook = EarlyStop(monitored("early_stopping.", "loss", "min", ("eval",), min_delta=0.1), patience=2)
    hook._history = [(10, 1.0), (20, 0.95), (30, 0.85), (40, 0.8)]  # 0.95 and 0.8: not by more than 0.1
    assert hook._standing() == (30, 1)
    hook._history.append((50, float("nan")))  # NaN never improves
    assert hook._standing() == (30, 2)
    up = monitored("early_stopping.", "train_b/accuracy", "max", ("eval", "train_b"))
    assert (up.split, up.key) == ("train_b", "accuracy") and up.improves(0.5, 0.4) and not up.improves(0.4, 0.4)


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_a_stopped_run_ends_with_exit_0_a_checkpoint_there_and_a_rerun_trains_no_more(tmp_path):
    model_dir = str(tmp_path / "run")
    args = ["--gin_file=gin/single.gin", *SHORT, *NEVER_IMPROVES]
    # The run, then the same command again, in turn in one interpreter.
    proc, rerun = main_in_one_process({"run": (args, model_dir), "rerun": (args, model_dir)}, timeout=180).values()
    assert proc["code"] == 0, proc["stderr"][-3000:]
    assert "early stopping at step 60: loss" in proc["stdout"], proc["stdout"][-2000:]
    assert rerun["code"] == 0, rerun["stderr"][-3000:]
    assert "this run stopped at step 60, nothing more to train" in rerun["stdout"]
    assert os.path.exists(os.path.join(model_dir, "ckpt-60.index"))
    records = read_jsonl(os.path.join(model_dir, "metrics.jsonl"))  # the rerun added no step
    assert max(r["step"] for r in records) == 60 and [r["step"] for r in records if r["split"] == "eval"] == [
        20,
        40,
        60,
    ]


BAD_VALUES = {
    "early_stopping.patience=0": "early_stopping.patience must be a positive integer",
    "early_stopping.mode='up'": "unknown early_stopping.mode 'up'",
    "train.keep_best=-1": "train.keep_best must be an integer >= 0",
    "train.best_mode='best'": "unknown train.best_mode 'best'",
}


@pytest.fixture(scope="module")
def bad_value_outcomes(tmp_path_factory) -> dict[str, dict]:
    """Each binding of BAD_VALUES in an empty model_dir, all in one interpreter."""
    root = tmp_path_factory.mktemp("bad_values")
    cases = {}
    for i, binding in enumerate(BAD_VALUES):
        (root / str(i)).mkdir()
        args = ["--gin_file=gin/single.gin", *SHORT, "--gin_bindings=train.early_stopping=@early_stopping()"]
        cases[binding] = ([*args, f"--gin_bindings={binding}"], str(root / str(i)))
    return main_in_one_process(cases, timeout=100)


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.xdist_group("bad_value_outcomes")
@pytest.mark.parametrize("binding", list(BAD_VALUES))
def test_bad_values_are_one_line_and_write_nothing(bad_value_outcomes, binding):
    outcome = bad_value_outcomes[binding]
    assert outcome["code"] == 2, outcome["stderr"][-2000:]
    lines = outcome["stderr"].strip().splitlines()
    assert lines[-1].startswith("error: ") and BAD_VALUES[binding] in lines[-1], lines[-1]
    assert outcome["unchanged"]  # still empty


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_multiworker_mirrored_workers_stop_at_the_same_step_and_keep_the_best(tmp_path):
    """Must-show 4: a real 2-worker launch; every worker prints its decision, from its own numbers."""
    model_dir = str(tmp_path / "run")
    proc = launch_workers(
        "--gin_file=gin/mwms.gin",
        f"--model_dir={model_dir}",
        *SHORT,
        *NEVER_IMPROVES,
        *BEST_2,
        "--gin_bindings=early_stopping.patience=3",
    )
    stops = re.findall(r"\[worker (\d)\] early stopping at step (\d+): (.*)", proc.stdout)
    assert sorted(w for w, _, _ in stops) == ["0", "1"], proc.stdout[-3000:]
    assert stops[0][1:] == stops[1][1:] and stops[0][1] == "80"  # same step, same numbers on both
    assert "[worker 0] finished" not in proc.stdout and "[worker 1] finished at step 80/200" in proc.stdout
    assert os.path.exists(os.path.join(model_dir, "ckpt-80.index"))
    assert [r["step"] for r in read_jsonl(os.path.join(model_dir, "metrics.jsonl")) if r["split"] == "eval"] == [
        20,
        40,
        60,
        80,
    ]
    assert best_steps(model_dir) == top_k_steps(model_dir, 2)
    files = sorted(os.listdir(os.path.join(model_dir, "best")))
    assert files == sorted(
        ["best.json", "checkpoint"]
        + [f"ckpt-{s}.{ext}" for s in best_steps(model_dir) for ext in ("index", "data-00000-of-00001")]
    )
    assert not trainer_pids_for(model_dir)


KILLABLE = [
    "--gin_bindings=train.model_fn=@mlp",
    "--gin_bindings=train.total_steps=120",
    "--gin_bindings=train.eval_every_steps=10",
    "--gin_bindings=train.checkpoint_every_steps=30",
    "--gin_bindings=train.steps_per_loop=10",
    "--gin_bindings=train.log_every_steps=10",
]


def killed_and_restarted(flags: list[str], model_dir: str, kill_at: int) -> subprocess.CompletedProcess:
    """`trainer.main flags` SIGKILLed once step `kill_at` is logged (held there), then run again to its end."""
    command = [sys.executable, "-m", "trainer.main", *flags, f"--model_dir={model_dir}"]
    first = subprocess.Popen(
        [*command, *held_at(kill_at)],
        cwd=REPO,
        env=subprocess_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        wait_for_step(model_dir, kill_at, first)
    finally:
        kill_group(first)
    return subprocess.run(command, cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=200)


@pytest.mark.slow
@pytest.mark.timeout(500)
def test_a_killed_and_restarted_run_stops_where_an_uninterrupted_one_does(tmp_path):
    """The patience count is in the checkpoint: resumed from step 30 after a kill at 40 or 50, the run
    still stops at step 60 (10 + 5 evals); one that forgot its history would go on to step 90."""
    flags = ["--gin_file=gin/single.gin", *KILLABLE, *NEVER_IMPROVES, "--gin_bindings=early_stopping.patience=5"]
    reference = run_main(*flags, f"--model_dir={tmp_path / 'reference'}", timeout=200)
    assert reference.returncode == 0, reference.stderr[-3000:]
    assert "early stopping at step 60" in reference.stdout
    resumed_dir = str(tmp_path / "resumed")
    restart = killed_and_restarted(flags, resumed_dir, kill_at=random.Random().choice([40, 50]))
    assert restart.returncode == 0, restart.stderr[-3000:]
    assert "continuing from step 30" in restart.stdout and "early stopping at step 60" in restart.stdout
    records = read_jsonl(os.path.join(resumed_dir, "metrics.jsonl"))
    assert max(r["step"] for r in records) == 60 and os.path.exists(os.path.join(resumed_dir, "ckpt-60.index"))
    evals = {r["step"]: r["loss"] for r in records if r["split"] == "eval"}
    expected = {
        r["step"]: r["loss"] for r in read_jsonl(str(tmp_path / "reference" / "metrics.jsonl")) if r["split"] == "eval"
    }
    assert evals == expected
