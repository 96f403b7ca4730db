"""What every entry point does with a mistake (one line on stderr and a meaningful exit code),
and how its process ends (without the interpreter's teardown once the outcome is out).

Exit codes (docs/design.md): 2 a user mistake (bad flag, gin, TF_CONFIG, data path), 1 a run
that could not go on, 130 Ctrl-C; absl alone would print usage and exit 1 for a bad flag.
"""

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
    """Prints `error: <first line of message>` to stderr and exits."""
    first_line = message.strip().splitlines()[0] if message.strip() else "unknown error"
    # TensorFlow warns at shutdown about objects it half-restored; the error must stay the last line.
    logging.set_verbosity(logging.ERROR)
    if "tensorflow" in sys.modules:
        sys.modules["tensorflow"].get_logger().setLevel("ERROR")
    print(f"error: {first_line}", file=sys.stderr, flush=True)
    sys.exit(exit_code)


def say_interrupted() -> None:
    """The line of a Ctrl-C while no training loop runs (setup, the final eval); during training
    the run saves first and says at which step (trainer/extensions/preemption.py)."""
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
    """absl's parser for `app.run(..., flags_parser=parse_flags)`: a bad flag exits 2 in one line;
    --help and --helpfull print the help and exit 0 (absl's own help flags exit 1, as a failure)."""
    try:
        return flags.FLAGS(argv)
    except flags.Error as e:
        fail(f"{e}; see --helpfull")
    except SystemExit as e:  # raised while parsing only by absl's help flags, once the help is out
        sys.exit(0 if e.code == 1 else e.code)


def exit_without_teardown(
    run: Callable[[list[str]], None], coordinates_ps_cluster: Callable[[], bool]
) -> Callable[[list[str]], None]:
    """Wraps an entry point's `run` so that its process ends, once the outcome is decided and
    printed, without the interpreter's teardown of TensorFlow and Keras.

    That teardown frees every module, graph and function one by one: about a CPU second per
    process after a short run, for nothing a finished run needs (by then the checkpoint writer
    has been waited for and the metrics log closed). What a normal exit does that matters is
    kept, in the interpreter's own order: threading's exit callbacks and the join of every
    non-daemon thread, then the atexit handlers (logging, MLflow, temporary directories), then
    stdout and stderr flushed. A ParameterServer coordinator (`coordinates_ps_cluster()`) skips
    those too: TensorFlow's would reach the stopped servers again, each attempt logging an error,
    and a dead ps makes them hang. An uncaught exception leaves as usual, with its traceback
    (a coordinator's printed first, for the same reason).
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
    """Flushes stdout and stderr (a reader that went away is no error) and ends the process with
    `code` at once, with no exit handler and no teardown."""
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
