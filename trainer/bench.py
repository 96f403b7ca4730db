"""`python -m trainer.bench --gin_file=gin/<mode>.gin [--gin_bindings=...] [--steps=N] [--json=PATH]`

How fast does our loop train this config, next to the bare step and next to Keras `fit`?
For the config's model, data, optimizer, strategy and speed options it measures, in one run:

- limit: a `tf.function` with the structure of our compiled loop (`steps_per_loop` steps
  per call in a `tf.range` loop: `strategy.run` of the same replica step, with the same XLA
  and precision settings, outputs SUM-reduced and added up) on one batch already on the
  device(s) instead of `next(iterator)`: no input pipeline, no hooks, no Python between
  steps. (Without the per-step reduce and sum it measured slower on this CPU, not faster.)
- ours: `trainer.train.train` itself, unchanged, with its default hooks (progress records
  to metrics.jsonl and TensorBoard every `log_every_steps`, checkpoints every
  `checkpoint_every_steps`, the operative config) and `steps_per_loop` as configured, in a
  temporary model_dir. Eval runs once, after the last measured step (fit gets no
  validation data either);
- fit: Keras 3 `model.fit` on the same model, optimizer, input pipeline and strategy, with
  the step's loss and an accuracy metric, at each `--fit_steps_per_execution` (default 1
  and `steps_per_loop`); the best one is "fit best". Under multi_worker_mirrored and
  parameter_server Keras 3 `fit` cannot run (DESIGN.md rule 7): the table says so.

Method. Each variant runs in its own process (so peak RSS is its own), started one after
the other (so start-up and first step are timed on a quiet machine). Time to first step
is from process start to the end of its first compiled call (1 step for limit and ours,
`steps_per_execution` steps for fit). Then every variant runs a warm-up chunk and
`--repeats` chunks of `--steps` steps, interleaved (limit, ours, fit..., limit, ours, ...):
while one runs the others wait, blocked between two of their own calls. Steps/s is the
median over the chunks; a chunk's time includes everything its process does between the
chunk's boundaries (hooks, Python, input). The compile count is how often the variant's
outer function was traced; ours must stay at 1 although its calls have different step
counts (1, then steps_per_loop, then shorter calls ending on hook boundaries).

Output: a table on stdout, `--json=PATH` (every figure and the machine), and
`--report=FILE` appends a markdown table (experiments/bench/run.sh builds its README so).
Exit 0 when everything ran, 1 when a variant other than fit failed, 2 on a user mistake.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
import re
import selectors
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app, flags, logging  # noqa: E402

from trainer import main as main_lib  # noqa: E402  (defines --gin_file and --gin_bindings)
from trainer.errors import UserError  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_integer("steps", 0, "Steps per measured chunk, rounded up to a multiple of every call length (0: the "
                     "least multiple of log_every_steps and checkpoint_every_steps, so that every chunk holds the "
                     "same hook work: one checkpoint and chunk/log_every_steps progress records).")
flags.DEFINE_integer("repeats", 5, "Measured chunks per variant (interleaved across variants).")
flags.DEFINE_integer("warmup_steps", 0, "Steps each variant runs after its first call before measuring "
                     "(0: one chunk).")
flags.DEFINE_list("variants", ["limit", "ours", "fit"], "Which variants to run: limit, ours, fit.")
flags.DEFINE_list("fit_steps_per_execution", [], "fit's steps_per_execution values (default: 1 and steps_per_loop).")
flags.DEFINE_string("json", None, "Write all results as JSON here.")
flags.DEFINE_string("report", None, "Append a markdown table to this file.")
flags.DEFINE_integer("timeout_secs", 3600, "Longest a variant may take to answer one request.")
flags.DEFINE_string("role", "compare", "Internal: 'compare', or the variant this worker process runs.")
flags.DEFINE_integer("fit_spe", 1, "Internal: steps_per_execution of a fit worker.")
flags.DEFINE_integer("total_steps", 0, "Internal: the steps a worker will run in all.")

PREFIX = "@bench "
FIT_CANNOT_RUN = {
    "multi_worker_mirrored": "Keras 3 fit cannot run under MultiWorkerMirroredStrategy (keras-team/keras 20585)",
    "parameter_server": "Keras 3 fit cannot run under ParameterServerStrategy (keras-team/keras 18624)",
}


# --- the worker side: one process per variant ------------------------------------------------------


class Channel:
    """A worker's side of the conversation: JSON lines with a prefix on stdout, commands on stdin."""

    def __init__(self):
        self.done = 0  # steps run so far
        self.started = time.monotonic()

    @staticmethod
    def send(**message) -> None:
        sys.stdout.write(PREFIX + json.dumps(message) + "\n")
        sys.stdout.flush()

    @staticmethod
    def receive() -> dict:
        line = sys.stdin.readline()
        if not line:
            raise SystemExit("bench: the parent went away")
        return json.loads(line)

    def ready(self, **extra) -> int:
        """Reports the first call and returns the step to run to next."""
        self.send(event="ready", steps=self.done, **extra)
        return self.receive()["until"]

    def chunk_done(self, seconds: float, **extra) -> int | None:
        """Reports a chunk; returns the step to run to next, or None when told to finish."""
        self.send(event="chunk", steps=self.done, seconds=seconds, **extra)
        command = self.receive()
        return command.get("until")


