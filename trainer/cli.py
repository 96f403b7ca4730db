"""What every entry point does with a mistake: one line on stderr and a meaningful exit code.

Exit codes (docs/design.md): 2 a user mistake (bad flag, gin, TF_CONFIG, data path), 1 a run
that could not go on; absl alone would print usage and exit 1 for a bad flag.
"""
from __future__ import annotations

import sys
from typing import NoReturn

from absl import flags, logging


def fail(message: str, exit_code: int = 2) -> NoReturn:
    """Prints `error: <first line of message>` to stderr and exits."""
    first_line = message.strip().splitlines()[0] if message.strip() else "unknown error"
    # TensorFlow warns at shutdown about objects it half-restored; the error must stay the last line.
    logging.set_verbosity(logging.ERROR)
    if "tensorflow" in sys.modules:
        sys.modules["tensorflow"].get_logger().setLevel("ERROR")
    print(f"error: {first_line}", file=sys.stderr, flush=True)
    sys.exit(exit_code)


def parse_flags(argv: list[str]) -> list[str]:
    """absl's parser for `app.run(..., flags_parser=parse_flags)`: a bad flag exits 2 in one line."""
    try:
        return flags.FLAGS(argv)
    except flags.Error as e:
        fail(f"{e}; see --helpfull")
