"""The worker watch: every worker's step time and memory per log interval in metrics.jsonl and
TensorBoard, one warning for a straggler, a collective timeout naming who did not arrive, and the
profiler on every worker; under MultiWorkerMirrored and parameter servers."""

from __future__ import annotations

import os
import signal
import threading

import pytest
import tensorflow as tf

from tests.support import Main, read_jsonl, run_module, subprocess_env
from tests.test_multiworker import trainer_pids_for

SMALL = ["--gin_bindings=train.model_fn=@mlp", "--gin_bindings=train.log_every_steps=10"]


def workers_records(model_dir) -> list[dict]:
    return [r for r in read_jsonl(os.path.join(model_dir, "metrics.jsonl")) if r["split"] == "workers"]


def event_tags(directory) -> set[str]:
    return {
        value.tag
        for name in os.listdir(directory)
        for event in tf.compat.v1.train.summary_iterator(os.path.join(directory, name))
        for value in event.summary.value
    }


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_mwms_workers_one_slowed_then_stuck(tmp_path):
    """Worker 1 burns 30 ms of CPU a step (tests/slow_steps.py), then after step 60 stops answering."""
    from trainer.extensions.profiler import trace_files

    model_dir = tmp_path / "run"
    proc = run_module(
        "trainer.launch",
        "--num_workers=2",
        "--",
        "--gin_file=gin/mwms.gin",
        f"--model_dir={model_dir}",
        "--gin_bindings=import tests.slow_steps",
        "--gin_bindings=train.step_fn=@slow_on_one_task_step",
        "--gin_bindings=train.total_steps=80",
        "--gin_bindings=train.steps_per_loop=10",
        "--gin_bindings=train.collective_timeout_secs=8.0",
        "--gin_bindings=train.extensions=[@profiler_hook(), @HangOnSlowTask()]",
        "--gin_bindings=profiler_hook.steps=(20, 30)",
        "--gin_bindings=profiler_hook.all_workers=True",
        "--gin_bindings=HangOnSlowTask.step=60",
        *SMALL,
        env=subprocess_env(SLOW_TASK="1"),
        timeout=240,
    )
    lines = (proc.stdout + proc.stderr).splitlines()
    assert proc.returncode == 1, "\n".join(lines[-40:])

    records = workers_records(model_dir)
    assert [r["step"] for r in records] == [10, 20, 30, 40, 50]  # at 60 worker 1 never came
    for record in records:
        for worker in (0, 1):
            assert record[f"worker/{worker}/step_time_s"] > 0 and record[f"worker/{worker}/rss_mb"] > 100, record
    for record in records[1:]:  # after the first interval, which holds the tracing
        # The all-reduce makes both wait for the slowest; the CPU time tells which one it is.
        assert record["worker/1/cpu_time_s"] > record["worker/0/cpu_time_s"] + 0.02, record
    assert {"worker/0/rss_mb", "worker/1/step_time_s"} <= event_tags(model_dir / "workers")

    warnings = [line for line in lines if "warning: worker" in line]
    assert len(warnings) == 1 and warnings[0].startswith("[worker 0] warning: worker 1 ran "), warnings
    assert "for 2 log intervals in a row, up to step 30" in warnings[0]  # the first interval (tracing) not judged

    error = next(line for line in lines if "error: training failed" in line)
    assert error.startswith("[worker 0] error: training failed at step 60 (DeadlineExceededError: Collective"), error
    assert "not arrived at step 60: worker 1 (still at step 50)" in error and "worker 0" not in error.split("]", 1)[1]

    for task in ("worker0", "worker1"):
        traces = trace_files(str(model_dir), task)
        assert len(traces) == 1 and os.path.getsize(traces[0]) > 10_000, traces
        shown = f"[{task[:-1]} {task[-1]}] profiler: traced steps 21-30 into {model_dir}/profile/{task}/plugins/profile"
        assert any(line.startswith(shown) for line in lines), shown
    assert not trainer_pids_for(str(model_dir))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_parameter_server_workers_report_their_own_closures_and_memory(tmp_path):
    """Once training starts, worker 1's server is stopped 30 ms of every 40 (a busy machine): its closures
    take longer and the warning names it, so closures are told apart by the worker process that ran
    them."""
    from trainer.extensions.profiler import trace_files

    model_dir = tmp_path / "run"
    run = Main(
        "--gin_file=gin/ps.gin",
        f"--model_dir={model_dir}",
        "--gin_bindings=train.model_fn=@mlp",
        "--gin_bindings=train.total_steps=150",
        "--gin_bindings=train.steps_per_loop=50",
        "--gin_bindings=train.log_every_steps=50",
        "--gin_bindings=train.extensions=[@profiler_hook()]",
        "--gin_bindings=profiler_hook.steps=(50, 100)",
        "--gin_bindings=profiler_hook.all_workers=True",
    )
    done = threading.Event()
    try:
        pid = int(run.wait_for(r"worker 1 pid (\d+)", 150).group(1))
        run.wait_for(r"^training ", 150)

        def throttle() -> None:
            try:
                while not done.wait(0.01):
                    os.kill(pid, signal.SIGSTOP)
                    done.wait(0.03)
                    os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass

        threading.Thread(target=throttle, daemon=True).start()
        run.wait_for(r"^step 150/150", 200)
        done.set()
        code = run.finish(120)
    finally:
        done.set()
        try:
            os.kill(pid, signal.SIGCONT)
        except (ProcessLookupError, UnboundLocalError):
            pass
        run.kill()
    assert code == 0, run.tail()
    records = workers_records(model_dir)
    assert [r["step"] for r in records] == [50, 100, 150]
    for record in records:
        assert record["worker/0/rss_mb"] > 100 and record["worker/1/rss_mb"] > 100, record
    warnings = [line for line in run.out if "warning: worker" in line]
    assert len(warnings) == 1 and warnings[0].startswith("warning: worker 1 ran "), run.stdout
    assert all(
        r["worker/1/step_time_s"] > r["worker/0/step_time_s"] for r in records[1:] if "worker/1/step_time_s" in r
    )
    # The workers are traced remotely from the window's first step (their gRPC servers answer the profiler).
    for task in ("chief0", "worker0", "worker1"):
        traces = trace_files(str(model_dir), task)
        assert len(traces) == 1 and os.path.getsize(traces[0]) > 10_000, (task, traces)
    assert [line for line in run.out if line.startswith("profiler: traced worker 1 for ")], run.stdout


