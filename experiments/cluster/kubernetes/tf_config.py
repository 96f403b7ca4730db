"""Entrypoint of a pod of an Indexed Job: sets TF_CONFIG (and TF_ROLE) from the pod's index, then runs the command.

    python experiments/cluster/kubernetes/tf_config.py -- python -m trainer.main --gin_file=gin/mwms.gin ...

Kubernetes gives each pod of an Indexed Job its index (`JOB_COMPLETION_INDEX`) and the host name
`<job name>-<index>`, which the headless Service named in the pod's `subdomain` makes resolvable as
`<job name>-<index>.<service>`. The group's tasks are numbered in the order of `TF_TASKS`:
`TF_TASKS=worker=2` makes pods 0 and 1 workers 0 and 1 (MultiWorkerMirrored, worker 0 the chief);
`TF_TASKS=chief=1,ps=1,worker=2` makes pod 0 the chief, pod 1 ps 0, pods 2 and 3 workers 0 and 1.

Environment: `JOB_COMPLETION_INDEX` (set by Kubernetes), `JOB_NAME` (the Job's name, from the downward API),
`TF_SERVICE` (the headless Service), `TF_TASKS`, `TF_PORT` (default 2222). A missing or malformed one is
one `error:` line, exit 2; trainer.main and trainer.server check the TF_CONFIG this writes again.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Mapping


def task_counts(text: str) -> list[tuple[str, int]]:
    """`'chief=1,ps=1,worker=2'` as `[('chief', 1), ('ps', 1), ('worker', 2)]`."""
    counts = []
    for part in text.split(","):
        name, _, count = part.strip().partition("=")
        if not name or not count.isdigit() or int(count) < 1:
            raise ValueError(f"TF_TASKS {text!r}: write it as task=count pairs, e.g. 'chief=1,ps=1,worker=2'")
        counts.append((name, int(count)))
    return counts


def tf_config(env: Mapping[str, str]) -> dict:
    """TF_CONFIG of the pod that `env` describes (see module doc)."""
    missing = [name for name in ("JOB_COMPLETION_INDEX", "JOB_NAME", "TF_SERVICE", "TF_TASKS") if not env.get(name)]
    if missing:
        raise ValueError(f"{', '.join(missing)} not set: run this in a pod of an Indexed Job (see its manifest)")
    job, service, port = env["JOB_NAME"], env["TF_SERVICE"], env.get("TF_PORT", "2222")
    index = int(env["JOB_COMPLETION_INDEX"])
    cluster, task, first = {}, None, 0
    for name, count in task_counts(env["TF_TASKS"]):
        cluster[name] = [f"{job}-{first + i}.{service}:{port}" for i in range(count)]
        if first <= index < first + count:
            task = {"type": name, "index": index - first}
        first += count
    if task is None:
        raise ValueError(f"JOB_COMPLETION_INDEX {index} is outside TF_TASKS {env['TF_TASKS']!r} ({first} pods)")
    return {"cluster": cluster, "task": task}


def main(argv: list[str]) -> None:
    if argv[:1] != ["--"] or len(argv) < 2:
        sys.exit("usage: tf_config.py -- COMMAND [ARGS...]")
    try:
        config = tf_config(os.environ)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    os.environ["TF_CONFIG"] = json.dumps(config)
    os.environ["TF_ROLE"] = config["task"]["type"]
    os.execvp(argv[1], argv[1:])


if __name__ == "__main__":
    main(sys.argv[1:])
