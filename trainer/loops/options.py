"""The loops' own option values: how the data is distributed, and the parameter-server specifics
(checked where made); the loops read the rest from the run's `Settings`."""

from __future__ import annotations

import dataclasses
from typing import Callable

from trainer.errors import UserError
from trainer.validation import check_int

DISTRIBUTE_METHODS = ("dataset", "function")


@dataclasses.dataclass(frozen=True)
class ParameterServerConfig:
    """Settings of ParameterServer training (gin: `train.parameter_server = @parameter_server()`).

    Attributes:
      steps_per_closure: steps in one scheduled function; None: about
        steps_per_loop / (2 x workers).
      variable_partitioner: shards variables across the ps tasks, e.g.
        `@min_size_partitioner()`: a tf.Module's tf.Variables (embedding tables); a Keras
        layer's own variables must stay whole (Keras 3 layers cannot compute with sharded
        variables), else the run is refused.
      eval_shards: eval spread over the workers in this many shards of consecutive eval batches,
        each example counted once, results as on the coordinator (trainer/loops/ps_eval.py);
        'auto': one per worker where the workers run on other hosts than the coordinator and it can
        work, else the coordinator; 0: on the coordinator.
    """

    steps_per_closure: int | None = None
    variable_partitioner: Callable | None = None
    eval_shards: int | str = "auto"

    def __post_init__(self) -> None:
        if self.steps_per_closure is not None:
            check_int("parameter_server.steps_per_closure", self.steps_per_closure)
        shards = self.eval_shards
        if shards != "auto" and (not isinstance(shards, int) or isinstance(shards, bool) or shards < 0):
            raise UserError(f"parameter_server.eval_shards must be 'auto' or an integer >= 0, got {shards!r}")
