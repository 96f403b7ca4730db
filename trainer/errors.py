"""User mistakes, kept apart from bugs so that entry points can exit 2 with one line."""


class UserError(Exception):
    """A mistake the user can fix (bad flag, gin, TF_CONFIG, data path).

    Entry points print `str(error)` on one line to stderr and exit with code 2.
    The message names the problem and the fix.
    """

    # Raised while a tf.function traces user code (a step returning a list, say): AutoGraph
    # re-raises errors with its own multi-line "in user code" trace unless they carry this.
    ag_pass_through = True


class RunFailure(Exception):
    """A run that cannot go on for a reason outside the code: a dead peer, a lost ps task.

    Entry points print it on one line and exit 1; the message says what to do next
    (usually: restart, and the run continues from the newest checkpoint).
    """
