"""trainer.cluster: every TF_CONFIG mistake is one line naming the field; chief rules; Slurm."""

import json
import os
import subprocess
import sys

import pytest

from trainer.distribution import cluster
from trainer.distribution.cluster import ClusterInfo, parse_tf_config
from trainer.errors import UserError

MWMS = {"chief", "worker"}
PS = {"chief", "worker", "ps", "evaluator"}


def tf_config(cluster_spec: object, task_type: object = "worker", index: object = 0) -> str:
    return json.dumps({"cluster": cluster_spec, "task": {"type": task_type, "index": index}})


TWO_WORKERS = {"worker": ["localhost:2222", "localhost:2223"]}

INVALID = [
    ('{"cluster": ', None, "not valid JSON (Expecting value at line 1 column 13)"),
    ("[1, 2]", None, "top level must be a JSON object, got list"),
    ('{"task": {"type": "worker", "index": 0}}', None, "'cluster' is missing"),
    (tf_config(["localhost:2222"]), None, "cluster must map each task type"),
    (tf_config({"worker": "localhost:2222"}), None, "cluster.worker must be a non-empty list"),
    (tf_config({"worker": []}), None, "cluster.worker must be a non-empty list"),
    (json.dumps({"cluster": TWO_WORKERS}), None, "'task' is missing"),
    (json.dumps({"cluster": TWO_WORKERS, "task": "worker"}), None, "task must be an object"),
    (json.dumps({"cluster": TWO_WORKERS, "task": {"index": 0}}), None, "task.type is None"),
    (tf_config(TWO_WORKERS, "ps"), None, "task.type 'ps' is not in cluster (it has worker)"),
    (
        json.dumps({"cluster": TWO_WORKERS, "task": {"type": "worker"}}),
        None,
        "task.index is missing",
    ),
    (tf_config(TWO_WORKERS, index="1"), None, "task.index must be an integer, got '1'"),
    (tf_config(TWO_WORKERS, index=True), None, "task.index must be an integer, got True"),
    (tf_config(TWO_WORKERS, index=-1), None, "task.index -1 is outside cluster.worker"),
    (tf_config({"worker": ["localhost"]}), None, "cluster.worker[0] is 'localhost', not host:port"),
    (tf_config({"worker": ["a:1", "b:x"]}), None, "cluster.worker[1] is 'b:x', not host:port"),
    (tf_config({"worker": [":2222"]}), None, "cluster.worker[0] is ':2222', not host:port"),
    (tf_config({"worker": ["a:70000"]}), None, "cluster.worker[0] is 'a:70000', not host:port"),
    (tf_config({"worker": [2222]}), None, "cluster.worker[0] is 2222, not host:port"),
    (
        tf_config({"chief": ["a:1"], "worker": ["a:1"]}),
        None,
        "cluster.worker[0] repeats address 'a:1' of cluster.chief[0]",
    ),
    (tf_config({"chief": ["a:1", "b:1"]}, "chief"), None, "cluster.chief has 2 tasks"),
    (
        tf_config({"worker": ["a:1"], "ps": ["b:1"]}),
        MWMS,
        "task type 'ps' cannot be used by this strategy",
    ),
    (tf_config({"worker": ["a:1"]}, "evaluator"), MWMS, "task type 'evaluator' cannot be used"),
    (
        tf_config({"worker": ["a:1"]}, "evaluator", 1),
        PS,
        "task.index 1 is outside cluster.evaluator",
    ),
]


@pytest.mark.parametrize("text, allowed, expected", INVALID)
def test_invalid_tf_config_is_one_line_naming_the_field(text, allowed, expected):
    with pytest.raises(UserError) as raised:
        parse_tf_config(text, allowed_task_types=allowed)
    message = str(raised.value)
    assert message.startswith("TF_CONFIG: ")
    assert expected in message
    assert "\n" not in message


def test_index_outside_cluster_message_names_the_fix():
    with pytest.raises(
        UserError,
        match=r"^TF_CONFIG: task\.index 3 is outside cluster\.worker "
        r"\(2 tasks\); set task\.index to 0\.\.1$",
    ):
        parse_tf_config(tf_config(TWO_WORKERS, index=3))


@pytest.mark.parametrize("text", [None, "", "  \n", "{}"])
def test_no_tf_config_means_one_process_that_is_chief(text):
    info = parse_tf_config(text)
    assert info == ClusterInfo(cluster={}, task_type=None, task_id=0)
    assert info.is_chief and not info.is_distributed
    assert info.task_name == "local"


def test_mwms_with_chief():
    spec = {"chief": ["h0:1"], "worker": ["h1:1", "h2:1"]}
    chief = parse_tf_config(tf_config(spec, "chief"), allowed_task_types=MWMS)
    worker0 = parse_tf_config(tf_config(spec, "worker", 0), allowed_task_types=MWMS)
    assert chief.is_chief and not worker0.is_chief
    assert chief.num_workers == 3 and chief.is_distributed
    assert worker0.cluster == spec and worker0.task_name == "worker0"


