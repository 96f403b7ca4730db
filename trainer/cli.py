"""What every entry point does with a mistake (one line on stderr; exit 2 a user mistake, 1 a run that could
not go on, 130 Ctrl-C: docs/design.md), and how its process ends (without the interpreter's teardown)."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import traceback
from typing import Callable, Iterator, NoReturn

from absl import flags, logging

from trainer import internals

INTERRUPTED_EXIT_CODE = 128 + signal.SIGINT  # 130, what a shell reports for Ctrl-C


def fail(message: str, exit_code: int = 2) -> NoReturn:
    first_line = message.strip().splitlines()[0] if message.strip() else "unknown error"
    # TensorFlow warns at shutdown about objects it half-restored; the error must stay the last line.
    logging.set_verbosity(logging.ERROR)
    if "tensorflow" in sys.modules:
        sys.modules["tensorflow"].get_logger().setLevel("ERROR")
    print(f"error: {first_line}", file=sys.stderr, flush=True)
    sys.exit(exit_code)


def say_interrupted() -> None:
    """The line of a Ctrl-C while no training loop runs (during training: trainer/extensions/preemption.py)."""
    print("interrupted; rerun the same command to continue", file=sys.stderr, flush=True)


def import_tensorflow_quietly() -> None:
    """An entry point's import of TensorFlow, without its load-time notices (trainer/quiet_start.py); Ctrl-C
    in the seconds it takes is the interrupted line and exit 130."""
    from trainer import quiet_start

    try:
        quiet_start.import_tensorflow()
    except KeyboardInterrupt:
        say_interrupted()
        flush_and_exit(INTERRUPTED_EXIT_CODE)


def parse_flags(argv: list[str]) -> list[str]:
    """absl's flags parser: a bad flag exits 2 in one line; --help and --helpfull exit 0 (absl's exit 1)."""
    try:
        return flags.FLAGS(argv)
    except flags.Error as e:
        fail(f"{e}; see --helpfull")
    except SystemExit as e:  # raised while parsing only by absl's help flags, once the help is out
        sys.exit(0 if e.code == 1 else e.code)


def exit_without_teardown(
    run: Callable[[list[str]], None], coordinates_ps_cluster: Callable[[], bool]
) -> Callable[[list[str]], None]:
    """Wraps an entry point's `run` so that its process ends, once the outcome is out, without the
    interpreter's teardown of TensorFlow and Keras (about a CPU second per process, for nothing).

    What matters of a normal exit is kept, in the interpreter's order: threading's exit callbacks and joins,
    the atexit handlers, the flush. A ParameterServer coordinator skips those too: TensorFlow's would reach
    the stopped servers again (an error each) or hang on a dead ps. An uncaught exception leaves as usual.
    """

    def leave(code: int) -> NoReturn:
        if not coordinates_ps_cluster():
            internals.run_exit_handlers()
        flush_and_exit(code)

    # os._exit inside each `except`: once the exception is dropped, the frames it holds are
    # freed and their tf.functions try to unregister themselves from a stopped server.
    def wrapped(argv: list[str]) -> None:
        try:
            run(argv)
        except SystemExit as e:
            leave(e.code if isinstance(e.code, int) else (0 if e.code is None else 1))
        except Exception:
            if not coordinates_ps_cluster():
                raise
            traceback.print_exc()
            leave(1)
        leave(0)

    return wrapped


def flush_and_exit(code: int) -> NoReturn:
    """Flushes stdout and stderr (a reader that went away is no error) and ends the process at once."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (BrokenPipeError, OSError):
            pass
    os._exit(code)


@contextlib.contextmanager
def sigterm_unwinds() -> Iterator[None]:
    """SIGTERM raises SystemExit(143) inside the block, so its `finally` blocks end the processes it
    started (servers, bench workers) instead of leaving them behind."""

    def handler(signum, frame):
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
