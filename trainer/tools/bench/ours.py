"""The `ours` worker: `trainer.train.train` itself, unchanged, with its default hooks, in a
temporary model_dir, plus one hook that paces it from the parent."""
from __future__ import annotations

import sys
import tempfile
import time

from trainer.hooks.base import Hook
from trainer.tools.bench.config import refuse_asynchronous
from trainer.tools.bench.protocol import Channel


class Pacer(Hook):
    """Ends a loop call at each step the parent asks for, reports, waits for the next."""

    def __init__(self, channel: Channel):
        self.channel = channel
        self.until: int | None = None
        self.started = 0.0

    def begin(self, run):
        self.until = run.start_step + 1  # the first call: one step

    def steps_to_boundary(self, step):
        return self.until - step if self.until is not None and self.until > step else None

    def after_loop(self, run, step, metrics):
        self.channel.done = step
        if step != self.until:
            return
        if step == run.start_step + 1:
            self.until = self.channel.ready()
        else:
            self.until = self.channel.chunk_done(time.monotonic() - self.started)
        if self.until is None:
            self.channel.finished(run.loop.trace_count)
        self.started = time.monotonic()


def run_ours(settings, channel: Channel, total_steps: int) -> None:
    """Trains `total_steps` measured steps (and one more: the final eval and checkpoint come after)."""
    import gin

    from trainer import configurables

    refuse_asynchronous(settings, "trainer.bench")
    with tempfile.TemporaryDirectory(prefix="bench-ours-") as model_dir:
        configurables.train(
            model_dir=model_dir, total_steps=total_steps + 1, eval_every_steps=total_steps + 1,
            hooks=[*settings.hooks, Pacer(channel)], describe_config=gin.operative_config_str,
            print_fn=lambda line: print(line, file=sys.stderr, flush=True),
        )
