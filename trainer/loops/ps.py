"""The asynchronous loop: ParameterServerStrategy driven by a ClusterCoordinator, with the
synchronous loop's interface and step function (replica context on a worker, outputs SUM-reduced).

Global batch: each scheduled step runs on one worker and applies one update to the ps variables
from one batch of `train.global_batch_size` examples (split over that worker's replicas), so the
global batch stays "the examples behind one update"; N workers do N updates concurrently, each
from variables that may be a few updates old.

Scheduling: a `run(num_steps)` call is cut into closures of `steps_per_closure` steps (default
about steps_per_loop / (2 x workers), so a fast worker can take a slow one's share), each a graph
while loop on one worker; `run` then joins, so extensions see a quiet cluster, and reads the
RemoteValues after the join (rule 8). The coordinator counts the global step after the join (a
closure on a worker that died runs again elsewhere, so its updates may be partly applied twice:
the ClusterCoordinator's contract); the optimizer's `iterations` counts every step
(trainer/loops/ps_schedules.py).

Data: with random access (a train split held in memory), each closure is given the indices of its
global batches, steps `step + 1 ...` training on batches `step ...` of the one global order
(trainer/data/order.py), and its worker gathers them from its own copy of the split
(trainer/data/indexed.py). A closure TF runs again (its worker died) runs on the same batches, and `run`
joins before any checkpoint, so a checkpoint at step S holds exactly batches 0..S-1 on any worker count:
each example once per pass, a resume goes on at batch S. A stream without random access is read by
each worker from its own copy in the per-worker dataset function (rule 8): one worker reads exactly the
single-device pipeline; with N, worker k reads the whole set shuffled with `seed + k` (k from a counter on
the ps), so a dead worker takes no data with it, and on resume each worker skips `start_step / N` batches
(approximate: who ran which step is not recorded). With a tf.data service every worker reads its batches
from the run's one job instead (`data.served_train`): with 'distributed_epoch', each example once per epoch
across the workers.
Evaluation reads the ps variables over the whole eval set, every example once: spread over the workers in
shards (trainer/loops/ps_eval.py, `parameter_server.eval_shards`) or on the coordinator.
"""

from __future__ import annotations

from typing import Callable, Mapping

import tensorflow as tf

from trainer import data
from trainer.data import service as data_service
from trainer.errors import UserError, error_line, peer_failure
from trainer.extensions.worker_watch import closure_report
from trainer.loops.controller import EvaluatorLike
from trainer.loops.step_summaries import refuse_under_parameter_server, tracing_for_summaries, writes_summaries
from trainer.loops.totals import reduce_outputs, repeated, stacked, with_step
from trainer.safety import tracing
from trainer.task import combine
from trainer.task.structure import flat, named, trainable_variables
from trainer.task.user_code import call_step
from trainer.update.recorder import GradientRecorder

StepFn = Callable[..., dict]

_LOST_TASK_ERRORS = (tf.errors.UnavailableError, tf.errors.AbortedError, tf.errors.CancelledError)
MAX_RESCHEDULES = 3
LOST_PS = "lost a parameter server: its variables are gone"


def rejected_by_worker(error: Exception) -> bool:
    """Whether a worker's gRPC server refused a request it could not parse (seen in CI, TF 2.21, first
    closures): it executed nothing, so the closure can run again. TF's coordinator cancels the other
    closures as for a user error; `run` schedules those again too (a cancelled one already running may
    apply part of its steps twice, as a worker failure does)."""
    text = str(error)
    return isinstance(error, tf.errors.InternalError) and "Unable to parse request" in text and "/job:worker" in text


def _tf_variables(variable) -> list:
    """The TensorFlow variables behind one model variable (a Keras 3 Variable's `.value`, a ShardedVariable's parts)."""
    import keras

    value = variable.value if isinstance(variable, getattr(keras, "Variable", ())) else variable
    return list(value.variables) if isinstance(value, tf.__internal__.distribute.ShardedVariable) else [value]


