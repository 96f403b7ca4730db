"""MultiWorkerMirrored with real worker processes on localhost: output, parity, preemption, failures."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import portpicker
import pytest
import tensorflow as tf

from tests.support import REPO, launch_workers, read_jsonl, run_main, subprocess_env

pytestmark = pytest.mark.slow  # every test here starts processes or trains for long

QUIET = ["--gin_bindings=train.log_every_steps=50", "--gin_bindings=train.steps_per_loop=25"]


def pids_alive(pids) -> list[int]:
    alive = []
    for pid in pids:
        try:
            os.kill(pid, 0)
            alive.append(pid)
        except ProcessLookupError:
            pass
    return alive


def trainer_pids_for(model_dir: str) -> list[int]:
    """Processes of ours still running for this model_dir (found through /proc)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().decode(errors="replace")
        except OSError:
            continue
        if "trainer." in cmdline and model_dir in cmdline:
            pids.append(int(entry))
    return pids


def worker_pid(model_dir: str, index: int) -> int:
    for pid in trainer_pids_for(model_dir):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(e.split("=", 1) for e in f.read().decode(errors="replace").split("\0") if "=" in e)
        except OSError:
            continue
        if "TF_CONFIG" in env and json.loads(env["TF_CONFIG"])["task"]["index"] == index:
            return pid
    raise AssertionError(f"worker {index} of {model_dir} not found")


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def model_weights(model_dir: str) -> dict[str, np.ndarray]:
    """The trainable weights in the newest checkpoint (the object graph files them under the optimizer)."""
    reader = tf.train.load_checkpoint(model_dir)
    return {
        name: reader.get_tensor(name)
        for name in reader.get_variable_to_shape_map()
        if name.startswith("optimizer/_trainable_variables/")
    }


@pytest.mark.timeout(300)
@pytest.mark.xdist_group("launched_mwms_run")
def test_two_launched_workers_train_and_only_the_chief_writes(launched_mwms_run):
    """The run is tests/conftest.py's (400 steps, its own TMPDIR), shared with tests/test_network.py;
    its stdout holds its stderr too."""
    proc, model_dir, scratch = launched_mwms_run.result, str(launched_mwms_run.model_dir), launched_mwms_run.scratch
    assert proc.returncode == 0, proc.stdout[-6000:]
    assert "[worker 0]" in proc.stdout and "[worker 1]" in proc.stdout
    assert "on 2 replica(s) (2 worker(s))" in proc.stdout
    records = read_jsonl(os.path.join(model_dir, "metrics.jsonl"))
    final = [r for r in records if r["split"] == "eval"][-1]
    assert final["step"] == 400 and final["accuracy"] >= 0.96
    assert len([r for r in records if r["split"] == "train" and r["step"] == 400]) == 1  # one writer
    assert len(os.listdir(os.path.join(model_dir, "train"))) == 1
    assert len([n for n in os.listdir(os.path.join(model_dir, "eval")) if n.startswith("events.")]) == 1
    assert os.path.exists(os.path.join(model_dir, "ckpt-400.index"))
    leftovers = [p for p in (scratch.rglob("*")) if "trainer" in p.name or "workertemp" in p.name]
    leftovers += [p for p in scratch.parent.rglob("*") if "workertemp" in p.name or ".tmp-" in p.name]
    assert not leftovers, leftovers
    assert not trainer_pids_for(model_dir)


# Few steps: Adam turns reduction-order differences (1e-8) into chaos after ~6 steps here
# (1e-2 by step 20, with SGD they stay at 1e-8); a scaling mistake shows at step 1.
AT_THE_SAME_GLOBAL_BATCH = [
    "--gin_bindings=train.total_steps=5",
    "--gin_bindings=train.steps_per_loop=2",
    "--gin_bindings=cnn.l2=0.001",
    "--gin_bindings=train.log_every_steps=1",
]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> str:
    """The one-device run both distribute methods of the two workers must match (one device reads
    the same batches either way)."""
    model_dir = str(tmp_path_factory.mktemp("one_process") / "single")
    single = run_main("--gin_file=gin/single.gin", f"--model_dir={model_dir}", *AT_THE_SAME_GLOBAL_BATCH)
    assert single.returncode == 0, single.stderr[-3000:]
    return model_dir


