"""Ctrl-C (SIGINT) during training: every worker saves the step the run reached, one line, exit 130,
no traceback, within 10 s; a second Ctrl-C exits at once; in front of trainer.launch the same."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from tests.support import REPO, Main, subprocess_env
from tests.test_multiworker import trainer_pids_for, wait_for

pytestmark = pytest.mark.slow  # every test here starts processes or trains for long

INTERRUPTED = re.compile(
    r"^(\[worker 0\] )?interrupted at step (\d+), saved ckpt-(\d+); rerun the same command to continue$"
)
# Short loop calls, a line every 10 steps, no eval or periodic checkpoint to wait for.
SHORT_CALLS = [
    "--gin_bindings=train.total_steps=100000",
    "--gin_bindings=train.log_every_steps=10",
    "--gin_bindings=train.steps_per_loop=10",
    "--gin_bindings=train.eval_every_steps=100000",
    "--gin_bindings=train.checkpoint_every_steps=100000",
]


def ctrl_c(main: Main) -> int:
    """Sends `main` a Ctrl-C; its exit code. The timeout is a hard bound only: the runs below would
    train for minutes (100000 steps, or a 5000-step loop call) if the Ctrl-C were not acted on."""
    main.proc.send_signal(signal.SIGINT)
    return main.finish(timeout=60)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("gin", ["gin/single.gin", "gin/mirrored.gin"])
def test_ctrl_c_saves_the_step_reached_says_so_in_one_line_and_exits_130(tmp_path, gin):
    model_dir = tmp_path / "run"
    main = Main(f"--gin_file={gin}", f"--model_dir={model_dir}", *SHORT_CALLS)
    try:
        main.wait_for(r"^step 20/", timeout=120)
        code = ctrl_c(main)
    finally:
        main.kill()
    assert code == 130, main.tail()
    match = INTERRUPTED.match(main.out[-1])
    assert match and match.group(2) == match.group(3), main.tail()
    step = int(match.group(2))
    assert step >= 20 and (model_dir / f"ckpt-{step}.index").exists()
    assert f"step {step}/" in main.stdout  # the step it saved is one it reached, not a later one
    assert main.stderr.strip() == "", main.stderr[-3000:]  # no traceback, no second line


@pytest.mark.timeout(150)
def test_sigterm_to_a_run_of_one_process_saves_as_ctrl_c_does_unless_turned_off(tmp_path):
    model_dir = tmp_path / "run"
    main = Main("--gin_file=gin/single.gin", f"--model_dir={model_dir}", *SHORT_CALLS)
    try:
        main.wait_for(r"^step 20/", timeout=120)
        main.proc.send_signal(signal.SIGTERM)
        code = main.finish(timeout=30)
    finally:
        main.kill()
    assert code == 143, main.tail()
    match = re.match(
        r"^terminated \(SIGTERM\) at step (\d+), saved ckpt-(\d+); rerun the same command to continue$", main.out[-1]
    )
    assert match and match.group(1) == match.group(2), main.tail()
    assert (model_dir / f"ckpt-{match.group(1)}.index").exists() and main.stderr.strip() == "", main.tail()
    off = Main(
        "--gin_file=gin/single.gin",
        f"--model_dir={tmp_path / 'off'}",
        *SHORT_CALLS,
        "--gin_bindings=train.preemption_checkpointing=False",
    )
    try:
        off.wait_for(r"^step 10/", timeout=120)
        off.proc.send_signal(signal.SIGTERM)
        assert off.finish(timeout=30) == -signal.SIGTERM, off.tail()  # the system's default: no save
    finally:
        off.kill()
    assert not list((tmp_path / "off").glob("ckpt-*.index"))


@pytest.mark.timeout(150)
def test_a_second_ctrl_c_exits_at_once_without_saving(tmp_path):
    """Loop calls of 5000 steps (a minute here): the first Ctrl-C waits for the call to end, the
    second does not."""
    model_dir = tmp_path / "run"
    main = Main(
        "--gin_file=gin/single.gin",
        f"--model_dir={model_dir}",
        *SHORT_CALLS,
        "--gin_bindings=train.steps_per_loop=5000",
        "--gin_bindings=train.log_every_steps=5000",
        "--gin_bindings=import tests.holding",
        "--gin_bindings=train.extensions=[@SayBegun()]",
    )
    try:
        main.wait_for(r"^begun$", timeout=120)  # the Ctrl-C handler is installed; the first call follows
        main.proc.send_signal(signal.SIGINT)
        time.sleep(0.5)
        assert main.proc.poll() is None
        code = ctrl_c(main)
    finally:
        main.kill()
    assert code == 130, (code, main.tail())
    assert "step 5000/" not in main.stdout, main.tail()  # it left inside the first call, not at its end
    assert main.out[-1] == (
        "interrupted again: exiting at once without saving; a rerun continues from the newest checkpoint"
    ), main.tail()
    assert not list(model_dir.glob("ckpt-*")) and main.stderr.strip() == ""


@pytest.mark.timeout(300)
def test_ctrl_c_in_front_of_the_launcher_saves_on_both_workers_in_one_line(tmp_path):
    """The launcher forwards Ctrl-C to its two MultiWorkerMirrored workers, which agree on the step;
    the chief's line is all the user sees after it, and the launcher exits 130."""
    model_dir = str(tmp_path / "run")
    launcher = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "trainer.launch",
            "--num_workers=2",
            "--",
            "--gin_file=gin/mwms.gin",
            f"--model_dir={model_dir}",
            *SHORT_CALLS,
        ],
        cwd=REPO,
        env=subprocess_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        lines = []
        for line in launcher.stdout:
            lines.append(line.rstrip("\n"))
            if line.startswith("[worker 0] step 20/"):
                break
        assert len(trainer_pids_for(model_dir)) == 3, lines[-10:]  # the launcher and its workers
        launcher.send_signal(signal.SIGINT)
        rest, _ = launcher.communicate(timeout=90)  # a hard bound only: 100000 steps would take minutes
    finally:
        launcher.kill()
        launcher.wait()
    after = [line for line in rest.splitlines() if not re.match(r"^\[worker \d\] step \d+/", line)]
    assert launcher.returncode == 130, rest[-4000:]
    assert len(after) == 1 and (match := INTERRUPTED.match(after[0])), rest[-4000:]
    step = int(match.group(2))
    assert step >= 20 and os.path.exists(os.path.join(model_dir, f"ckpt-{step}.index"))
    wait_for(lambda: not trainer_pids_for(model_dir), 15, "the workers to end")