def check_partitioner(models) -> None:
    """Refuses a Keras layer whose variables the partitioner sharded: Keras 3 layers compute with whole
    tensors. A `tf.Module`'s sharded tables beside a Keras tower (wide and deep) are fine."""
    import keras

    for key, model in named(models, default="").items():
        if not isinstance(model, keras.layers.Layer):
            continue
        for variable in model.variables:
            parts = _tf_variables(variable)
            if len(parts) > 1:
                which = f"model {key!r} ({type(model).__name__})" if key else type(model).__name__
                raise UserError(
                    f"parameter_server.variable_partitioner sharded {variable.path} {tuple(variable.shape)} of "
                    f"the Keras {which} into {len(parts)} parts, and Keras 3 layers cannot compute with sharded "
                    "variables; keep Keras layers' variables whole (a larger min_size_partitioner.min_shard_bytes "
                    "or a partitioner that shards only your tf.Module's tables) or hold that variable in a "
                    "tf.Module"
                )


def describe_placement(models) -> str:
    """Where the models' variables live, and which are sharded in how many parts (a tf.Module lists a
    sharded variable's parts itself, as `<v>/part_<i>`)."""
    import keras

    parts: dict[str, list] = {}
    for variable in trainable_variables(models):
        name = variable.path if isinstance(variable, getattr(keras, "Variable", ())) else variable.name.split(":")[0]
        parts.setdefault(name.partition("/part_")[0], []).extend(_tf_variables(variable))
    tasks = sorted(
        {part.device.split("/device:")[0].replace("/replica:0", "") for found in parts.values() for part in found}
    )
    sharded = ", ".join(f"{name} in {len(found)}" for name, found in sorted(parts.items()) if len(found) > 1)
    return f"{len(parts)} variables on {', '.join(tasks)}; sharded: {sharded or 'none'}"