@pytest.mark.timeout(400)
@pytest.mark.xdist_group("one_process")
@pytest.mark.parametrize("method", ["dataset", "function"])
def test_two_workers_match_one_process_at_the_same_global_batch(one_process, tmp_path, method):
    multi_dir = str(tmp_path / "multi")
    method_binding = f"--gin_bindings=train.distribute_method='{method}'"
    launch_workers("--gin_file=gin/mwms.gin", f"--model_dir={multi_dir}", *AT_THE_SAME_GLOBAL_BATCH, method_binding)
    expected, got = model_weights(one_process), model_weights(multi_dir)
    assert expected.keys() == got.keys() and len(expected) == 16
    for name in expected:
        np.testing.assert_allclose(got[name], expected[name], rtol=0, atol=1e-6, err_msg=name)


@pytest.mark.timeout(400)
def test_sigterm_to_one_worker_saves_on_all_and_the_restart_finishes(tmp_path):
    model_dir = str(tmp_path / "run")
    args = [
        "--num_workers=2",
        "--max_restarts=1",
        "--",
        "--gin_file=gin/mwms.gin",
        f"--model_dir={model_dir}",
        "--gin_bindings=train.total_steps=500",
        "--gin_bindings=train.checkpoint_every_steps=400",
        "--gin_bindings=train.eval_every_steps=1000",
        *QUIET,
    ]
    launcher = subprocess.Popen(
        [sys.executable, "-m", "trainer.launch", *args],
        cwd=REPO,
        env=subprocess_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        metrics = os.path.join(model_dir, "metrics.jsonl")
        wait_for(lambda: os.path.exists(metrics) and read_jsonl(metrics), 150, "the first train record")
        os.kill(worker_pid(model_dir, 1), signal.SIGTERM)
        output, _ = launcher.communicate(timeout=240)
    finally:
        launcher.kill()
    assert launcher.returncode == 0, output[-4000:]
    saved = {line.split("saved ckpt-")[1].split(";")[0] for line in output.splitlines() if "preempted: saved" in line}
    assert len(saved) == 1, output[-4000:]
    saved_step = int(saved.pop())
    assert output.count("preempted: saved") == 2  # both workers took part
    assert "restarting group (1/1)" in output
    assert f"continuing from step {saved_step}" in output
    train_steps = [r["step"] for r in read_jsonl(os.path.join(model_dir, "metrics.jsonl")) if r["split"] == "train"]
    assert train_steps == sorted(set(train_steps)), "a step was trained (and logged) twice"
    assert train_steps[-1] == 500 and 0 < saved_step < 500
    assert not trainer_pids_for(model_dir)


@pytest.mark.timeout(500)
def test_a_killed_worker_makes_its_peer_fail_with_the_step_and_the_launcher_exit(tmp_path):
    model_dir = str(tmp_path / "run")
    cluster = {"worker": [f"localhost:{portpicker.pick_unused_port()}" for _ in range(2)]}
    flags = [
        "-m",
        "trainer.main",
        "--gin_file=gin/mwms.gin",
        f"--model_dir={model_dir}",
        "--gin_bindings=train.total_steps=100000",
        "--gin_bindings=train.collective_timeout_secs=20.0",
        *QUIET,
    ]
    workers = []
    for index in range(2):
        env = subprocess_env(TF_CONFIG=json.dumps({"cluster": cluster, "task": {"type": "worker", "index": index}}))
        workers.append(
            subprocess.Popen(
                [sys.executable, *flags], cwd=REPO, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE
            )
        )
    try:
        metrics = os.path.join(model_dir, "metrics.jsonl")
        wait_for(lambda: os.path.exists(metrics) and read_jsonl(metrics), 150, "the first train record")
        workers[1].kill()
        _, stderr = workers[0].communicate(timeout=120)  # it fails by the 20 s collective timeout at the latest
    finally:
        for w in workers:
            w.kill()
            w.wait()
    assert workers[0].returncode == 1
    last = stderr.strip().splitlines()[-1]
    # The peer's loss surfaces in a step's collective or in the worker watch's one at a log interval.
    assert re.match(r"error: training failed (in steps \d+-\d+|at step \d+) ", last) and "peer" in last, last

    launched_dir = str(tmp_path / "launched")
    launcher = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "trainer.launch",
            "--num_workers=2",
            "--",
            *flags[2:3],
            f"--model_dir={launched_dir}",
            "--gin_bindings=train.total_steps=100000",
            *QUIET,
        ],
        cwd=REPO,
        env=subprocess_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        metrics = os.path.join(launched_dir, "metrics.jsonl")
        wait_for(lambda: os.path.exists(metrics) and read_jsonl(metrics), 150, "the first train record")
        pids = trainer_pids_for(launched_dir)
        os.kill(worker_pid(launched_dir, 1), signal.SIGKILL)
        assert launcher.wait(timeout=60) != 0
    finally:
        launcher.kill()
        launcher.wait()
    wait_for(lambda: not pids_alive(pids), 15, "the workers to end")


