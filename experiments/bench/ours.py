"""The `ours` worker: `trainer.train.train` itself, unchanged, with its default hooks, in a
temporary model_dir, plus one hook that paces it from the parent; `ours_async` is the same with
`train.async_checkpoint = True`, so that the two side by side show what the saves cost; `ours_tf_data`
the same with `train.device_data_max_bytes = 0`, so that the two show what holding the train split on
the devices (trainer/data/device.py) gains over the tf.data pipeline."""

from __future__ import annotations

import sys
import tempfile

from experiments.bench.config import refuse_asynchronous
from experiments.bench.protocol import Channel
from trainer.extensions.protocol import Extension


class Pacer(Extension):
    """Ends a loop call at each step the parent asks for, reports (with the checkpoints and train records
    written since the last report, and the seconds the run spent in its compiled step calls), waits for
    the next; ends the run when told to finish. It runs before the checkpoint hook, so the save at a
    chunk's last step falls into the next chunk: each chunk of a checkpoint interval holds one."""

    def __init__(self, channel: Channel):
        self.channel = channel
        self.until: int | None = None
        self.saved_step: int | None = None
        self.work = {"checkpoints": 0, "records": 0}
        self.train_seconds = 0.0  # the run's seconds in compiled step calls when the chunk began

    def begin(self, context):
        self.until = context.start_step + 1  # the first call: one step
        context.metrics_log.subscribe(self._record)

    def _record(self, step, split, metrics):
        self.work["records"] += split == "train"

    def steps_to_boundary(self, step):
        return self.until - step if self.until is not None and self.until > step else None

    def after_loop(self, context, step, metrics):
        self.channel.done = step
        if context.saver.last_saved_step != self.saved_step:
            self.saved_step = context.saver.last_saved_step
            self.work["checkpoints"] += 1
        if step != self.until:
            return
        if step == context.start_step + 1:
            self.until = self.channel.ready()
        else:
            self.until = self.channel.chunk_done(
                step_seconds=context.clock.train_seconds - self.train_seconds, **self.work
            )
        self.work = dict.fromkeys(self.work, 0)
        self.train_seconds = context.clock.train_seconds
        if self.until is None:  # the bench has measured enough: the run ends now, however many steps are left
            context.request_stop()

    def end(self, context, step):
        self.channel.finished(context.loop.trace_count)  # only once the run has ended: a run that went on is seen


def run_ours(
    settings, channel: Channel, total_steps: int, *, async_checkpoint: bool = False, tf_data: bool = False
) -> None:
    """Trains up to `total_steps` measured steps (and one more: the final eval and checkpoint come after),
    ending early where the parent says it has measured enough;
    `async_checkpoint`: with `train.async_checkpoint = True`; `tf_data`: the train data through tf.data."""
    import gin

    from trainer import configurables

    refuse_asynchronous(settings, "experiments.bench")
    with tempfile.TemporaryDirectory(prefix="bench-ours-") as model_dir:
        configurables.train(
            model_dir=model_dir,
            total_steps=total_steps + 1,
            eval_every_steps=total_steps + 1,
            extensions=[*settings.extensions, Pacer(channel)],
            describe_config=gin.operative_config_str,
            print_fn=lambda line: print(line, file=sys.stderr, flush=True),
            async_checkpoint=async_checkpoint or settings.async_checkpoint,
            **({"device_data_max_bytes": 0} if tf_data else {}),
        )
