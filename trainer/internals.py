"""Every private API of another library we use, one function each, where no public API does the job:
why, and what breaks if it changes (tests/test_internals.py tries each against the installed version).
Libraries are imported inside the functions: trainer.cli and the gin tools run without TensorFlow."""

from __future__ import annotations

from typing import Any, Callable


def gin_registry() -> Any:
    """gin's registry (`gin.config._REGISTRY`): gin lists no configurables publicly. Without it
    `--print_config` and the hparams cannot list gin's names."""
    import gin

    return gin.config._REGISTRY  # noqa: SLF001


def record_operative(scope: str, selector: str, values: dict[str, Any]) -> None:
    """Records `values` in gin's operative config (`_OPERATIVE_CONFIG`) as gin's wrapper does: our bound
    functions (trainer/tools/gin_functions.py) bypass it. Without it `operative_config.gin` misses them."""
    import gin

    with gin.config._OPERATIVE_CONFIG_LOCK:  # noqa: SLF001
        gin.config._OPERATIVE_CONFIG.setdefault((scope, selector), {}).update(values)  # noqa: SLF001


def run_exit_handlers() -> None:
    """What the interpreter's exit runs first (`threading._shutdown`, then `atexit._run_exitfuncs`), for a
    process ending with `os._exit` (trainer/cli.py). Without it MLflow, logging and temp dirs are not finished."""
    import atexit
    import threading

    threading._shutdown()  # noqa: SLF001
    atexit._run_exitfuncs()  # noqa: SLF001


def keras_layers_in(module: Any) -> list:
    """The Keras layers a `tf.Module` holds, outermost first (`tf.Module._flatten`): Keras 3 layers are
    no tf.Modules, so `submodules` skips them. Without it a tf.Module model's layers are not found."""
    import keras

    return list(module._flatten(predicate=lambda x: isinstance(x, keras.layers.Layer)))  # noqa: SLF001


def keras_sublayers(layer: Any) -> list:
    """`layer` and every layer inside it (`Layer._flatten_layers`, Keras' own walk): Keras 3 has no
    public recursive one. Without it the per-replica losses (trainer/task/layer_state.py) are not set."""
    return list(layer._flatten_layers(include_self=True, recursive=True))  # noqa: SLF001


def replace_layer_losses(layer: Any, replace: Callable[[list], Any]) -> None:
    """Puts `replace(losses)` in place of a Keras 3 layer's `_losses` (read by `model.losses`), past attribute
    tracking; Keras has no hook. Without it a mirrored model's replicas read each other's `add_loss` losses."""
    losses = layer.__dict__.get("_losses")
    if losses is not None:
        object.__setattr__(layer, "_losses", replace(losses))


def set_summary_resource(writer: Any, resource: Any) -> None:
    """Makes `resource` the one a `tf.summary.SummaryWriter` subclass writes to (`_resource`): `create_file_writer`
    creates its file at once, before a run's checks. Without it trainer/files/event_writers.py writes nothing."""
    writer._resource = resource  # noqa: SLF001


def checkpoint_tensors(checkpoint: Any) -> tuple[dict, Any]:
    """What a save of `checkpoint` writes (`_saver._gather_serialized_tensors`): no public API takes them
    apart from the write. Without it no asynchronous checkpoint (trainer/files/checkpoints.py)."""
    tensors, _, registered_savers, _ = checkpoint._saver._gather_serialized_tensors(None)  # noqa: SLF001
    return tensors, registered_savers


def read_save_spec(value: Any) -> Any:
    """A `SaveSpec` (a lazy read among `checkpoint_tensors`) as its tensor read now; anything else as it is.
    Without it an asynchronous save would write the values of later steps."""
    from tensorflow.python.training.saving import saveable_object

    if isinstance(value, saveable_object.SaveSpec):
        return value if (tensor := value.tensor) is None else tensor  # one read
    return value


def write_checkpoint_tensors(tensors: dict, registered_savers: Any, prefix: str) -> None:
    """Writes `prefix.index` and `prefix.data-*` from `checkpoint_tensors` with tf.train.Checkpoint's
    own writer (`functional_saver.MultiDeviceSaver`): the files of a synchronous save."""
    import tensorflow as tf
    from tensorflow.python.checkpoint import functional_saver

    functional_saver.MultiDeviceSaver(tensors, registered_savers).save(tf.constant(prefix))


def keras_step_counter(optimizer: Any) -> Any:
    """A Keras 3 optimizer's own step counter (`_iterations`): the public `iterations` is computed under
    gradient accumulation, the inner optimizer's for a LossScaleOptimizer. Without it the ps loop's
    counter counts no steps atomically (trainer/loops/ps_schedules.py)."""
    return getattr(optimizer, "_iterations", None)


def keras_learning_rate(optimizer: Any) -> Any:
    """What a Keras 3 optimizer was given as its learning rate (`_learning_rate`: a schedule or a
    variable): the public `learning_rate` is the current value, never the schedule. Without it a
    Keras callback that sets the rate is not refused beside a schedule it would fight."""
    return getattr(optimizer, "_learning_rate", None)


