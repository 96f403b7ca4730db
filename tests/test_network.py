"""Local clusters are closed to the network (docs/design.md, rule 12), seen from the host.

A real embedded ParameterServer run and a real 2-worker `trainer.launch` run: while they
train, the listening TCP sockets of every process of the run are sampled from /proc. In the
host's network namespace (this test's) there must be none; in the run's own namespace the
servers do listen (so the samples were taken while the cluster was up). Each run has a
hard timeout, and every process it started is killed in a `finally`.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.listening import Sampler, run_sampled
from tests.support import REPO, subprocess_env
from trainer.distribution import netns

pytestmark = pytest.mark.slow  # every test here starts processes or trains for long

_WHY_NOT = netns.can_enter()
needs_namespaces = pytest.mark.skipif(_WHY_NOT is not None, reason=f"no private network namespace: {_WHY_NOT}")


def assert_closed(result: subprocess.CompletedProcess, sampler: Sampler, model_dir: Path) -> None:
    assert result.returncode == 0, result.stdout[-4000:]
    assert "Traceback" not in result.stdout and "warning:" not in result.stdout, result.stdout[-4000:]
    assert sampler.in_run_namespace, "no server of the run was seen listening"
    assert not sampler.on_host, f"listening in the host's network namespace: {sampler.on_host}"
    assert os.readlink("/proc/self/ns/net") not in sampler.listening_namespaces
    # The files keep the invoking user's ownership (the user namespace maps it onto itself).
    assert (model_dir / "metrics.jsonl").stat().st_uid == os.getuid()


@needs_namespaces
@pytest.mark.xdist_group("embedded_ps_run")
def test_embedded_ps_cluster_listens_only_in_its_own_namespace(embedded_ps_run):
    # The run is tests/conftest.py's (600 steps, the sidecar beside it), shared with tests/test_ps.py.
    assert_closed(embedded_ps_run.result, embedded_ps_run.sampler, embedded_ps_run.model_dir)
    assert "local cluster: ps 0 pid" in embedded_ps_run.result.stdout
    assert "step 600/600" in embedded_ps_run.result.stdout
    assert len(embedded_ps_run.sampler.in_run_namespace) >= 4, (
        embedded_ps_run.sampler.in_run_namespace
    )  # chief, ps, 2 workers


@needs_namespaces
def test_a_ps_run_its_flags_do_not_reveal_is_reexecuted_into_the_namespace(tmp_path):
    # trainer.main's first-line check reads --gin_file and --gin_bindings, not an absl
    # --flagfile: the process has loaded TensorFlow when it learns it coordinates an
    # embedded cluster, so it re-executes itself (same pid, same flags) into the namespace.
    flagfile = tmp_path / "ps.flags"
    flagfile.write_text("--gin_file=gin/ps.gin\n--gin_bindings=train.total_steps=100\n")
    model_dir = tmp_path / "ps"
    result, sampler = run_sampled(
        [
            sys.executable,
            "-m",
            "trainer.main",
            f"--flagfile={flagfile}",
            f"--model_dir={model_dir}",
        ]
    )
    assert_closed(result, sampler, model_dir)
    assert result.stdout.count("local cluster: ps 0 pid") == 1


@needs_namespaces
@pytest.mark.xdist_group("launched_mwms_run")
def test_launched_workers_listen_only_in_their_own_namespace(launched_mwms_run):
    # The run is tests/conftest.py's (400 steps), shared with tests/test_multiworker.py.
    assert_closed(launched_mwms_run.result, launched_mwms_run.sampler, launched_mwms_run.model_dir)
    assert "finished at step 400/400" in launched_mwms_run.result.stdout
    assert len(launched_mwms_run.sampler.in_run_namespace) >= 2, (
        launched_mwms_run.sampler.in_run_namespace
    )  # one server per worker


def test_a_process_that_cannot_enter_warns_once_and_goes_on():
    # A process that already runs a thread cannot enter a user namespace: the fallback path.
    code = textwrap.dedent("""
        import threading, time
        from trainer.distribution import netns
        threading.Thread(target=time.sleep, args=(5,), daemon=True).start()
        print(netns.isolate("the test cluster"), netns.isolate("the test cluster"))
    """)
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["False", "False"]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("warning: the test cluster is reachable from the network"), lines
    assert "threads" in lines[0] and "firewall" in lines[0]
