"""`python -m trainer.parity --gin_file=gin/<mode>.gin [--steps=K] [--atol=X]`: does our loop train exactly like
Keras `fit` on this config? K steps of each from the same weights on the same batches, built as a run builds them
(trainer/tools/parity/sides.py); exit 0 within `--atol`, 1 outside it, 2 on a user mistake (docs/parity.md).
Where Keras 3 `fit` cannot run (multi_worker_mirrored, parameter_server), each side runs in processes of its
own, ours first, then tf_keras fit from ours' initial weights; `--replicas=1,2,4` compares replica counts instead.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import tempfile
import time

from absl import app, flags, logging

from trainer.cli import exit_without_teardown, fail, import_tensorflow_quietly, parse_flags
from trainer.distribution import local_cluster  # no TensorFlow: the tf_keras side must choose Keras first
from trainer.errors import UserError
from trainer.gin_flags import define_config_flags, parse_gin

FLAGS = flags.FLAGS
ROLES = ["compare", "ours", "tf_keras_fit", "replicas"]


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
    flags.DEFINE_enum("role", "compare", ROLES, "Internal: what this process does (compare runs the others).")
    flags.DEFINE_string("work_dir", None, "Internal: where worker processes leave their results.")
    flags.DEFINE_integer("num_replicas", 0, "Internal: the replica count of a --role=replicas process.")


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


def across_processes(settings, config, steps: int, atol: float, gin_args: list[str]):
    """The comparison of a config whose sides need processes of their own (see the module docstring)."""
    from trainer import configurables
    from trainer.tools.parity import sides
    from trainer.tools.parity.outcome import MetricOutcome, Outcome, describe

    mode = settings.mode
    ps_workers = configurables.local_cluster().num_workers if mode.coordinates_workers else 0
    if mode.coordinates_workers and os.environ.get("TF_CONFIG", "").strip():
        raise UserError("parity for parameter_server starts its own local clusters; unset TF_CONFIG")
    steps = FLAGS.metric_steps if mode.coordinates_workers and ps_workers > 1 else steps
    with tempfile.TemporaryDirectory(prefix="parity-") as work_dir:
        args = [*gin_args, f"--steps={steps}", f"--work_dir={work_dir}"]
        for role in ("ours", "tf_keras_fit"):
            launch = ["trainer.launch", f"--num_workers={FLAGS.num_workers}", "--module=trainer.parity", "--"]
            command = [*(launch if mode.synchronous else ["trainer.parity"]), *args, f"--role={role}"]
            run_worker(command, f"{role} run")
        runs = [sides.load(os.path.join(work_dir, role)) for role in ("ours", "tf_keras_fit")]
    if mode.synchronous:
        title = f"{describe(settings, runs[0]['replicas'])} in {FLAGS.num_workers} worker processes"
    else:
        title = f"parameter_server, {ps_workers} worker(s), global batch {settings.global_batch_size}"
    if mode.synchronous or ps_workers == 1:
        return Outcome.of_runs(f"{title}: TrainLoop vs tf_keras fit", ["ours", "tf_keras fit"], runs, atol)
    results = []
    for run in runs:
        metrics = sides.evaluate(settings, run["final"])
        if config.metric not in metrics:
            raise UserError(
                f"parity.metric {config.metric!r} is not an output of train.eval_step_fn "
                f"(it returns {', '.join(sorted(metrics))})"
            )
        results.append({"optimizer iterations": run["iterations"], "last train loss": run["losses"][-1], **metrics})
    return MetricOutcome(
        f"{title}: TrainLoop vs tf_keras fit, by final eval metrics", steps, FLAGS.metric_atol, *results, config.metric
    )


def compare_replicas(settings, steps: int, atol: float, gin_args: list[str]):
    """Ours on each `--replicas` count in a fresh process, all from the first one's initial weights."""
    from trainer.tools.parity import sides
    from trainer.tools.parity.outcome import Outcome

    try:
        counts = [int(c) for c in FLAGS.replicas]
    except ValueError:
        raise UserError(f"--replicas takes replica counts like 1,2,4, got {','.join(FLAGS.replicas)}") from None
    for count in counts:
        if count < 1 or settings.global_batch_size % count:
            raise UserError(f"--replicas: {count} does not divide train.global_batch_size {settings.global_batch_size}")
    with tempfile.TemporaryDirectory(prefix="parity-") as work_dir:
        for count in counts:
            args = [f"--steps={steps}", f"--work_dir={work_dir}", "--role=replicas", f"--num_replicas={count}"]
            run_worker(["trainer.parity", *gin_args, *args], f"{count}-replica run")
        runs = [sides.load(os.path.join(work_dir, f"replicas{count}")) for count in counts]
    title = (
        f"{settings.strategy} config on {', '.join(map(str, counts))} logical-CPU replicas "
        f"(MirroredStrategy), global batch {settings.global_batch_size}: same losses and weights"
    )
    return Outcome.of_runs(title, [f"{c} replica(s)" for c in counts], runs, atol)


