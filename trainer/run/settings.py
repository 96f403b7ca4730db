"""The run's options as small frozen dataclasses, each field checked where it is made.

`train` has many gin parameters; grouped here by who reads them (the loops, the hooks, the
recovery from failures), each group is validated once, with one UserError line naming the gin
name, the value and what is allowed, before anything is built or written.
"""
from __future__ import annotations

import dataclasses

from trainer.safety import nonfinite
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

    def __post_init__(self) -> None:
        for name in ("total_steps", "global_batch_size", "steps_per_loop"):
            check_int(f"train.{name}", getattr(self, name))
        check_int("train.seed", self.seed, minimum=0)
        check_choice("train.distribute_method", self.distribute_method, DISTRIBUTE_METHODS)
        if not isinstance(self.shard_policy, str) or self.shard_policy.upper() not in SHARD_POLICIES:
            raise UserError(f"unknown train.shard_policy {self.shard_policy!r}: use one of "
                            f"{', '.join(SHARD_POLICIES)}")
        check_bool("train.jit_compile", self.jit_compile)


@dataclasses.dataclass(frozen=True)
class HookOptions:
    """How often the default hooks act, and how many checkpoints stay."""

    log_every_steps: int = 100
    checkpoint_every_steps: int = 500
    eval_every_steps: int = 500
    keep_checkpoints: int = 3

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            check_int(f"train.{field.name}", getattr(self, field.name))


@dataclasses.dataclass(frozen=True)
class RecoveryOptions:
    """What guards the run: the loss-scaling check, non-finite outputs, resume changes, preemption."""

    check_loss_scaling: bool = True
    nonfinite: str = "stop"
    max_rollbacks: int = 3
    allow_resume_changes: bool = False
    preemption_checkpointing: bool = False

    def __post_init__(self) -> None:
        for name in ("check_loss_scaling", "allow_resume_changes", "preemption_checkpointing"):
            check_bool(f"train.{name}", getattr(self, name))
        check_choice("train.nonfinite", self.nonfinite, nonfinite.MODES)
        check_int("train.max_rollbacks", self.max_rollbacks, minimum=0, maximum=nonfinite.CAPACITY)
