"""The Kubernetes manifests (experiments/cluster/kubernetes): valid objects of the Kubernetes API, checked
offline against its schema (kubernetes-validate; no cluster here), whose pods each get the TF_CONFIG of
their task from tf_config.py, as trainer.main and trainer.server read it (issue 38, must-show 7)."""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import subprocess
import sys

import kubernetes_validate
import pytest
import yaml

from tests.support import REPO
from trainer.distribution import cluster

HERE = os.path.join(REPO, "experiments", "cluster", "kubernetes")
ENTRYPOINT = os.path.join(HERE, "tf_config.py")
# successPolicy (ps.yaml) is GA from 1.33; the newest schema the package bundles is checked too.
VERSIONS = ("1.33.0", kubernetes_validate.latest_version())
MANIFESTS = {  # file -> (strategy, the task of each pod index)
    "mwms.yaml": ("multi_worker_mirrored", [("worker", 0), ("worker", 1)]),
    "ps.yaml": ("parameter_server", [("chief", 0), ("ps", 0), ("worker", 0), ("worker", 1)]),
}

spec = importlib.util.spec_from_file_location("tf_config", ENTRYPOINT)
tf_config = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tf_config)


def objects(name: str) -> dict[str, dict]:
    with open(os.path.join(HERE, name)) as f:
        return {doc["kind"]: doc for doc in yaml.safe_load_all(f)}


def test_the_directory_holds_the_manifests_the_tests_check():
    assert sorted(f for f in os.listdir(HERE) if f.endswith(".yaml")) == sorted(MANIFESTS)


@pytest.mark.parametrize("name", sorted(MANIFESTS))
def test_every_object_is_valid_against_the_kubernetes_api_schema(name):
    found = objects(name)
    assert sorted(found) == ["Job", "NetworkPolicy", "Service"]
    for obj in found.values():
        for version in VERSIONS:
            kubernetes_validate.validate(obj, version, strict=True)


def test_the_schema_check_rejects_a_misspelled_field_and_a_wrong_type():
    job = objects("ps.yaml")["Job"]
    misspelled = copy.deepcopy(job)
    misspelled["spec"]["completionsMode"] = misspelled["spec"].pop("completionMode")
    wrong_type = copy.deepcopy(job)
    wrong_type["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "grpc"
    for broken in (misspelled, wrong_type):
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(broken, VERSIONS[0], strict=True)


@pytest.mark.parametrize("name", sorted(MANIFESTS))
def test_each_pod_gets_the_tf_config_of_its_task_and_the_objects_agree(name):
    strategy, tasks = MANIFESTS[name]
    found = objects(name)
    job, service, policy = found["Job"], found["Service"], found["NetworkPolicy"]
    job_name, pod = job["metadata"]["name"], job["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    label = {"batch.kubernetes.io/job-name": job_name}  # what the Job controller labels its pods with
    assert {
        "name": "JOB_NAME",
        "valueFrom": {"fieldRef": {"fieldPath": f"metadata.labels['{next(iter(label))}']"}},
    } in (container["env"])
    assert job["spec"]["completionMode"] == "Indexed"
    assert job["spec"]["completions"] == job["spec"]["parallelism"] == len(tasks)
    assert (
        service["spec"]["clusterIP"] == "None" and service["metadata"]["name"] == pod["subdomain"] == env["TF_SERVICE"]
    )
    assert service["spec"]["selector"] == label == policy["spec"]["podSelector"]["matchLabels"]
    assert policy["spec"]["ingress"][0]["from"][0]["podSelector"]["matchLabels"] == label
    port = int(env["TF_PORT"])
    assert container["ports"][0]["containerPort"] == service["spec"]["ports"][0]["port"] == port
    assert policy["spec"]["ingress"][0]["ports"][0]["port"] == port
    assert container["command"] == ["python", os.path.relpath(ENTRYPOINT, REPO), "--"]
    with open(os.path.join(REPO, "experiments", "cluster", "Dockerfile")) as f:
        assert f"COPY {os.path.relpath(ENTRYPOINT, REPO)} " in f.read()  # the image holds the entrypoint

    addresses = [f"{job_name}-{i}.{pod['subdomain']}:{port}" for i in range(len(tasks))]  # pod i's DNS name
    for index, (task_type, task_id) in enumerate(tasks):
        config = tf_config.tf_config(env | {"JOB_NAME": job_name, "JOB_COMPLETION_INDEX": str(index)})
        info = cluster.parse_tf_config(json.dumps(config), allowed_task_types=cluster.allowed_task_types_for(strategy))
        assert (info.task_type, info.task_id) == (task_type, task_id)
        assert info.cluster[task_type][task_id] == addresses[index]
        assert sorted(a for found in info.cluster.values() for a in found) == sorted(addresses)
        assert info.is_chief == (index == 0)
    if strategy == "parameter_server":  # the chief's success ends the job, and the servers with it
        assert job["spec"]["successPolicy"] == {"rules": [{"succeededIndexes": "0"}]}
        script = container["args"][-1]
        assert "gin/ps.gin" in script and "python -m trainer.server" in script and '"$TF_ROLE" = chief' in script
    else:
        assert (
            container["args"][:3] == ["python", "-m", "trainer.main"] and "--gin_file=gin/mwms.gin" in container["args"]
        )


def run_entrypoint(env: dict[str, str], *command: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k not in ("TF_CONFIG", "JOB_COMPLETION_INDEX")}
    return subprocess.run(
        [sys.executable, ENTRYPOINT, "--", *command], env=clean | env, capture_output=True, text=True, timeout=30
    )


def test_the_entrypoint_runs_the_command_with_tf_config_and_refuses_a_pod_it_cannot_place_in_one_line():
    env = {"JOB_NAME": "trainer-ps", "TF_SERVICE": "trainer-ps", "TF_TASKS": "chief=1,ps=1,worker=2"}
    show = "import os; print(os.environ['TF_ROLE'], os.environ['TF_CONFIG'])"
    ran = run_entrypoint(env | {"JOB_COMPLETION_INDEX": "3"}, sys.executable, "-c", show)
    assert ran.returncode == 0, ran.stderr
    role, config = ran.stdout.split(" ", 1)
    assert role == "worker" and json.loads(config)["task"] == {"type": "worker", "index": 1}
    for broken, needle in [
        ({}, "JOB_COMPLETION_INDEX not set"),
        ({"JOB_COMPLETION_INDEX": "4"}, "JOB_COMPLETION_INDEX 4 is outside TF_TASKS"),
        ({"JOB_COMPLETION_INDEX": "0", "TF_TASKS": "chief,worker=2"}, "write it as task=count pairs"),
    ]:
        refused = run_entrypoint(env | broken, sys.executable, "-c", "print('ran')")
        assert refused.returncode == 2 and not refused.stdout
        assert refused.stderr.startswith("error: ") and needle in refused.stderr
        assert len(refused.stderr.strip().splitlines()) == 1
