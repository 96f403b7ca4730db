"""The run's options as small frozen dataclasses, each field checked where it is made.

`train` has many gin parameters; grouped here by who reads them (the loops, the hooks, the
recovery from failures), each group is validated once, with one UserError line naming the gin
name, the value and what is allowed, before anything is built or written.
"""
from __future__ import annotations

import dataclasses

from trainer.core import nonfinite
from trainer.data import SHARD_POLICIES
from trainer.errors import UserError

DISTRIBUTE_METHODS = ("dataset", "function")


def check_int(name: str, value, *, minimum: int = 1) -> None:
    """`train.<name>` must be an int (not a bool) of at least `minimum`."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        allowed = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise UserError(f"train.{name} must be {allowed}, got {value!r}")


def check_bool(name: str, value) -> None:
    if not isinstance(value, bool):
        raise UserError(f"train.{name} must be True or False, got {value!r}")


def check_choice(name: str, value, choices) -> None:
    if value not in choices:
        raise UserError(f"unknown train.{name} {value!r}: use one of {', '.join(map(repr, choices))}")


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
            check_int(name, getattr(self, name))
        check_int("seed", self.seed, minimum=0)
        check_choice("distribute_method", self.distribute_method, DISTRIBUTE_METHODS)
        if not isinstance(self.shard_policy, str) or self.shard_policy.upper() not in SHARD_POLICIES:
            raise UserError(f"unknown train.shard_policy {self.shard_policy!r}: use one of "
                            f"{', '.join(SHARD_POLICIES)}")
        check_bool("jit_compile", self.jit_compile)


@dataclasses.dataclass(frozen=True)
class HookOptions:
    """How often the default hooks act, and how many checkpoints stay."""

    log_every_steps: int = 100
    checkpoint_every_steps: int = 500
    eval_every_steps: int = 500
    keep_checkpoints: int = 3

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            check_int(field.name, getattr(self, field.name))


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
            check_bool(name, getattr(self, name))
        check_int("max_rollbacks", self.max_rollbacks, minimum=0)
        nonfinite.check_options(self.nonfinite, self.max_rollbacks)
