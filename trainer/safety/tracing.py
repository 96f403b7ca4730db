"""The user's functions, tried on the real batch spec before anything is written to model_dir.

A step that returns a list, a model that cannot take the batch, an eval step without
`num_examples`: each would otherwise end in a traceback at the first loop call, after the
run record, operative config and first checkpoint exist. The loops trace their compiled
functions early instead (the same trace their first call reuses, so nothing is traced twice)
and a failure of the user's code becomes one UserError line naming the function.
"""
from __future__ import annotations

import contextlib
import re
from typing import Any, Callable, Iterator

from trainer.errors import UserError


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_ERROR_LINE = re.compile(r"^\s*(\w+(?:Error|Exception)): (.*)$")


def first_line(error: BaseException) -> str:
    """What happened, in one line: for an error AutoGraph re-raised with the trace of the user's
    code ("in user code: File ... ValueError: ..."), the original error's own message."""
    text = _ANSI.sub("", re.sub(r"\{\{function_node [^}]*\}\}\s*", "", str(error)))
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for index, line in enumerate(lines):
        if match := _ERROR_LINE.match(line):  # the innermost error AutoGraph quotes, then its detail
            detail = " ".join(lines[index + 1:index + 2]) if match.group(2).startswith("Exception encountered") \
                else match.group(2)
            return f"{match.group(1)}: {detail}".rstrip(".:")[:300]
    for line in lines:
        if not line.startswith(("Traceback", "File ", "in user code", "Graph execution error", "Detected at node")):
            return line.rstrip(".:")[:300]
    return type(error).__name__


def traced(what: str, name: str, trace: Callable[[], Any]) -> Any:
    """Runs `trace`; an error in the user's code while tracing is one UserError naming `what`."""
    try:
        return trace()
    except UserError:
        raise
    except Exception as error:  # noqa: BLE001  (any failure of user code while tracing is theirs to fix)
        raise UserError(
            f"{what} {name} cannot run on the batches of train.input_fn ({first_line(error)}); fix the "
            "function or the model it calls (check the batch structure: "
            "train batches are the examples batched, eval batches have the weight appended)"
        ) from error


CROSS_REPLICA_CALLS = ("all_gather", "all_reduce")


@contextlib.contextmanager
def cross_replica_calls() -> Iterator[list[str]]:
    """Records the cross-replica calls (`get_replica_context().all_gather` / `.all_reduce`) made
    while the body traces a step, for a mode that has no replica context spanning its workers.

    TensorFlow offers no way to ask a traced function whether it communicates across replicas
    (under some strategies the calls leave no op of their own), so the two methods of
    `tf.distribute.ReplicaContext` are wrapped for the length of the body and put back after it.
    """
    import tensorflow as tf

    calls: list[str] = []
    originals = {name: getattr(tf.distribute.ReplicaContext, name) for name in CROSS_REPLICA_CALLS}

    def recording(name: str, original: Callable) -> Callable:
        def method(self, *args, **kwargs):
            calls.append(name)
            return original(self, *args, **kwargs)
        return method

    for name, original in originals.items():
        setattr(tf.distribute.ReplicaContext, name, recording(name, original))
    try:
        yield calls
    finally:
        for name, original in originals.items():
            setattr(tf.distribute.ReplicaContext, name, original)
