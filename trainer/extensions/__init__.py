"""Extensions: every optional feature, built in or a researcher's own, through one protocol.

Public: `Extension` (subclass it), `Setup` (what `attach` gets), `Outputs` (what `verify` gets),
and the strategy declarations of trainer.distribution.modes (`ALL`, `SYNCHRONOUS`, `support`).
Writing one: docs/extensions.md.
"""

from trainer.distribution.modes import ALL, SYNCHRONOUS, support
from trainer.extensions.protocol import Extension, Outputs, Setup

__all__ = ["ALL", "Extension", "Outputs", "SYNCHRONOUS", "Setup", "support"]
