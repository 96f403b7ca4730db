"""Test extensions that let a test act on a run at a known point, not after a fixed sleep: a run held
still at a step (the test waits for the step's line in metrics.jsonl and kills it there; the run
cannot race on to a later checkpoint or to its end while the test's process waits for a core on a
loaded machine), and a line once the run's signal handlers are installed."""

import time

import gin

from trainer.extensions import Extension


@gin.configurable
class HoldAt(Extension):
    """After the loop call that ends at `step` (or first past it), sleeps `secs`: until killed. The
    step's line is logged by then (the progress logger runs first) and its periodic checkpoint not
    written (a user's extensions run before it): a run killed there resumes from an earlier checkpoint."""

    name = "hold_at"
    after = ("progress",)  # the step's line first

    def __init__(self, step: int, secs: float = 600.0):
        self.step, self.secs = step, secs

    def after_loop(self, context, step, metrics):
        if step >= self.step:
            time.sleep(self.secs)


@gin.configurable
class SayBegun(Extension):
    """Prints `begun` once the extensions before it have begun, Ctrl-C's among them: a test that
    signals the run after this line finds its handlers installed."""

    name = "say_begun"
    after = ("preemption",)  # its signal handlers first

    def begin(self, context):
        print("begun", flush=True)