@pytest.mark.timeout(60)
def test_ctrl_c_before_training_is_one_line_and_exit_130(tmp_path):
    """While TensorFlow loads (the first seconds), nothing to save: the line, exit 130, model_dir untouched."""
    model_dir = tmp_path / "run"
    main = Main("--gin_file=gin/single.gin", f"--model_dir={model_dir}")
    try:
        time.sleep(1.5)
        main.proc.send_signal(signal.SIGINT)
        code = main.finish(timeout=30)
    finally:
        main.kill()
    assert code == 130 and main.err == ["interrupted; rerun the same command to continue"], main.tail()
    assert not model_dir.exists()


@pytest.mark.timeout(400)
def test_ctrl_c_to_an_embedded_parameter_server_run_saves_then_ends_the_servers(tmp_path):
    """As from a terminal, to the whole process group: the servers (a group of their own) keep the
    variables until the coordinator has saved them, then the coordinator ends them."""
    model_dir = tmp_path / "run"
    main = Main("--gin_file=gin/ps.gin", f"--model_dir={model_dir}", *SHORT_CALLS)
    try:
        main.wait_for(r"^step 20/", timeout=150)
        os.killpg(main.proc.pid, signal.SIGINT)
        code = main.finish(timeout=60)
    finally:
        main.kill()
    assert code == 130, main.tail()
    match = INTERRUPTED.match(main.out[-1])
    assert match and (model_dir / f"ckpt-{match.group(2)}.index").exists(), main.tail()
    stopped = [line for line in main.err if line.endswith(" stopped")]
    assert len(stopped) == 3 and not [line for line in main.err if "Traceback" in line], main.stderr[-3000:]
    wait_for(lambda: not trainer_pids_for(str(model_dir)), 10, "the coordinator to end")
