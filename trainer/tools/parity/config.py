"""gin `parity.*`, what the fit side needs that `train` does not say. Imports no Keras, so that the tf_keras
side can register and parse it before `keras` means tf_keras."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from trainer.errors import UserError


@dataclasses.dataclass(frozen=True)
class ParityConfig:
    """`loss`: fit's (our step computes its own), a Keras loss name or a gin reference to a loss function or
    object; None: the default step's SparseCategoricalCrossentropy(from_logits=True). `metric`: the eval output
    compared under parameter_server with several workers."""

    loss: str | Callable | None = None
    metric: str = "accuracy"

    def __post_init__(self) -> None:
        if self.loss is not None and not isinstance(self.loss, str) and not callable(self.loss):
            raise UserError(
                f"parity.loss must be a Keras loss name like 'mean_squared_error' or a @reference to "
                f"a loss function or object, got {self.loss!r}"
            )
        if not isinstance(self.metric, str) or not self.metric:
            raise UserError(f"parity.metric must name an output of train.eval_step_fn, got {self.metric!r}")

    def keras_loss(self) -> Any:
        """The loss for `model.compile`, made with whichever `keras` this process imports."""
        import keras

        if self.loss is None:
            return keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        try:
            return keras.losses.get(self.loss)
        except ValueError as e:
            raise UserError(f"parity.loss {self.loss!r} is not a Keras loss: {str(e).splitlines()[0]}") from e
