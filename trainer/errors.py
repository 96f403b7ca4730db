"""User mistakes, kept apart from bugs so that entry points can exit 2 with one line."""


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
