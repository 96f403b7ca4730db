"""ParameterServer training with real processes on localhost ports (issue 4, must-show 1-6).

The embedded cluster and the launcher end to end, one worker against one device (bit-exact),
a worker and the ps killed with SIGKILL mid-run, the sidecar evaluator, variable sharding.
Every test checks that no server it started is left running.
"""

from __future__ import annotations

import json
import os
import re
import signal
import textwrap
import time

import numpy as np
import pytest
import tensorflow as tf

from tests.support import REPO, Main, read_jsonl, refused_run, run_main, run_module, subprocess_env
from trainer.distribution import early_isolation, local_cluster

PS = "--gin_file=gin/ps.gin"
SERVER_LINE = re.compile(r"server (\w+) (\d+) \(pid (\d+)\) listening at")
RESTARTED = re.compile(r"restarted it as pid (\d+)")


def server_pids(*texts: str) -> dict[str, int]:
    """'worker 1' -> pid of every server that said it was listening (restarted ones too)."""
    pids = {}
    for text in texts:
        for task_type, index, pid in SERVER_LINE.findall(text):
            pids[f"{task_type} {index} pid {pid}"] = int(pid)
    return pids


def assert_all_gone(pids: dict[str, int], grace_secs: float = 5.0) -> None:
    assert pids, "no server pid seen"
    deadline = time.monotonic() + grace_secs
    alive = dict(pids)
    while alive and time.monotonic() < deadline:
        for name, pid in list(alive.items()):
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                del alive[name]
        time.sleep(0.1)
    assert not alive, f"left running: {alive}"


def evals(model_dir) -> tuple[list[dict], list[dict]]:
    """(the chief's inline eval records, the sidecar's); the sidecar's carry num_examples."""
    records = [r for r in read_jsonl(os.path.join(model_dir, "metrics.jsonl")) if r["split"] == "eval"]
    return [r for r in records if "num_examples" not in r], [r for r in records if "num_examples" in r]


