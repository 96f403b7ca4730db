"""Hooks: what runs eagerly between compiled loop calls (progress, eval, checkpoints, the config).

Public: `Hook` (subclass it for a hook of your own), `Run` (what a hook sees), and the core hooks.
"""

from trainer.hooks.base import Console, Evaluations, Hook, Run, name_of
from trainer.hooks.checkpointing import CheckpointHook
from trainer.hooks.config import ConfigWriter, HParamsWriter
from trainer.hooks.evaluation import EvalHook
from trainer.hooks.progress import ProgressLogger

__all__ = [
    "CheckpointHook",
    "ConfigWriter",
    "Console",
    "EvalHook",
    "Evaluations",
    "HParamsWriter",
    "Hook",
    "ProgressLogger",
    "Run",
    "name_of",
]
