"""Every use of another library's private API, one function each, where no public API does the job.

Each docstring says why the private API and what breaks if the library changes it;
tests/test_internals.py tries each against the installed version, so an upgrade that changes one
fails there, by name, at once. The libraries are imported inside the functions: `trainer.cli`
and the gin tools use this module without TensorFlow.
"""

from __future__ import annotations

from typing import Any, Callable


def gin_registry() -> Any:
    """gin's registry of configurables (`gin.config._REGISTRY`: selector -> `Configurable`, with
    `minimal_selector`). gin lists no configurables publicly (`get_configurable` takes one name);
    without this `--print_config`'s listing of every gin name and its parameters fails."""
    import gin

    return gin.config._REGISTRY  # noqa: SLF001


def record_operative(scope: str, selector: str, values: dict[str, Any]) -> None:
    """Records `values` as the operative parameters of the configurable `selector` in `scope`, as gin's
    wrapper does when it calls a configurable (`gin.config._OPERATIVE_CONFIG`, under its lock). Our
    bound function references (trainer/tools/gin_functions.py) call the function itself, not gin's
    wrapper, which is the only public way in; without this `operative_config.gin` misses them."""
    import gin

    with gin.config._OPERATIVE_CONFIG_LOCK:  # noqa: SLF001
        gin.config._OPERATIVE_CONFIG.setdefault((scope, selector), {}).update(values)  # noqa: SLF001


def run_exit_handlers() -> None:
    """What the interpreter's exit does first, in its order: threading's exit callbacks and the join
    of every non-daemon thread (`threading._shutdown`), then the atexit handlers
    (`atexit._run_exitfuncs`), for a process that then ends with `os._exit` (trainer/cli.py).
    Python has no public call for either short of a full exit; without them MLflow, logging and
    temporary directories are not finished at the end of a run."""
    import atexit
    import threading

    threading._shutdown()  # noqa: SLF001
    atexit._run_exitfuncs()  # noqa: SLF001


def keras_layers_in(module: Any) -> list:
    """The Keras layers a `tf.Module` holds (as attributes, in lists or dicts), outermost first
    (`tf.Module._flatten`). Keras 3 layers are no tf.Modules, so the public `submodules` skips
    them; without this the layers of a tf.Module model (wide and deep) are not found."""
    import keras

    return list(module._flatten(predicate=lambda x: isinstance(x, keras.layers.Layer)))  # noqa: SLF001


def keras_sublayers(layer: Any) -> list:
    """`layer` and every layer inside it, recursively (`Layer._flatten_layers`, how Keras itself
    walks them for `losses` and weights); Keras 3 has no public recursive walk (`Model.layers` is
    one level). Without it the per-replica losses (trainer/task/layer_state.py) are not set."""
    return list(layer._flatten_layers(include_self=True, recursive=True))  # noqa: SLF001


def replace_layer_losses(layer: Any, replace: Callable[[list], Any]) -> None:
    """Puts `replace(losses)` in place of a Keras 3 layer's own list of the losses its call made
    (`_losses`, cleared when the outermost call starts, read by `model.losses`), past Keras'
    attribute tracking; a layer without one is left alone. Keras offers no hook into that list;
    without this the replicas of a mirrored model read each other's `add_loss` losses."""
    losses = layer.__dict__.get("_losses")
    if losses is not None:
        object.__setattr__(layer, "_losses", replace(losses))


def set_summary_resource(writer: Any, resource: Any) -> None:
    """Makes `resource` (a summary writer resource handle) the one a `tf.summary.SummaryWriter`
    subclass writes to: the summary ops take the default writer's `_resource`. The public
    `tf.summary.create_file_writer` creates its event file at once, before a run's checks may
    refuse it; without this no lazily created event file (trainer/files/event_writers.py) is written."""
    writer._resource = resource  # noqa: SLF001


def checkpoint_tensors(checkpoint: Any) -> tuple[dict, Any]:
    """What a save of `checkpoint` would write: (serialized tensors by trackable, registered savers),
    from `tf.train.Checkpoint`'s own `_saver._gather_serialized_tensors`. There is no public way to
    take the tensors apart from the write; without it no asynchronous checkpoint is taken
    (trainer/files/checkpoints.py)."""
    tensors, _, registered_savers, _ = checkpoint._saver._gather_serialized_tensors(None)  # noqa: SLF001
    return tensors, registered_savers


def read_save_spec(value: Any) -> Any:
    """A `SaveSpec` (tf.Variable's lazy read in `checkpoint_tensors`, from
    `tensorflow.python.training.saving`) as its tensor read now (the spec itself for a variable
    without a value); anything else as it is. Without it an asynchronous save writes values of later steps."""
    from tensorflow.python.training.saving import saveable_object

    if isinstance(value, saveable_object.SaveSpec):
        tensor = value.tensor
        return value if tensor is None else tensor
    return value


def write_checkpoint_tensors(tensors: dict, registered_savers: Any, prefix: str) -> None:
    """Writes `prefix.index` and `prefix.data-*` from what `checkpoint_tensors` returned, with the
    writer `tf.train.Checkpoint` uses itself (`tensorflow.python.checkpoint.functional_saver`), so
    the files are those of a synchronous save. Without it no asynchronous checkpoint is written."""
    import tensorflow as tf
    from tensorflow.python.checkpoint import functional_saver

    functional_saver.MultiDeviceSaver(tensors, registered_savers).save(tf.constant(prefix))