def train_settings() -> dict:
    """The `train` parameters as the parsed gin config binds them, over `train`'s defaults."""
    import gin

    from trainer.core import train as train_lib

    return train_lib.defaults_with(gin.get_bindings("train"))


def setup(settings: dict):
    """Runtime, strategy, model and built optimizer, by `train`'s own setup."""
    from trainer.core import train as train_lib

    runtime, task = train_lib.setup_from(settings)
    return runtime.strategy, task


def machine() -> dict:
    """What this process runs on: CPU, cores, accelerators, versions."""
    import keras
    import tensorflow as tf

    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    gpus = []
    for gpu in tf.config.list_physical_devices("GPU"):
        details = tf.config.experimental.get_device_details(gpu)
        gpus.append(details.get("device_name", gpu.name))
    return {"cpu": cpu, "cores": os.cpu_count(), "gpus": gpus, "platform": platform.platform(),
            "python": platform.python_version(), "tensorflow": tf.__version__, "keras": keras.__version__}


def peak_rss_mib() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # KiB on Linux


def peak_gpu_mib() -> float | None:
    """Peak memory TensorFlow allocated on the first GPU (None without a GPU)."""
    import tensorflow as tf

    if not tf.config.list_logical_devices("GPU"):
        return None
    return tf.config.experimental.get_memory_info("GPU:0")["peak"] / 2**20


def finished(channel, compile_count) -> None:
    channel.send(event="finished", compile_count=compile_count, peak_rss_mib=peak_rss_mib(),
                 peak_gpu_mib=peak_gpu_mib())


def run_limit(settings: dict, channel: Channel) -> None:
    """The bare step on one batch already on the device(s), steps_per_loop steps per call."""
    import tensorflow as tf

    from trainer import data
    from trainer.distribution import devices
    from trainer.core import xla

    dist, task = setup(settings)
    model, optimizer = task.models, task.optimizers
    gb = settings["global_batch_size"]
    dataset = data.train_dataset(task.input, gb, settings["seed"], shard_policy=settings["shard_policy"])
    batch = next(iter(dist.experimental_distribute_dataset(dataset)))
    if dist.num_replicas_in_sync == 1 and not isinstance(dist, tf.distribute.OneDeviceStrategy):
        with tf.device(devices.compute_devices()[0]):  # the default strategy leaves it on the host
            batch = tf.nest.map_structure(tf.identity, batch)
    del dataset
    step = xla.replica_step(dist, settings["step_fn"], model, optimizer, gb, jit_compile=settings["jit_compile"])
    SUM = tf.distribute.ReduceOp.SUM

    def one_step(batch):
        return {k: tf.cast(dist.reduce(SUM, v, axis=None), tf.float32) for k, v in dist.run(step, args=(batch,)).items()}

    @tf.function
    def limit(batch, num_steps):  # TrainLoop's loop, with the batch in memory instead of next(iterator)
        totals = one_step(batch)
        for _ in tf.range(num_steps - 1):
            outputs = one_step(batch)
            totals = {k: totals[k] + outputs[k] for k in totals}
        return totals

    def run_until(until: int) -> None:
        while channel.done < until:
            count = min(settings["steps_per_loop"], until - channel.done)
            outputs = limit(batch, tf.constant(count, tf.int32))
            {k: float(v) for k, v in outputs.items()}  # noqa: B018  (waits for the call, like ours does)
            channel.done += count

    run_until(1)
    until = channel.ready(machine=machine())
    while until is not None:
        started = time.monotonic()
        run_until(until)
        until = channel.chunk_done(time.monotonic() - started)
    finished(channel, limit.experimental_get_tracing_count())


