"""The entry point end to end: files in model_dir, resume, a user's own step, exit codes."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from tests.support import REPO, main_in_one_process, read_jsonl, run_main, subprocess_env, tree_digest
from tests.test_resume import held_at

pytestmark = pytest.mark.slow  # every test here starts processes or trains for long

SHORT = ["--gin_bindings=train.log_every_steps=20", "--gin_bindings=train.steps_per_loop=25"]


@pytest.mark.xdist_group("single_runs")
def test_single_run_writes_checkpoints_events_config_and_metrics(trained_single_dir):
    names = os.listdir(trained_single_dir)
    assert "operative_config.gin" in names
    assert "ckpt-60.index" in names and "ckpt-30.index" in names
    assert any(n.startswith("events.out.tfevents") for n in os.listdir(os.path.join(trained_single_dir, "train")))
    assert any(n.startswith("events.out.tfevents") for n in os.listdir(os.path.join(trained_single_dir, "eval")))
    with open(os.path.join(trained_single_dir, "operative_config.gin")) as f:
        config = f.read()
    assert "train.total_steps = 60" in config and "train.strategy = 'default'" in config
    records = read_jsonl(os.path.join(trained_single_dir, "metrics.jsonl"))
    train = [r for r in records if r["split"] == "train"]
    evals = [r for r in records if r["split"] == "eval"]
    assert [r["step"] for r in train] == [20, 40, 60]
    assert [r["step"] for r in evals] == [30, 60]
    for r in train:
        assert {"loss", "accuracy", "learning_rate", "steps_per_sec", "examples_per_sec"} <= set(r)
        assert r["examples_per_sec"] == r["steps_per_sec"] * 64
    assert 0.0 <= evals[-1]["accuracy"] <= 1.0 and evals[-1]["loss"] > 0


@pytest.mark.xdist_group("single_runs")
def test_rerun_continues_from_checkpoint_and_never_trains_a_step_twice(trained_single_dir, tmp_path):
    model_dir = str(tmp_path / "run")
    shutil.copytree(trained_single_dir, model_dir)
    done, more = main_in_one_process(  # both in turn in one interpreter; the second as --model_dir=~/run
        {
            "done": (["--gin_file=gin/single.gin", "--gin_bindings=train.total_steps=60"], model_dir),
            "more": (["--gin_file=gin/single.gin", "--gin_bindings=train.total_steps=90", *SHORT], "~/run"),
        },
        prelude=f"import os\nos.environ['HOME'] = {str(tmp_path)!r}",
        timeout=240,
    ).values()
    assert done["code"] == 0, done["stderr"][-3000:]
    assert "already trained" in done["stdout"] and "step 60" in done["stdout"]
    assert more["code"] == 0, more["stderr"][-3000:]
    assert "continuing from step 60" in more["stdout"]
    assert more["stdout"].startswith(f"model_dir: {model_dir} (~ expanded: --model_dir=~/run)\n"), more["stdout"]
    steps = [r["step"] for r in read_jsonl(os.path.join(model_dir, "metrics.jsonl")) if r["split"] == "train"]
    assert steps == [20, 40, 60, 80, 90]
    assert os.path.exists(os.path.join(model_dir, "ckpt-90.index"))


def test_killed_run_finishes_when_rerun(tmp_path):
    model_dir = str(tmp_path / "run")
    args = [
        "--gin_file=gin/single.gin",
        f"--model_dir={model_dir}",
        "--gin_bindings=train.total_steps=3000",
        "--gin_bindings=train.checkpoint_every_steps=50",
        *SHORT,
    ]
    proc = subprocess.Popen(  # held after ckpt-100 (tests/holding.py): killed before ckpt-400 on any machine
        [sys.executable, "-m", "trainer.main", *args, *held_at(101)],
        cwd=REPO,
        env=subprocess_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 120
        while not os.path.exists(os.path.join(model_dir, "ckpt-100.index")):
            assert proc.poll() is None and time.monotonic() < deadline, "no checkpoint before the kill"
            time.sleep(0.2)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL

    rerun = run_main(*args, "--gin_bindings=train.total_steps=400")
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert "is gone (no such process on this host); taking it over" in rerun.stdout  # the killed run's claim
    restored = int(rerun.stdout.split("continuing from step ")[1].split()[0])
    assert restored == 100
    records = read_jsonl(os.path.join(model_dir, "metrics.jsonl"))
    assert records[-1]["split"] == "eval" and records[-1]["step"] == 400
    assert os.path.exists(os.path.join(model_dir, "ckpt-400.index"))


def test_user_step_function_bound_by_gin_reaches_metrics(tmp_path):
    (tmp_path / "my_steps.py").write_text(
        textwrap.dedent("""
        import gin
        import tensorflow as tf

        @gin.configurable
        def my_step(model, optimizer, batch, global_batch_size, label_smoothing=0.1):
            images, labels = batch
            with tf.GradientTape() as tape:
                logits = model(images, training=True)
                onehot = tf.one_hot(labels, 10) * (1 - label_smoothing) + label_smoothing / 10
                per_example = tf.nn.softmax_cross_entropy_with_logits(onehot, logits)
                loss = tf.nn.compute_average_loss(per_example, global_batch_size=global_batch_size)
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            confidence = tf.reduce_sum(tf.reduce_max(tf.nn.softmax(logits), -1)) / global_batch_size
            return {"loss": loss, "confidence": confidence}
    """)
    )
    (tmp_path / "my.gin").write_text(
        textwrap.dedent(f"""
        import my_steps
        include '{REPO}/gin/mirrored.gin'
        train.step_fn = @my_step
        my_step.label_smoothing = 0.2
        train.total_steps = 40
    """)
    )
    model_dir = str(tmp_path / "run")
    env = subprocess_env(PYTHONPATH=os.pathsep.join([str(tmp_path), REPO]))
    proc = run_main(f"--gin_file={tmp_path / 'my.gin'}", f"--model_dir={model_dir}", *SHORT, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    train = [r for r in read_jsonl(os.path.join(model_dir, "metrics.jsonl")) if r["split"] == "train"]
    assert [r["step"] for r in train] == [20, 40]
    assert all(0.1 <= r["confidence"] <= 1.0 for r in train)
    with open(os.path.join(model_dir, "operative_config.gin")) as f:
        assert "my_step.label_smoothing = 0.2" in f.read()


def _assert_user_error(code: int, stderr: str, *needles: str) -> None:
    assert code == 2, (code, stderr[-3000:])
    lines = stderr.strip().splitlines()
    assert lines and lines[-1].startswith("error: "), stderr[-3000:]
    assert "Traceback" not in stderr
    for needle in needles:
        assert needle in lines[-1], lines[-1]


@pytest.mark.xdist_group("single_runs")
def test_user_mistakes_exit_2_with_one_line_and_leave_model_dir_alone(trained_single_dir, tmp_path):
    model_dir = str(tmp_path / "run")
    shutil.copytree(trained_single_dir, model_dir)
    before = tree_digest(model_dir)
    bad_gin = tmp_path / "bad.gin"
    bad_gin.write_text("include 'gin/single.gin'\ntrain.total_steps = = 3\n")

    # trainer.main's parsing and run in one interpreter (a real process below, for the flag)
    outcomes = main_in_one_process(
        {
            "missing_data": (
                [
                    "--gin_file=experiments/fashion_mnist/fashion_mnist.gin",
                    f"--gin_bindings=fashion_mnist.data_dir='{tmp_path / 'nowhere'}'",
                ],
                model_dir,
            ),
            "syntax": ([f"--gin_file={bad_gin}"], model_dir),
            "unknown": (["--gin_file=gin/single.gin", "--gin_bindings=train.totl_steps=5"], model_dir),
            "no_configurable": (["--gin_file=gin/single.gin", "--gin_bindings=trian.total_steps=5"], model_dir),
        },
        timeout=240,
    )
    for name, needles in (
        ("missing_data", [str(tmp_path / "nowhere")]),
        ("syntax", ["bad.gin", ":2"]),
        ("unknown", ["totl_steps"]),
        ("no_configurable", ["trian"]),
    ):
        _assert_user_error(outcomes[name]["code"], outcomes[name]["stderr"], *needles)
    bad_flag = run_main("--gin_file=gin/single.gin", "--no_such_flag=1")
    _assert_user_error(bad_flag.returncode, bad_flag.stderr, "no_such_flag")
    assert tree_digest(model_dir) == before


def test_without_model_dir_a_fresh_one_is_made_and_printed(tmp_path):
    env = subprocess_env()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "trainer.main",
            f"--gin_file={REPO}/gin/single.gin",
            "--gin_bindings=train.total_steps=5",
            "--gin_bindings=train.eval_every_steps=5",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    model_dir = proc.stdout.split("model_dir: ")[1].split()[0]
    assert os.path.exists(os.path.join(tmp_path, model_dir, "ckpt-5.index"))


def test_a_finished_run_leaves_after_its_threads_and_exit_handlers(tmp_path):
    # trainer.main skips the interpreter's teardown once the outcome is out (trainer/cli.py), but not
    # what a normal exit does that a user may rely on: a non-daemon thread is joined, atexit runs.
    (tmp_path / "at_exit.py").write_text(
        textwrap.dedent(f"""
        import atexit, pathlib, threading, time

        def late_write():  # still running when the run returns: it writes after the final checkpoint
            while not pathlib.Path({str(tmp_path / "run" / "ckpt-2.index")!r}).exists():
                time.sleep(0.01)
            time.sleep(1.0)
            pathlib.Path({str(tmp_path / "thread.txt")!r}).write_text("joined")

        threading.Thread(target=late_write).start()
        atexit.register(pathlib.Path({str(tmp_path / "atexit.txt")!r}).write_text, "ran")
    """)
    )
    env = subprocess_env(PYTHONPATH=os.pathsep.join([str(tmp_path), REPO]))
    proc = run_main(
        "--gin_file=gin/single.gin",
        f"--model_dir={tmp_path / 'run'}",
        "--gin_bindings=import at_exit",
        "--gin_bindings=train.total_steps=2",
        "--gin_bindings=train.eval_every_steps=2",
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "thread.txt").read_text() == "joined"
    assert (tmp_path / "atexit.txt").read_text() == "ran"
    assert proc.stdout.rstrip().splitlines()[-1].startswith("eval at step 2:")
    assert os.path.exists(tmp_path / "run" / "ckpt-2.index")


def test_a_gin_include_loop_is_one_error_line_naming_the_loop(tmp_path):
    (tmp_path / "self.gin").write_text(f"include '{tmp_path / 'self.gin'}'\n")
    (tmp_path / "a.gin").write_text(f"include '{REPO}/gin/base.gin'\ninclude '{tmp_path / 'b.gin'}'\n")
    (tmp_path / "b.gin").write_text(f"\n\ninclude '{tmp_path / 'a.gin'}'\n")
    model_dir = tmp_path / "run"
    itself = run_main(f"--gin_file={tmp_path / 'self.gin'}", f"--model_dir={model_dir}", timeout=120)
    _assert_user_error(
        itself.returncode, itself.stderr, f"{tmp_path / 'self.gin'}:1 -> {tmp_path / 'self.gin'}", "remove the include"
    )
    loop = run_main(f"--gin_file={tmp_path / 'a.gin'}", f"--model_dir={model_dir}", timeout=120)
    _assert_user_error(
        loop.returncode, loop.stderr, f"{tmp_path / 'a.gin'}:2 -> {tmp_path / 'b.gin'}:3 -> {tmp_path / 'a.gin'})"
    )
    assert len(itself.stderr.strip().splitlines()) == len(loop.stderr.strip().splitlines()) == 1
    assert "recursion" not in itself.stderr + loop.stderr
    assert not model_dir.exists()


def test_help_prints_the_flags_and_exits_0():
    for module in ("trainer.main", "trainer.launch"):
        for flag in ("--help", "--helpfull"):
            proc = subprocess.run(
                [sys.executable, "-m", module, flag],
                cwd=REPO,
                env=subprocess_env(),
                capture_output=True,
                text=True,
                timeout=120,
            )
            assert proc.returncode == 0, (module, flag, proc.returncode, proc.stderr[-2000:])
            assert "--num_workers" in proc.stdout if module == "trainer.launch" else "--model_dir" in proc.stdout


def test_importing_the_entry_point_changes_nothing():
    # With the flags of an embedded ParameterServer run, `python -m trainer.main` enters a private network
    # namespace and captures fd 2 while TensorFlow loads; `import trainer.main` does neither, nor anything else.
    code = textwrap.dedent("""
        import json, os, sys, threading
        from absl import app, flags, logging  # their own flags, defined by any absl program
        def state():
            fds = [os.readlink(f"/proc/self/fd/{fd}") for fd in (0, 1, 2)] + [len(os.listdir("/proc/self/fd"))]
            return [os.getpid(), os.readlink("/proc/self/ns/net"), dict(os.environ), threading.active_count(), fds,
                    sorted(flags.FLAGS)]
        before = state()
        import trainer.main
        after = state()
        print(json.dumps({"same": before == after, "tf": "tensorflow" in sys.modules, "gin": "gin" in sys.modules,
                          "before": before[1:4:2], "after": after[1:4:2]}))
    """)
    proc = subprocess.run(
        [sys.executable, "-c", code, "--gin_file=gin/ps.gin"],
        cwd=REPO,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["same"], result
    assert not result["tf"] and not result["gin"], result
    assert proc.stderr == ""
