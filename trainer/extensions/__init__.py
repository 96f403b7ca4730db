"""Extensions: every feature around the loop, built in or a researcher's own, through one protocol.
Public: `Extension`, `AveragedWeights` (one holding weights the run evaluates beside the model's), `Context`,
`Outputs` and the strategy declarations `ALL`, `SYNCHRONOUS`,
`support` (trainer.distribution.modes). Writing one: docs/extensions.md.
"""

from trainer.distribution.modes import ALL, SYNCHRONOUS, support
from trainer.extensions.averaged_weights import AveragedWeights
from trainer.extensions.context import Context
from trainer.extensions.protocol import Extension, Outputs

__all__ = ["ALL", "AveragedWeights", "Context", "Extension", "Outputs", "SYNCHRONOUS", "support"]