def test_mwms_workers_only_worker0_is_chief():
    infos = [parse_tf_config(tf_config(TWO_WORKERS, "worker", i), allowed_task_types=MWMS) for i in range(2)]
    assert [info.is_chief for info in infos] == [True, False]
    assert infos[1].num_workers == 2


def test_parameter_server_cluster_with_unlisted_evaluator():
    spec = {"chief": ["h0:1"], "worker": ["h1:1", "h1:2"], "ps": ["h2:1"]}
    for task_type, index in [("chief", 0), ("worker", 1), ("ps", 0), ("evaluator", 0)]:
        info = parse_tf_config(tf_config(spec, task_type, index), allowed_task_types=PS)
        assert info.num_workers == 2  # the chief coordinates, the 2 workers train
        assert info.is_chief == (task_type == "chief")


def test_cluster_from_env(monkeypatch):
    monkeypatch.setenv("TF_CONFIG", tf_config(TWO_WORKERS, "worker", 1))
    assert cluster.cluster_from_env(MWMS).task_id == 1
    monkeypatch.delenv("TF_CONFIG")
    assert not cluster.cluster_from_env(MWMS).is_distributed


def test_allowed_task_types_and_single_machine_check():
    assert cluster.allowed_task_types_for("multi_worker_mirrored") == MWMS
    assert cluster.allowed_task_types_for("parameter_server") == PS
    assert cluster.allowed_task_types_for("mirrored") == MWMS
    assert cluster.allowed_task_types_for("no_such_strategy") is None
    one = parse_tf_config(tf_config({"worker": ["a:1"]}))
    cluster.check_single_machine(one, "mirrored")
    two = parse_tf_config(tf_config(TWO_WORKERS))
    cluster.check_single_machine(two, "multi_worker_mirrored")
    with pytest.raises(
        UserError,
        match="strategy 'mirrored' runs on one machine but TF_CONFIG "
        "describes 2 workers; use gin/mwms.gin or unset TF_CONFIG",
    ):
        cluster.check_single_machine(two, "mirrored")


def test_checking_tf_config_does_not_import_tensorflow():
    code = (
        "import sys; from trainer.distribution import cluster; cluster.cluster_from_env({'worker'}); "
        "assert 'tensorflow' not in sys.modules"
    )
    env = {**os.environ, "TF_CONFIG": tf_config(TWO_WORKERS)}
    subprocess.run(
        [sys.executable, "-c", code],
        check=True,
        env=env,
        timeout=60,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )


def test_unknown_resolver_kind_lists_the_valid_ones():
    with pytest.raises(UserError, match="unknown cluster_resolver 'k8s'; use one of 'tf_config', 'slurm'"):
        cluster.make_cluster_resolver("k8s")


def test_tf_config_resolver_rejects_slurm_arguments():
    with pytest.raises(UserError, match="takes no arguments"):
        cluster.make_cluster_resolver("tf_config", port_base=9000)


def test_tf_config_resolver_checks_tf_config_first(monkeypatch):
    monkeypatch.setenv("TF_CONFIG", '{"cluster": {"worker": ["a:1"]}, "task": {"type": "worker"}}')
    with pytest.raises(UserError, match="task.index is missing"):
        cluster.make_cluster_resolver("tf_config")


def test_resolve_attaches_the_resolver_and_applies_the_strategy_checks(monkeypatch):
    monkeypatch.setenv("TF_CONFIG", tf_config(TWO_WORKERS, "worker", 1))
    info = cluster.resolve("multi_worker_mirrored")
    assert (info.task_type, info.task_id, info.num_workers) == ("worker", 1, 2)
    assert info.resolver.cluster_spec().as_dict() == TWO_WORKERS
    with pytest.raises(UserError, match="runs on one machine"):
        cluster.resolve("mirrored")
    monkeypatch.setenv("TF_CONFIG", tf_config({"worker": ["a:1"], "ps": ["b:1"]}))
    with pytest.raises(UserError, match="task type 'ps' cannot be used"):
        cluster.resolve("multi_worker_mirrored")


@pytest.fixture
def slurm_env(monkeypatch):
    """A fake srun step: 4 tasks on node1 and node2, this process is rank 2."""
    for name in list(os.environ):
        if name.startswith("SLURM_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("SLURM_PROCID", "2")
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "4")
    monkeypatch.setenv("SLURM_STEP_NODELIST", "node[1-2]")
    monkeypatch.setenv("SLURM_STEP_TASKS_PER_NODE", "2(x2)")
    monkeypatch.setenv("SLURMD_NODENAME", "node2")  # rank 2 of 2(x2) runs on the second node
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # restored after the test


def test_slurm_on_cpu_gives_the_same_cluster_info_as_tf_config(slurm_env):
    resolver = cluster.make_cluster_resolver("slurm", gpus_per_node=0, port_base=9000)
    info = cluster.cluster_info_from_resolver(resolver)
    spec = {"worker": ["node1:9000", "node1:9001", "node2:9000", "node2:9001"]}
    assert info == parse_tf_config(tf_config(spec, "worker", 2))
    assert not info.is_chief and info.num_workers == 4
    assert resolver.num_accelerators() == {}
    assert resolver.master() == "grpc://node2:9000"


