"""The first thing an entry point does, before TensorFlow starts threads: enter a private
network namespace if this run will start an embedded cluster (trainer/distribution/local_cluster.py).

Entering needs a single-threaded process, and only the gin config says whether the run starts a
cluster, so the flags' gin files and bindings are read here as text, without TensorFlow or gin.
"""

from __future__ import annotations

import os
import re
from typing import Sequence

from trainer.distribution import modes, netns
from trainer.distribution.local_cluster import DEFAULT_DATA_WORKERS, WHAT, needs_local_cluster

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_STRATEGY = re.compile(r"""\bstrategy\s*=\s*['"](\w+)['"]""")
_RESOLVER = re.compile(r"""\bcluster_resolver\s*=\s*['"](\w+)['"]""")
_DATA_SERVICE = re.compile(r"""\bdata_service\s*=\s*['"]([^'"]*)['"]""")
_DATA_WORKERS = re.compile(r"""\bdata_service\.num_workers\s*=\s*(\d+)""")
_INCLUDE = re.compile(r"""^\s*include\s+['"]([^'"]+)['"]""", re.M)


def isolate_early(argv: Sequence[str]) -> None:
    """An entry point's first line, before TensorFlow starts threads: enters the private
    network namespace (trainer/distribution/netns.py) if this run will start an embedded
    cluster, or if the image that exec'd this one asked to.

    Entering needs a single-threaded process, and only the gin config says whether the run
    is a ParameterServer one without a cluster, so this reads the flags' gin files and
    bindings as text (the last `strategy = '...'` and `cluster_resolver = '...'` win). A run
    this misses is caught by `cluster_for`, which re-executes the process into the namespace.
    """
    netns.enter_if_requested(WHAT)
    alone = local_data_workers(argv) and not os.environ.get("TF_CONFIG", "").strip()
    if not netns.is_private() and (expects_embedded_cluster(argv) or alone):
        netns.isolate(WHAT)


def expects_embedded_cluster(argv: Sequence[str]) -> bool:
    """Whether `python -m trainer.main argv` (no TF_CONFIG) trains or evaluates ParameterServer on a
    cluster of its own (not one resolved from SLURM), by text."""
    run_modes, print_config = _flag_values(argv, "mode"), _flag_values(argv, "print_config")
    run_mode = modes.RUN_MODES.get(run_modes[-1] if run_modes else "train")
    if os.environ.get("TF_CONFIG", "").strip() or run_mode is None or not run_mode.on_the_run_cluster:
        return False
    if print_config[-1:] not in ([], ["false"], ["False"], ["0"]):
        return False
    texts = _texts(argv)
    strategies = [m for text in texts for m in _STRATEGY.findall(text)]
    resolvers = [m for text in texts for m in _RESOLVER.findall(text)] or ["tf_config"]
    return bool(strategies) and needs_local_cluster(strategies[-1], resolvers[-1])


def local_data_workers(argv: Sequence[str]) -> int:
    """How many data workers a 'local' tf.data service of `python -m trainer.main argv` has, by text (0:
    none), for the entry points that start it before TensorFlow loads (trainer.launch, this isolation)."""
    texts = _texts(argv)
    services = [m for text in texts for m in _DATA_SERVICE.findall(text)]
    if services[-1:] != ["local"]:
        return 0
    counts = [int(m) for text in texts for m in _DATA_WORKERS.findall(text)]
    return counts[-1] if counts else DEFAULT_DATA_WORKERS


def _texts(argv: Sequence[str]) -> list[str]:
    """The flags' gin files' and bindings' texts, in order."""
    texts = [text for path in _flag_values(argv, "gin_file") for text in _gin_texts(path, set())]
    return texts + _flag_values(argv, "gin_bindings")


def _flag_values(argv: Sequence[str], name: str) -> list[str]:
    """Values of `--name=V`, `--name V` (or a bare `--name`, as "1") in absl's spellings."""
    values = []
    for i, arg in enumerate(argv):
        flag, eq, value = arg.lstrip("-").partition("=")
        if not arg.startswith("-") or flag != name:
            continue
        if eq:
            values.append(value)
        elif i + 1 < len(argv) and not argv[i + 1].startswith("-"):
            values.append(argv[i + 1])
        else:
            values.append("1")
    return values


def _gin_texts(path: str, seen: set[str]) -> list[str]:
    """The file's text without comments, its includes' texts spliced in where they stand."""
    found = next((p for p in (path, os.path.join(REPO_ROOT, path)) if os.path.isfile(p)), None)
    if found is None or os.path.abspath(found) in seen:
        return []
    seen.add(os.path.abspath(found))
    with open(found) as f:
        text = re.sub(r"#.*", "", f.read())
    texts, start = [], 0
    for include in _INCLUDE.finditer(text):
        texts += [text[start : include.start()], *_gin_texts(include.group(1), seen)]
        start = include.end()
    return texts + [text[start:]]