def run_ours(settings: dict, channel: Channel) -> None:
    """`trainer.train.train` with its default hooks, plus one that paces it from the parent."""
    import gin

    from trainer import configurables
    from trainer.core.hooks import Hook

    class Pacer(Hook):
        """Ends a loop call at each step the parent asks for, reports, waits for the next."""

        def __init__(self):
            self.until: int | None = None
            self.started = 0.0

        def begin(self, run):
            self.until = run.start_step + 1  # the first call: one step

        def steps_to_boundary(self, step):
            return self.until - step if self.until is not None and self.until > step else None

        def after_loop(self, run, step, metrics):
            channel.done = step
            if step != self.until:
                return
            if step == run.start_step + 1:
                self.until = channel.ready(machine=machine())
            else:
                self.until = channel.chunk_done(time.monotonic() - self.started)
            if self.until is None:
                finished(channel, run.loop.trace_count)
            self.started = time.monotonic()

    if settings["strategy"] == "parameter_server":
        raise UserError("trainer.bench does not run parameter_server: its steps are asynchronous closures on "
                        "remote workers, not comparable with a local bare step")
    total = FLAGS.total_steps
    with tempfile.TemporaryDirectory(prefix="bench-ours-") as model_dir:
        # One step beyond the last chunk: the final eval and checkpoint happen after the measurement.
        configurables.train(
            model_dir=model_dir, total_steps=total + 1, eval_every_steps=total + 1,
            hooks=[*settings.get("hooks", ()), Pacer()], describe_config=gin.operative_config_str,
            print_fn=lambda line: print(line, file=sys.stderr, flush=True),
        )


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


def run_fit(settings: dict, channel: Channel, steps_per_execution: int) -> None:
    """Keras 3 `fit` on the same model, optimizer, pipeline and strategy, paced by a callback."""
    import keras

    from trainer import data
    from trainer.core import xla

    dist, task = setup(settings)  # the optimizer built as ours (rule 1); fit would build it itself
    model, optimizer = task.models, task.optimizers
    with dist.scope():
        model.compile(
            optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"], steps_per_execution=steps_per_execution,
            # XLA where fit can compile the whole step (one device); Keras itself turns it off under a strategy.
            jit_compile=bool(settings["jit_compile"]) and xla.update_inside_xla(dist),
        )
    dataset = data.train_dataset(task.input, settings["global_batch_size"], settings["seed"],
                                 shard_policy=settings["shard_policy"])

    class Pacer(keras.callbacks.Callback):
        """Paces fit from `on_train_batch_begin`: fit has synchronised with the previous call there
        (it reads the call's `has_value`), and a callback without batch-end methods leaves fit's
        asynchronous batch-end dispatch on, so fit runs as it would without this callback."""

        def __init__(self):
            super().__init__()
            self.until = steps_per_execution
            self.started = 0.0

        def on_train_batch_begin(self, batch, logs=None):
            channel.done = batch
            if batch != self.until:
                return
            if batch == steps_per_execution:
                self.until = channel.ready(machine=machine())
            else:
                self.until = channel.chunk_done(time.monotonic() - self.started)
            if self.until is None:
                self.model.stop_training = True  # after one more call, which is not measured
            self.started = time.monotonic()

    # One call beyond the last chunk, so that its end is the start of a call.
    model.fit(dataset, epochs=1, steps_per_epoch=FLAGS.total_steps + steps_per_execution, verbose=0,
              callbacks=[Pacer()])
    finished(channel, tracing_count(model.train_function, "multi_step_on_iterator"))


