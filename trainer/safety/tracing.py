"""The user's functions, tried on the real batch spec before anything is written to model_dir.

A step that returns a list or a model that cannot take the batch would otherwise fail at the first
loop call, after the first files exist. The loops trace early instead (the trace their first call
reuses) and a failure of the user's code becomes one UserError line naming the function.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

from trainer.errors import UserCodeError, UserError, error_line

MERGE_CALL_IN_GRAPH = "`merge_call` called while defining a new graph"


def merge_call_in_graph(error: BaseException) -> bool:
    """Whether `error` is TensorFlow refusing a cross-replica synchronisation point (the update of
    `apply_gradients`) inside graph control flow (`for _ in tf.range(n)`) or a nested tf.function."""
    return MERGE_CALL_IN_GRAPH in str(error)


def update_in_graph_control_flow(what: str, name: str) -> UserError:
    """The one line for an update inside graph control flow (see `merge_call_in_graph`)."""
    return UserError(
        f"{what} {name} calls optimizer.apply_gradients inside graph control flow (a `for` over tf.range, a `while` "
        "or `if` on a tensor) or a nested tf.function, which TensorFlow runs on one device only: under this strategy "
        "the update is a cross-replica synchronisation point; unroll the loop with a Python range "
        "(`for _ in range(n_critic)`, n a Python int) or move the update out of the control flow"
    )


def traced(what: str, name: str, trace: Callable[[], Any]) -> Any:
    """Runs `trace`; an error in the user's code while tracing is one UserError naming `what`, with the
    user's own frames (a layer of theirs that raised) printed above it."""
    from trainer.task.user_code import user_frames  # TensorFlow: imported where a trace runs

    try:
        return trace()
    except UserError:
        raise
    except Exception as error:  # noqa: BLE001  (any failure of user code while tracing is theirs to fix)
        if merge_call_in_graph(error):
            raise update_in_graph_control_flow(what, name) from error
        raise UserCodeError(
            f"{what} {name} cannot run on the batches of train.input_fn ({error_line(error)}); fix the "
            "function or the model it calls (check the batch structure: "
            "train batches are the examples batched, eval batches have the weight appended)",
            user_frames(error),
        ) from error


CROSS_REPLICA_CALLS = ("all_gather", "all_reduce")


@contextlib.contextmanager
def cross_replica_calls() -> Iterator[list[str]]:
    """Records the `ReplicaContext.all_gather` / `.all_reduce` calls made while the body traces a step.
    TensorFlow cannot tell whether a traced function communicates (some strategies leave no op of
    their own), so the two methods are wrapped for the body's length."""
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