def split_steps(num_steps: int, steps_per_closure: int) -> list[int]:
    """`num_steps` as closures of at most `steps_per_closure` steps, sizes within 1 of each other."""
    count = -(-num_steps // steps_per_closure)
    size, extra = divmod(num_steps, count)
    return [size + 1] * extra + [size] * (count - extra)


class PSTrainLoop:
    """Schedules `num_steps` steps as closures on the workers, joins, returns the step means."""

    last_nonfinite_offset = None  # not located: a call's means say whether it had a non-finite step

    def __init__(
        self,
        strategy: tf.distribute.Strategy,
        coordinator: tf.distribute.coordinator.ClusterCoordinator,
        model,
        optimizer,
        step_fn: StepFn,
        global_batch_size: int,
        per_worker_dataset,
        global_step: tf.Variable,
        *,
        steps_per_closure: int,
        indexed: data.IndexedBatches | None = None,
        batch_spec=None,
        print_fn: Callable[[str], None] = print,
    ):
        self.coordinator = self._coordinator = coordinator  # public for trainer/extensions/worker_watch.py
        self.worker_reports: list[tuple[float, float, int]] = []  # the last run's (worker process id, seconds, steps)
        self._print = print_fn
        self._global_step = global_step
        self._step = int(global_step.numpy())  # kept here too: no ps read before a loop
        self._steps_per_closure = steps_per_closure
        self._iterator = iter(per_worker_dataset)

        def replica_step(batch):
            if indexed is not None:
                batch = data.replica_slice(batch)
            return call_step(step_fn, model, optimizer, batch, global_batch_size)

        def batches(iterator):
            """Global batch index -> the batch a step trains on: gathered by index, or the stream's next."""
            if indexed is None:
                return lambda _: next(iterator)
            examples = next(iterator)  # the worker's copy of the split
            return lambda batch_index: indexed.batch(examples, batch_index)

        self._model, self._optimizer, self._step_fn = model, optimizer, step_fn
        self._global_batch_size, self._batch_spec = global_batch_size, batch_spec

        self.rule = rule = combine.rule_of(step_fn)  # how each output combines (trainer/task/combine.py)

        def train_steps(iterator, first_batch, num_steps):
            batch_at = batches(iterator)

            names: list[str] = []  # the step's outputs, in its order, known once traced

            def one_step(i, totals):
                batch_index = first_batch + tf.cast(i, tf.int64)
                outputs = reduce_outputs(strategy, strategy.run(replica_step, args=(batch_at(batch_index),)), rule=rule)
                names[:] = list(outputs)
                outputs = stacked(outputs, names)
                kinds = combine.kinds(rule, names)
                return tf.cond(i > 0, lambda: with_step(kinds, totals, outputs), lambda: outputs)

            started = tf.timestamp()
            with tf.control_dependencies([started]):
                summed = repeated(one_step, tf.zeros([0], tf.float32), num_steps)  # sums (or max/min) over the steps
            totals = {name: summed[j] for j, name in enumerate(names)}
            with tf.control_dependencies([summed]):
                return totals, closure_report(started)  # which worker ran it, in how many seconds

        # Plain TF ops: no AutoGraph but for the user's step (trainer/task/user_code.py).
        self._train_steps = tf.function(train_steps, autograph=False)

    def set_dataset(self, per_worker_dataset) -> None:
        """Continues from new per-worker train data, without retracing."""
        self._iterator = iter(per_worker_dataset)

    def _args(self, first_batch: int, num_steps: int) -> tuple:
        return self._iterator, tf.constant(first_batch, tf.int64), tf.constant(num_steps, tf.int32)

    def run(self, num_steps: int) -> dict[str, float]:
        """Trains `num_steps` steps on the workers; returns each output's mean over them. A closure
        rejected before running (`rejected_by_worker`) is scheduled again with those cancelled with it,
        as TF asks, up to `MAX_RESCHEDULES` times a call, with one warning line each."""
        step = self._step
        sizes = split_steps(num_steps, self._steps_per_closure)
        pending = [(step + sum(sizes[:k]), n) for k, n in enumerate(sizes)]  # (first batch, steps)
        totals: dict[str, float] | None = None
        rescheduled = 0
        self.worker_reports = []
        try:
            while pending:
                scheduled = [
                    ((first, n), self._coordinator.schedule(self._train_steps, args=self._args(first, n)))
                    for first, n in pending
                ]
                try:
                    self._coordinator.join()
                except tf.errors.InternalError as error:
                    if not rejected_by_worker(error) or rescheduled == MAX_RESCHEDULES:
                        raise
                    rescheduled += 1
                    self._print(
                        f"warning: a worker's server rejected a closure in steps {step + 1}-"
                        f"{step + num_steps} before running it ({error_line(error)}); scheduling it "
                        f"and the closures cancelled with it again ({rescheduled}/{MAX_RESCHEDULES})"
                    )
                pending = []
                for (first, n), result in scheduled:
                    try:
                        outputs, report = result.fetch()
                    except (tf.errors.CancelledError, tf.errors.InternalError) as error:
                        if not rescheduled or not (
                            isinstance(error, tf.errors.CancelledError) or rejected_by_worker(error)
                        ):
                            raise
                        pending.append((first, n))
                        continue
                    totals = combine.over_steps(self.rule, totals, {k: float(v) for k, v in outputs.items()})
                    self.worker_reports.append((*(float(v) for v in report), n))
            self._global_step.assign_add(num_steps)
            self._step += num_steps
        except _LOST_TASK_ERRORS as error:
            raise peer_failure(error, f"in steps {step + 1}-{step + num_steps}", LOST_PS) from error
        return combine.per_interval(self.rule, totals or {}, num_steps)

    def trace(self, step_name: str) -> tuple[str, ...]:
        """Traces the step alone on the coordinator, before anything is written, and returns its
        output names. With stand-in optimizers, a cross-replica call is the step's own: refused (no
        replica context spans asynchronous workers), as are summaries (the event files are the chief's)
        and an update traced in a loop or branch body (the worker's merge_call fails there)."""
        optimizers = self._optimizer
        stand_ins = (
            {k: _GraphNotingRecorder(o) for k, o in optimizers.items()}
            if isinstance(optimizers, Mapping)
            else _GraphNotingRecorder(optimizers)
        )
        step_graphs = []

        def traced_step(batch):
            step_graphs.append(tf.compat.v1.get_default_graph())
            outputs = call_step(self._step_fn, self._model, stand_ins, batch, self._global_batch_size)
            return reduce_outputs(tf.distribute.get_strategy(), outputs, rule=self.rule)

        with tracing.cross_replica_calls() as calls, tracing_for_summaries():
            concrete = tracing.traced(
                "train.step_fn",
                step_name,
                lambda: tf.function(traced_step, autograph=False).get_concrete_function(self._batch_spec),
            )
        if writes_summaries(concrete):
            raise refuse_under_parameter_server(step_name)
        if calls:
            raise UserError(
                f"train.step_fn {step_name} calls get_replica_context().{calls[0]}, a cross-replica call, "
                "which parameter_server does not support: its workers run their steps on their own, "
                "asynchronously, and no replica context spans them; use a synchronous strategy "
                "(gin/mwms.gin) for this step"
            )
        if any(graph is not step_graphs[0] for recorder in flat(stand_ins) for graph in recorder.graphs):
            # On a worker the update is a merge_call, which TensorFlow refuses inside graph control flow.
            raise tracing.update_in_graph_control_flow("train.step_fn", step_name)
        return tuple(concrete.structured_outputs)

    @property
    def trace_count(self) -> int:
        return self._train_steps.experimental_get_tracing_count()


class _GraphNotingRecorder(GradientRecorder):
    """A stand-in optimizer noting the graph each update is traced in (not the step's: a loop or branch body)."""

    def __init__(self, optimizer):
        super().__init__(optimizer, once=False)
        self.graphs: list = []

    def _record(self, gradients: list, variables: list):
        self.graphs.append(tf.compat.v1.get_default_graph())
        return super()._record(gradients, variables)


class PSEvaluator:
    """An eval pass on the coordinator's own device (an `Evaluator`) or spread over the workers (a
    `ps_eval.WorkerEvaluator`); a lost ps ends the run with its one line."""

    def __init__(self, evaluator: EvaluatorLike):
        self._evaluator = evaluator

    def trace(self) -> tuple[str, ...]:
        return self._evaluator.trace()

    def evaluate(self) -> dict[str, float]:
        try:
            return self._evaluator.evaluate()
        except _LOST_TASK_ERRORS as error:
            raise peer_failure(error, "during evaluation", LOST_PS) from error


def per_worker_train_data(
    strategy: tf.distribute.Strategy,
    coordinator: tf.distribute.coordinator.ClusterCoordinator,
    inp: data.Input,
    global_batch_size: int,
    seed: int,
    *,
    start_step: int,
    shard_policy: str,
    service: data_service.DataServiceConfig | None = None,
    model_dir: str | None = None,
    indexed: data.IndexedBatches | None = None,
):
    """Per-worker datasets, each built on its worker inside the dataset function (see module doc): with
    `indexed`, each worker's copy of the split; with a tf.data `service`, each worker a reader of the run's
    one job; else each worker's own stream."""
    if indexed is not None:
        return coordinator.create_per_worker_dataset(indexed.source)
    if service is not None:
        data_service.check_servable(inp)
        served = lambda: data.served_train(strategy, inp, global_batch_size, seed, service, model_dir=model_dir)  # noqa: E731
        return coordinator.create_per_worker_dataset(served)
    workers = data.num_workers(strategy)
    with strategy.scope():
        stream_counter = tf.Variable(0, dtype=tf.int64, trainable=False, name="worker_stream_counter")

    def dataset_fn(context: tf.distribute.InputContext) -> tf.data.Dataset:
        batch_size = context.get_per_replica_batch_size(global_batch_size)
        skip = start_step // workers * context.num_replicas_in_sync
        if workers == 1:
            return data.train_dataset(inp, batch_size, seed, shard_policy=shard_policy, skip_batches=skip)
        streams = [
            data.train_dataset(inp, batch_size, seed + k, shard_policy=shard_policy, skip_batches=skip)
            for k in range(workers)
        ]
        which = (stream_counter.assign_add(1) - 1) % workers
        return tf.data.Dataset.choose_from_datasets(streams, tf.data.Dataset.from_tensors(which).repeat())

    return coordinator.create_per_worker_dataset(lambda: strategy.distribute_datasets_from_function(dataset_fn))
