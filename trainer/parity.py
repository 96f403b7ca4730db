"""`python -m trainer.parity --gin_file=gin/<mode>.gin`: does our loop train exactly like Keras `fit` on this config
(docs/parity.md)? Where Keras 3 `fit` cannot run (multi_worker_mirrored, parameter_server), each side runs in
processes of its own, ours first, then tf_keras fit from ours' initial weights (trainer/tools/parity/sides.py)."""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time

import gin
from absl import app, flags, logging

from trainer.cli import exit_without_teardown, fail, import_tensorflow_quietly, parse_flags
from trainer.distribution import local_cluster  # no TensorFlow: the tf_keras side must choose Keras first
from trainer.errors import UserError
from trainer.gin_flags import define_config_flags, parse_gin

FLAGS = flags.FLAGS


def define_flags() -> None:
    """Defined by `main`, so that importing this module claims no flag name."""
    define_config_flags()
    flags.DEFINE_integer("steps", 20, "Train steps on each side.")
    flags.DEFINE_float("atol", 1e-6, "Largest allowed absolute difference of any weight and of any step's loss.")
    flags.DEFINE_list("replicas", [], "Replica counts for the replica-invariance check instead of fit, e.g. 1,2,4.")
    flags.DEFINE_integer("num_workers", 2, "multi_worker_mirrored: worker processes on each side.")
    flags.DEFINE_integer("metric_steps", 300, "parameter_server with several workers: steps on each side.")
    flags.DEFINE_float("metric_atol", 0.03, "parameter_server with several workers: largest eval metric difference.")
    flags.DEFINE_string("report", None, "Append the table and verdict to this markdown file.")
    roles = ["compare", "ours", "tf_keras_fit", "replicas"]
    flags.DEFINE_enum("role", "compare", roles, "Internal: what this process does (compare runs the others).")
    flags.DEFINE_string("result", None, "Internal: where a worker process leaves its result.")


