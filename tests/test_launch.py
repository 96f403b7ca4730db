"""trainer.launch: real processes (tests/fake_worker.py), and none left behind in any path."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import pytest

from trainer import launch

ROOT = Path(__file__).resolve().parents[1]
FAKE = ["--module=tests.fake_worker", "--server_module=tests.fake_worker", "--grace_secs=2"]


def launcher_command(flags: list[str], passthrough: list[str], pid_dir: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "trainer.launch",
        *flags,
        *FAKE,
        "--",
        f"--pid_dir={pid_dir}",
        "--wait_for_cluster",
        *passthrough,
    ]


def launcher_env(pid_dir: Path) -> dict[str, str]:
    env = {**os.environ, "FAKE_WORKER_PID_DIR": str(pid_dir)}  # for servers, which get no flags
    env.pop("TF_CONFIG", None)
    return env


def run_launcher(flags: list[str], passthrough: list[str], pid_dir: Path):
    return subprocess.run(
        launcher_command(flags, passthrough, pid_dir),
        cwd=ROOT,
        env=launcher_env(pid_dir),
        capture_output=True,
        text=True,
        timeout=60,
    )


def launcher_acting_once_started(
    flags: list[str], passthrough: list[str], pid_dir: Path, tasks: int, act: Callable[[subprocess.Popen], None]
) -> tuple[int, str]:
    """Starts the launcher, calls `act(launcher)` once `tasks` fake tasks have started, and returns (its
    exit code, its stderr); the launcher is killed if it has not ended 30 s later."""
    process = subprocess.Popen(
        launcher_command(flags, passthrough, pid_dir),
        cwd=ROOT,
        env=launcher_env(pid_dir),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120  # a hard bound only: the tasks start in a second or two
        while len(started_pids(pid_dir)) < tasks:
            assert process.poll() is None and time.monotonic() < deadline, f"{tasks} tasks did not start"
            time.sleep(0.05)
        act(process)
        _, stderr = process.communicate(timeout=30)
    finally:
        process.kill()
        process.wait()
    return process.returncode, stderr


def started_pids(pid_dir: Path) -> dict[int, str]:
    """pid -> 'type:index' of every fake task that started."""
    return {int(path.name[len("pid-") :]): path.read_text() for path in pid_dir.glob("pid-*")}


def assert_none_alive(pid_dir: Path) -> None:
    pids = started_pids(pid_dir)
    assert pids, "no fake task started"
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def reported_configs(stdout: str) -> dict[str, dict]:
    """'worker 0' -> the TF_CONFIG that task printed, read from its prefixed line."""
    found = re.findall(r"^\[(\w+ \d+)\] task=\S+ port=\d+ tf_config=(.*)$", stdout, re.M)
    return {name: json.loads(config) for name, config in found}


def test_two_workers_succeed_with_consistent_tf_configs(tmp_path):
    result = run_launcher(["--num_workers=2"], ["--sleep=0.2"], tmp_path)
    assert result.returncode == 0, result.stderr
    configs = reported_configs(result.stdout)
    assert set(configs) == {"worker 0", "worker 1"}
    assert configs["worker 0"]["cluster"] == configs["worker 1"]["cluster"]
    addresses = configs["worker 0"]["cluster"]["worker"]
    assert len(set(addresses)) == 2
    assert [configs[f"worker {i}"]["task"] for i in range(2)] == [
        {"type": "worker", "index": 0},
        {"type": "worker", "index": 1},
    ]
    assert_none_alive(tmp_path)


def test_a_failing_worker_ends_the_group_with_its_code(tmp_path):
    # worker 0 would sleep 600 s: the launcher ends it rather than waiting (run_launcher's timeout is 60 s)
    result = run_launcher(["--num_workers=2"], ["--sleep=600", "--fail_task=worker:1", "--exit_code=3"], tmp_path)
    assert result.returncode == 3
    assert "worker 1 exited with code 3" in result.stderr
    assert sorted(started_pids(tmp_path).values()) == ["worker:0", "worker:1"]
    assert_none_alive(tmp_path)


def test_tasks_that_ignore_sigterm_are_killed_with_what_they_started(tmp_path):
    start = time.monotonic()
    result = run_launcher(
        ["--num_workers=2"], ["--sleep=60", "--fail_task=worker:1", "--ignore_sigterm", "--grandchild"], tmp_path
    )
    assert result.returncode == 1
    assert time.monotonic() - start >= 2  # --grace_secs=2 before SIGKILL
    assert_none_alive(tmp_path)
    grandchildren = [int(path.name.split("-")[1]) for path in tmp_path.glob("grandchild-*")]
    assert len(grandchildren) == 2
    assert not any(is_running(pid) for pid in grandchildren)


def is_running(pid: int) -> bool:
    """False once gone, or a zombie: an orphan is reaped by init, not by the launcher."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.parametrize("signum, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_to_the_launcher_reaches_every_task(tmp_path, signum, code):
    returncode, stderr = launcher_acting_once_started(
        ["--num_workers=2"], ["--sleep=60"], tmp_path, 2, lambda launcher: launcher.send_signal(signum)
    )
    assert returncode == code, stderr
    assert_none_alive(tmp_path)


