"""What every entry point shares (trainer/cli.py, trainer/quiet_start.py): a mistake is one `error:`
line and exit 2, SIGTERM unwinds the `finally` blocks, a decided process leaves with its code without
the interpreter's teardown, and TensorFlow's start-up notices are filtered as TF_CPP_MIN_LOG_LEVEL says.
The entry points themselves: tests/test_main.py, tests/test_launch.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from absl import app, flags

from tests.support import REPO
from trainer import cli, quiet_start


def test_fail_prints_the_first_line_of_the_message_and_exits_with_its_code(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.fail("train.total_steps must be positive; set train.total_steps\nTraceback (most recent call last):")
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == "error: train.total_steps must be positive; set train.total_steps\n"
    with pytest.raises(SystemExit) as exit_info:
        cli.fail("   ", exit_code=1)
    assert exit_info.value.code == 1 and capsys.readouterr().err == "error: unknown error\n"


@pytest.fixture
def unparsed_flags():
    """absl's flags are the process's: put back as they were."""
    parsed = flags.FLAGS.is_parsed()
    yield flags.FLAGS
    if not parsed:
        flags.FLAGS.unparse_flags()


def test_a_bad_flag_is_one_error_line_and_help_exits_0(capsys, unparsed_flags):
    """absl exits 1 for --help and raises for a bad flag; the entry points exit 0 and 2."""
    with pytest.raises(SystemExit) as exit_info:
        cli.parse_flags(["prog", "--no_such_flag_anywhere=1"])
    assert exit_info.value.code == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("error: ") and "no_such_flag_anywhere" in line and line.endswith("; see --helpfull")
    app.define_help_flags()  # what app.run does first: --help prints the help and exits 1
    with pytest.raises(SystemExit) as exit_info:
        cli.parse_flags(["prog", "--help"])
    assert exit_info.value.code == 0


def test_sigterm_in_the_block_runs_its_finally_and_exits_143():
    ended = []
    previous = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as exit_info:
        with cli.sigterm_unwinds():
            try:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(5)  # the handler raises in the main thread, ending the sleep
            finally:
                ended.append("servers stopped")
    assert exit_info.value.code == 143 and ended == ["servers stopped"]
    assert signal.getsignal(signal.SIGTERM) is previous


# A process that decided its outcome: the code it leaves with, its output flushed, its atexit
# handlers run (and, coordinating a ParameterServer cluster, not).
EXITING = """
import atexit, sys
from trainer import cli
atexit.register(lambda: print("atexit ran", flush=True))
def run(argv):
    print("outcome", argv[1], end="")
    {body}
cli.exit_without_teardown(run, lambda: {coordinates})(["prog", "x"])
"""


@pytest.mark.parametrize(
    "body, coordinates, code, stdout",
    [
        ("", False, 0, "outcome xatexit ran\n"),
        ("sys.exit(3)", False, 3, "outcome xatexit ran\n"),
        ("sys.exit('a message')", False, 1, "outcome xatexit ran\n"),
        ("sys.exit(0)", True, 0, "outcome x"),
        ("raise RuntimeError('lost a ps')", True, 1, "outcome x"),
    ],
)
def test_a_decided_process_exits_with_its_code_and_keeps_the_exit_handlers(body, coordinates, code, stdout):
    proc = subprocess.run(
        [sys.executable, "-c", EXITING.format(body=body, coordinates=coordinates)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (proc.returncode, proc.stdout) == (code, stdout), proc.stderr
    assert ("RuntimeError: lost a ps" in proc.stderr) == ("RuntimeError" in body)


NOTICES = [
    "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR",
    "I0000 00:00:1.000 1 cuda_executor.cc:1] Could not find cuda drivers on your machine, GPU will not be used.",
    "I0000 00:00:1.000 1 port.cc:153] oneDNN custom operations are on.",
    "E0000 00:00:1.000 1 cuda_executor.cc:2] failed call to cuInit: INTERNAL: CUDA error",
    "W0000 00:00:1.000 1 op.cc:3] a real warning",
    "Traceback (most recent call last):",
]


def test_start_up_notices_are_dropped_below_the_level_and_real_lines_kept():
    """The cuInit failure is the missing driver again (said in the same lines), not an error of the run."""
    assert quiet_start.kept_lines(NOTICES, 0) == NOTICES
    assert quiet_start.kept_lines(NOTICES, 1) == NOTICES[4:]
    assert quiet_start.kept_lines(NOTICES, 2) == quiet_start.kept_lines(NOTICES, 3) == NOTICES[5:]
    with_driver = [line for line in NOTICES if "cuda drivers" not in line]
    assert quiet_start.kept_lines(with_driver, 2) == [NOTICES[3], NOTICES[5]]  # a driver's failed cuInit stays
    # TensorFlow loaded before the capture (a notebook's earlier cell): the missing driver known otherwise.
    assert quiet_start.kept_lines(with_driver, 2, no_driver=True) == [NOTICES[5]]
