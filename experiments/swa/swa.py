"""Stochastic weight averaging as a user extension: written only against trainer's public protocol.

SWA (Izmailov et al., 2018) keeps the running mean of the weights taken every `every_steps`
steps from `start_step` on, and evaluates (and, if asked, exports) that mean instead of the last
weights. As an extension it shows every power a built-in feature has:

- `supports`: the synchronous strategies (under parameter_server there is no single set of
  weights at a step to average); the run refuses it elsewhere in one line, before anything runs;
- `check(settings)`: its own options against the run's, before any TensorFlow op;
- `attach(context)`: the averages are variables made under the strategy's scope and added to the
  checkpoint (`swa`), and, with `export=True`, offered to the export as the weights to write;
- `state_dict`/`load_state_dict`: how many snapshots the mean holds, saved in every checkpoint,
  so a run killed and restarted averages exactly as one that never stopped;
- `every_steps`: loop calls end on its boundaries, where `after_loop` takes a snapshot;
- after the run's eval (`after = ("eval",)`), its own eval entries: split `<split>_swa`, as an
  `AveragedWeights` extension, whose weights `--mode=evaluate` re-evaluates too.

    train.extensions = [@swa()]
    swa.start_step = 300
    swa.every_steps = 20
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import gin
import tensorflow as tf

from trainer.errors import UserError
from trainer.extensions import SYNCHRONOUS, AveragedWeights, Context, Outputs
from trainer.extensions.export import EXPORT_WEIGHTS, ExportWeights


class SwaAverages(tf.Module):
    """The running means, one per trainable variable of the model(s), in the checkpoint as `swa`."""

    def __init__(self, weights: list):
        super().__init__(name="swa")
        self.means = [
            tf.Variable(
                tf.convert_to_tensor(w),
                trainable=False,
                name=f"swa_{i}",
                aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA,
            )
            for i, w in enumerate(weights)
        ]


@gin.configurable("swa")
class StochasticWeightAveraging(AveragedWeights):
    """The mean of the weights at every `every_steps`-th step from `start_step` on.

    Args:
      start_step: the first step whose weights enter the mean (a multiple of every_steps).
      every_steps: steps between two snapshots.
      export: the export (train.export_saved_model) writes the mean instead of the last weights.
    """

    name = "swa"
    weights_label = "SWA"
    supports = SYNCHRONOUS
    unsupported_reason = "asynchronous workers hold no single set of weights at a step to average"
    after = ("eval",)

    def __init__(self, start_step: int = 100, every_steps: int = 10, export: bool = False):
        for key, value in (("start_step", start_step), ("every_steps", every_steps)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise UserError(f"swa.{key} must be a positive integer, got {value!r}")
        if start_step % every_steps:
            raise UserError(f"swa.start_step {start_step} must be a multiple of swa.every_steps {every_steps}")
        self.start_step, self.every_steps, self.export = start_step, every_steps, bool(export)
        self.count = 0  # snapshots in the mean
        self._evaluated: int | None = None

    def check(self, settings: Any) -> None:
        if self.start_step > settings.total_steps:
            raise UserError(
                f"swa.start_step {self.start_step} is after train.total_steps {settings.total_steps}: "
                "nothing would be averaged"
            )

    def attach(self, context: Context) -> None:
        models = context.task.models
        self._weights = [
            v for m in (models.values() if isinstance(models, dict) else [models]) for v in m.trainable_variables
        ]
        with context.scope():
            self.averages = SwaAverages(self._weights)
        context.add_checkpoint_item("swa", self.averages)
        if self.export:
            context.provide(EXPORT_WEIGHTS, ExportWeights("SWA weights", self.swapped_in, {"swa": self.averages}))

    def verify(self, outputs: Outputs) -> None:
        if not outputs.eval:
            raise UserError("swa evaluates the averaged weights beside the raw ones, but the run has no eval split")

    def state_dict(self) -> dict[str, Any]:
        return {"count": self.count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.count = int(state["count"])

    def after_loop(self, context: Context, step: int, metrics: dict[str, float]) -> None:
        if step >= self.start_step and step % self.every_steps == 0 and self._snapshots_at(step) > self.count:
            self._add_snapshot()
        if context.evaluations.at(step) is not None and self.holds_weights() and self._evaluated != step:
            self.evaluate_weights(context, step)
            self._evaluated = step

    def end(self, context: Context, step: int) -> None:
        self.after_loop(context, step, {})  # the final eval, if it was not at a boundary

    def holds_weights(self) -> bool:
        return self.count > 0

    def _snapshots_at(self, step: int) -> int:
        return (step - self.start_step) // self.every_steps + 1

    def _add_snapshot(self) -> None:
        """mean += (w - mean) / (n + 1): every replica's copy gets the same value (cross-replica context)."""
        n = tf.constant(self.count + 1, tf.float32)
        for mean, weight in zip(self.averages.means, self._weights):
            value = tf.convert_to_tensor(weight)
            mean.assign(tf.convert_to_tensor(mean) + (value - tf.convert_to_tensor(mean)) / tf.cast(n, value.dtype))
        self.count += 1

    @contextlib.contextmanager
    def swapped_in(self) -> Iterator[None]:
        """The model holds the means inside the block, its own weights again after it."""
        held = [tf.identity(tf.convert_to_tensor(w)) for w in self._weights]
        for weight, mean in zip(self._weights, self.averages.means):
            weight.assign(tf.convert_to_tensor(mean))
        try:
            yield
        finally:
            for weight, value in zip(self._weights, held):
                weight.assign(value)