@pytest.mark.timeout(200)
@pytest.mark.parametrize(
    "tf_config,needle",
    [
        ('{"cluster": {"worker": ["localhost:1"]', "not valid JSON"),
        ('{"cluster": {"worker": ["localhost:1", "localhost:2"]}}', "task"),
        (
            '{"cluster": {"worker": ["localhost:1", "localhost:2"]}, "task": {"type": "worker", "index": 2}}',
            "task.index",
        ),
        ('{"cluster": {"worker": ["localhost:1"], "ps": ["localhost:2"]}, "task": {"type": "ps", "index": 0}}', "ps"),
        (
            '{"cluster": {"worker": ["localhost:1", "localhost:1"]}, "task": {"type": "worker", "index": 0}}',
            "localhost:1",
        ),
    ],
)
def test_bad_tf_config_exits_2_with_one_line_quickly(tmp_path, tf_config, needle):
    proc = run_main(  # without waiting for a cluster (that would outlast the timeout)
        "--gin_file=gin/mwms.gin",
        f"--model_dir={tmp_path / 'run'}",
        timeout=120,
        env=subprocess_env(TF_CONFIG=tf_config),
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: TF_CONFIG") and needle in last, last
    assert "Traceback" not in proc.stderr
    assert not os.path.exists(tmp_path / "run")


@pytest.mark.timeout(200)
def test_two_slurm_tasks_find_each_other_without_tf_config(tmp_path):
    """srun sets these variables per task; TensorFlow's SlurmClusterResolver builds the cluster."""
    model_dir = str(tmp_path / "run")
    port_base = portpicker.pick_unused_port()
    slurm = {
        "SLURM_JOB_ID": "7",
        "SLURM_STEP_NUM_TASKS": "2",
        "SLURM_STEP_NODELIST": "localhost",
        "SLURM_STEP_TASKS_PER_NODE": "2",
    }
    flags = [
        "-m",
        "trainer.main",
        "--gin_file=gin/mwms.gin",
        f"--model_dir={model_dir}",
        "--gin_bindings=train.cluster_resolver='slurm'",
        f"--gin_bindings=train.cluster_resolver_options={{'port_base': {port_base}}}",
        "--gin_bindings=train.total_steps=20",
        *QUIET,
    ]
    tasks = [
        subprocess.Popen(
            [sys.executable, *flags],
            cwd=REPO,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=subprocess_env(SLURM_PROCID=str(i), **slurm),
        )
        for i in range(2)
    ]
    try:
        outputs = [t.communicate(timeout=150)[0] for t in tasks]
    finally:
        for t in tasks:
            t.kill()
            t.wait()
    assert [t.returncode for t in tasks] == [0, 0], outputs[0][-2000:] + outputs[1][-2000:]
    assert all("on 2 replica(s) (2 worker(s))" in out for out in outputs)
    assert "eval at step 20" in outputs[0] and "eval at step 20" not in outputs[1]  # task 0 is the chief
    assert os.path.exists(os.path.join(model_dir, "ckpt-20.index"))