def run_worker(role: str) -> None:
    channel = Channel()
    try:
        main_lib.parse_gin(FLAGS.gin_file, FLAGS.gin_bindings)
        settings = train_settings()
        if role == "limit":
            run_limit(settings, channel)
        elif role == "ours":
            run_ours(settings, channel)
        elif role == "fit":
            run_fit(settings, channel, FLAGS.fit_spe)
        else:
            raise UserError(f"unknown --role {role!r}")
    except SystemExit:
        raise
    except BaseException as e:  # the parent reports it; the traceback goes to this worker's log
        traceback.print_exc()
        channel.send(event="error", message=error_summary(e, role), user_error=isinstance(e, UserError))
        sys.exit(2 if isinstance(e, UserError) else 1)


KNOWN_FIT_FAILURES = {
    "You must feed a value for placeholder tensor": "keras-team/keras#19246: fit with steps_per_execution > 1 under "
                                                     "MirroredStrategy",
}


def error_summary(error: BaseException, role: str) -> str:
    """One line: the TensorFlow status message if there is one, and a known issue it matches."""
    text = str(error).strip()
    status = re.search(r"\b(?:INVALID_ARGUMENT|FAILED_PRECONDITION|UNIMPLEMENTED|INTERNAL|NOT_FOUND|UNKNOWN|"
                       r"RESOURCE_EXHAUSTED|OUT_OF_RANGE|ABORTED|UNAVAILABLE):\s*(.+)", text)
    detail = status.group(1).strip() if status else (text.splitlines()[0] if text else "")
    summary = f"{type(error).__name__}: {detail}"
    known = next((issue for symptom, issue in KNOWN_FIT_FAILURES.items() if symptom in text), None)
    return f"{summary} ({known})" if known and role == "fit" else summary


# --- the parent: start, pace and measure the workers ---------------------------------------------------


@dataclasses.dataclass
class Variant:
    """One measured variant and what came back from its worker."""

    name: str
    label: str
    role: str
    fit_spe: int = 0
    status: str = "ok"  # ok | cannot_run | failed
    reason: str = ""
    first_step_s: float | None = None
    first_call_steps: int = 1
    chunks: list[float] = dataclasses.field(default_factory=list)  # seconds per measured chunk
    warmup_s: float | None = None
    compile_count: int | None = None
    peak_rss_mib: float | None = None
    peak_gpu_mib: float | None = None
    process: subprocess.Popen | None = None
    log_path: str = ""
    machine: dict | None = None

    def steps_per_sec(self, steps: int) -> float | None:
        return steps / statistics.median(self.chunks) if self.chunks else None

    def spread(self, steps: int) -> tuple[float, float] | None:
        return (steps / max(self.chunks), steps / min(self.chunks)) if self.chunks else None


class WorkerError(Exception):
    pass


