"""How each worker is doing: its step time and memory every log interval, recorded by the chief as
split `workers` (`worker/<i>/step_time_s`, `worker/<i>/rss_mb`, ...), and one `warning:` line when
a worker runs slower than its peers for intervals in a row. On by default under the multi-worker
strategies (`worker_watch.enabled = False` turns it off); docs/watching-runs.md lists the records.

Under MultiWorkerMirrored each worker measures itself and the values reach the chief in one small
all-reduce at each log interval, which every worker joins outside the compiled step (the losses do
not change). Every worker waits for the slowest at each step's all-reduce, so their wall step times
are alike; what tells a straggler there is the CPU time each spends per step (`cpu_time_s`: a
worker waiting for its peers idles). Under parameter servers the workers are plain TensorFlow
servers: each closure reports the worker process it ran in and its seconds (trainer/loops/ps.py),
and at each log interval one small function run on every worker (trainer/internals.py
`run_on_every_worker`) reads its process and memory, which maps processes to task indices.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

import numpy as np
import tensorflow as tf

from trainer import internals
from trainer.distribution import modes
from trainer.distribution.cluster import ClusterInfo
from trainer.errors import peer_failure
from trainer.extensions.context import Context
from trainer.extensions.protocol import Extension
from trainer.files import metrics_log
from trainer.validation import check_bool, check_int, check_number

SPLIT = metrics_log.WORKERS
ABSENT_PEERS = "absent_peers"  # the named value: step -> "; not arrived at step S: worker 1 (...)" or ""
_READ_TIMEOUT_MS = 2000
_STATUS = "/proc/self/status"  # Linux: where a process reads its own resident memory
_STAT = "/proc/self/stat"  # ... and its own process id, first


_READABLE = os.path.exists(_STATUS)  # elsewhere (macOS) both read as -1 and no memory is recorded


def process_id() -> tf.Tensor:
    """The id of the process this op runs in (a remote worker's, placed on its device)."""
    if not _READABLE:
        return tf.constant(-1.0, tf.float64)
    return tf.strings.to_number(tf.strings.split(tf.io.read_file(_STAT), maxsplit=1)[0], tf.float64)


def memory_mb() -> tf.Tensor:
    """The resident memory, in MB, of the process this op runs in: a TensorFlow op, so that placed on
    a parameter-server worker it reads that server's own memory."""
    if not _READABLE:
        return tf.constant(-1.0, tf.float64)
    kilobytes = tf.strings.regex_replace(tf.io.read_file(_STATUS), r"(?s).*VmRSS:\s*(\d+) kB.*", r"\1")
    return tf.strings.to_number(kilobytes, tf.float64) / 1024


def closure_report(started: tf.Tensor) -> tf.Tensor:
    """[process id, seconds since `started`] of the worker running a closure."""
    return tf.stack([process_id(), tf.timestamp() - started])


def gpu_memory_mb() -> float:
    """Memory in use on this process's GPUs, in MB (-1 without one)."""
    gpus = tf.config.list_logical_devices("GPU")
    if not gpus:
        return -1.0
    return sum(tf.config.experimental.get_memory_info(gpu.name)["current"] for gpu in gpus) / 2**20


class WorkerWatch(Extension):
    """Per-worker step time and memory every `every_steps` steps (the log interval), and a warning
    when a worker's pace is `slow_factor` times the median of the others' for `slow_intervals`
    intervals in a row."""

    name = "worker_watch"
    after = ("checkpoint",)  # a worker's post says it has done all there is between loop calls
    setting = "worker_watch.enabled"
    supports = modes.support((m.name for m in modes.MODES.values() if m.multi_worker), "the multi-worker strategies")
    unsupported_reason = "one process is one worker: its step time is the train record's steps_per_sec"

    def __init__(self, every_steps: int, *, enabled: bool = True, slow_factor: float = 1.5, slow_intervals: int = 2):
        check_bool("worker_watch.enabled", enabled)
        check_number("worker_watch.slow_factor", slow_factor)
        check_int("worker_watch.slow_intervals", slow_intervals, minimum=1)
        self.every_steps, self.enabled = every_steps, enabled
        self.slow_factor, self.slow_intervals = float(slow_factor), slow_intervals
        self._slow_runs: dict[int, int] = {}  # worker -> slow intervals in a row

    def attach(self, context: Context) -> None:
        runtime = context.runtime
        self._idle = not runtime.spans_processes  # one MWMS worker: its train record says it all
        if self._idle:
            self.every_steps = 0
        # Synchronous workers post each step they reach, so a worker whose collective timed out can
        # name the peers that never arrived (TensorFlow's timeout names none).
        self._posting = runtime.num_workers > 1 and not runtime.mode.coordinates_workers
        if self._posting:
            context.provide(ABSENT_PEERS, lambda step: self._absent(context, step))

    def begin(self, context: Context) -> None:
        self._coordinated = context.runtime.mode.coordinates_workers
        if self._coordinated:  # built once: a new function at each interval would be traced anew
            self._read = tf.function(lambda: tf.stack([process_id(), memory_mb()]))
        self._since = context.start_step
        self._restart(context)
        self._post(context, context.start_step)

    def _post(self, context: Context, step: int) -> None:
        """Tells the other workers (the coordination service's key-value store) this one reached `step`."""
        if not self._posting:
            return
        service, key = internals.coordination_service(), _arrival_key(worker_index(context.runtime.cluster))
        try:  # two calls: TensorFlow's insert refuses a key already set, and no overwrite or update is exported
            service.delete_config_key_value(key)
            service.set_config_key_value(key, str(step))
        except tf.errors.OpError:
            pass  # the service gone: the next collective fails and says so

    def _absent(self, context: Context, step: int) -> str:
        """The peers that had not reached `step` (the start of the call that failed), as a phrase."""
        service, behind = internals.coordination_service(), []
        for worker in range(context.runtime.num_workers):
            try:
                reached = int(service.get_config_key_value(_arrival_key(worker), _READ_TIMEOUT_MS))
            except tf.errors.OpError:
                return ""  # the service gone with its leader: TensorFlow's error names who
            if reached < step:
                behind.append(f"worker {worker} (still at step {reached})")
        return f"; not arrived at step {step}: {', '.join(behind)}" if behind else ""

    def rewind(self, context: Context, step: int) -> None:
        self._since = step
        self._restart(context)

    def _restart(self, context: Context) -> None:
        self._train_seconds, self._cpu = context.clock.train_seconds, time.process_time()
        self._closures: dict[float, list[float]] = {}  # process id -> [seconds, steps]

    def after_loop(self, context: Context, step: int, metrics: dict[str, float]) -> None:
        if self._idle:
            return
        if self._coordinated:
            for pid, seconds, steps in context.loop.worker_reports:
                totals = self._closures.setdefault(pid, [0.0, 0])
                totals[0], totals[1] = totals[0] + seconds, totals[1] + steps
        self._post(context, step)
        if not (self.at_boundary(step) or step >= context.settings.total_steps) or step <= self._since:
            return
        per_worker = self._coordinator_view(context) if self._coordinated else self._gathered(context, step)
        first, self._since = self._since == context.start_step, step
        self._restart(context)
        record = {  # what could not be read (-1: no GPU, no /proc) left out
            f"worker/{i}/{key}": value
            for i, values in per_worker.items()
            for key, value in values.items()
            if value >= 0
        }
        context.metrics_log.record(step, SPLIT, record)
        if context.runtime.is_chief and not first:  # the first interval's times hold the tracing
            self._warn_slow(context, step, per_worker)

    def _gathered(self, context: Context, step: int) -> dict[int, dict[str, float]]:
        """Every worker's own measurements, summed into the chief's view by one all-reduce."""
        steps = step - self._since
        own = {  # the same keys on every worker: the all-reduce needs one shape
            "step_time_s": (context.clock.train_seconds - self._train_seconds) / steps,
            "cpu_time_s": (time.process_time() - self._cpu) / steps,
            "rss_mb": float(memory_mb()),
            "gpu_mb": gpu_memory_mb(),
        }
        keys, worker = sorted(own), worker_index(context.runtime.cluster)
        try:
            table = all_workers_rows(context.runtime.strategy, worker, [own[k] for k in keys])
        except tf.errors.OpError as error:  # a collective of constants fails only for want of a peer
            lost = "a peer task may have died or timed out" + self._absent(context, step)
            raise peer_failure(error, f"at step {step}", lost, context.saver.latest()) from error
        return {i: dict(zip(keys, (float(v) for v in row))) for i, row in enumerate(table)}

    def _coordinator_view(self, context: Context) -> dict[int, dict[str, float]]:
        """Each worker's closures since the last interval (the processes mapped to task indices by one
        read on every worker), and every worker's memory now."""
        per_worker = {}
        for index, remote in enumerate(internals.run_on_every_worker(context.loop.coordinator, self._read)):
            try:
                pid, megabytes = remote.fetch()
            except tf.errors.OpError:  # a worker lost (and being restarted): nothing to read of it now
                continue
            seconds, steps = self._closures.get(float(pid), (0.0, 0)) if pid >= 0 else (0.0, 0)
            per_worker[index] = {"rss_mb": float(megabytes)} | ({"step_time_s": seconds / steps} if steps else {})
        return per_worker

    def _warn_slow(self, context: Context, step: int, per_worker: dict[int, dict[str, float]]) -> None:
        pace = "step_time_s" if self._coordinated else "cpu_time_s"
        times = {i: values[pace] for i, values in per_worker.items() if values.get(pace, -1) >= 0}
        for worker, seconds in times.items():
            others = [t for i, t in times.items() if i != worker]
            median = statistics.median(others) if others else 0.0
            slow = median > 0 and seconds > self.slow_factor * median
            self._slow_runs[worker] = self._slow_runs.get(worker, 0) + 1 if slow else 0
            if self._slow_runs[worker] == self.slow_intervals:
                context.print(
                    f"warning: worker {worker} ran {seconds / median:.1f}x slower than the median of the other "
                    f"workers ({pace} {seconds:.4f} against {median:.4f}) for {self.slow_intervals} log intervals "
                    f"in a row, up to step {step}; its records are split {SPLIT!r} of metrics.jsonl"
                )


def _arrival_key(worker: int) -> str:
    return f"worker_watch/reached/{worker}"


def worker_index(cluster: ClusterInfo) -> int:
    """This worker's place among a synchronous cluster's workers: the chief (if any) first, as the
    strategy numbers them (the index in `worker/<i>/...`)."""
    return cluster.task_id + (1 if cluster.task_type == "worker" and "chief" in cluster.cluster else 0)


def all_workers_rows(strategy: tf.distribute.Strategy, task_id: int, values: list[float]) -> np.ndarray:
    """[worker, value]: each worker's `values` in its own row, summed over every replica of the
    strategy (each worker's replicas all add its row; divided by their number)."""
    workers = internals.strategy_worker_count(strategy) or 1
    local = strategy.num_replicas_in_sync // workers
    own = np.zeros([workers, len(values)])
    own[task_id] = np.asarray(values) / local
    per_replica = strategy.experimental_distribute_values_from_function(lambda _: tf.constant(own))
    return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None).numpy()


def make(settings: Any) -> WorkerWatch | None:
    """The watch under the multi-worker strategies, unless `worker_watch.enabled` is False."""
    if not modes.get(settings.strategy).multi_worker:
        return None
    watch = WorkerWatch(settings.log_every_steps)
    return watch if watch.enabled else None