def skip_keras_gradient_sum(optimizer: Any) -> bool:
    """Makes a Keras 3 TensorFlow optimizer apply gradients without summing them across replicas (clipping
    sums first): `TFOptimizer._all_reduce_sum_gradients` becomes the identity on this instance; Keras has no
    switch. False, changing nothing, without that method (if Keras renames it, clipping is refused)."""
    if not callable(getattr(type(optimizer), "_all_reduce_sum_gradients", None)):
        return False
    optimizer._all_reduce_sum_gradients = list  # noqa: SLF001  (the gradients and variables, as given)
    return True


def strategy_worker_count(strategy: Any) -> int | None:
    """The worker count a multi-worker strategy was built with (`extended._num_workers`; None for
    others): its public `cluster_resolver` also counts a parameter-server cluster's coordinator. Without
    it the input's shard count falls back to the cluster spec (trainer/data/distribute.py)."""
    return getattr(strategy.extended, "_num_workers", None)


def cached_variable_reads() -> Any:
    """A scope in which a ParameterServer variable read traced inside a function is read from the ps once per
    call, then reused (`distribute_utils.cache_variable_reads`, as tf_keras' exact evaluation does): no public
    API. Without it an eval shard on a worker (trainer/loops/ps_eval.py) reads every variable for every batch."""
    from tensorflow.python.distribute import distribute_utils

    return distribute_utils.cache_variable_reads()


def keras_variable_backing(variable: Any) -> Any:
    """The TensorFlow variable behind a Keras 3 variable (`_value`): Keras' own `assign_add` reads,
    adds and assigns in three ops, which lose counts when parameter-server workers add at once;
    the backing variable's `assign_add` is one op. Without it trainer/loops/ps_schedules.py's
    atomic step counter fails."""
    return variable._value  # noqa: SLF001


def coordination_service() -> Any:
    """The multi-worker coordination service's client of this process (`tensorflow.python.eager.context`:
    `set_config_key_value`, `get_config_key_value`, `wait_at_barrier`), which TensorFlow exports no
    public way to. Without it a stop signal cannot reach every worker (trainer/extensions/preemption.py)."""
    from tensorflow.python.eager import context

    return context.context()


def silenced_deprecation() -> Any:
    """A context that hides TensorFlow's deprecation notices (`tensorflow.python.util.deprecation`):
    `PreemptionCheckpointHandler.save_checkpoint_if_preempted` is deprecated in favour of `run`, which
    takes one step a call and so cannot drive a compiled loop of many steps."""
    from tensorflow.python.util import deprecation

    return deprecation.silence()


def stop_preemption_watchers(handler: Any) -> bool:
    """Stops a `PreemptionCheckpointHandler`'s watcher threads (`_stop_*_thread`), which it stops only
    when it is collected, so a run that ends leaves none behind; returns whether it watched its peers
    (then every worker meets at a barrier before leaving)."""
    watched_peers = getattr(handler, "_cluster_wise_termination_watcher_thread", None) is not None
    handler._stop_cluster_wise_termination_watcher_thread()  # noqa: SLF001
    handler._stop_poll_termination_signal_thread()  # noqa: SLF001
    return watched_peers


def tell_preemption_handler(handler: Any) -> None:
    """What the handler's own SIGTERM handler does (`_maybe_set_received_own_sigterm`): our signal
    thread decides which signal stops the run, and hands the handler the stop it then agrees on with
    every worker."""
    handler._maybe_set_received_own_sigterm()  # noqa: SLF001


def sleep_each(microseconds: int) -> Callable[[Any], Any]:
    """A dataset transformation that waits `microseconds` before each element (tf.data's own test op,
    `testing.sleep`): a source with a read latency that, unlike `tf.py_function`, runs on tf.data service
    workers in other processes. Without it the input bench cannot model a slow source."""
    from tensorflow.python.data.experimental.ops import testing

    return testing.sleep(microseconds)


def dataset_ops(dataset: Any) -> set[str]:
    """The op types of `dataset`'s graph and of the functions in it (`Dataset._as_serialized_graph`, what
    tf.data serializes to send a pipeline to the tf.data service). Without it a pipeline that calls Python
    (which the service's data workers cannot run) is found only by its first batch failing there."""
    import tensorflow as tf

    graph = tf.compat.v1.GraphDef.FromString(dataset._as_serialized_graph().numpy())  # noqa: SLF001
    return {node.op for node in graph.node} | {
        node.op for function in graph.library.function for node in function.node_def
    }


def run_on_every_worker(coordinator: Any, fn: Callable[[], Any]) -> list:
    """`fn()` scheduled once on each parameter-server worker: its `RemoteValue`s in task order
    (`ClusterCoordinator._create_per_worker_resources`, how TF builds per-worker datasets): the public
    `schedule` picks any one worker. Without it trainer/extensions/worker_watch.py cannot tell which
    worker ran which closure, nor read an idle worker's memory."""
    return list(coordinator._create_per_worker_resources(fn)._values)  # noqa: SLF001
