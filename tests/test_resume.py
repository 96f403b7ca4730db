"""Exact resume: a run killed with SIGKILL and restarted logs the same per-step losses as one
that never stopped (dropout included); a crash mid-save leaves the previous checkpoint usable."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import pytest

from tests.support import REPO, read_jsonl, run_main, subprocess_env
from tests.test_multiworker import trainer_pids_for

pytestmark = pytest.mark.slow  # every test here starts processes or trains for long

TOTAL = 60
PER_STEP = [
    f"--gin_bindings=train.total_steps={TOTAL}",
    "--gin_bindings=train.log_every_steps=1",
    "--gin_bindings=train.checkpoint_every_steps=20",
    "--gin_bindings=train.eval_every_steps=1000",
    "--gin_bindings=cnn.dropout=0.3",
    "--gin_bindings=cnn.filters=(16, 16, 16)",
]


def per_step_losses(model_dir: str) -> dict[int, float]:
    """step -> train loss; a step logged again after a restart keeps its latest value."""
    return {r["step"]: r["loss"] for r in read_jsonl(os.path.join(model_dir, "metrics.jsonl")) if r["split"] == "train"}


def held_at(step: int, *extensions: str) -> list[str]:
    """Bindings that hold a run still once it has logged `step` (tests/holding.py), beside the run's
    own `extensions` (gin references): a run killed on seeing `step` logged is killed there."""
    return [
        "--gin_bindings=import tests.holding",
        f"--gin_bindings=train.extensions=[{', '.join([*extensions, '@HoldAt()'])}]",
        f"--gin_bindings=HoldAt.step={step}",
    ]


def wait_for_step(model_dir: str, step: int, proc: subprocess.Popen, timeout: float = 150) -> None:
    path = os.path.join(model_dir, "metrics.jsonl")
    deadline = time.monotonic() + timeout
    while not (os.path.exists(path) and step in per_step_losses(model_dir)):
        assert proc.poll() is None, "the run ended before it could be killed"
        assert time.monotonic() < deadline, f"step {step} not reached"
        time.sleep(0.05)


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILLs the run's process group and every process of its model_dir outside it (trainer.launch starts
    each worker in a session of its own, so a killed launcher leaves them running: a rerun then finds the
    model_dir held, as it should)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=30)
    for model_dir in [arg.split("=", 1)[1] for arg in proc.args if str(arg).startswith("--model_dir=")]:
        for pid in trainer_pids_for(model_dir):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def kill_while_writing(command: list[str], model_dir: str, timeout: float = 200) -> list[str]:
    """Runs `command` in its own session and SIGKILLs it as soon as ckpt-40's files appear beside a
    complete ckpt-20 (a save in progress); returns model_dir's names at that moment."""
    proc = subprocess.Popen(
        command,
        cwd=REPO,
        env=subprocess_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and proc.poll() is None:
            names = os.listdir(model_dir) if os.path.isdir(model_dir) else []
            if "ckpt-20.index" in names and any(n.startswith("ckpt-40") for n in names):
                os.killpg(proc.pid, signal.SIGKILL)
                return names
            time.sleep(0.002)
    finally:
        kill_group(proc)
    raise AssertionError(f"never caught the save of ckpt-40 in progress (exit {proc.returncode})")


def command(launch_workers: int, gin_file: str, model_dir: str, *extra: str) -> list[str]:
    main_flags = [f"--gin_file={gin_file}", f"--model_dir={model_dir}", *PER_STEP, *extra]
    if launch_workers:
        return [sys.executable, "-m", "trainer.launch", f"--num_workers={launch_workers}", "--", *main_flags]
    return [sys.executable, "-m", "trainer.main", *main_flags]


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "gin_file,workers,atol",
    [
        ("gin/single.gin", 0, 0.0),
        ("gin/mirrored.gin", 0, 0.0),
        ("gin/mwms.gin", 2, 1e-6),
    ],
)
def test_killed_and_restarted_run_matches_an_uninterrupted_one(tmp_path, gin_file, workers, atol):
    reference_dir, resumed_dir = str(tmp_path / "reference"), str(tmp_path / "resumed")
    reference = subprocess.run(
        command(workers, gin_file, reference_dir),
        cwd=REPO,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert reference.returncode == 0, reference.stderr[-3000:] + reference.stdout[-3000:]

    kill_at = random.Random(gin_file).randint(21, TOTAL - 8)
    first = subprocess.Popen(
        command(workers, gin_file, resumed_dir, *held_at(kill_at)),
        cwd=REPO,
        env=subprocess_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        wait_for_step(resumed_dir, kill_at, first)
    finally:
        kill_group(first)
    restart = subprocess.run(
        command(workers, gin_file, resumed_dir),
        cwd=REPO,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert restart.returncode == 0, restart.stderr[-3000:] + restart.stdout[-3000:]
    restored = int(restart.stdout.split("continuing from step ")[1].split()[0])
    assert 20 <= restored < kill_at  # held at kill_at before its own checkpoint

    expected, got = per_step_losses(reference_dir), per_step_losses(resumed_dir)
    assert sorted(expected) == list(range(1, TOTAL + 1)) and sorted(got) == sorted(expected)
    for step in range(restored + 1, TOTAL + 1):
        if atol:
            assert abs(got[step] - expected[step]) <= atol, (step, got[step], expected[step])
        else:
            assert got[step] == expected[step], (step, got[step], expected[step])  # bit for bit


@pytest.mark.timeout(300)
def test_crash_during_a_checkpoint_save_restores_the_previous_one(tmp_path):
    """A model large enough that a save takes a while; SIGKILL as soon as its files start to appear."""
    model_dir = str(tmp_path / "run")
    flags = [
        "--gin_file=gin/single.gin",
        f"--model_dir={model_dir}",
        "--gin_bindings=train.model_fn=@mlp",
        "--gin_bindings=mlp.hidden=(3072, 3072)",
        "--gin_bindings=train.total_steps=40",
        "--gin_bindings=train.checkpoint_every_steps=20",
        "--gin_bindings=train.eval_every_steps=1000",
        "--gin_bindings=train.log_every_steps=10",
    ]
    kill_while_writing([sys.executable, "-m", "trainer.main", *flags], model_dir)
    with open(os.path.join(model_dir, "checkpoint")) as f:
        assert 'model_checkpoint_path: "ckpt-20"' in f.read()

    rerun = run_main(*flags)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert "continuing from step 20" in rerun.stdout
    assert os.path.exists(os.path.join(model_dir, "ckpt-40.index"))
