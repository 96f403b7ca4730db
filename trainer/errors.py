"""User mistakes, kept apart from bugs so that entry points can exit 2 with one line; run failures
(exit 1, one line too); and `error_line`, the one way an exception becomes that line's detail."""

from __future__ import annotations

import re

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_ERROR_LINE = re.compile(r"^\s*(\w+(?:Error|Exception)): (.*)$")
_NOT_WHAT = ("Traceback", "File ", "in user code", "Graph execution error", "Detected at node", "<stack")
MAX_LINE = 300


class UserError(Exception):
    """A mistake the user can fix (bad flag, gin, TF_CONFIG, data path).

    Entry points print `str(error)` on one line to stderr and exit with code 2.
    The message names the problem and the fix.
    """

    # Raised while a tf.function traces user code (a step returning a list, say): AutoGraph
    # re-raises errors with its own multi-line "in user code" trace unless they carry this.
    ag_pass_through = True

    @property
    def details(self) -> str:
        """Text printed above the one line: the user's own frames of an exception their code raised.

        Read through an attribute of the instance, so that it survives gin's re-raise of the
        exception as a proxy (which looks up only what its class lacks on the original)."""
        return getattr(self, "_details", "")


class UserCodeError(UserError):
    """An exception the user's own function raised (an input function whose file is missing, a
    Keras callback with a bug): the one line names the function, its gin binding and the
    exception; `details` holds that function's frames only (none of TensorFlow's, Keras' or
    ours), as a traceback would show them, for the entry point to print above the line."""

    def __init__(self, message: str, details: str = ""):
        super().__init__(message)
        self._details = details


class RunFailure(Exception):
    """A run that cannot go on for a reason outside the code: a dead peer, a lost ps task.

    Entry points print it on one line and exit 1; the message says what to do next
    (usually: restart, and the run continues from the newest checkpoint).
    """


def error_line(error: BaseException) -> str:
    """What happened, in one line, for a message that names it: TensorFlow's graph errors put it
    below "Graph execution error", the nodes and the stack ("Detected at node ... File ..."); for
    an error AutoGraph re-raised with the trace of the user's code ("in user code: File ...
    ValueError: ..."), the original error's own message."""
    text = _ANSI.sub("", re.sub(r"\{\{function_node [^}]*\}\}\s*", "", str(error)))
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for index, line in enumerate(lines):
        if match := _ERROR_LINE.match(line):  # the innermost error AutoGraph quotes, then its detail
            detail = (
                " ".join(lines[index + 1 : index + 2])
                if match.group(2).startswith("Exception encountered")
                else match.group(2)
            )
            return _shortened(f"{match.group(1)}: {detail}")
    return next((_shortened(line) for line in lines if not line.startswith(_NOT_WHAT)), type(error).__name__)


def _shortened(line: str) -> str:
    """`line` without its final stop; a line longer than `MAX_LINE` ends after its last whole
    sentence that fits (else its last whole word, then "..."), never inside a word."""
    line = line.rstrip(".: ")
    if len(line) <= MAX_LINE:
        return line
    head = line[:MAX_LINE]
    end = head.rfind(". ")
    if end > 0:
        return head[:end]
    return head[: head.rfind(" ")].rstrip(",;:") + "..." if " " in head else head + "..."


def peer_failure(error: BaseException, when: str, lost: str, latest_checkpoint: str | None = None) -> RunFailure:
    """Training stopped by a collective or remote call that failed because another task of the
    cluster died or hangs: when, the error's own line, what was lost, and where a rerun continues
    (`latest_checkpoint`, if the caller knows it)."""
    resume = (
        f"a rerun continues from {latest_checkpoint}"
        if latest_checkpoint
        else "rerun the same command to continue from the newest checkpoint (if there is one)"
    )
    return RunFailure(f"training failed {when} ({type(error).__name__}: {error_line(error)}); {lost}; {resume}")