def assert_one_line_error(stderr: str, *needles: str) -> str:
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("error: "), stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    for needle in needles:
        assert needle in last, last
    return last


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.xdist_group("embedded_ps_run")
def test_embedded_cluster_trains_to_accuracy_and_sidecar_evaluates_each_checkpoint(embedded_ps_run):
    """Must-show 1 (no TF_CONFIG: 1 ps + 2 workers as subprocesses) and 6 (the sidecar). The run is
    tests/conftest.py's, shared with tests/test_network.py; its stdout holds its stderr too."""
    run, model_dir, sidecar = embedded_ps_run.result, embedded_ps_run.model_dir, embedded_ps_run.sidecar
    assert run.returncode == 0, run.stdout[-4000:]
    assert embedded_ps_run.sidecar_code == 0, sidecar.tail()
    print(f"embedded ps run: {embedded_ps_run.seconds:.0f} s")
    assert "local cluster: ps 0 pid" in run.stdout and "strategy 'parameter_server'" in run.stdout
    chief, side = evals(model_dir)
    assert [r["step"] for r in chief] == [200, 400, 600]
    assert chief[-1]["accuracy"] >= 0.95, chief
    train_steps = [r["step"] for r in read_jsonl(model_dir / "metrics.jsonl") if r["split"] == "train"]
    assert train_steps == [100, 200, 300, 400, 500, 600]
    # One sidecar line per checkpoint, in order; it stopped after the one at total_steps.
    assert [r["step"] for r in side] == [200, 400, 600]
    assert all(r["num_examples"] == 359 for r in side)
    assert side[-1]["accuracy"] == pytest.approx(chief[-1]["accuracy"], abs=1e-6)
    assert "reached train.total_steps 600; done" in sidecar.stdout
    # The servers stopped on SIGTERM, cleanly, and nothing is left.
    for name in ("ps 0", "worker 0", "worker 1"):
        assert f"[{name}] server {name} stopped" in run.stdout
    assert_all_gone(server_pids(run.stdout))


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_launcher_runs_chief_workers_and_ps_as_separate_processes(tmp_path):
    """Must-show 2: `trainer.launch --num_workers=2 --num_ps=1 -- --gin_file=gin/ps.gin`."""
    model_dir = tmp_path / "run"
    proc = run_module(
        "trainer.launch", "--num_workers=2", "--num_ps=1", "--", PS, f"--model_dir={model_dir}", timeout=180
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "[chief 0] training Sequential with strategy 'parameter_server'" in proc.stdout
    pids = server_pids(proc.stdout)
    assert sorted(name.rsplit(" pid", 1)[0] for name in pids) == ["ps 0", "worker 0", "worker 1"]
    chief, _ = evals(model_dir)
    assert chief[-1]["step"] == 600 and chief[-1]["accuracy"] >= 0.95, chief
    assert_all_gone(pids)


@pytest.mark.slow
@pytest.mark.timeout(200)
@pytest.mark.xdist_group("single_runs")
def test_one_worker_trains_exactly_like_one_device(trained_single_dir, tmp_path):
    """Must-show 3: with one worker the updates are sequential, so the weights are bit-identical."""
    model_dir = tmp_path / "run"
    proc = run_main(
        PS,
        f"--model_dir={model_dir}",
        "--gin_bindings=local_cluster.num_workers=1",
        "--gin_bindings=train.total_steps=60",
        "--gin_bindings=train.checkpoint_every_steps=30",
        "--gin_bindings=train.eval_every_steps=30",
        "--gin_bindings=train.log_every_steps=20",
        "--gin_bindings=train.steps_per_loop=25",
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    for step in (30, 60):
        ps = tf.train.load_checkpoint(str(model_dir / f"ckpt-{step}"))
        single = tf.train.load_checkpoint(os.path.join(trained_single_dir, f"ckpt-{step}"))
        # Keras 3 model weights are keyed through the optimizer (optimizer/_trainable_variables/i).
        names = set(ps.get_variable_to_shape_map()) - {"_CHECKPOINTABLE_OBJECT_GRAPH"}
        assert names == set(single.get_variable_to_shape_map()) - {"_CHECKPOINTABLE_OBJECT_GRAPH"}
        assert "optimizer/_trainable_variables/0/.ATTRIBUTES/VARIABLE_VALUE" in names
        different = [n for n in names if not np.array_equal(ps.get_tensor(n), single.get_tensor(n))]
        assert not different, f"step {step}: {different}"
    ps_evals, _ = evals(model_dir)
    single_evals, _ = evals(trained_single_dir)
    assert ps_evals == single_evals
    assert_all_gone(server_pids(proc.stderr))


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_worker_killed_mid_run_is_worked_around(tmp_path):
    """Must-show 4: SIGKILL one of two workers (not restarted); the other one finishes the run."""
    model_dir = tmp_path / "run"
    run = Main(PS, f"--model_dir={model_dir}", "--gin_bindings=local_cluster.max_worker_restarts=0")
    try:
        run.wait_for(r"^local cluster: ps 0 pid", timeout=150)
        run.wait_for(r"^step 100/600", timeout=120)
        time.sleep(0.3)  # inside the next loop's closures
        victim = server_pids(run.stderr)
        victim = next(pid for name, pid in victim.items() if name.startswith("worker 1 "))
        os.kill(victim, signal.SIGKILL)
        code = run.finish(timeout=200)
    finally:
        run.kill()
    assert code == 0, run.tail()
    assert "local cluster: worker 1 exited with code -9" in run.stdout
    chief, _ = evals(model_dir)
    assert chief[-1]["step"] == 600 and chief[-1]["accuracy"] >= 0.95, chief
    assert os.path.exists(model_dir / "ckpt-600.index")
    assert_all_gone(server_pids(run.stderr))


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_lost_ps_stops_the_chief_with_one_line_and_a_rerun_continues(tmp_path):
    """Must-show 5: SIGKILL the ps; exit 1 with one line; the same command resumes at the checkpoint."""
    model_dir = tmp_path / "run"
    args = [
        PS,
        f"--model_dir={model_dir}",
        "--gin_bindings=train.total_steps=300",
        "--gin_bindings=train.checkpoint_every_steps=100",
        "--gin_bindings=train.eval_every_steps=300",
        "--gin_bindings=train.log_every_steps=50",
    ]
    run = Main(*args)
    try:
        run.wait_for(r"^local cluster: ps 0 pid", timeout=150)
        deadline = time.monotonic() + 120
        state = model_dir / "checkpoint"
        while not (state.exists() and "ckpt-100" in state.read_text()):
            assert run.proc.poll() is None and time.monotonic() < deadline, run.tail()
            time.sleep(0.05)
        ps = next(pid for name, pid in server_pids(run.stderr).items() if name.startswith("ps 0 "))
        os.kill(ps, signal.SIGKILL)
        code = run.finish(timeout=120)
    finally:
        run.kill()
    assert code == 1, run.tail()
    assert_one_line_error(run.stderr, "lost a parameter server", "rerun the same command")
    assert_all_gone(server_pids(run.stderr))
    killed_at = max(r["step"] for r in read_jsonl(model_dir / "metrics.jsonl"))
    assert killed_at < 300

    rerun = run_main(*args, timeout=180)
    assert rerun.returncode == 0, rerun.stderr[-4000:]
    restored = int(re.search(r"continuing from step (\d+)", rerun.stdout).group(1))
    assert 100 <= restored < 300 and os.path.exists(model_dir / f"ckpt-{restored}.index")
    records = read_jsonl(model_dir / "metrics.jsonl")
    resumed = list(range(restored + 50, 301, 50))  # the rerun's train lines carry on from there
    assert [r["step"] for r in records if r["split"] == "train"][-len(resumed) :] == resumed
    assert [(r["split"], r["step"]) for r in records if r["split"] != "workers"][-1] == ("eval", 300)
    assert os.path.exists(model_dir / "ckpt-300.index")
    assert_all_gone(server_pids(rerun.stderr))


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_tf_module_variables_shard_across_ps_tasks_and_sigterm_ends_the_cluster(tmp_path):
    """Sharding by gin for a tf.Module model; then SIGTERM: exit 143, every server stopped.
    (One cluster start for both, to keep the suite short.)"""
    gin_file = tmp_path / "module.gin"
    gin_file.write_text(
        textwrap.dedent(f"""
        import tests.module_model
        include '{REPO}/gin/ps.gin'
        train.model_fn = @module_mlp
        train.total_steps = 100000
        train.log_every_steps = 50
        train.checkpoint_every_steps = 50
        parameter_server.variable_partitioner = @min_size_partitioner()
        min_size_partitioner.min_shard_bytes = 4096
        min_size_partitioner.max_shards = 2
        local_cluster.num_ps = 2
        local_cluster.num_workers = 1
    """)
    )
    model_dir = tmp_path / "module"
    run = Main(f"--gin_file={gin_file}", f"--model_dir={model_dir}")
    try:
        # w1 (64x64 floats, 16 KiB) is split across both ps tasks; the small ones stay whole.
        run.wait_for(r"variables on /job:ps/task:0, /job:ps/task:1; sharded: w1 in 2$", timeout=150)
        first, second = (
            float(run.wait_for(rf"^step {n}/100000  loss ([\d.]+)", timeout=60).group(1)) for n in (50, 150)
        )
        assert second < first
        run.proc.send_signal(signal.SIGTERM)
        code = run.finish(timeout=60)
    finally:
        run.kill()
    assert code == 128 + signal.SIGTERM, run.tail()
    assert (model_dir / "ckpt-100.index").exists()
    for name in ("ps 0", "ps 1", "worker 0"):
        assert f"[{name}] server {name} stopped" in run.stderr
    assert_all_gone(server_pids(run.stderr))


WIDE_AND_DEEP = """
    import tests.wide_deep_model
    include '{repo}/gin/ps.gin'
    train.model_fn = @wide_and_deep
    train.step_fn = @wide_and_deep_step
    train.eval_step_fn = @wide_and_deep_eval_step
    train.total_steps = 150
    train.log_every_steps = 50
    train.eval_every_steps = 150
    train.checkpoint_every_steps = 150
    parameter_server.variable_partitioner = @min_size_partitioner()
    min_size_partitioner.min_shard_bytes = 4096
    min_size_partitioner.max_shards = 2
    local_cluster.num_ps = 2
    local_cluster.num_workers = 1
"""


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sharded_module_tables_train_beside_a_keras_tower_and_a_sharded_keras_layer_is_refused(tmp_path):
    """Must-show 9: wide and deep under a partitioner, in a dict of models: the tf.Module's table
    (64 pixels x 17 levels x 16 floats, 68 KiB) is split across both ps tasks, the Keras tower's
    variables (at most 1.3 KiB) stay whole, and it trains. A tower wide enough for the partitioner to
    split its kernel (16 x 128 floats, 8 KiB) is refused in one line naming that variable."""
    gin_file = tmp_path / "wide_deep.gin"
    gin_file.write_text(textwrap.dedent(WIDE_AND_DEEP.format(repo=REPO)))
    model_dir = tmp_path / "run"
    proc = run_main(f"--gin_file={gin_file}", f"--model_dir={model_dir}", timeout=280)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "variable placement: 5 variables on /job:ps/task:0, /job:ps/task:1; sharded: table in 2\n" in proc.stdout
    losses = [r["loss"] for r in read_jsonl(model_dir / "metrics.jsonl") if r["split"] == "train"]
    assert len(losses) == 3 and losses[-1] < losses[0] - 0.5, losses
    chief, _ = evals(model_dir)
    assert chief[-1]["step"] == 150 and chief[-1]["accuracy"] > 0.5, chief
    assert_all_gone(server_pids(proc.stderr))

    (tmp_path / "wide").mkdir()
    line = refused_run(tmp_path / "wide", f"--gin_file={gin_file}", "--gin_bindings=wide_and_deep.hidden=128")
    assert line == (
        "error: parameter_server.variable_partitioner sharded tower/dense/kernel (16, 128) of the "
        "Keras model 'tower' (Sequential) into 2 parts, and Keras 3 layers cannot compute with sharded "
        "variables; keep Keras layers' variables whole (a larger min_size_partitioner.min_shard_bytes or "
        "a partitioner that shards only your tf.Module's tables) or hold that variable in a tf.Module"
    )


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_keras_layers_held_by_a_tf_module_are_named_as_the_cause(tmp_path):
    """tf.Module collects only tf.Variables and nested tf.Modules; a Keras 3 layer is neither, so a
    tf.Module of Keras Embedding layers has no trainable variables: the line says so and how to fix it."""
    line = refused_run(
        tmp_path,
        "--gin_file=gin/single.gin",
        "--gin_bindings=import tests.wide_deep_model",
        "--gin_bindings=train.model_fn=@wide_and_deep",
        "--gin_bindings=wide_and_deep.keras_tables=True",
        "--gin_bindings=train.step_fn=@wide_and_deep_step",
        "--gin_bindings=train.eval_step_fn=@wide_and_deep_eval_step",
    )
    assert "model 'tables' of train.model_fn wide_and_deep is a tf.Module holding Keras layers (embeddings[0])" in line
    assert "subclass keras.Layer or keras.Model instead of tf.Module" in line


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_workers_and_ps_tasks_are_refused_by_main_and_servers_check_tf_config(tmp_path):
    cluster = '{"chief": ["localhost:1"], "worker": ["localhost:2"], "ps": ["localhost:3"]}'
    as_worker = run_main(
        PS,
        f"--model_dir={tmp_path / 'w'}",
        env=subprocess_env(TF_CONFIG=f'{{"cluster": {cluster}, "task": {{"type": "worker", "index": 0}}}}'),
    )
    assert as_worker.returncode == 2
    assert_one_line_error(as_worker.stderr, "trainer.server")
    no_config = run_module("trainer.server", timeout=60)
    assert no_config.returncode == 2 and no_config.stderr.strip().startswith("error: trainer.server needs TF_CONFIG")
    as_chief = run_module(
        "trainer.server",
        timeout=60,
        env=subprocess_env(TF_CONFIG=f'{{"cluster": {cluster}, "task": {{"type": "chief", "index": 0}}}}'),
    )
    assert as_chief.returncode == 2 and "runs 'worker' or 'ps' tasks" in as_chief.stderr
    bad = run_module("trainer.server", timeout=60, env=subprocess_env(TF_CONFIG='{"cluster": {"ps": ["nohost"]}}'))
    assert bad.returncode == 2 and "not host:port" in bad.stderr


ONE_NODE_STEP = {"SLURM_STEP_NUM_TASKS": "4", "SLURM_STEP_NODELIST": "localhost", "SLURM_STEP_TASKS_PER_NODE": "4"}
SLURM_JOBS = "{'jobs': {'chief': 1, 'ps': 1, 'worker': 2}, 'gpus_per_node': 0}"


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_ps_run_resolved_from_slurm_starts_no_cluster_of_its_own(tmp_path):
    """The chief of a SLURM job must join the job's tasks: outside an srun step it says what is
    missing instead of training on an embedded cluster in a namespace of its own."""
    slurm = "--gin_bindings=train.cluster_resolver='slurm'"
    run = run_main(PS, f"--model_dir={tmp_path / 'run'}", slurm, timeout=90)
    assert run.returncode == 2
    assert_one_line_error(run.stderr, "slurm resolver chosen but SLURM_PROCID")
    assert "local cluster" not in run.stdout + run.stderr and not os.path.exists(tmp_path / "run")
    assert not early_isolation.expects_embedded_cluster([PS, slurm])
    assert early_isolation.expects_embedded_cluster([PS, slurm, "--gin_bindings=train.cluster_resolver='tf_config'"])
    assert not local_cluster.needs_local_cluster("parameter_server", "slurm")


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_server_resolved_from_slurm_checks_its_flags_and_its_task():
    bad_kind = run_module("trainer.server", "--cluster_resolver=k8s", timeout=60)
    assert bad_kind.returncode == 2
    assert_one_line_error(bad_kind.stderr, "--cluster_resolver", "invalid choice: 'k8s'")
    not_a_dict = run_module("trainer.server", "--cluster_resolver=slurm", "--cluster_resolver_options=[1]", timeout=60)
    assert not_a_dict.returncode == 2
    assert_one_line_error(not_a_dict.stderr, "--cluster_resolver_options='[1]' is not a Python dict")
    outside = run_module("trainer.server", "--cluster_resolver=slurm", timeout=60)
    assert outside.returncode == 2
    assert_one_line_error(outside.stderr, "slurm resolver chosen but SLURM_PROCID")
    as_chief = run_module(
        "trainer.server",
        "--cluster_resolver=slurm",
        f"--cluster_resolver_options={SLURM_JOBS}",
        timeout=60,
        env=subprocess_env(SLURM_PROCID="0", **ONE_NODE_STEP),
    )
    assert as_chief.returncode == 2
    assert_one_line_error(as_chief.stderr, "task.type is 'chief' but trainer.server runs 'worker' or 'ps' tasks")


def test_split_steps_is_exact_and_even():
    from trainer.loops.ps import split_steps

    assert split_steps(50, 13) == [13, 13, 12, 12]
    assert split_steps(7, 50) == [7]
    for n in range(1, 60):
        for size in range(1, 20):
            parts = split_steps(n, size)
            assert sum(parts) == n and max(parts) <= size and max(parts) - min(parts) <= 1


REJECTED = (
    "2 root error(s) found. (0) INTERNAL: Unable to parse request Additional GRPC error information from "
    "remote target /job:worker/replica:0/task:0/device:CPU:0 while calling "
    "/tensorflow.eager.EagerService/RunComponentFunction"
)


class _Result:
    """A RemoteValue's stand-in: the closure's summed outputs, or the error its fetch raises."""

    def __init__(self, steps: int, error: Exception | None):
        self.steps, self.error = steps, error

    def fetch(self):
        if self.error:
            raise self.error
        return {"loss": np.float32(2.0 * self.steps)}, np.zeros(2)  # and the closure's report (worker, seconds)


class _RejectingCoordinator:
    """A ClusterCoordinator's stand-in (Orbit-style in-process fake of the loop's one dependency):
    in each of its first `rejections` rounds the first closure is rejected by a worker's server
    and the others are cancelled, as TF's coordinator does; later rounds succeed."""

    def __init__(self, rejections: int, error: Exception | None = None):
        self.rejections, self.error = rejections, error or tf.errors.InternalError(None, None, REJECTED)
        self.rounds: list[list[tuple[int, int]]] = [[]]  # per round, each closure's (first batch, steps)

    def schedule(self, fn, args):
        first_batch, steps = int(args[1].numpy()), int(args[2].numpy())
        self.rounds[-1].append((first_batch, steps))
        failing = len(self.rounds) <= self.rejections
        first = len(self.rounds[-1]) == 1
        cancelled = tf.errors.CancelledError(None, None, "The corresponding function is cancelled.")
        return _Result(steps, (self.error if first else cancelled) if failing else None)

    def join(self):
        failing = len(self.rounds) <= self.rejections
        self.rounds.append([])
        if failing:
            raise self.error


def _loop(coordinator, printed):
    from trainer.loops.ps import PSTrainLoop

    step = tf.Variable(0, dtype=tf.int64)
    loop = PSTrainLoop(
        tf.distribute.get_strategy(),
        coordinator,
        None,
        None,
        None,
        8,
        [],
        step,
        steps_per_closure=10,
        print_fn=printed.append,
    )
    return loop, step


def test_a_closure_a_worker_rejected_unread_runs_again_with_the_ones_cancelled_with_it():
    printed: list[str] = []
    coordinator = _RejectingCoordinator(rejections=2)
    loop, step = _loop(coordinator, printed)
    assert loop.run(30) == {"loss": 2.0}  # every step counted once
    # Scheduled again on the same global batches: a closure's batches are its arguments, not its worker's.
    assert coordinator.rounds[:3] == [[(0, 10), (10, 10), (20, 10)]] * 3 and int(step.numpy()) == 30
    assert len(printed) == 2 and all(
        line.startswith("warning: a worker's server rejected a closure in steps 1-30") for line in printed
    ), printed


def test_other_closure_errors_and_a_fourth_rejection_still_end_the_call():
    from trainer.loops.ps import MAX_RESCHEDULES

    loop, step = _loop(_RejectingCoordinator(rejections=MAX_RESCHEDULES + 1), [])
    with pytest.raises(tf.errors.InternalError, match="Unable to parse request"):
        loop.run(30)
    other = tf.errors.InternalError(None, None, "a kernel failed on /job:worker/replica:0/task:0")
    loop, step = _loop(_RejectingCoordinator(rejections=1, error=other), [])
    with pytest.raises(tf.errors.InternalError, match="a kernel failed"):
        loop.run(30)
    assert int(step.numpy()) == 0


def _ended(pids) -> bool:
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        return False
    return True


def test_the_embedded_cluster_restarts_a_dead_worker_and_ends_every_server(tmp_path, monkeypatch):
    """LocalCluster with stand-in servers (tests/fake_server.py, no TensorFlow): the chief's
    TF_CONFIG, a worker that dies restarted on its port, every process ended and reaped at the end."""
    monkeypatch.chdir(REPO)
    monkeypatch.setenv("FAKE_SERVER_DIR", str(tmp_path))
    monkeypatch.setenv("FAKE_SERVER_DIES", "worker:1")
    printed: list[str] = []
    config = local_cluster.LocalClusterConfig(num_workers=2, num_ps=1, grace_secs=1, max_worker_restarts=1)
    with local_cluster.LocalCluster(config, print_fn=printed.append, server_module="tests.fake_server") as cluster:
        first = cluster.pids
        assert json.loads(cluster.coordinator_tf_config()) == {
            "cluster": cluster.cluster,
            "task": {"type": "chief", "index": 0},
        }
        assert {kind: len(addresses) for kind, addresses in cluster.cluster.items()} == {
            "chief": 1,
            "worker": 2,
            "ps": 1,
        }
        assert re.fullmatch(
            r"local cluster: ps 0 pid \d+ at localhost:\d+, worker 0 .*; this process is the coordinator \(chief\)",
            printed[0],
        )
        deadline = time.monotonic() + 120  # a hard bound only: the restart takes about a second
        while len(printed) < 2:
            assert time.monotonic() < deadline, printed
            time.sleep(0.05)
        restarted = cluster.pids
        assert printed[1] == (
            f"local cluster: worker 1 exited with code 3; restarted it as pid {restarted['worker 1']} (1/1)"
        ), printed
        assert restarted["worker 1"] != first["worker 1"] and restarted["ps 0"] == first["ps 0"]
    assert _ended([*first.values(), *restarted.values()])


def test_an_embedded_server_that_fails_to_start_ends_the_cluster_with_its_last_lines(tmp_path, monkeypatch):
    from trainer.errors import RunFailure, UserError

    with pytest.raises(UserError, match="local_cluster.num_workers must be a positive integer"):
        local_cluster.LocalCluster(local_cluster.LocalClusterConfig(num_workers=0))
    monkeypatch.chdir(REPO)
    monkeypatch.setenv("FAKE_SERVER_FAILS", "worker:0")
    cluster = local_cluster.LocalCluster(
        local_cluster.LocalClusterConfig(num_workers=1, grace_secs=1), print_fn=print, server_module="tests.fake_server"
    )
    with pytest.raises(RunFailure) as failure:
        with cluster:
            pass
    assert str(failure.value) == ("local cluster: worker 0 exited with code 4 while starting (no such flag --bogus)")
    assert cluster.pids and _ended(cluster.pids.values())


def test_whether_a_run_starts_an_embedded_cluster_is_read_from_its_flags_and_gin_text(tmp_path, monkeypatch):
    """early_isolation reads it before TensorFlow starts threads: the last strategy and resolver of
    the gin files (includes spliced in, comments left out) and bindings; eval modes, print_config
    and a TF_CONFIG start none."""
    monkeypatch.delenv("TF_CONFIG", raising=False)
    mine = tmp_path / "mine.gin"
    mine.write_text("include 'gin/single.gin'\n# train.strategy = 'parameter_server'\n")
    expects = early_isolation.expects_embedded_cluster
    assert expects([PS]) and expects(["--gin_file", "gin/ps.gin", "--mode=train"])
    assert not expects([f"--gin_file={mine}"])
    assert expects([f"--gin_file={mine}", "--gin_bindings=train.strategy = 'parameter_server'"])
    assert not expects([PS, "--gin_bindings=train.strategy='mirrored'"])
    assert not expects([PS, "--mode=eval_continuous"]) and not expects([PS, "--print_config"])
    assert expects([PS, "--print_config=false"])
    monkeypatch.setenv("TF_CONFIG", '{"cluster": {"worker": ["localhost:1"]}}')
    assert not expects([PS]) and not local_cluster.needs_local_cluster("parameter_server")


def test_the_sidecar_evaluates_each_checkpoint_of_a_run_once_in_step_order(tmp_path):
    """The sidecar evaluator (loops/sidecar.py) in process, after a short run of gin/single.gin in
    process: one metrics line per checkpoint, the step restored from it, done at total_steps."""
    import gin

    from trainer import configurables

    gin.clear_config()
    try:
        gin.add_config_file_search_path(REPO)
        bindings = [
            "train.model_fn = @mlp",
            "mlp.hidden = (8,)",
            "train.total_steps = 4",
            "train.steps_per_loop = 2",
            "train.checkpoint_every_steps = 2",
            "train.eval_every_steps = 4",
            "train.log_every_steps = 2",
            "eval_continuous.timeout_secs = 5",
            "eval_continuous.poll_secs = 0.1",
        ]
        gin.parse_config_files_and_bindings(["gin/single.gin"], bindings, finalize_config=False)
        configurables.train(model_dir=str(tmp_path), print_fn=lambda line: None)
        inline = [r for r in read_jsonl(str(tmp_path / "metrics.jsonl")) if r["split"] == "eval"]
        printed: list[str] = []
        results = configurables.evaluate_continuously(model_dir=str(tmp_path), print_fn=printed.append)
    finally:
        gin.clear_config()
    lines = [r for r in read_jsonl(str(tmp_path / "metrics.jsonl")) if "num_examples" in r]
    assert [(r["step"], r["split"]) for r in lines] == [(2, "eval"), (4, "eval")]
    assert lines[-1]["loss"] == pytest.approx(inline[-1]["loss"], rel=1e-5) and results["loss"] == lines[-1]["loss"]
    assert [line.split(":")[0] for line in printed[1:]] == [
        "sidecar eval of ckpt-2 at step 2",
        "sidecar eval of ckpt-4 at step 4",
        "sidecar evaluator",
    ]
    assert printed[-1] == "sidecar evaluator: reached train.total_steps 4; done"