def compare(settings, config, steps: int, atol: float):
    """The comparison this config and these flags ask for: an Outcome or a MetricOutcome."""
    from trainer.tools.parity import sides

    gin_args = [*(f"--gin_file={f}" for f in FLAGS.gin_file), *(f"--gin_bindings={b}" for b in FLAGS.gin_bindings)]
    if FLAGS.replicas:
        return compare_replicas(settings, steps, atol, gin_args)
    if not settings.mode.multi_worker:
        return sides.compare_in_process(settings, config, steps, atol)
    if settings.mixed_precision not in (None, "float32"):
        raise UserError(
            f"parity against tf_keras under {settings.mixed_precision} compares different losses: tf_keras "
            "computes the loss in the compute dtype, Keras 3 and our step in float32; check this config "
            "with gin/mirrored.gin (against Keras 3 fit) or without train.mixed_precision"
        )
    return across_processes(settings, config, steps, atol, gin_args)


def use_tf_keras() -> None:
    """From here on, `import keras` (ours, the user's gin modules) and tf.keras are tf_keras."""
    os.environ["TF_USE_LEGACY_KERAS"] = "1"
    if "keras" in sys.modules and not sys.modules["keras"].__name__.startswith("tf_keras"):
        raise RuntimeError("Keras 3 was imported before the tf_keras side could start")
    import tf_keras

    sys.modules["keras"] = tf_keras


def run(argv: list[str]) -> None:
    del argv
    if not FLAGS["verbosity"].present:
        logging.set_verbosity(logging.WARNING)
    if FLAGS.steps < 1:
        fail(f"--steps must be at least 1, got {FLAGS.steps}")
    if FLAGS.role == "tf_keras_fit":
        use_tf_keras()
    started = time.monotonic()
    try:
        parse_gin(FLAGS.gin_file, FLAGS.gin_bindings)
        from trainer import configurables
        from trainer.tools.parity import config as parity_config

        settings, config = configurables.settings_from_gin(), parity_config.from_gin()
        if FLAGS.role != "compare":
            from trainer.tools.parity import sides

            if FLAGS.role == "replicas":
                return sides.run_replicas(settings, FLAGS.steps, FLAGS.work_dir, FLAGS.num_replicas)
            return sides.run_side(FLAGS.role, settings, config, FLAGS.steps, FLAGS.work_dir)
        outcome = compare(settings, config, FLAGS.steps, FLAGS.atol)
    except UserError as e:
        fail(str(e))
    outcome.seconds = time.monotonic() - started
    if FLAGS.report:
        args = [a for a in sys.argv[1:] if not a.startswith("--report")]
        # As a person would type it: gin strings in single quotes, so the flag in double quotes.
        quoted = [shlex.quote(a) if shlex.quote(a) == a or set('"$`\\') & set(a) else f'"{a}"' for a in args]
        command = " ".join(["python -m trainer.parity", *quoted])
        with open(FLAGS.report, "a") as f:
            f.write(outcome.markdown(command) + "\n")
    print(outcome.text(), flush=True)
    sys.exit(0 if outcome.passed else 1)


def main() -> None:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if "--role=tf_keras_fit" in sys.argv[1:]:
        os.environ["TF_USE_LEGACY_KERAS"] = "1"  # before TensorFlow loads, which imports Keras 3 unless told
    import_tensorflow_quietly()
    define_flags()
    # Leaves without the interpreter's teardown once the outcome is printed, as trainer.main does.
    app.run(exit_without_teardown(run, local_cluster.coordinates_ps_cluster), flags_parser=parse_flags)


if __name__ == "__main__":
    main()
