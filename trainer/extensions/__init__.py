"""Extensions: every feature around the loop, built in or a researcher's own, through one protocol.

Public: `Extension` (subclass it), `Context` (what every stage but `check` and `verify` gets),
`Outputs` (what `verify` gets), and the strategy declarations of trainer.distribution.modes
(`ALL`, `SYNCHRONOUS`, `support`). Writing one: docs/extensions.md.
"""

from trainer.distribution.modes import ALL, SYNCHRONOUS, support
from trainer.extensions.context import Context
from trainer.extensions.protocol import Extension, Outputs

__all__ = ["ALL", "Context", "Extension", "Outputs", "SYNCHRONOUS", "support"]