@dataclasses.dataclass
class Outcome:
    """A comparison as a table (header first) and a verdict: printed as text, appended as markdown (`--report`).
    `details` and `md_details` lead the summary line, which ends with the time taken."""

    title: str
    table: list[list[str]]
    passed: bool
    verdict: str
    details: str = ""
    md_details: str = ""
    note: str = ""
    seconds: float = 0.0

    def text(self) -> str:
        widths = [max(map(len, column)) for column in zip(*self.table)]
        aligned = ["  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in self.table]
        note = [f"({self.note})"] if self.note else []
        return "\n".join([self.title, *note, *aligned, f"{self.details}{self.seconds:.0f} s", self.verdict])

    def markdown(self, command: str) -> str:
        header, *rows = self.table
        note = [self.note + ".", ""] if self.note else []
        first = "---:" if all(row[0].isdigit() for row in rows) else "---"
        lines = [f"## {self.title}", "", f"`{command}`", "", *note, "| " + " | ".join(header) + " |"]
        lines += ["|" + first + "|" + "---:|" * (len(header) - 1), *("| " + " | ".join(row) + " |" for row in rows)]
        summary = f"{self.md_details}{self.seconds:.0f} s on this machine"
        return "\n".join([*lines, "", summary, "", f"**{self.verdict}**", ""])


def verdict(passed: bool, found: str, limit: str, title: str, steps: int) -> str:
    return (
        f"{'PASS' if passed else 'FAIL'}: {found} {'<=' if passed else 'exceeds'} {limit} after {steps} steps ({title})"
    )


def max_abs_difference(a: list, b: list) -> float:
    """The largest |a - b| over every element of two lists of weight arrays (in float64)."""
    if len(a) != len(b) or any(x.shape != y.shape for x, y in zip(a, b)):
        raise UserError(
            "the two models have different weights (count or shapes); model_fn must build the same model on both sides"
        )
    return max((float(abs(x.astype("float64") - y.astype("float64")).max()) for x, y in zip(a, b) if x.size), default=0)


def by_losses(title: str, columns: list[str], runs: list[dict], atol: float) -> Outcome:
    """Each run's step losses and final weights against the first's."""
    reference, losses = runs[0]["final"], [run["losses"] for run in runs]
    dw = max(max_abs_difference(reference, run["final"]) for run in runs[1:])
    dloss = max(abs(a - b) for other in losses[1:] for a, b in zip(losses[0], other))
    table = [["step", *(f"{c} loss" for c in columns), "diff"]]
    for step, values in enumerate(zip(*losses), start=1):
        diff = max((v - values[0] for v in values[1:]), key=abs)
        table.append([str(step), *(f"{v:.9f}" for v in values), f"{diff:+.2e}"])
    passed = dw <= atol and dloss <= atol
    found = f"max |dw| {dw:.2e}, max |dloss| {dloss:.2e}"
    weights = f"max |weight difference| {dw:.2e} over {sum(w.size for w in reference)} parameters; "
    return Outcome(
        title,
        table,
        passed,
        verdict(passed, found, f"atol {atol:g}", title, len(losses[0])),
        weights + f"max |loss difference| {dloss:.2e}; ",
        weights.replace("|", "\\|"),
    )


def by_metric(title: str, steps: int, tolerance: float, ours: dict, fit: dict, metric: str) -> Outcome:
    """Asynchronous training on both sides: the final eval `metric` compared, not weights."""
    table = [["metric", "ours", "tf_keras fit", "diff"]]
    for name, a in ours.items():
        b, exact = fit[name], isinstance(a, int)
        table.append(
            [name, *(str(v) if exact else f"{v:.4f}" for v in (a, b)), f"{b - a:+d}" if exact else f"{b - a:+.4f}"]
        )
    difference = abs(ours[metric] - fit[metric])
    passed = difference <= tolerance
    note = (
        "updates from several workers are asynchronous and land in a different order on every run, so "
        f"weights are not comparable; compared: final {metric}"
    )
    found = f"|{metric} difference| {difference:.4f}"
    return Outcome(title, table, passed, verdict(passed, found, f"{tolerance:g}", title, steps), note=note)


def describe(settings, replicas: int) -> str:
    """`<strategy>, N replica(s), global batch B[, <precision>][, XLA]`: the title's start."""
    extras = [settings.mixed_precision if settings.mixed_precision not in (None, "float32") else None]
    extras += ["XLA" if settings.jit_compile else None]
    title = f"{settings.strategy}, {replicas} replica(s), global batch {settings.global_batch_size}"
    return title + "".join(f", {e}" for e in extras if e)


def run_worker(command: list[str], what: str) -> None:
    """`python -m command...`, its output passed on as it comes; a user mistake there is one here."""
    mistake = None
    with subprocess.Popen(
        [sys.executable, "-m", *command], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    ) as proc:
        try:
            for line in proc.stdout:  # trainer.launch prefixes its tasks' lines with `[worker N] `
                if found := re.match(r"(\[[\w ]+\] )?error: (.*)", line):
                    mistake = found[2]
                else:
                    print(line, end="", flush=True)
        except BaseException:  # Ctrl-C, SIGTERM: the worker goes too (trainer.launch ends its tasks on SIGTERM)
            proc.terminate()
            raise
    if proc.returncode == 2:
        raise UserError(mistake or f"the {what} stopped on a user mistake")
    if proc.returncode:
        raise RuntimeError(f"the {what} failed with exit code {proc.returncode}" + (f": {mistake}" if mistake else ""))


def in_processes(commands: dict[str, list[str]], steps: int) -> list[dict]:
    """Each named worker command in turn (the first leaves the initial weights the others start from); the results."""
    from trainer.tools.parity import sides

    gin_args = [*(f"--gin_file={f}" for f in FLAGS.gin_file), *(f"--gin_bindings={b}" for b in FLAGS.gin_bindings)]
    with tempfile.TemporaryDirectory(prefix="parity-") as work_dir:
        for name, command in commands.items():
            run_worker([*command, *gin_args, f"--steps={steps}", f"--result={work_dir}/{name}"], f"{name} run")
        return [sides.load(f"{work_dir}/{name}") for name in commands]


def compare(settings, config, steps: int, atol: float) -> Outcome:
    """The comparison this config and these flags ask for."""
    from trainer import configurables
    from trainer.tools.parity import sides

    if FLAGS.replicas:
        try:
            counts = list(dict.fromkeys(int(c) for c in FLAGS.replicas))
        except ValueError:
            raise UserError(f"--replicas takes replica counts like 1,2,4, got {','.join(FLAGS.replicas)}") from None
        for count in counts:
            if count < 1 or settings.global_batch_size % count:
                raise UserError(
                    f"--replicas: {count} does not divide train.global_batch_size {settings.global_batch_size}"
                )
        commands = {f"{c}-replica": ["trainer.parity", "--role=replicas", f"--replicas={c}"] for c in counts}
        runs = in_processes(commands, steps)
        title = (
            f"{settings.strategy} config on {', '.join(map(str, counts))} logical-CPU replicas "
            f"(MirroredStrategy), global batch {settings.global_batch_size}: same losses and weights"
        )
        return by_losses(title, [f"{c} replica(s)" for c in counts], runs, atol)
    mode, fit = settings.mode, "tf_keras fit"
    if not mode.multi_worker:
        runs, replicas = sides.compare_in_process(settings, config, steps)
        return by_losses(
            f"{describe(settings, replicas)}: TrainLoop vs Keras 3 fit", ["ours", "Keras 3 fit"], runs, atol
        )
    if settings.mixed_precision not in (None, "float32"):
        raise UserError(
            f"parity against tf_keras under {settings.mixed_precision} compares different losses: tf_keras "
            "computes the loss in the compute dtype, Keras 3 and our step in float32; check this config "
            "with gin/mirrored.gin (against Keras 3 fit) or without train.mixed_precision"
        )
    ps_workers = configurables.local_cluster().num_workers if mode.coordinates_workers else 0
    if mode.coordinates_workers and os.environ.get("TF_CONFIG", "").strip():
        raise UserError("parity for parameter_server starts its own local clusters; unset TF_CONFIG")
    steps = FLAGS.metric_steps if ps_workers > 1 else steps
    if ps_workers > 1 and steps % settings.steps_per_loop:  # each side runs whole loops
        raise UserError(f"--metric_steps {steps} must be a multiple of train.steps_per_loop {settings.steps_per_loop}")
    launch = ["trainer.launch", f"--num_workers={FLAGS.num_workers}", "--module=trainer.parity", "--"]
    command = launch if mode.synchronous else ["trainer.parity"]
    runs = in_processes({role: [*command, f"--role={role}"] for role in ("ours", "tf_keras_fit")}, steps)
    if mode.synchronous:
        title = f"{describe(settings, runs[0]['replicas'])} in {FLAGS.num_workers} worker processes: TrainLoop vs {fit}"
    else:
        title = (
            f"parameter_server, {ps_workers} worker(s), global batch {settings.global_batch_size}: TrainLoop vs {fit}"
        )
    if ps_workers <= 1:
        return by_losses(title, ["ours", fit], runs, atol)
    results = []
    for run in runs:
        metrics = sides.evaluate(settings, run["final"])
        if config.metric not in metrics:
            raise UserError(
                f"parity.metric {config.metric!r} is not an output of train.eval_step_fn "
                f"(it returns {', '.join(sorted(metrics))})"
            )
        results.append(
            {"optimizer iterations": run["iterations"], "train loss (last loop)": run["losses"][-1]}
            | {f"eval {k}": v for k, v in metrics.items() if k != "num_examples"}
        )
    return by_metric(f"{title}, by final eval metrics", steps, FLAGS.metric_atol, *results, f"eval {config.metric}")


def run(argv: list[str]) -> None:
    del argv
    if not FLAGS["verbosity"].present:
        logging.set_verbosity(logging.WARNING)
    if FLAGS.steps < 1:
        fail(f"--steps must be at least 1, got {FLAGS.steps}")
    started = time.monotonic()
    try:
        parse_gin(FLAGS.gin_file, FLAGS.gin_bindings)
        from trainer import configurables
        from trainer.tools.parity.config import ParityConfig

        settings, config = configurables.settings_from_gin(), ParityConfig(**gin.get_bindings("parity"))
        if FLAGS.role != "compare":
            from trainer.tools.parity import sides

            return sides.run_side(FLAGS.role, settings, config, FLAGS.steps, FLAGS.result, FLAGS.replicas)
        outcome = compare(settings, config, FLAGS.steps, FLAGS.atol)
    except UserError as e:
        fail(str(e))
    outcome.seconds = time.monotonic() - started
    if FLAGS.report:
        args = [a for a in sys.argv[1:] if not a.startswith("--report")]
        # As a person would type it: gin strings in single quotes, so the flag in double quotes.
        quoted = [shlex.quote(a) if shlex.quote(a) == a or set('"$`\\') & set(a) else f'"{a}"' for a in args]
        with open(FLAGS.report, "a") as f:
            f.write(outcome.markdown(" ".join(["python -m trainer.parity", *quoted])) + "\n")
    print(outcome.text(), flush=True)
    sys.exit(0 if outcome.passed else 1)


def main() -> None:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    tf_keras_side = "--role=tf_keras_fit" in sys.argv[1:]
    if tf_keras_side:
        os.environ["TF_USE_LEGACY_KERAS"] = "1"  # before TensorFlow loads, which imports Keras 3 unless told
    import_tensorflow_quietly()
    if tf_keras_side:  # from here on, `import keras` (ours, the user's gin modules) and tf.keras are tf_keras
        import tf_keras

        sys.modules["keras"] = tf_keras
    define_flags()
    # Leaves without the interpreter's teardown once the outcome is printed, as trainer.main does.
    app.run(exit_without_teardown(run, local_cluster.coordinates_ps_cluster), flags_parser=parse_flags)


if __name__ == "__main__":
    main()