def test_slurm_jobs_make_a_parameter_server_cluster(slurm_env):
    resolver = cluster.make_cluster_resolver("slurm", jobs={"chief": 1, "worker": 2, "ps": 1}, gpus_per_node=0)
    info = cluster.cluster_info_from_resolver(resolver, allowed_task_types=PS)
    assert info.cluster == {"chief": ["node1:8888"], "ps": ["node1:8889"], "worker": ["node2:8888", "node2:8889"]}
    assert (info.task_type, info.task_id, "ps" in info.cluster) == ("worker", 0, True)


def test_slurm_jobs_give_a_server_its_task(slurm_env):
    from trainer import server

    kind, options = server.parse_args(
        ["--cluster_resolver=slurm", "--cluster_resolver_options={'jobs': {'chief': 1, 'ps': 1, 'worker': 2}}"]
    )
    info = server.server_task(kind, options)
    assert (info.task_type, info.task_id) == ("worker", 0)
    assert info.cluster["worker"] == ["node2:8888", "node2:8889"]
    assert server.parse_args([]) == ("tf_config", {})


def test_slurm_with_gpus_uses_tensorflows_resolver(slurm_env, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    resolver = cluster.make_cluster_resolver("slurm")
    info = cluster.cluster_info_from_resolver(resolver)
    assert (info.task_type, info.task_id, info.num_workers) == ("worker", 2, 4)
    assert resolver.num_accelerators() == {"GPU": 1}
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0"  # rank 2 = node2's first task


def test_slurm_without_slurm_env_names_the_missing_variables(slurm_env, monkeypatch):
    monkeypatch.delenv("SLURM_PROCID")
    monkeypatch.delenv("SLURM_STEP_NODELIST")
    with pytest.raises(
        UserError,
        match=r"^slurm resolver chosen but SLURM_PROCID, "
        r"SLURM_STEP_NODELIST not set: run inside an sbatch/srun job or use "
        r"cluster_resolver='tf_config'$",
    ):
        cluster.make_cluster_resolver("slurm")


@pytest.mark.parametrize("gpus_per_node", [0, 1])
def test_slurm_refuses_an_address_on_another_node_than_the_tasks_own(slurm_env, monkeypatch, gpus_per_node):
    """SLURM puts task 0 of node[9-10] on node9; TensorFlow's resolver sorts node10 first."""
    monkeypatch.setenv("SLURM_PROCID", "0")
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "2")
    monkeypatch.setenv("SLURM_STEP_NODELIST", "node[9-10]")
    monkeypatch.setenv("SLURM_STEP_TASKS_PER_NODE", "1(x2)")
    monkeypatch.setenv("SLURMD_NODENAME", "node9")
    with pytest.raises(
        UserError,
        match=r"^slurm resolver: task 0 runs on node9 but TensorFlow's "
        r"SlurmClusterResolver gives it node10:8888 .*cluster_resolver='tf_config'$",
    ):
        cluster.make_cluster_resolver("slurm", gpus_per_node=gpus_per_node)
    monkeypatch.setenv("SLURM_STEP_NODELIST", "node[10-11]")
    monkeypatch.setenv("SLURMD_NODENAME", "node10")
    resolver = cluster.make_cluster_resolver("slurm", gpus_per_node=gpus_per_node)
    assert resolver.cluster_spec().as_dict() == {"worker": ["node10:8888", "node11:8888"]}


@pytest.mark.parametrize(
    "kwargs, expected",
    [
        ({"jobs": {"worker": 3}, "gpus_per_node": 0}, "Requested 3 tasks but only 4 were assigned"),
        ({"bogus": 1}, r"unknown argument\(s\) \['bogus'\]"),
    ],
)
def test_slurm_argument_mistakes_are_user_errors(slurm_env, kwargs, expected):
    with pytest.raises(UserError, match=expected):
        cluster.make_cluster_resolver("slurm", **kwargs)


def test_a_task_whose_port_something_listens_on_is_refused_naming_the_task_and_address():
    import socket

    with socket.socket() as listener:
        listener.bind(("", 0))
        listener.listen()
        port = listener.getsockname()[1]
        taken = ClusterInfo(cluster={"worker": ["localhost:1", f"localhost:{port}"]}, task_type="worker", task_id=1)
        with pytest.raises(UserError) as refused:
            cluster.check_own_port_free(taken)
        assert str(refused.value).startswith(
            f"task worker 1 of the cluster is at localhost:{port}, but something already listens on port {port} of "
            "this host; give the task a free port in TF_CONFIG"
        )
    cluster.check_own_port_free(taken)  # free again
    cluster.check_own_port_free(ClusterInfo(cluster={}, task_type=None, task_id=0))  # one process: no server
