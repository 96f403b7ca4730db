"""`tf.summary` calls inside the step: written to the chief's train event file every `train.log_every_steps`
steps under every synchronous strategy, refused in one line under parameter_server.

TensorFlow writes a summary op only if a default writer is set when the op is traced, so the train loop
traces inside `StepSummaries.recording`: on the chief, the train event writer is the default, the default
step a counter that is the global step of the step running, and recording on only where it is a multiple of
`every_steps`; each summary op (and its computation) sits in a `tf.cond` that runs only on those steps.
Other workers trace with a no-op writer, under which no summary op is traced. In replica context TensorFlow
records from replica 0 only: the values written are the first replica's (its batch, its share of a loss).
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import tensorflow as tf

from trainer.errors import UserError
from trainer.files.event_writers import EventWriter


class StepSummaries:
    """The default summary writer, step and recording condition of the train loop's trace. `writer`: the
    chief's train `EventWriter`; a no-op writer on other workers; None without a model_dir."""

    def __init__(self, writer: tf.summary.SummaryWriter | None, every_steps: int):
        self._writer = writer
        self._every = every_steps
        self._step: tf.Variable | None = None
        if isinstance(writer, EventWriter):
            self._step = tf.Variable(0, dtype=tf.int64, trainable=False, name="summary_step")

    @contextlib.contextmanager
    def recording(self, global_step: tf.Variable) -> Iterator[Callable[[], None]]:
        """Around the compiled loop's body, from `global_step`; yields `advance`, to call before each step."""
        if self._step is None:
            with self._writer.as_default() if self._writer is not None else contextlib.nullcontext():
                yield lambda: None
            return
        step, every = self._step, self._every
        step.assign(tf.cast(global_step.read_value(), tf.int64))
        with self._writer.as_default(step=step), tf.summary.record_if(lambda: tf.equal(step % every, 0)):
            yield lambda: step.assign_add(1)

    def start(self) -> None:
        if isinstance(self._writer, EventWriter):
            self._writer.init()


def writes_summaries(concrete_function) -> bool:
    """Whether a traced function (or any function it calls) writes summaries."""
    graph = concrete_function.graph.as_graph_def()
    nodes = [*graph.node, *(node for function in graph.library.function for node in function.node_def)]
    return any(node.op.startswith("Write") and node.op.endswith("Summary") for node in nodes)


@contextlib.contextmanager
def tracing_for_summaries() -> Iterator[None]:
    """A default writer never created, recording on: a step traced under it has its summary ops."""
    with EventWriter("never-created").as_default(step=0), tf.summary.record_if(True):
        yield


def refuse_under_parameter_server(step_name: str) -> UserError:
    return UserError(
        f"train.step_fn {step_name} writes tf.summary inside the step, which parameter_server cannot record: the "
        "step runs on the workers, and the event files are the chief's; return the value from the step instead "
        "(each output is logged to metrics.jsonl and TensorBoard), or use a synchronous strategy (gin/mwms.gin)"
    )