def test_a_peers_heartbeat_loss_names_it_in_the_one_line():
    from trainer.errors import peer_failure

    # TensorFlow 2.21's text when worker 1 was stopped (SIGSTOP) during a collective of worker 0's.
    error = tf.errors.UnavailableError(
        None,
        None,
        "{{function_node __wrapped__CollectiveReduceV2_device_/job:worker/replica:0/task:0/device:CPU:0}} "
        "Collective ops is aborted by: Error reported from /job:worker/task:1: The following tasks are unhealthy "
        "(stopped sending heartbeats):\n/job:worker/replica:0/task:1\nThe tasks have crashed. Check the task logs "
        "for an earlier error, or scheduler events (e.g. preemption, eviction) to debug further.",
    )
    line = str(peer_failure(error, "in steps 51-75", "a peer task may have died or timed out"))
    assert "; a peer task may have died or timed out; not answering: worker 1; rerun" in line, line


def test_memory_and_process_are_read_by_ops_of_the_process_they_run_in():
    from trainer.extensions.worker_watch import memory_mb, process_id

    with open("/proc/self/status") as f:
        kilobytes = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    assert abs(float(memory_mb()) - kilobytes / 1024) < 50
    assert int(process_id()) == os.getpid()


def test_on_by_default_under_the_multi_worker_strategies_and_its_options_checked():
    from trainer.errors import UserError
    from trainer.extensions.profiler import Profiler
    from trainer.extensions.worker_watch import WorkerWatch, make
    from trainer.run.settings import Settings

    assert make(Settings(strategy="mirrored")) is None
    assert isinstance(make(Settings(strategy="parameter_server", log_every_steps=7)), WorkerWatch)
    assert make(Settings(strategy="multi_worker_mirrored")).every_steps == 100
    for bad in ({"enabled": 1}, {"slow_factor": 0}, {"slow_intervals": 0}):
        with pytest.raises(UserError, match="worker_watch"):
            WorkerWatch(10, **bad)
    with pytest.raises(UserError, match="profiler_hook.all_workers must be True or False"):
        Profiler(all_workers=1)
