"""The loops' own option values: how the data is distributed, and the parameter-server specifics
(checked where made); the loops read the rest from the run's `Settings`."""

from __future__ import annotations

import dataclasses
from typing import Callable

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
    """

    steps_per_closure: int | None = None
    variable_partitioner: Callable | None = None

    def __post_init__(self) -> None:
        if self.steps_per_closure is not None:
            check_int("parameter_server.steps_per_closure", self.steps_per_closure)
