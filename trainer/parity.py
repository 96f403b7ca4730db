"""`python -m trainer.parity --gin_file=gin/<mode>.gin [--gin_bindings=...] [--steps=K] [--atol=X]`

Does our loop train exactly like Keras `fit` on this config? Runs K steps of TrainLoop
with the configured step, model, optimizer and data, and K steps of `fit` from the same
initial weights on the same batches in the same order (`steps_per_execution=1`), prints
both losses step by step, their difference and the largest weight difference, and exits
0 when both are within `--atol`, 1 when not (2: a user mistake). The last line is the
verdict with its figures.

- default, one_device, mirrored, central_storage: against Keras 3 `fit` in this process,
  on the same strategy (same replica count). Expected bit-identical weights.
- multi_worker_mirrored: Keras 3 `fit` cannot run there (DESIGN.md rule 7), so the
  comparison is against `tf_keras` `fit` (`TF_USE_LEGACY_KERAS=1`): `--num_workers`
  worker processes run our loop, then as many run tf_keras `fit` under the same strategy
  from the weights ours started with; results travel as .npz files. The tf_keras side calls
  the configured `model_fn`/`optimizer_fn` with the name `keras` bound to tf_keras, so
  they must use Keras API that both have.
- `--replicas=1,2,4`: instead of fit, the same config on 1, 2 and 4 logical-CPU replicas
  (MirroredStrategy, one fresh process each) at the same global batch size must give
  the same losses and weights as the first count.
- parameter_server: against tf_keras `fit` under ParameterServerStrategy, each side in
  its own process with its own embedded local cluster (`local_cluster.num_workers`
  workers, one ps). With one worker, exact, step by step as above. With more, updates
  are asynchronous and their order differs on every run, so weights cannot match: each
  side trains `--metric_steps` steps and the final eval accuracy of both (computed here,
  with the configured eval step) must agree within `--metric_atol`. The table also shows
  each side's `optimizer.iterations`: Keras 3 increments it with a separate read and
  write, so concurrent workers lose increments (246 of 300 measured with 2 workers),
  which shifts Adam's bias correction and any schedule; tf_keras counts every step.

Both sides follow `train.mixed_precision` (fit's `compile` adds its own loss scaling under
mixed_float16) and `train.jit_compile` (fit compiled with `jit_compile` too). Against
tf_keras, mixed precision is refused: tf_keras computes the loss in the compute dtype.

`--report=FILE` appends the table and verdict to a markdown file
(experiments/parity/run.sh regenerates experiments/parity/README.md that way).
"""
from __future__ import annotations

import dataclasses
import os
import shlex
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app, flags, logging  # noqa: E402

from trainer import main as main_lib  # noqa: E402  (defines --gin_file and --gin_bindings)
from trainer.errors import UserError  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_integer("steps", 20, "Train steps on each side.")
flags.DEFINE_float("atol", 1e-6, "Largest allowed absolute difference of any weight and of any step's loss.")
flags.DEFINE_list("replicas", [], "Replica counts for the replica-invariance check instead of fit, e.g. 1,2,4.")
flags.DEFINE_integer("num_workers", 2, "multi_worker_mirrored: worker processes on each side.")
flags.DEFINE_integer("metric_steps", 300, "parameter_server with several workers: steps on each side before "
                     "the final eval metrics are compared.")
flags.DEFINE_float("metric_atol", 0.03, "parameter_server with several workers: largest allowed difference of the "
                   "final eval accuracy.")
flags.DEFINE_string("report", None, "Append the table and verdict to this markdown file.")
flags.DEFINE_enum("role", "compare", ["compare", "ours", "tf_keras_fit", "replicas"],
                  "Internal: what this process does (compare runs the others as needed).")
flags.DEFINE_string("work_dir", None, "Internal: where worker processes leave their results.")
flags.DEFINE_integer("num_replicas", 0, "Internal: the replica count of a --role=replicas process.")

IN_PROCESS = ("default", "one_device", "mirrored", "central_storage")


