"""Runtime made, input checked, task built: what `train` trains, and what `experiments.bench`,
`trainer.parity` and the sidecar build the same way from the same `Settings`."""

from __future__ import annotations

import contextlib
from typing import Iterator

import keras

from trainer.distribution.runtime import Runtime, make_runtime
from trainer.errors import UserError
from trainer.run.settings import Settings
from trainer.task import steps
from trainer.task.task import Task, build_task
from trainer.task.user_code import built_at_import, user_functions

# The user's functions `build_task` calls: what one of them raises is one line naming it, with
# its own frames above (the steps are traced later, trainer/safety/tracing.py).
USER_FUNCTIONS = ("model_fn", "optimizer_fn")


def setup(settings: Settings) -> tuple[Runtime, Task]:
    """The runtime (devices first: they are split before any TensorFlow op runs), then the
    input checked against the batch size, then the task under the strategy's scope."""
    with _diagnosing_import_time_models():
        runtime = make_runtime(settings)
    inp = settings.make_input()
    inp.print_fn = settings.print_fn  # a long count of a split of unknown size says how far it got
    inp.validate()
    steps.check_examples(
        inp.element_spec,
        input_named=settings.input_named,
        step_fn=settings.step_fn,
        eval_step_fn=settings.eval_step_fn,
    )
    inp.check_sizes(settings.global_batch_size)
    runtime.check_batch_size(settings.global_batch_size)
    if not inp.deterministic:
        settings.print_fn(
            f"warning: {inp!r} declares deterministic = False: a resumed run does not see exactly the "
            "batches an uninterrupted one would, and eval counts are only as exact as its output"
        )
    keras.utils.set_random_seed(settings.seed)
    functions = {f"train.{name}": getattr(settings, name) for name in USER_FUNCTIONS}
    with user_functions(functions), _diagnosing_import_time_models():
        task = build_task(
            runtime,
            inp,
            model_fn=settings.model_fn,
            optimizer_fn=settings.optimizer_fn,
            step_fn=settings.step_fn,
            eval_step_fn=settings.eval_step_fn,
            global_batch_size=settings.global_batch_size,
            total_steps=settings.total_steps,
        )
    return runtime, task


@contextlib.contextmanager
def _diagnosing_import_time_models() -> Iterator[None]:
    """A failure of the device setup or the task's build, where a user module built a model at import,
    is that model's doing (TensorFlow started early, variables outside the scope): one line naming it."""
    try:
        yield
    except Exception as e:  # noqa: BLE001  (only re-raised as the cause where one is found)
        # A UserError of its own is another mistake, unless TensorFlow refused the device setup.
        refused_devices = isinstance(e, UserError) and isinstance(e.__cause__, RuntimeError)
        if (isinstance(e, UserError) and not refused_devices) or not (found := built_at_import()):
            raise
        what = f"{e.__cause__}" if refused_devices else f"{type(e).__name__}"
        raise UserError(
            f"{found[0]} was built when its module was imported, outside the strategy's scope and "
            f"before the run set up its devices, and the run failed on it ({what}); build models inside "
            "train.model_fn, which the run calls under the strategy's scope"
        ) from e
