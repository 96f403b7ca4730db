"""User mistakes, kept apart from bugs so that entry points can exit 2 with one line; run failures
(exit 1, one line too); and `error_line`, the one way an exception becomes that line's detail."""

from __future__ import annotations

import re

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_ERROR_LINE = re.compile(r"^\s*(\w+(?:Error|Exception)): (.*)$")
_KERAS_CALL = re.compile(r"^Exception encountered when calling (.+?)\.?$")  # Keras' wrapper of a layer's error
_NOT_WHAT = ("Traceback", "File ", "in user code", "Graph execution error", "Detected at node", "<stack")
MAX_LINE = 300


class UserError(Exception):
    """A mistake the user can fix; entry points print its one line (the problem and the fix), exit 2."""

    # Raised while a tf.function traces user code (a step returning a list, say): AutoGraph
    # re-raises errors with its own multi-line "in user code" trace unless they carry this.
    ag_pass_through = True

    @property
    def details(self) -> str:
        """Printed above the one line: the user's own frames. An instance attribute, so it survives gin's
        re-raise as a proxy (which looks up only what its class lacks on the original)."""
        return getattr(self, "_details", "")


class UserCodeError(UserError):
    """An exception the user's own function raised: the line names the function, its gin binding and the
    exception; `details` holds that function's frames only, as a traceback would show them."""

    def __init__(self, message: str, details: str = ""):
        super().__init__(message)
        self._details = details


class RunFailure(Exception):
    """A run that cannot go on for a reason outside the code (a dead peer): one line, exit 1."""


def error_line(error: BaseException) -> str:
    """What happened, in one line: for TensorFlow's graph errors the line below "Graph execution error"
    and the stack; for an error AutoGraph re-raised with the user's trace, the original's message; for
    an error in a Keras layer's call, its cause and the call (`layer_call_cause`)."""
    text = _ANSI.sub("", re.sub(r"\{\{function_node [^}]*\}\}\s*", "", str(error)))
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for index, line in enumerate(lines):
        match = _ERROR_LINE.match(line)  # the innermost error AutoGraph quotes, then its detail
        kind, message = match.groups() if match else (type(error).__name__, line)
        if layer := layer_call_cause([message, *lines[index + 1 :]]):
            return _shortened(f"{kind} in {layer[0]}: {layer[1]}")
        if match:
            return _shortened(f"{kind}: {message}")
    return next((_shortened(line) for line in lines if not line.startswith(_NOT_WHAT)), type(error).__name__)


def layer_call_cause(lines: list[str]) -> tuple[str, str] | None:
    """(the call, e.g. "Dense.call()", and the cause) where `lines` (an error's message, a line a list item)
    start with Keras' wrapper of an error raised in a layer's call ("Exception encountered when calling
    Dense.call()."), whose own message is the next line. The wrapper alone names neither the cause nor
    the layer that raised it."""
    wrapper = _KERAS_CALL.match(lines[0]) if lines else None
    return (wrapper.group(1), lines[1]) if wrapper and len(lines) > 1 else None


def _shortened(line: str) -> str:
    """`line` without its final stop, cut after its last whole sentence (else word, then "...") that fits."""
    line = line.rstrip(".: ")
    if len(line) <= MAX_LINE:
        return line
    head = line[:MAX_LINE]
    end = head.rfind(". ")
    if end > 0:
        return head[:end]
    return head[: head.rfind(" ")].rstrip(",;:") + "..." if " " in head else head + "..."


_TASK = re.compile(r"^/job:(\w+)/replica:\d+/task:(\d+)$", re.MULTILINE)  # a task on a line of its own


def named_tasks(error: BaseException) -> list[str]:
    """The tasks TensorFlow's error text lists, one a line (`/job:worker/replica:0/task:1` -> `worker 1`):
    a collective aborted because peers stopped sending heartbeats lists them so, below the line
    `error_line` keeps (a device's name in the text is not such a line)."""
    return sorted({f"{job} {task}" for job, task in _TASK.findall(str(error))})


def peer_failure(error: BaseException, when: str, lost: str, latest_checkpoint: str | None = None) -> RunFailure:
    """Training stopped by a call that failed because another task died or hangs: when, the error's
    line, the tasks that did not answer (where TensorFlow names them), what was lost, and where a
    rerun continues."""
    if tasks := named_tasks(error):
        lost = f"{lost}; not answering: {', '.join(tasks)}"
    resume = (
        f"a rerun continues from {latest_checkpoint}"
        if latest_checkpoint
        else "rerun the same command to continue from the newest checkpoint (if there is one)"
    )
    return RunFailure(f"training failed {when} ({type(error).__name__}: {error_line(error)}); {lost}; {resume}")
