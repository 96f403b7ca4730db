"""metrics.jsonl after a resume reads as one history: a resumed run marks the lines of the steps it
trains again superseded, and `read_history` (what trainer.plot draws) has each (step, split) once."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.support import REPO, read_jsonl, run_main, subprocess_env
from tests.test_nonfinite import BAD_STEP, poisoned  # noqa: F401  (poisoned: a fixture)
from tests.test_resume import held_at, kill_group, wait_for_step
from trainer.files.metrics_log import read_history


def write_lines(model_dir, lines: list) -> None:
    with open(os.path.join(model_dir, "metrics.jsonl"), "w") as f:
        f.write("".join(line if isinstance(line, str) else json.dumps(line) + "\n" for line in lines))


def test_a_resume_line_supersedes_later_steps_and_the_last_line_of_a_step_wins(tmp_path):
    write_lines(
        tmp_path,
        [
            {"step": 10, "split": "train", "loss": 1.0},
            {"step": 20, "split": "train", "loss": 0.8},
            {"step": 20, "split": "eval", "loss": 0.9, "accuracy": 0.5},
            {"step": 30, "split": "train", "loss": 0.7},
            {"step": 35, "split": "train", "loss": 0.6},  # logged at a stop, never logged again
            {"step": 30, "split": "eval", "loss": 0.7, "num_examples": 360.0},  # a sidecar's, of the lost ckpt-30
            {"step": 20, "split": "resumed"},
            {"step": 30, "split": "train", "loss": 0.65},
            {"step": 30, "split": "eval", "loss": 0.75, "accuracy": 0.6},
            {"step": 40, "split": "train", "loss": 0.5},
            {"step": 40, "split": "eval_ema", "loss": 0.4},
            {"step": 40, "split": "eval_ema", "loss": 0.45},  # a step written twice without a resume: the last
            '{"step": 50, "split": "tra',  # a line a running job is still writing
        ],
    )
    assert read_history(str(tmp_path)) == [
        {"step": 10, "split": "train", "loss": 1.0},
        {"step": 20, "split": "train", "loss": 0.8},
        {"step": 20, "split": "eval", "loss": 0.9, "accuracy": 0.5},
        {"step": 30, "split": "train", "loss": 0.65},
        {"step": 30, "split": "eval", "loss": 0.75, "accuracy": 0.6},
        {"step": 40, "split": "train", "loss": 0.5},
        {"step": 40, "split": "eval_ema", "loss": 0.45},
    ]


def test_a_file_without_resume_lines_reads_as_before_and_a_broken_one_is_one_error(tmp_path):
    from trainer.errors import UserError

    old = [{"step": 5, "split": "train", "loss": 1.0}, {"step": 5, "split": "eval", "loss": 2.0}]
    write_lines(tmp_path, old)
    assert read_history(str(tmp_path)) == old
    write_lines(tmp_path, ["not json\n", *old])
    with pytest.raises(UserError, match=r"metrics.jsonl:1 is not a JSON line"):
        read_history(str(tmp_path))
    write_lines(tmp_path, [{"loss": 1.0}])
    with pytest.raises(UserError, match=r"metrics.jsonl:1 is not a metrics record"):
        read_history(str(tmp_path))
    with pytest.raises(UserError, match="no metrics.jsonl in"):
        read_history(str(tmp_path / "nowhere"))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_run_resumed_from_an_older_checkpoint_draws_each_step_once(tmp_path):
    """Killed past step 55 with ckpt-50 its newest checkpoint, then rerun: steps 55, 60, ... are in
    metrics.jsonl twice, after one `resumed` line at 50; the history and the plot have them once,
    at the rerun's values."""
    model_dir = str(tmp_path / "run")
    flags = [
        "--gin_file=gin/single.gin",
        f"--model_dir={model_dir}",
        "--gin_bindings=train.log_every_steps=5",
        "--gin_bindings=train.steps_per_loop=5",
        "--gin_bindings=train.checkpoint_every_steps=50",
        "--gin_bindings=train.eval_every_steps=50",
    ]
    first = subprocess.Popen(
        [sys.executable, "-m", "trainer.main", *flags, "--gin_bindings=train.total_steps=100000", *held_at(55)],
        cwd=REPO,
        env=subprocess_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        wait_for_step(model_dir, 55, first)
    finally:
        kill_group(first)
    written = read_jsonl(os.path.join(model_dir, "metrics.jsonl"))
    killed_at = max(r["step"] for r in written)
    assert killed_at == 55 and os.path.exists(os.path.join(model_dir, "ckpt-50.index"))  # held at 55

    rerun = run_main(*flags, "--gin_bindings=train.total_steps=100", timeout=200)
    assert rerun.returncode == 0 and "continuing from step 50" in rerun.stdout, rerun.stderr[-3000:]
    records = read_jsonl(os.path.join(model_dir, "metrics.jsonl"))
    resumed = [i for i, r in enumerate(records) if r["split"] == "resumed"]
    assert len(resumed) == 1 and records[resumed[0]] == {"step": 50, "split": "resumed"}
    train_steps = [r["step"] for r in records if r["split"] == "train"]
    assert train_steps.count(55) == 2  # the file keeps what was written

    history = read_history(model_dir)
    assert [r["step"] for r in history if r["split"] == "train"] == list(range(5, 105, 5))
    assert [r["step"] for r in history if r["split"] == "eval"] == [50, 100]
    rerun_values = {r["step"]: r for r in records[resumed[0] :] if r["split"] == "train"}
    assert all(r == rerun_values[r["step"]] for r in history if r["split"] == "train" and r["step"] > 50)

    from trainer import plot

    figure, _ = plot.build_figure({"run": history})
    for ax in figure.axes:
        for line in ax.lines:
            steps = list(line.get_xdata())
            assert steps == sorted(set(steps)), (ax.get_title(), steps)


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_a_roll_back_marks_the_steps_it_trains_again(poisoned, tmp_path):  # noqa: F811
    """A NaN at step 7, checkpoints every 5 steps, a line every step: the roll-back to step 5 marks
    step 6's first line superseded; the history has each step once."""
    model_dir = str(tmp_path / "run")
    proc = run_main(
        *poisoned,
        f"--model_dir={model_dir}",
        "--gin_bindings=train.nonfinite='rollback'",
        "--gin_bindings=train.log_every_steps=1",
    )
    assert proc.returncode == 0 and f"(step 5) and skipping batch {BAD_STEP - 1}" in proc.stdout, proc.stderr[-3000:]
    records = read_jsonl(os.path.join(model_dir, "metrics.jsonl"))
    mark = records.index({"step": 5, "split": "resumed"})
    assert [r["step"] for r in records[:mark] if r["split"] == "train"] == [1, 2, 3, 4, 5, 6]
    history = read_history(model_dir)
    assert [r["step"] for r in history if r["split"] == "train"] == list(range(1, 31))
    assert next(r for r in history if r["step"] == 6) == next(r for r in records[mark:] if r["step"] == 6)
