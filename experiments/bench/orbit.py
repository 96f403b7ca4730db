"""The `orbit` worker: the same model, optimizer, step, distributed input and strategy as ours,
trained by Orbit (TensorFlow Model Garden's loop library): an `orbit.Controller` over an
`orbit.StandardTrainer`, as a Model Garden user would write it.

Orbit comes from the tf-models-official wheel, installed without its dependencies (its metadata
pins another TensorFlow); the project does not depend on it, so `missing()` says in one line
how to get it and the bench reports the variant as not runnable without it.

What Orbit is given, so that its work between steps matches ours:
- its train loop is Orbit's own (`use_tf_function`, `use_tf_while_loop`): `steps_per_loop`
  calls of `train_step`, which runs the config's step with `strategy.run` on `next(iterator)`
  of our distributed dataset, SUM-reduces the outputs into Keras `Mean` metrics and counts the
  global step;
- its Controller ends a loop call where ours does (at `steps_per_loop` and on the log and
  checkpoint boundaries: `steps_per_loop` is a function of the step, as Orbit allows) and
  writes what `train_loop_end` returns as TensorBoard summaries after every call, so
  `train_loop_end` returns the means only at `log_every_steps` boundaries (Controller's
  `summary_interval` gates only `tf.summary` calls inside the step, which this step makes none
  of; it also writes its own steps/s after every call, which is Orbit's cost);
- its `tf.train.CheckpointManager` saves every `checkpoint_every_steps` (counted from step 0,
  as ours; left to itself it would also save right after the first call).
No eval (as for fit): ours evaluates once, after the last measured step.
"""

from __future__ import annotations

import tempfile

from experiments.bench.config import setup, train_data
from experiments.bench.protocol import Channel

INSTALL = "tf-models-official==2.20.0"


def missing() -> str | None:
    """Why the orbit variant cannot run here (with how to install it), or None when it can."""
    try:
        import orbit  # noqa: F401
    except ImportError as e:
        return (
            f"orbit is not importable ({e}): install it with `python -m experiments.bench --install_orbit` "
            f"(pip install --no-deps {INSTALL})"
        )
    return None


def next_call(step: int, settings) -> int:
    """The length of the loop call from `step`: `steps_per_loop`, cut at the next log or checkpoint boundary."""
    return min(
        settings.steps_per_loop,
        *(every - step % every for every in (settings.log_every_steps, settings.checkpoint_every_steps) if every > 0),
    )


def run_orbit(settings, channel: Channel) -> None:
    """Trains to the steps the parent asks for, with Orbit's Controller and a StandardTrainer."""
    import keras
    import orbit
    import tensorflow as tf

    from trainer.loops.totals import reduce_outputs
    from trainer.update import xla

    dist, task = setup(settings)
    gb, log_every = settings.global_batch_size, settings.log_every_steps
    dataset = train_data(dist, task.input, settings)
    step = xla.replica_step(dist, task.step_fn, task.models, task.optimizers, gb, jit_compile=settings.jit_compile)
    global_step = task.global_step
    # One step's reduced outputs, traced now on the batch spec for their names (the metrics must exist
    # before Orbit traces its loop, which then calls this trace instead of tracing the step again).
    one_step = tf.function(lambda batch: reduce_outputs(dist, dist.run(step, args=(batch,))))
    names = list(one_step.get_concrete_function(dataset.element_spec).structured_outputs)

    class Trainer(orbit.StandardTrainer):
        """Orbit's inner loop around our step; Keras metrics reset after each logged read."""

        def __init__(self):
            with dist.scope():
                self.means = {name: keras.metrics.Mean(name=name) for name in names}
            super().__init__(dataset, orbit.StandardTrainerOptions(use_tf_function=True, use_tf_while_loop=True))

        def train_step(self, iterator):
            for name, value in one_step(next(iterator)).items():
                self.means[name].update_state(value)
            global_step.assign_add(1)

        def create_train_loop_fn(self):
            self.loop_fn = super().create_train_loop_fn()  # kept for its tracing count
            return self.loop_fn

        def train_loop_end(self):
            if log_every <= 0 or int(global_step.numpy()) % log_every:
                return None
            work["records"] += 1
            results = {name: mean.result() for name, mean in self.means.items()}
            for mean in self.means.values():
                mean.reset_state()
            return results

    class CountingManager(tf.train.CheckpointManager):
        """Orbit's checkpoint manager, counting the saves it writes (a save off the interval writes none)."""

        def save(self, *args, **kwargs):
            path = super().save(*args, **kwargs)
            work["checkpoints"] += path is not None
            return path

    work = {"checkpoints": 0, "records": 0}  # since the last report
    trainer = Trainer()
    with tempfile.TemporaryDirectory(prefix="bench-orbit-") as model_dir:
        manager = CountingManager(
            tf.train.Checkpoint(**task.checkpoint_items),
            model_dir,
            max_to_keep=settings.keep_checkpoints,
            step_counter=global_step,
            checkpoint_interval=settings.checkpoint_every_steps,
            last_checkpoint_step=0,
        )
        controller = orbit.Controller(
            global_step=global_step,
            trainer=trainer,
            strategy=dist,
            steps_per_loop=lambda at: next_call(at, settings),
            checkpoint_manager=manager,
            summary_dir=model_dir,
        )
        controller.train(steps=1, checkpoint_at_completion=False)
        channel.done = 1
        until = channel.ready()
        work.update(checkpoints=0, records=0)
        while until is not None:
            controller.train(steps=until, checkpoint_at_completion=False)
            channel.done = until
            until = channel.chunk_done(**work)
            work.update(checkpoints=0, records=0)
        channel.finished(trainer.loop_fn.experimental_get_tracing_count())