def test_restart_after_a_failure_on_the_first_attempt(tmp_path):
    result = run_launcher(
        ["--num_workers=2", "--max_restarts=1"], ["--fail_task=worker:1", "--fail_once", "--exit_code=42"], tmp_path
    )
    assert result.returncode == 0, result.stderr
    assert "restarting group (1/1)" in result.stderr
    assert len(started_pids(tmp_path)) == 4
    assert_none_alive(tmp_path)


def test_restarts_run_out(tmp_path):
    result = run_launcher(["--num_workers=1", "--max_restarts=1"], ["--fail_task=worker:0", "--exit_code=42"], tmp_path)
    assert result.returncode == 42
    assert result.stderr.count("restarting group") == 1
    assert_none_alive(tmp_path)


def test_a_user_mistake_is_not_restarted(tmp_path):
    result = run_launcher(["--num_workers=1", "--max_restarts=2"], ["--fail_task=worker:0", "--exit_code=2"], tmp_path)
    assert result.returncode == 2
    assert "restarting" not in result.stderr
    assert_none_alive(tmp_path)


def test_parameter_server_mode_ends_the_servers_when_the_chief_is_done(tmp_path):
    result = run_launcher(["--num_workers=2", "--num_ps=1"], [], tmp_path)
    assert result.returncode == 0, result.stderr
    configs = reported_configs(result.stdout)
    assert set(configs) == {"chief 0", "worker 0", "worker 1", "ps 0"}
    spec = configs["chief 0"]["cluster"]
    assert {name: len(addresses) for name, addresses in spec.items()} == {"chief": 1, "worker": 2, "ps": 1}
    assert all(config["cluster"] == spec for config in configs.values())
    assert "chief done; stopping the servers" in result.stderr
    assert sorted(started_pids(tmp_path).values()) == ["chief:0", "ps:0", "worker:0", "worker:1"]
    assert_none_alive(tmp_path)


def test_a_server_stopped_while_the_chief_runs_restarts_the_group(tmp_path):
    """A ps-mode worker stopped by SIGTERM exits 0; the chief would wait on it, so the group restarts."""

    def stop_worker_1(_) -> None:
        os.kill(next(pid for pid, task in started_pids(tmp_path).items() if task == "worker:1"), signal.SIGTERM)

    flags = ["--num_workers=2", "--num_ps=1", "--max_restarts=1"]
    returncode, stderr = launcher_acting_once_started(flags, ["--sleep=3"], tmp_path, 4, stop_worker_1)
    assert returncode == 0, stderr
    assert "worker 1 stopped while the chief runs; stopping the other tasks" in stderr
    assert "restarting group (1/1)" in stderr and len(started_pids(tmp_path)) == 8
    assert_none_alive(tmp_path)


@pytest.mark.parametrize(
    "flags, expected",
    [
        (["--num_workers=0"], "--num_workers must be at least 1, got 0"),
        ([], "--num_workers must have a value"),
        (["--num_workers=two"], "--num_workers=two"),
        (["--num_workers=1", "--num_ps=-1"], "--num_ps must be 0 or more"),
        (["--num_workers=1", "stray"], "put the module's flags after --"),
        (
            ["--num_workers=2", "--gin_file=gin/mwms.gin"],
            "--gin_file is not a flag of trainer.launch; the flags of the module it runs (--module, default "
            "trainer.main: --gin_file, --gin_bindings, --model_dir, ...) go after `--`",
        ),
    ],
)
def test_bad_launcher_flags_exit_2_with_one_line(flags, expected):
    result = subprocess.run(
        [sys.executable, "-m", "trainer.launch", *flags], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2
    assert len(result.stderr.splitlines()) == 1 and expected in result.stderr
    assert result.stderr.startswith("error: "), result.stderr  # as every other refusal
    assert result.stdout == ""


def ports_from_5000(count: int) -> list[int]:
    return list(range(5000, 5000 + count))


def test_cluster_layouts():
    ports = ports_from_5000
    assert launch.build_cluster(2, 0, ports) == {"worker": ["localhost:5000", "localhost:5001"]}
    assert launch.build_cluster(1, 2, ports) == {
        "chief": ["localhost:5000"],
        "worker": ["localhost:5001"],
        "ps": ["localhost:5002", "localhost:5003"],
    }


def test_in_ps_mode_only_the_chief_runs_the_module():
    options = launch.Options(module="m", server_module="s", grace_secs=1)
    ps_cluster = {"chief": ["a:1"], "worker": ["a:2"], "ps": ["a:3"]}
    assert launch.command_for(ps_cluster, "chief", ["--x"], options)[1:] == ["-m", "m", "--x"]
    assert launch.command_for(ps_cluster, "ps", ["--x"], options)[1:] == ["-m", "s"]
    assert launch.command_for(ps_cluster, "worker", ["--x"], options)[1:] == ["-m", "s"]
    assert launch.command_for({"worker": ["a:1"]}, "worker", ["--x"], options)[1:] == ["-m", "m", "--x"]
