"""Progress: a live bar that redraws in place on a terminal, plain lines everywhere else."""

from __future__ import annotations

import fcntl
import io
import os
import pty
import re
import select
import struct
import subprocess
import sys
import tempfile
import termios
import time
import types

import pytest

from tests.support import REPO, read_jsonl, subprocess_env

BAR = re.compile(r"step (\d+)/(\d+) \[[=> ]+\]")


def run_under_terminal(args: list[str], timeout: float = 240) -> tuple[int, str, str]:
    """Runs trainer.main with stdout on a pseudo-terminal (120 columns); returns (exit code,
    everything written to the terminal, stderr)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    with open(os.devnull) as devnull, tempfile.TemporaryFile("w+") as stderr:
        # The size comes from the terminal itself: COLUMNS/LINES (set by pytest-xdist's workers to
        # 80x24) would take precedence over it.
        env = {k: v for k, v in subprocess_env(TERM="xterm").items() if k not in ("COLUMNS", "LINES")}
        proc = subprocess.Popen(
            [sys.executable, "-m", "trainer.main", *args],
            cwd=REPO,
            env=env,
            stdin=devnull,
            stdout=slave,
            stderr=stderr,
        )
        os.close(slave)
        chunks, deadline = [], time.monotonic() + timeout
        try:
            while time.monotonic() < deadline:
                ready, _, _ = select.select([master], [], [], 0.5)
                if ready:
                    try:
                        data = os.read(master, 65536)
                    except OSError:  # EIO: the child closed the terminal
                        break
                    if not data:
                        break
                    chunks.append(data)
                elif proc.poll() is not None:
                    break
            else:
                raise AssertionError("trainer.main under a terminal did not finish in time")
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=30)
            os.close(master)
        stderr.seek(0)
        return proc.returncode, b"".join(chunks).decode(errors="replace"), stderr.read()


@pytest.mark.slow
def test_on_a_terminal_the_bar_redraws_in_place_and_eval_lines_print_above_it(tmp_path):
    model_dir = str(tmp_path / "run")
    code, screen, stderr = run_under_terminal(
        [
            "--gin_file=gin/single.gin",
            f"--model_dir={model_dir}",
            # One loop call of 60 steps, broken only at the eval step 30 by the other extensions: any
            # other step the bar shows comes from the driver ending calls early for the bar.
            "--gin_bindings=train.total_steps=60",
            "--gin_bindings=train.steps_per_loop=60",
            "--gin_bindings=train.log_every_steps=60",
            "--gin_bindings=train.eval_every_steps=30",
            "--gin_bindings=train.checkpoint_every_steps=60",
            "--gin_bindings=progress_logger.refresh_secs=0.05",
        ]
    )
    assert code == 0, stderr[-3000:]
    lines = screen.replace("\r\n", "\n").split("\n")  # the terminal turns \n into \r\n
    bar_lines = [line for line in lines if BAR.search(line)]
    # The bar's redraws share a line: several \r-separated frames with no newline between them.
    frames = [f for f in max(bar_lines, key=lambda line: line.count("\r")).split("\r") if BAR.search(f)]
    assert len(frames) >= 3, screen
    steps = [int(BAR.search(f).group(1)) for f in frames]
    assert steps == sorted(steps) and len(set(steps)) >= 3, steps
    shown = {int(m.group(1)) for m in BAR.finditer(screen)}
    assert shown - {30, 60}, f"the driver never ended a loop call early for the bar: {sorted(shown)}"
    assert all("steps/s" in f and "ETA" in f and "loss" in f for f in frames[1:]), frames
    # The last frame is the whole run, and the bar's line is ended before the final eval line.
    assert re.search(r"step 60/60 \[=+\] 100%[^\n]*\n", screen.replace("\r\n", "\n")), screen[-2000:]
    evals = [line.split("\r")[-1] for line in lines if "eval at step" in line]
    assert [e.split(":")[0] for e in evals] == ["eval at step 30", "eval at step 60"], evals
    assert not any(re.match(r"step \d+/\d+  loss", line) for line in lines)  # no plain lines on a terminal
    # Shorter loop calls change nothing recorded: one train record at the log step.
    records = read_jsonl(os.path.join(model_dir, "metrics.jsonl"))
    assert [(r["split"], r["step"]) for r in records] == [("eval", 30), ("train", 60), ("eval", 60)]


@pytest.mark.slow
@pytest.mark.xdist_group("single_runs")
def test_without_a_terminal_the_output_is_plain_lines(profiled_run):
    _, proc = profiled_run
    assert "\r" not in proc.stdout
    progress = [line for line in proc.stdout.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in progress] == ["10/40", "20/40", "30/40", "40/40"]
    assert all("loss" in line and "steps/s" in line and "ETA" in line for line in progress)


# --- the extension on its own, in this process ----------------------------------------------------


class _Log:
    def __init__(self):
        self.records = []

    def record(self, step, split, metrics):
        self.records.append((step, split, dict(metrics)))


class _Optimizer:
    learning_rate = 0.1


def _run_context(is_chief: bool, printed: list[str]):
    from trainer.extensions.context import Context, Contributions
    from trainer.run.settings import Settings

    settings = Settings(total_steps=30, global_batch_size=8, print_fn=printed.append)
    runtime = types.SimpleNamespace(is_chief=is_chief, spans_processes=False)
    context = Context(settings, runtime, types.SimpleNamespace(optimizers=_Optimizer()), Contributions())
    context.metrics_log = _Log()
    return context


def _drive(logger, run, calls, eval_at=None):
    logger.begin(run)
    step = 0
    for num_steps in calls:
        run.clock.train_seconds += 0.01 * num_steps
        step += num_steps
        logger.after_loop(run, step, {"loss": 1.0 / step})
        if step == eval_at:
            run.print(f"eval at step {step}")  # as the eval extension prints, after the logger
    logger.end(run, step)


def test_non_chief_workers_print_one_line_unless_asked():
    from trainer.extensions.progress import ProgressLogger

    quiet, chatty = [], []
    _drive(ProgressLogger(10), _run_context(False, quiet), [10, 10, 10])
    assert quiet == ["finished at step 30/30"]
    _drive(ProgressLogger(10, all_workers=True), _run_context(False, chatty), [10, 10, 10])
    assert [line.split()[1] for line in chatty if line.startswith("step ")] == ["10/30", "20/30", "30/30"]


def test_forced_bar_keeps_metrics_records_and_prints_other_lines_above_it():
    from trainer.extensions.progress import ProgressLogger

    printed, screen = [], io.StringIO()
    logger = ProgressLogger(10, live=True, refresh_secs=0.0, stream=screen)
    run = _run_context(True, printed)
    _drive(logger, run, [5, 5, 10, 10], eval_at=20)
    assert [(step, split) for step, split, _ in run.metrics_log.records] == [
        (10, "train"),
        (20, "train"),
        (30, "train"),
    ]
    assert set(run.metrics_log.records[0][2]) == {"loss", "learning_rate", "steps_per_sec", "examples_per_sec"}
    assert printed == ["eval at step 20"]
    text = screen.getvalue()
    run.print("after the run")  # the bar is gone: lines go straight through, the screen stays as it was
    assert printed[-1] == "after the run" and screen.getvalue() == text
    assert [int(m.group(1)) for m in BAR.finditer(text)] == [5, 10, 20, 20, 30]  # 20 again after the eval line
    assert text.endswith("\n") and text.count("\n") == 1
