"""Runtime made, input checked, task built: what `train` trains, and what `trainer.bench`,
`trainer.parity` and the sidecar build the same way from the same `Settings`."""
from __future__ import annotations

import keras

from trainer.distribution.runtime import Runtime, make_runtime
from trainer.run.settings import Settings
from trainer.task.task import Task, build_task


def setup(settings: Settings) -> tuple[Runtime, Task]:
    """The runtime (devices first: they are split before any TensorFlow op runs), then the
    input checked against the batch size, then the task under the strategy's scope."""
    runtime = make_runtime(settings.runtime)
    inp = settings.make_input()
    inp.print_fn = settings.print_fn  # a long count of a split of unknown size says how far it got
    inp.validate()
    inp.check_sizes(settings.global_batch_size)
    runtime.check_batch_size(settings.global_batch_size)
    if not inp.deterministic:
        settings.print_fn(f"warning: {inp!r} declares deterministic = False: a resumed run does not see exactly the "
                          "batches an uninterrupted one would, and eval counts are only as exact as its output")
    keras.utils.set_random_seed(settings.seed)
    task = build_task(runtime, inp, model_fn=settings.model_fn, optimizer_fn=settings.optimizer_fn,
                      step_fn=settings.step_fn, eval_step_fn=settings.eval_step_fn,
                      global_batch_size=settings.global_batch_size, total_steps=settings.total_steps)
    return runtime, task
