"""The tf.data service as the train input (trainer/data/service.py): real dispatcher and data workers,
real parameter-server and MultiWorkerMirrored processes, the example ids each run trained on counted
in a checkpointed variable (tests/id_counting.py). Every run checks that no server is left running."""

from __future__ import annotations

import numpy as np
import pytest

from tests import id_counting
from tests.id_counting import COUNTING_RUN
from tests.support import REPO, launch_workers, refused_run, run_main, run_module, subprocess_env
from tests.test_ps import assert_all_gone, server_pids
from trainer.data import service
from trainer.distribution import early_isolation, local_cluster
from trainer.errors import UserError
from trainer.run.settings import Settings

COUNTING = [
    *COUNTING_RUN,
    "--gin_bindings=train.total_steps = 32",  # 256 examples: half of a pass over the 512 ids
    "--gin_bindings=train.steps_per_loop = 16",
    "--gin_bindings=train.checkpoint_every_steps = 16",
    "--gin_bindings=train.eval_every_steps = 32",
    "--gin_bindings=train.data_service = 'local'",
    "--gin_bindings=data_service.shuffle_buffer = 16",
]
SERVICE = ("dispatcher 0", "data_worker 0", "data_worker 1")


def assert_every_id_at_most_once(model_dir) -> None:
    seen = id_counting.seen(str(model_dir))
    assert seen.sum() == 256 and seen.max() == 1, np.bincount(seen)  # 256 distinct examples of the pass


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_parameter_server_workers_share_one_pass_over_the_data(tmp_path):
    """Must-show 1 and 2: the embedded cluster (1 ps, 2 workers) with a local service of 2 data workers
    in 'distributed_epoch' mode; the two workers' 256 examples are 256 distinct ids (each worker
    reading its own shuffled copy, as without the service, repeats about a sixteenth of them)."""
    model_dir = tmp_path / "run"
    proc = run_main("--gin_file=gin/ps.gin", *COUNTING, f"--model_dir={model_dir}", timeout=380)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "strategy 'parameter_server' on 1 replica(s) (2 worker(s))" in proc.stdout
    assert_every_id_at_most_once(model_dir)
    pids = server_pids(proc.stderr)
    assert sorted(name.rsplit(" pid", 1)[0] for name in pids) == sorted(["ps 0", "worker 0", "worker 1", *SERVICE])
    for name in SERVICE:
        assert f"[{name}] server {name} stopped" in proc.stderr
    assert_all_gone(pids)  # their ports were in the run's private network namespace, gone with them


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_multi_worker_mirrored_under_the_launcher_reads_from_one_service(tmp_path):
    """trainer.launch reads the config's 'local' service and starts a dispatcher and 2 data workers
    beside the 2 workers, which share one pass."""
    model_dir = tmp_path / "run"
    proc = launch_workers("--gin_file=gin/mwms.gin", *COUNTING, f"--model_dir={model_dir}", timeout=380)
    assert_every_id_at_most_once(model_dir)
    pids = server_pids(proc.stdout)
    assert sorted(name.rsplit(" pid", 1)[0] for name in pids) == sorted(SERVICE)
    assert_all_gone(pids)


def test_settings_refuse_what_cannot_work_in_one_line(monkeypatch):
    with pytest.raises(UserError, match="data_service.processing_mode .*'distributed_epoch', 'parallel_epochs'"):
        service.DataServiceConfig(processing_mode="off")
    with pytest.raises(UserError, match="must be 'local' or 'grpc://host:port'"):
        Settings(data_service="localhost:5050")
    with pytest.raises(UserError, match="train.data_service is not supported with tpu"):
        Settings(strategy="tpu", data_service="local")
    assert Settings(data_service="grpc://dispatcher:5050").data_service.processing_mode == "distributed_epoch"
    # 'local' under a cluster this program did not start (TF_CONFIG given, no launcher) names the fix.
    monkeypatch.delenv(local_cluster.ADDRESS_ENV, raising=False)
    with pytest.raises(UserError, match="run a dispatcher .* 'grpc://host:port'"):
        service.dispatcher_address(service.DataServiceConfig())
    monkeypatch.setenv(local_cluster.ADDRESS_ENV, "grpc://localhost:5050")
    assert service.dispatcher_address(service.DataServiceConfig()) == "grpc://localhost:5050"


def test_entry_points_find_a_local_service_in_the_gin_text(tmp_path):
    config = tmp_path / "service.gin"
    config.write_text("include 'gin/single.gin'\ntrain.data_service = 'local'  # beside the run\n")
    assert early_isolation.local_data_workers([f"--gin_file={config}"]) == 2
    argv = [f"--gin_file={config}", "--gin_bindings=data_service.num_workers = 3"]
    assert early_isolation.local_data_workers(argv) == 3
    assert early_isolation.local_data_workers([*argv, "--gin_bindings=train.data_service = 'grpc://d:1'"]) == 0
    assert local_cluster.build_service_cluster(2, lambda n: list(range(7000, 7000 + n))) == {
        "dispatcher": ["localhost:7000"],
        "data_worker": ["localhost:7001", "localhost:7002"],
    }


@pytest.mark.slow
@pytest.mark.timeout(200)
@pytest.mark.parametrize("config", ["gin/single.gin", "gin/ps.gin"])
def test_a_pipeline_that_calls_python_is_one_line_before_the_service_reads_it(tmp_path, config):
    """The service's data workers are other processes: a from_generator source cannot run there (TensorFlow
    says only that a callback key is missing, at the first batch). Under parameter servers the pipeline is
    built inside each worker's dataset function, so the check runs before it, eagerly."""
    line = refused_run(
        tmp_path,
        f"--gin_file={config}",
        "--gin_bindings=import tests.broken_functions",
        "--gin_bindings=train.input_fn=@generator_input",
        "--gin_bindings=cnn.num_classes=10",
        "--gin_bindings=train.data_service='local'",
    )
    assert line.startswith(
        "error: train.data_service: the train dataset of train.input_fn tests.broken_functions.generator_input "
        "calls Python (PyFunc: tf.data.Dataset.from_generator"
    ) and line.endswith("or leave train.data_service unset"), line


def test_server_runs_dispatcher_and_data_worker_tasks_and_checks_their_cluster():
    env = subprocess_env(
        TF_CONFIG='{"cluster": {"data_worker": ["localhost:1"]}, "task": {"type": "data_worker", "index": 0}}'
    )
    proc = run_module("trainer.server", env=env, timeout=60)
    assert proc.returncode == 2 and "needs exactly one 'dispatcher' task" in proc.stderr.strip().splitlines()[-1]


def test_a_local_service_alone_starts_a_dispatcher_and_its_data_workers_and_ends_them(monkeypatch):
    """LocalCluster without parameter-server tasks (a one-process run), with stand-in servers
    (tests/fake_server.py): the service's own cluster and its address, every process ended."""
    from tests.test_ps import _ended

    monkeypatch.chdir(REPO)
    printed: list[str] = []
    with local_cluster.LocalCluster(
        None, data_workers=2, print_fn=printed.append, server_module="tests.fake_server"
    ) as cluster:
        pids = cluster.pids
        assert sorted(pids) == sorted(SERVICE) and cluster.cluster == {}
        assert cluster.service_address == f"grpc://{cluster.service_cluster['dispatcher'][0]}"
    assert printed[-1].endswith("; this process is the trainer") and "dispatcher 0 pid" in printed[-1]
    assert _ended(pids.values())
