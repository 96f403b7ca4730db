"""The `fit` worker: Keras 3 `model.fit` on the same model, optimizer, input pipeline and
strategy, with the step's loss and an accuracy metric, paced by a callback."""

from __future__ import annotations

from experiments.bench.config import setup
from experiments.bench.protocol import Channel


def tracing_count(function, name: str) -> int | None:
    """How often the `tf.function` called `name` in `function`'s closures was traced (Keras hides it)."""
    seen, todo = set(), [function]
    while todo:
        fn = todo.pop()
        if id(fn) in seen:
            continue
        seen.add(id(fn))
        if hasattr(fn, "experimental_get_tracing_count") and getattr(fn, "_name", None) == name:
            return fn.experimental_get_tracing_count()
        python_fn = getattr(fn, "python_function", fn)
        for cell in getattr(python_fn, "__closure__", None) or ():
            try:
                contents = cell.cell_contents
            except ValueError:
                continue
            if callable(contents):
                todo.append(contents)
    return None


def run_fit(settings, channel: Channel, steps_per_execution: int, total_steps: int) -> None:
    """Fits up to `total_steps` measured steps (and one call more, so that the last chunk ends where a call
    starts), stopping one call after the parent says it has measured enough."""
    import keras

    from trainer import data
    from trainer.update import xla

    dist, task = setup(settings)  # the optimizer built as ours (rule 1); fit would build it itself
    model, optimizer = task.models, task.optimizers
    with dist.scope():
        model.compile(
            optimizer=optimizer,
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
            steps_per_execution=steps_per_execution,
            # XLA where fit can compile the whole step (one device); Keras itself turns it off under a strategy.
            jit_compile=bool(settings.jit_compile) and xla.update_inside_xla(dist),
        )
    dataset = data.train_dataset(
        task.input, settings.global_batch_size, settings.seed, shard_policy=settings.shard_policy
    )

    class Pacer(keras.callbacks.Callback):
        """Paces fit from `on_train_batch_begin`: fit has synchronised with the previous call there
        (it reads the call's `has_value`), and a callback without batch-end methods leaves fit's
        asynchronous batch-end dispatch on, so fit runs as it would without this callback."""

        def __init__(self):
            super().__init__()
            self.until = steps_per_execution

        def on_train_batch_begin(self, batch, logs=None):
            channel.done = batch
            if batch != self.until:
                return
            if batch == steps_per_execution:
                self.until = channel.ready()
            else:
                self.until = channel.chunk_done()
            if self.until is None:
                self.model.stop_training = True  # after one more call, which is not measured

    model.fit(dataset, epochs=1, steps_per_epoch=total_steps + steps_per_execution, verbose=0, callbacks=[Pacer()])
    channel.finished(tracing_count(model.train_function, "multi_step_on_iterator"))