class Worker:
    """The parent's side of one worker process."""

    def __init__(self, variant: Variant, args: list[str], log_dir: str, timeout: float):
        variant.log_path = os.path.join(log_dir, f"{variant.name}.log")
        self.variant, self.timeout = variant, timeout
        self.log = open(variant.log_path, "w")
        variant.process = subprocess.Popen(
            [sys.executable, "-m", "trainer.bench", *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=self.log, text=True, bufsize=1, cwd=main_lib.REPO_ROOT,
        )
        self.selector = selectors.DefaultSelector()
        self.selector.register(variant.process.stdout, selectors.EVENT_READ)

    def receive(self) -> dict:
        deadline = time.monotonic() + self.timeout
        while True:
            if not self.selector.select(timeout=max(0.0, deadline - time.monotonic())):
                raise WorkerError(f"no answer within {self.timeout:.0f} s")
            line = self.variant.process.stdout.readline()
            if not line:
                code = self.variant.process.wait()
                raise WorkerError(f"exited with code {code} ({self.log_tail()})")
            if line.startswith(PREFIX):
                message = json.loads(line[len(PREFIX):])
                if message["event"] == "error":
                    raise WorkerError(message["message"])
                return message

    def send(self, **command) -> None:
        self.variant.process.stdin.write(json.dumps(command) + "\n")
        self.variant.process.stdin.flush()

    def log_tail(self) -> str:
        self.log.flush()
        with open(self.variant.log_path) as f:
            lines = [line.strip() for line in f if line.strip()]
        return lines[-1] if lines else "no output"

    def close(self) -> None:
        process = self.variant.process
        if process.poll() is None:
            try:
                process.stdin.close()
                process.wait(timeout=120)
            except (OSError, subprocess.TimeoutExpired):
                process.kill()
                process.wait()
        self.log.close()


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def plan_variants(settings: dict, names: list[str], fit_spes: list[int]) -> list[Variant]:
    variants = []
    for name in names:
        if name == "limit":
            variants.append(Variant("limit", "limit (bare step, batch in memory)", "limit"))
        elif name == "ours":
            variants.append(Variant("ours", "ours (trainer.train + hooks)", "ours"))
        elif name == "fit":
            for spe in fit_spes:
                variant = Variant(f"fit_spe{spe}", f"Keras fit, steps_per_execution {spe}", "fit", fit_spe=spe,
                                  first_call_steps=spe)
                if settings["strategy"] in FIT_CANNOT_RUN:
                    variant.status, variant.reason = "cannot_run", FIT_CANNOT_RUN[settings["strategy"]]
                variants.append(variant)
        else:
            raise UserError(f"unknown --variants entry {name!r}: use limit, ours, fit")
    return variants


def measure(settings: dict, variants: list[Variant], gin_args: list[str], *, chunk: int, warmup: int,
            repeats: int, total: int, timeout: float, print_fn) -> None:
    """Starts the workers one by one, then paces them through warm-up and interleaved chunks."""
    workers: dict[str, Worker] = {}
    log_dir = tempfile.mkdtemp(prefix="bench-logs-")
    try:
        for variant in variants:
            if variant.status != "ok":
                continue
            args = [*gin_args, f"--role={variant.role}", f"--fit_spe={variant.fit_spe}", f"--total_steps={total}"]
            started = time.monotonic()
            try:
                workers[variant.name] = worker = Worker(variant, args, log_dir, timeout)
                message = worker.receive()
            except WorkerError as e:
                variant.status, variant.reason = "failed", str(e)
                print_fn(f"{variant.name}: failed to start: {e} (log: {variant.log_path})")
                continue
            variant.first_step_s = time.monotonic() - started
            variant.first_call_steps = message["steps"]
            variant.machine = message.get("machine")
            print_fn(f"{variant.name}: first call ({message['steps']} step(s)) done {variant.first_step_s:.1f} s "
                     "after process start")
        targets = [("warmup", warmup)] + [(f"repeat {r + 1}", warmup + (r + 1) * chunk) for r in range(repeats)]
        for label, until in targets:
            for variant in variants:
                worker = workers.get(variant.name)
                if variant.status != "ok" or worker is None:
                    continue
                try:
                    worker.send(until=until)
                    message = worker.receive()
                except WorkerError as e:
                    variant.status, variant.reason = "failed", str(e)
                    print_fn(f"{variant.name}: failed in {label}: {e} (log: {variant.log_path})")
                    continue
                if message.get("steps") != until:
                    raise RuntimeError(f"{variant.name} answered {message} when asked to run to step {until}")
                if label == "warmup":
                    variant.warmup_s = message["seconds"]
                else:
                    variant.chunks.append(message["seconds"])
                print_fn(f"{label:>9}  {variant.name:<12} {chunk / message['seconds'] if label != 'warmup' else 0:8.2f}"
                         f" steps/s  ({message['seconds']:.2f} s)" if label != "warmup" else
                         f"{label:>9}  {variant.name:<12} {message['seconds']:.2f} s")
        for variant in variants:
            worker = workers.get(variant.name)
            if variant.status != "ok" or worker is None:
                continue
            try:
                worker.send(until=None)
                message = worker.receive()
                variant.compile_count = message.get("compile_count")
                variant.peak_rss_mib = message.get("peak_rss_mib")
                variant.peak_gpu_mib = message.get("peak_gpu_mib")
            except WorkerError as e:
                variant.status, variant.reason = "failed", str(e)
    finally:
        for worker in workers.values():
            worker.close()


def _per_chunk(every: int, warmup: int, chunk: int, repeats: int) -> float:
    """How many multiples of `every` the measured steps (warmup, warmup + repeats * chunk] hold, per chunk."""
    end = warmup + repeats * chunk
    return (end // every - warmup // every) / repeats


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def results(settings: dict, variants: list[Variant], *, chunk: int, warmup: int, repeats: int,
            load_before: tuple, load_after: tuple, command: str) -> dict:
    """Everything measured, as one JSON-ready dict."""
    by_name = {v.name: v for v in variants}
    gb = settings["global_batch_size"]
    rate = {v.name: v.steps_per_sec(chunk) for v in variants}
    fits = [v for v in variants if v.role == "fit" and rate[v.name] is not None]
    best_fit = max(fits, key=lambda v: rate[v.name]) if fits else None
    ours, limit = by_name.get("ours"), by_name.get("limit")
    source = settings["input_fn"] or settings["data_source"]
    model_fn = settings["model_fn"]
    mach = next((v.machine for v in variants if v.machine), None)
    out = {
        "command": command,
        "config": {
            "model": getattr(model_fn, "__name__", str(model_fn)),
            "data": type(source).__name__ if source is not None else "Digits",
            "input_shape": list(getattr(source, "input_shape", None) or (8, 8, 1)),
            "strategy": settings["strategy"], "global_batch_size": gb,
            "steps_per_loop": settings["steps_per_loop"], "log_every_steps": settings["log_every_steps"],
            "checkpoint_every_steps": settings["checkpoint_every_steps"],
            "jit_compile": bool(settings["jit_compile"]),
            "mixed_precision": settings["mixed_precision"] or "float32",
        },
        "method": {"steps_per_chunk": chunk, "warmup_until_step": warmup, "repeats": repeats,
                   "order": [v.name for v in variants], "statistic": "median over chunks",
                   # What our loop's hooks did in the measured chunks, per chunk on average.
                   "ours_progress_records_per_chunk": _per_chunk(settings["log_every_steps"], warmup, chunk, repeats),
                   "ours_checkpoints_per_chunk": _per_chunk(settings["checkpoint_every_steps"], warmup, chunk,
                                                            repeats)},
        "machine": mach,
        "load_average": {"before": list(load_before), "after": list(load_after)},
        "variants": {},
        "ratios": {
            "ours_over_limit": ratio(rate.get("ours"), rate.get("limit")),
            "ours_over_fit_spe1": ratio(rate.get("ours"), rate.get("fit_spe1")),
            "ours_over_fit_best": ratio(rate.get("ours"), rate[best_fit.name] if best_fit else None),
            "fit_best": best_fit.name if best_fit else None,
            "rss_ours_over_fit": ratio(ours.peak_rss_mib if ours else None,
                                       min((v.peak_rss_mib for v in fits if v.peak_rss_mib), default=None)),
        },
        "ours_compile_count": ours.compile_count if ours else None,
        "limit_compile_count": limit.compile_count if limit else None,
    }
    for v in variants:
        spread = v.spread(chunk)
        out["variants"][v.name] = {
            "label": v.label, "status": v.status, "reason": v.reason,
            "steps_per_sec": rate[v.name], "examples_per_sec": rate[v.name] * gb if rate[v.name] else None,
            "steps_per_sec_min_max": list(spread) if spread else None,
            "chunk_seconds": v.chunks, "warmup_seconds": v.warmup_s,
            "time_to_first_step_s": v.first_step_s, "first_call_steps": v.first_call_steps,
            "compile_count": v.compile_count, "peak_rss_mib": v.peak_rss_mib, "peak_gpu_mib": v.peak_gpu_mib,
        }
    return out


def _fmt(value, spec: str, missing: str = "-") -> str:
    return missing if value is None else format(value, spec)


def table_rows(res: dict) -> list[list[str]]:
    limit_rate = (res["variants"].get("limit") or {}).get("steps_per_sec")
    gpu = any(v.get("peak_gpu_mib") is not None for v in res["variants"].values())
    rows = [["variant", "steps/s", "examples/s", "min-max steps/s", "vs limit", "first step s", "peak RSS MiB",
             *(["peak GPU MiB"] if gpu else []), "compiles"]]
    for v in res["variants"].values():
        if v["status"] != "ok":
            reason = f"{v['status'].replace('_', ' ')}: {v['reason']}"
            rows.append([v["label"], reason, *[""] * (len(rows[0]) - 2)])
            continue
        spread = v["steps_per_sec_min_max"]
        first = _fmt(v["time_to_first_step_s"], ".1f") + (f" ({v['first_call_steps']} steps)"
                                                          if v["first_call_steps"] != 1 else "")
        rows.append([v["label"], _fmt(v["steps_per_sec"], ".2f"), _fmt(v["examples_per_sec"], ".0f"),
                     f"{spread[0]:.2f}-{spread[1]:.2f}" if spread else "-",
                     _fmt(ratio(v["steps_per_sec"], limit_rate), ".3f"), first, _fmt(v["peak_rss_mib"], ".0f"),
                     *([_fmt(v.get("peak_gpu_mib"), ".0f")] if gpu else []), _fmt(v["compile_count"], "d")])
    return rows


def headline(res: dict) -> str:
    c = res["config"]
    return (f"{c['model']} on {c['data']} {tuple(c['input_shape'])}, strategy {c['strategy']}, global batch "
            f"{c['global_batch_size']}, steps_per_loop {c['steps_per_loop']}, {c['mixed_precision']}"
            f"{', XLA' if c['jit_compile'] else ''}")


def ratio_line(res: dict) -> str:
    r = res["ratios"]
    parts = [f"ours/limit {_fmt(r['ours_over_limit'], '.3f')}",
             f"ours/fit(spe 1) {_fmt(r['ours_over_fit_spe1'], '.2f')}",
             f"ours/fit(best{', ' + r['fit_best'] if r['fit_best'] else ''}) {_fmt(r['ours_over_fit_best'], '.2f')}",
             f"peak RSS ours/fit {_fmt(r['rss_ours_over_fit'], '.2f')}",
             f"ours compile count {_fmt(res['ours_compile_count'], 'd')}"]
    return "; ".join(parts)


def method_line(res: dict) -> str:
    m, load = res["method"], res["load_average"]
    return (f"{m['repeats']} interleaved chunks of {m['steps_per_chunk']} steps per variant after warm-up to step "
            f"{m['warmup_until_step']}; medians; our loop's hooks per chunk: "
            f"{m['ours_progress_records_per_chunk']:g} progress record(s), {m['ours_checkpoints_per_chunk']:g} "
            f"checkpoint(s). Load average (1 min) {load['before'][0]:.2f} before, {load['after'][0]:.2f} after.")


def text_table(res: dict) -> str:
    rows = table_rows(res)
    widths = [max(len(row[i]) for row in rows if len(row[1]) < 40 or row is rows[0]) for i in range(len(rows[0]))]
    lines = []
    for row in rows:
        if row[2] == "" and row[1]:  # a variant that did not run: one long cell
            lines.append(f"{row[0].ljust(widths[0])}  {row[1]}")
        else:
            lines.append("  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in
                                   enumerate(zip(row, widths))))
    return "\n".join([headline(res), method_line(res), *lines, ratio_line(res)])


def markdown(res: dict) -> str:
    rows = table_rows(res)
    lines = [f"### {headline(res)}", "", f"`{res['command']}`", "", method_line(res), "",
             "| " + " | ".join(rows[0]) + " |", "|---|" + "---:|" * (len(rows[0]) - 1)]
    lines += ["| " + " | ".join(row) + " |" for row in rows[1:]]
    lines += ["", f"**{ratio_line(res)}**", ""]
    return "\n".join(lines)


def compare() -> int:
    import gin  # noqa: F401

    main_lib.parse_gin(FLAGS.gin_file, FLAGS.gin_bindings)
    settings = train_settings()
    if settings["strategy"] == "parameter_server":
        raise UserError("trainer.bench does not run parameter_server (asynchronous closures on remote workers); "
                        "Keras 3 fit cannot run there either (DESIGN.md rule 7)")
    if FLAGS.steps < 0 or FLAGS.repeats < 1 or FLAGS.warmup_steps < 0:
        raise UserError("--repeats must be at least 1, --steps and --warmup_steps at least 0")
    try:
        fit_spes = sorted({int(s) for s in FLAGS.fit_steps_per_execution} or {1, settings["steps_per_loop"]})
    except ValueError:
        raise UserError(f"--fit_steps_per_execution takes integers, got {FLAGS.fit_steps_per_execution}") from None
    if min(fit_spes) < 1:
        raise UserError("--fit_steps_per_execution values must be at least 1")
    variants = plan_variants(settings, FLAGS.variants, fit_spes)
    # Every chunk ends on a call boundary of every variant: a multiple of steps_per_loop and of fit's values.
    unit = math.lcm(settings["steps_per_loop"], *fit_spes)
    hooks_unit = math.lcm(settings["log_every_steps"], settings["checkpoint_every_steps"])
    chunk = round_up(FLAGS.steps or (hooks_unit if hooks_unit <= 20_000 else 1000), unit)
    # Warm-up ends on a chunk boundary beyond every variant's first call (fit's first call is unit steps long).
    warmup = round_up(max(FLAGS.warmup_steps or chunk, unit + 1), chunk)
    total = warmup + FLAGS.repeats * chunk
    gin_args = [*(f"--gin_file={f}" for f in FLAGS.gin_file), *(f"--gin_bindings={b}" for b in FLAGS.gin_bindings)]
    command = shlex.join(["python", "-m", "trainer.bench", *(a for a in sys.argv[1:]
                                                              if not a.startswith(("--json", "--report")))])
    print_fn = lambda line: print(line, flush=True)  # noqa: E731
    print_fn(f"bench: {', '.join(v.name for v in variants)}; {FLAGS.repeats} x {chunk} steps after warm-up to "
             f"step {warmup}")
    load_before = os.getloadavg()
    measure(settings, variants, gin_args, chunk=chunk, warmup=warmup, repeats=FLAGS.repeats, total=total,
            timeout=FLAGS.timeout_secs, print_fn=print_fn)
    res = results(settings, variants, chunk=chunk, warmup=warmup, repeats=FLAGS.repeats, load_before=load_before,
                  load_after=os.getloadavg(), command=command)
    print_fn("")
    print_fn(text_table(res))
    if FLAGS.json:
        with open(FLAGS.json, "w") as f:
            json.dump(res, f, indent=2)
    if FLAGS.report:
        with open(FLAGS.report, "a") as f:
            f.write(markdown(res) + "\n")
    failed = [v for v in variants if v.status == "failed" and v.role != "fit"]
    return 1 if failed else 0


def run(argv: list[str]) -> None:
    del argv
    if not FLAGS["verbosity"].present:
        logging.set_verbosity(logging.WARNING)
    if FLAGS.role != "compare":
        run_worker(FLAGS.role)
        return
    try:
        code = compare()
    except UserError as e:
        main_lib.fail(str(e))
    sys.exit(code)


def main() -> None:
    app.run(run, flags_parser=main_lib.parse_flags)


if __name__ == "__main__":
    main()
