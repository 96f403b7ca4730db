"""Each private API of another library that trainer/internals.py isolates, tried against the
installed version: a gin, Keras, TensorFlow or Python upgrade that changes one fails here, by name."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import gin
import keras
import pytest
import tensorflow as tf

from tests.support import REPO, subprocess_env
from trainer import internals


@gin.configurable("internals_probe")
def _probe(rate: float = 0.1, depth: int = 2) -> float:
    return rate * depth


def test_gin_registry_lists_a_configurable_with_its_short_name():
    registry = internals.gin_registry()
    selector, entry = next((s, e) for s, e in registry.items() if s.endswith("internals_probe"))
    assert entry.wrapped.__name__ == "_probe" and registry.minimal_selector(selector) == "internals_probe"


def test_a_recorded_configurable_is_in_the_operative_config():
    selector = internals.gin_registry().get_match("internals_probe").selector
    try:
        internals.record_operative("", selector, {"rate": 0.5, "depth": 3})
        assert "internals_probe.rate = 0.5" in gin.operative_config_str()
        assert "internals_probe.depth = 3" in gin.operative_config_str()
    finally:
        gin.clear_config()


def test_the_exit_handlers_run_and_threads_are_joined_before_an_os_exit():
    code = textwrap.dedent("""
        import atexit, os, threading, time
        from trainer import internals
        atexit.register(lambda: print("atexit ran", flush=True))
        threading.Thread(target=lambda: (time.sleep(0.3), print("thread done", flush=True))).start()
        internals.run_exit_handlers()
        print("then exit", flush=True)
        os._exit(0)
    """)
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=subprocess_env(), capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.splitlines() == ["thread done", "atexit ran", "then exit"], proc


def _regularized_block() -> keras.layers.Layer:
    class Block(keras.layers.Layer):
        def __init__(self):
            super().__init__()
            self.parts = [keras.layers.Dense(3, activity_regularizer="l2"), keras.layers.Dropout(0.1)]

        def call(self, x):
            return self.parts[1](self.parts[0](x))

    return Block()


def test_keras_layers_are_found_inside_a_module_and_inside_each_other():
    model = keras.Sequential([keras.Input((4,)), _regularized_block(), keras.layers.Dense(2)])

    class Holder(tf.Module):
        def __init__(self):
            self.towers = {"deep": model}

    assert internals.keras_layers_in(Holder()) == [model]
    names = [type(layer).__name__ for layer in internals.keras_sublayers(model)]
    assert names[0] == "Sequential" and sorted(names[1:]) == ["Block", "Dense", "Dense", "Dropout", "InputLayer"]


def test_a_layers_own_losses_list_is_replaced_and_read_by_model_losses():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activity_regularizer="l2")])
    dense = model.layers[-1]

    class Seen(list):
        pass

    replaced = []
    internals.replace_layer_losses(dense, lambda old: replaced.append(Seen(old)) or replaced[-1])
    assert len(replaced) == 1
    model(tf.ones([2, 4]))
    assert len(replaced[0]) == 1 and float(model.losses[0]) == pytest.approx(float(replaced[0][0]))


def test_a_summary_written_through_a_resource_set_on_the_writer_lands_in_its_event_file(tmp_path):
    from trainer.files.event_writers import EventWriter

    writer = EventWriter(str(tmp_path))
    writer.init()
    with writer.as_default(step=7):
        tf.summary.scalar("loss", 0.25)
    writer.close()
    (path,) = tmp_path.glob("events.out.tfevents.*")
    values = [
        (event.step, value.tag)
        for event in tf.compat.v1.train.summary_iterator(str(path))
        for value in event.summary.value
    ]
    assert values == [(7, "loss")]


def test_a_checkpoints_tensors_taken_apart_read_now_and_written_restore(tmp_path):
    variable = tf.Variable([1.0, 2.0])
    checkpoint = tf.train.Checkpoint(weights=variable)
    checkpoint.save_counter.assign_add(1)  # as a save does first
    tensors, registered_savers = internals.checkpoint_tensors(checkpoint)
    for trackable in list(tensors):  # keyed by identity: variables are not hashable
        tensors[trackable] = {key: internals.read_save_spec(value) for key, value in tensors[trackable].items()}
    variable.assign([5.0, 6.0])  # after the read: not what is written
    internals.write_checkpoint_tensors(tensors, registered_savers, str(tmp_path / "ckpt-1"))
    restored = tf.Variable([0.0, 0.0])
    again = tf.train.Checkpoint(weights=restored)
    again.restore(str(tmp_path / "ckpt-1")).assert_consumed()
    assert restored.numpy().tolist() == [1.0, 2.0] and int(again.save_counter) == 1


def test_a_keras_optimizers_own_counter_and_schedule():
    schedule = keras.optimizers.schedules.ExponentialDecay(0.1, decay_steps=10, decay_rate=0.5)
    optimizer = keras.optimizers.SGD(schedule)
    variable = keras.Variable([1.0])
    optimizer.apply_gradients([(tf.constant([1.0]), variable)])
    counter = internals.keras_step_counter(optimizer)
    assert isinstance(counter, keras.Variable) and int(counter.numpy()) == 1
    wrapped = keras.optimizers.LossScaleOptimizer(optimizer)
    assert wrapped.iterations is counter and internals.keras_step_counter(wrapped) is not counter
    assert internals.keras_learning_rate(optimizer) is schedule
    assert internals.keras_step_counter(object()) is None and internals.keras_learning_rate(object()) is None


def test_a_keras_optimizer_sums_through_the_method_it_skips():
    optimizer = keras.optimizers.SGD(0.5)
    assert internals.skip_keras_gradient_sum(optimizer) and not internals.skip_keras_gradient_sum(object())
    skipped, summed = optimizer._all_reduce_sum_gradients, []  # noqa: SLF001
    optimizer._all_reduce_sum_gradients = lambda pairs: summed.append(len(pairs)) or skipped(pairs)  # noqa: SLF001
    variable = keras.Variable([1.0, 2.0])
    optimizer.apply_gradients([(tf.constant([1.0, 1.0]), variable)])
    assert summed == [1] and variable.numpy().tolist() == [0.5, 1.5]  # the update goes through it, unchanged


def test_a_multi_worker_strategys_worker_count_and_a_keras_variables_backing():
    # A MultiWorkerMirroredStrategy sets up collectives for its process: made in a fresh one.
    code = (
        "import tensorflow as tf; from trainer import internals; "
        "print(internals.strategy_worker_count(tf.distribute.MultiWorkerMirroredStrategy()))"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=subprocess_env(), capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.split() == ["1"], proc
    assert internals.strategy_worker_count(tf.distribute.get_strategy()) is None
    with internals.cached_variable_reads():  # driven for real by tests/test_ps_eval.py's run
        pass
    variable = keras.Variable(3, dtype="int64")
    backing = internals.keras_variable_backing(variable)
    assert isinstance(backing, tf.Variable) and backing is not variable
    backing.assign_add(2)
    assert int(variable.numpy()) == 5


def test_the_preemption_handlers_private_methods_and_the_coordination_service_exist():
    # Driven for real by tests/test_multiworker.py's SIGTERM and Ctrl-C runs; here each name is tried
    # against the installed TensorFlow so that an upgrade that drops one fails by name.
    handler = tf.distribute.experimental.PreemptionCheckpointHandler
    for name in (
        "_stop_cluster_wise_termination_watcher_thread",
        "_stop_poll_termination_signal_thread",
        "_maybe_set_received_own_sigterm",
    ):
        assert callable(getattr(handler, name, None)), name
    service = internals.coordination_service()
    assert all(
        callable(getattr(service, n, None))
        for n in ("set_config_key_value", "get_config_key_value", "delete_config_key_value", "wait_at_barrier")
    )
    with internals.silenced_deprecation():
        pass


def test_the_sleep_transformation_waits_before_each_element():
    dataset = tf.data.Dataset.range(5).apply(internals.sleep_each(20_000))
    started = time.monotonic()
    assert list(dataset.as_numpy_iterator()) == [0, 1, 2, 3, 4]
    assert time.monotonic() - started >= 0.1


def test_a_datasets_ops_include_those_of_its_functions():
    plain = tf.data.Dataset.range(4).map(lambda i: i * 2).batch(2)
    python = tf.data.Dataset.range(4).map(lambda i: tf.py_function(lambda j: j, [i], tf.int64))
    generated = tf.data.Dataset.from_generator(lambda: iter([1, 2]), output_signature=tf.TensorSpec([], tf.int32))
    assert {"RangeDataset", "MapDataset", "BatchDatasetV2", "Mul"} <= internals.dataset_ops(plain)
    assert "EagerPyFunc" in internals.dataset_ops(python) and "PyFunc" in internals.dataset_ops(generated)


def test_the_coordinators_per_worker_run_exists_and_its_values_are_held_in_order():
    # Driven for real by tests/test_worker_watch.py's parameter-server run (the warning names the
    # throttled worker only if the values come in task order); here the names are tried.
    from tensorflow.python.distribute.coordinator import values

    assert callable(getattr(tf.distribute.coordinator.ClusterCoordinator, "_create_per_worker_resources", None))
    remote = (values.RemoteValueImpl(None, None), values.RemoteValueImpl(None, None))
    assert values.PerWorkerValues(remote)._values == remote  # noqa: SLF001
