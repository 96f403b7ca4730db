"""What the loops are configured with: length, batch, distribution of the data, and the
parameter-server specifics, each field checked where the object is made."""

from __future__ import annotations

import dataclasses
from typing import Callable

from trainer.data import SHARD_POLICIES
from trainer.errors import UserError
from trainer.validation import check_bool, check_choice, check_int

DISTRIBUTE_METHODS = ("dataset", "function")


@dataclasses.dataclass(frozen=True)
class LoopOptions:
    """What the train loops need: how long, how big, how the data is cut and distributed."""

    total_steps: int = 1000
    global_batch_size: int = 64
    steps_per_loop: int = 50
    seed: int = 0
    distribute_method: str = "dataset"
    shard_policy: str = "AUTO"
    jit_compile: bool = False
    log_every_steps: int = 100  # the step's tf.summary calls are recorded at these steps
    model_dir: str | None = None  # None: the step's tf.summary calls are not recorded

    def __post_init__(self) -> None:
        for name in ("total_steps", "global_batch_size", "steps_per_loop"):
            check_int(f"train.{name}", getattr(self, name))
        check_int("train.seed", self.seed, minimum=0)
        check_choice("train.distribute_method", self.distribute_method, DISTRIBUTE_METHODS)
        if not isinstance(self.shard_policy, str) or self.shard_policy.upper() not in SHARD_POLICIES:
            raise UserError(f"unknown train.shard_policy {self.shard_policy!r}: use one of {', '.join(SHARD_POLICIES)}")
        check_bool("train.jit_compile", self.jit_compile)


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