@dataclasses.dataclass
class Outcome:
    """Per-step losses of several runs (the first is the reference) and the weight difference."""

    title: str
    columns: list[str]
    losses: list[list[float]]
    max_dw: float
    atol: float
    num_params: int
    seconds: float = 0.0

    @property
    def max_dloss(self) -> float:
        reference = self.losses[0]
        return max(abs(a - b) for other in self.losses[1:] for a, b in zip(reference, other))

    @property
    def passed(self) -> bool:
        return self.max_dw <= self.atol and self.max_dloss <= self.atol

    def rows(self) -> list[list[str]]:
        rows = []
        for step, values in enumerate(zip(*self.losses), start=1):
            diff = max((v - values[0] for v in values[1:]), key=abs)
            rows.append([str(step), *(f"{v:.9f}" for v in values), f"{diff:+.2e}"])
        return rows

    def header(self) -> list[str]:
        return ["step", *(f"{c} loss" for c in self.columns), "diff"]

    def verdict(self) -> str:
        word, relation = ("PASS", "<=") if self.passed else ("FAIL", "exceeds")
        return (f"{word}: max |dw| {self.max_dw:.2e}, max |dloss| {self.max_dloss:.2e} {relation} atol "
                f"{self.atol:g} after {len(self.losses[0])} steps ({self.title})")

    def text(self) -> str:
        table = [self.header(), *self.rows()]
        widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
        lines = ["  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in table]
        lines.append(f"max |weight difference| {self.max_dw:.2e} over {self.num_params} parameters; "
                     f"max |loss difference| {self.max_dloss:.2e}; {self.seconds:.0f} s")
        return "\n".join([self.title, *lines, self.verdict()])

    def markdown(self, command: str) -> str:
        table = [self.header(), *self.rows()]
        lines = [f"## {self.title}", "", f"`{command}`", "",
                 "| " + " | ".join(table[0]) + " |", "|" + "---:|" * len(table[0])]
        lines += ["| " + " | ".join(row) + " |" for row in table[1:]]
        lines += ["", f"max \\|weight difference\\| {self.max_dw:.2e} over {self.num_params} parameters; "
                  f"{self.seconds:.0f} s on this machine", "", f"**{self.verdict()}**", ""]
        return "\n".join(lines)


def max_abs_difference(a: list, b: list) -> float:
    if len(a) != len(b) or any(x.shape != y.shape for x, y in zip(a, b)):
        raise UserError("the two models have different weights (count or shapes); model_fn must build the same "
                        "model on both sides")
    return max((float(abs(x.astype("float64") - y.astype("float64")).max()) for x, y in zip(a, b) if x.size),
               default=0.0)


def describe(settings, replicas: int) -> str:
    extras = [e for e in (settings.mixed_precision if settings.mixed_precision not in (None, "float32") else None,
                          "XLA" if settings.jit_compile else None) if e]
    return (f"{settings.strategy}, {replicas} replica(s), global batch {settings.global_batch_size}"
            + "".join(f", {e}" for e in extras))


# --- the comparisons ------------------------------------------------------------------------


def compare_in_process(settings, steps: int, atol: float) -> Outcome:
    """Ours and Keras 3 fit in this process, on the configured strategy."""
    from trainer.tools import parity_runs as runs

    dist, _ = runs.make_strategy(settings)
    model, optimizer = runs.build(settings, dist)
    fit_model, fit_optimizer = runs.build(settings, dist, seed=False, for_fit=True)
    runs.copy_state(model, fit_model)
    initial = runs.weights(model)
    ours = runs.run_ours(settings, dist, model, optimizer, steps)
    fit = runs.run_fit(settings, dist, fit_model, fit_optimizer, steps)
    replicas = dist.num_replicas_in_sync
    return Outcome(
        title=f"{describe(settings, replicas)}: TrainLoop vs Keras 3 fit",
        columns=["ours", "Keras 3 fit"], losses=[ours, fit],
        max_dw=max_abs_difference(runs.weights(model), runs.weights(fit_model)),
        atol=atol, num_params=sum(w.size for w in initial),
    )


def compare_multi_worker(settings, steps: int, atol: float, num_workers: int, gin_args: list[str]) -> Outcome:
    """Ours on `num_workers` processes, then tf_keras fit on as many, from ours' initial weights."""
    from trainer import launch
    from trainer.tools import parity_runs as runs

    with tempfile.TemporaryDirectory(prefix="parity-") as work_dir:
        common = [*gin_args, f"--steps={steps}", f"--work_dir={work_dir}"]
        for role in ("ours", "tf_keras_fit"):
            code = launch.launch(num_workers, 0, [*common, f"--role={role}"], module="trainer.parity")
            if code == 2:
                raise UserError(f"the {role} workers stopped on a user mistake (see their output above)")
            if code:
                raise RuntimeError(f"the {role} workers failed with exit code {code} (see their output above)")
        ours, ours_arrays = runs.load(os.path.join(work_dir, "ours"))
        fit, fit_arrays = runs.load(os.path.join(work_dir, "tf_keras_fit"))
    return Outcome(
        title=(f"{describe(settings, ours['replicas'])} in {num_workers} worker processes: "
               "TrainLoop vs tf_keras fit"),
        columns=["ours", "tf_keras fit"], losses=[ours["losses"], fit["losses"]],
        max_dw=max_abs_difference(ours_arrays["final"], fit_arrays["final"]),
        atol=atol, num_params=sum(w.size for w in ours_arrays["initial"]),
    )


def compare_replicas(settings, steps: int, atol: float, counts: list[int], gin_args: list[str]) -> Outcome:
    """Ours on each replica count in a fresh process, all from the first one's initial weights."""
    from trainer.tools import parity_runs as runs

    results = []
    with tempfile.TemporaryDirectory(prefix="parity-") as work_dir:
        for count in counts:
            command = [sys.executable, "-m", "trainer.parity", *gin_args, f"--steps={steps}",
                       f"--work_dir={work_dir}", "--role=replicas", f"--num_replicas={count}"]
            proc = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            if proc.returncode:
                print(proc.stdout, end="")
                if proc.returncode == 2:
                    raise UserError(proc.stdout.strip().splitlines()[-1].removeprefix("error: "))
                raise RuntimeError(f"the {count}-replica run failed with exit code {proc.returncode}")
            results.append(runs.load(os.path.join(work_dir, f"replicas{count}")))
    reference = results[0][1]["final"]
    return Outcome(
        title=(f"{settings.strategy} config on {', '.join(map(str, counts))} logical-CPU replicas "
               f"(MirroredStrategy), global batch {settings.global_batch_size}: same losses and weights"),
        columns=[f"{c} replica(s)" for c in counts], losses=[meta["losses"] for meta, _ in results],
        max_dw=max(max_abs_difference(reference, arrays["final"]) for _, arrays in results[1:]),
        atol=atol, num_params=sum(w.size for w in reference),
    )


def compare_parameter_server(settings, steps: int, atol: float, gin_args: list[str]):
    """Ours, then tf_keras fit, each in a subprocess that runs its own embedded ps cluster."""
    from trainer import configurables
    from trainer.tools import parity_runs as runs

    if os.environ.get("TF_CONFIG", "").strip():
        raise UserError("parity for parameter_server starts its own local clusters; unset TF_CONFIG")
    workers = configurables.local_cluster().num_workers
    exact = workers == 1
    if not exact:
        steps = FLAGS.metric_steps
    with tempfile.TemporaryDirectory(prefix="parity-") as work_dir:
        for role in ("ours", "tf_keras_fit"):
            command = [sys.executable, "-m", "trainer.parity", *gin_args, f"--steps={steps}",
                       f"--work_dir={work_dir}", f"--role={role}"]
            code = subprocess.run(command).returncode
            if code == 2:
                raise UserError(f"the {role} run stopped on a user mistake (see its output above)")
            if code:
                raise RuntimeError(f"the {role} run failed with exit code {code} (see its output above)")
        ours, ours_arrays = runs.load(os.path.join(work_dir, "ours"))
        fit, fit_arrays = runs.load(os.path.join(work_dir, "tf_keras_fit"))
    title = f"parameter_server, {workers} worker(s), global batch {settings.global_batch_size}: TrainLoop vs tf_keras fit"
    if exact:
        return Outcome(
            title=title, columns=["ours", "tf_keras fit"], losses=[ours["losses"], fit["losses"]],
            max_dw=max_abs_difference(ours_arrays["final"], fit_arrays["final"]),
            atol=atol, num_params=sum(w.size for w in ours_arrays["initial"]),
        )
    return MetricOutcome(
        title=f"{title}, by final eval metrics", steps=steps, tolerance=FLAGS.metric_atol,
        ours={"optimizer iterations": ours["iterations"], "last train loss": ours["losses"][-1],
              **runs.evaluate(settings, ours_arrays["final"])},
        fit={"optimizer iterations": fit["iterations"], "last train loss": fit["losses"][-1],
             **runs.evaluate(settings, fit_arrays["final"])},
    )


@dataclasses.dataclass
class MetricOutcome:
    """Asynchronous training on both sides: final metrics compared, not weights."""

    title: str
    steps: int
    tolerance: float
    ours: dict
    fit: dict
    seconds: float = 0.0

    NOTE = ("updates from several workers are asynchronous and land in a different order on every run, so "
            "weights are not comparable; compared: final eval accuracy")

    @property
    def accuracy_difference(self) -> float:
        return abs(self.ours["accuracy"] - self.fit["accuracy"])

    @property
    def passed(self) -> bool:
        return self.accuracy_difference <= self.tolerance

    def rows(self) -> list[list[str]]:
        names = {"optimizer iterations": "optimizer iterations", "last train loss": "train loss (last loop)",
                 "loss": "eval loss", "accuracy": "eval accuracy"}

        def cell(value) -> str:
            return str(value) if isinstance(value, int) else f"{value:.4f}"

        return [[name, cell(self.ours[k]), cell(self.fit[k]),
                 f"{self.fit[k] - self.ours[k]:+d}" if isinstance(self.ours[k], int) else f"{self.fit[k] - self.ours[k]:+.4f}"]
                for k, name in names.items()]

    def verdict(self) -> str:
        word, relation = ("PASS", "<=") if self.passed else ("FAIL", "exceeds")
        return (f"{word}: |eval accuracy difference| {self.accuracy_difference:.4f} {relation} "
                f"{self.tolerance:g} after {self.steps} steps ({self.title})")

    def text(self) -> str:
        table = [["metric", "ours", "tf_keras fit", "diff"], *self.rows()]
        widths = [max(len(row[i]) for row in table) for i in range(4)]
        lines = ["  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in table]
        return "\n".join([self.title, f"({self.NOTE})", *lines, f"{self.seconds:.0f} s", self.verdict()])

    def markdown(self, command: str) -> str:
        lines = [f"## {self.title}", "", f"`{command}`", "", self.NOTE + ".", "",
                 "| metric | ours | tf_keras fit | diff |", "|---|---:|---:|---:|"]
        lines += ["| " + " | ".join(row) + " |" for row in self.rows()]
        lines += ["", f"{self.seconds:.0f} s on this machine", "", f"**{self.verdict()}**", ""]
        return "\n".join(lines)


# --- what one worker process does -------------------------------------------------------------


def worker_ours(settings, steps: int, work_dir: str) -> None:
    """Our loop; the chief saves the results. Multi-worker: one of the launched workers.

    parameter_server: this process coordinates its own embedded cluster.
    """
    from trainer.tools import parity_runs as runs

    with _embedded_cluster(settings):
        dist, is_chief = runs.make_strategy(settings)
        model, optimizer = runs.build(settings, dist)
        initial = runs.weights(model)
        if settings.strategy == "parameter_server":
            losses = runs.run_ours_ps(settings, dist, model, optimizer, steps, chunk=_ps_chunk(settings, dist))
        else:
            losses = runs.run_ours(settings, dist, model, optimizer, steps)
        if is_chief:
            runs.save(os.path.join(work_dir, "ours"), losses=losses, replicas=dist.num_replicas_in_sync,
                      iterations=int(optimizer.iterations.numpy()),
                      arrays={"initial": initial, "final": runs.weights(model)})
    print(f"ours: {steps} steps on {dist.num_replicas_in_sync} replicas, last loss {losses[-1]:.6f}", flush=True)


def worker_tf_keras_fit(settings, steps: int, work_dir: str) -> None:
    """tf_keras fit from ours' initial weights, on the same strategy; the chief saves the results."""
    from trainer.tools import parity_runs as runs

    _, arrays = runs.load(os.path.join(work_dir, "ours"))
    with _embedded_cluster(settings):
        dist, is_chief = runs.make_strategy(settings)
        model, optimizer = runs.build(settings, dist, for_fit=True)
        with dist.scope():
            model.set_weights(arrays["initial"])
        if settings.strategy == "parameter_server":
            losses = runs.run_fit_ps(settings, dist, model, optimizer, steps, chunk=_ps_chunk(settings, dist))
        else:
            losses = runs.run_fit(settings, dist, model, optimizer, steps)
        if is_chief:
            runs.save(os.path.join(work_dir, "tf_keras_fit"), losses=losses, replicas=dist.num_replicas_in_sync,
                      iterations=int(optimizer.iterations.numpy()), arrays={"final": runs.weights(model)})
    print(f"tf_keras fit: {steps} steps on {dist.num_replicas_in_sync} replicas, last loss {losses[-1]:.6f}",
          flush=True)


def _embedded_cluster(settings):
    """parameter_server: a local cluster coordinated by this process; otherwise nothing."""
    from trainer import configurables
    from trainer.distribution import local_cluster

    return local_cluster.cluster_for(settings.strategy, configurables.local_cluster, print_fn=print)


def _ps_chunk(settings, dist) -> int:
    """One step per call with one worker (step-by-step losses); a whole loop's steps with more."""
    from trainer import data

    return 1 if data.num_workers(dist) == 1 else settings.steps_per_loop


def worker_replicas(settings, steps: int, work_dir: str, count: int) -> None:
    """Our loop on `count` logical CPUs under MirroredStrategy, from the first count's initial weights."""
    import tensorflow as tf

    from trainer.distribution import devices
    from trainer.tools import parity_runs as runs

    if count < 1 or settings.global_batch_size % count:
        raise UserError(f"--replicas: {count} does not divide train.global_batch_size {settings.global_batch_size}")
    devices.configure_devices(dataclasses.replace(settings.device_config, logical_cpus=count,
                                                  logical_cpus_without_gpu=0))
    dist = tf.distribute.MirroredStrategy([d.name for d in tf.config.list_logical_devices("CPU")])
    model, optimizer = runs.build(settings, dist)
    init_path = os.path.join(work_dir, "initial")
    if runs.exists(init_path):
        _, arrays = runs.load(init_path)
        with dist.scope():
            model.set_weights(arrays["initial"])
    else:
        runs.save(init_path, losses=[], arrays={"initial": runs.weights(model)})
    losses = runs.run_ours(settings, dist, model, optimizer, steps)
    runs.save(os.path.join(work_dir, f"replicas{count}"), losses=losses, arrays={"final": runs.weights(model)})


# --- entry point ---------------------------------------------------------------------------------


def use_tf_keras() -> None:
    """From here on, `import keras` (ours, the user's gin modules) and tf.keras are tf_keras."""
    os.environ["TF_USE_LEGACY_KERAS"] = "1"
    if "keras" in sys.modules and not sys.modules["keras"].__name__.startswith("tf_keras"):
        raise RuntimeError("Keras 3 was imported before the tf_keras side could start")
    import tf_keras

    sys.modules["keras"] = tf_keras


def _shell_quote(arg: str) -> str:
    """As a person would type it: gin strings in single quotes, so the flag in double quotes."""
    if shlex.quote(arg) == arg or '"' in arg or "$" in arg or "`" in arg or "\\" in arg:
        return shlex.quote(arg)
    return f'"{arg}"'


def gin_args() -> list[str]:
    return [*(f"--gin_file={f}" for f in FLAGS.gin_file), *(f"--gin_bindings={b}" for b in FLAGS.gin_bindings)]


def compare(settings, steps: int, atol: float) -> Outcome | MetricOutcome:
    if FLAGS.replicas:
        try:
            counts = [int(c) for c in FLAGS.replicas]
        except ValueError:
            raise UserError(f"--replicas takes replica counts like 1,2,4, got {','.join(FLAGS.replicas)}") from None
        for count in counts:
            if count < 1 or settings.global_batch_size % count:
                raise UserError(f"--replicas: {count} does not divide train.global_batch_size "
                                f"{settings.global_batch_size}")
        return compare_replicas(settings, steps, atol, counts, gin_args())
    if settings.strategy in IN_PROCESS:
        return compare_in_process(settings, steps, atol)
    if settings.mixed_precision not in (None, "float32"):
        raise UserError(f"parity against tf_keras under {settings.mixed_precision} compares different losses: tf_keras "
                        "computes the loss in the compute dtype, Keras 3 and our step in float32; check this config "
                        "with gin/mirrored.gin (against Keras 3 fit) or without train.mixed_precision")
    if settings.strategy == "multi_worker_mirrored":
        return compare_multi_worker(settings, steps, atol, FLAGS.num_workers, gin_args())
    if settings.strategy == "parameter_server":
        return compare_parameter_server(settings, steps, atol, gin_args())
    raise UserError(f"parity does not support strategy {settings.strategy!r}; use one of "
                    f"{', '.join(IN_PROCESS)}, multi_worker_mirrored, parameter_server")


def run(argv: list[str]) -> None:
    del argv
    if not FLAGS["verbosity"].present:
        logging.set_verbosity(logging.WARNING)
    if FLAGS.steps < 1:
        main_lib.fail(f"--steps must be at least 1, got {FLAGS.steps}")
    if FLAGS.role == "tf_keras_fit":
        use_tf_keras()
    started = time.monotonic()
    try:
        main_lib.parse_gin(FLAGS.gin_file, FLAGS.gin_bindings)
        from trainer.tools import parity_runs as runs

        settings = runs.settings_from_gin()
        if FLAGS.role in ("ours", "tf_keras_fit"):
            worker = worker_ours if FLAGS.role == "ours" else worker_tf_keras_fit
            return worker(settings, FLAGS.steps, FLAGS.work_dir)
        if FLAGS.role == "replicas":
            return worker_replicas(settings, FLAGS.steps, FLAGS.work_dir, FLAGS.num_replicas)
        outcome = compare(settings, FLAGS.steps, FLAGS.atol)
    except UserError as e:
        main_lib.fail(str(e))
    outcome.seconds = time.monotonic() - started
    if FLAGS.report:
        args = [a for a in sys.argv[1:] if not a.startswith("--report")]
        command = " ".join(["python -m trainer.parity", *map(_shell_quote, args)])
        with open(FLAGS.report, "a") as f:
            f.write(outcome.markdown(command) + "\n")
    print(outcome.text(), flush=True)
    sys.exit(0 if outcome.passed else 1)


def main() -> None:
    from trainer.distribution import local_cluster

    # A ParameterServer coordinator leaves with os._exit (TensorFlow's teardown would call
    # the stopped servers), as trainer.main does.
    app.run(local_cluster.exit_hard_after_ps(run), flags_parser=main_lib.parse_flags)


if __name__ == "__main__":
    main()
