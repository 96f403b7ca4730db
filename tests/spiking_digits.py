"""For tests/test_loss_bound.py: the digits with one train image blown up in the batch of a chosen
step, which with tests/nan_steps.py's `input_energy_step` (a loss term of the input's energy) makes
that step's loss far above the others' (a spike, still finite); and a step without a `loss` output."""

from __future__ import annotations

import dataclasses
from functools import cached_property

import gin

from trainer.data import Digits, shuffled_index_batches
from trainer.task import steps


@gin.configurable
@dataclasses.dataclass(frozen=True)
class SpikingDigits(Digits):
    """Digits whose first train image of global step `step` (batches of `batch_size`, train.seed
    `train_seed`) is multiplied by `scale`."""

    step: int = 10
    batch_size: int = 32
    train_seed: int = 0
    scale: float = 1e4

    @cached_property
    def _arrays(self) -> dict:
        arrays = dict(super()._arrays)
        images, labels = arrays["train"]
        batches = shuffled_index_batches(len(images), self.batch_size, self.train_seed, first_batch=self.step - 1)
        images = images.copy()
        images[int(next(iter(batches))[0])] *= self.scale
        arrays["train"] = (images, labels)
        return arrays


@gin.configurable
def unnamed_loss_step(model, optimizer, batch, global_batch_size):
    """The classification step with its loss output named `xent`: nothing is called `loss`."""
    outputs = steps.classification_step(model, optimizer, batch, global_batch_size)
    return {"xent" if name == "loss" else name: value for name, value in outputs.items()}
