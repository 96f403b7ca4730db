"""`python -m trainer.parity --gin_file=gin/<mode>.gin [--gin_bindings=...] [--steps=K] [--atol=X]`

Does our loop train exactly like Keras `fit` on this config? Runs K steps of TrainLoop
with the configured step, model, optimizer and data, and K steps of `fit` from the same
initial weights on the same batches in the same order (`steps_per_execution=1`), prints
both losses step by step, their difference and the largest weight difference, and exits
0 when both are within `--atol`, 1 when not (2: a user mistake). The last line is the
verdict with its figures.

- default, one_device, mirrored, central_storage: against Keras 3 `fit` in this process,
  on the same strategy (same replica count). Expected bit-identical weights.
- multi_worker_mirrored: Keras 3 `fit` cannot run there (docs/design.md, rule 7), so the
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

Any task: fit's loss is `parity.loss` (a Keras loss name such as 'mean_squared_error', or a
gin @reference to a loss function or object; default SparseCategoricalCrossentropy(from_logits=True),
the loss of the default step), and fit gets exactly our batches, of any structure the input
function yields, as (x, y) or (x, y, sample_weight). `parity.metric` names the eval output
compared under parameter_server with several workers (default 'accuracy'). Both sides are
built by `train`'s own setup (trainer/run/setup.py); see trainer/tools/parity/.

Both sides follow `train.mixed_precision` (fit's `compile` adds its own loss scaling under
mixed_float16) and `train.jit_compile` (fit compiled with `jit_compile` too). Against
tf_keras, mixed precision is refused: tf_keras computes the loss in the compute dtype.

`--report=FILE` appends the table and verdict to a markdown file
(experiments/parity/run.sh regenerates experiments/parity/README.md that way).
"""

from __future__ import annotations

import os
import shlex
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
if "--role=tf_keras_fit" in sys.argv[1:]:
    # Before anything imports TensorFlow, which imports Keras 3 unless told otherwise.
    os.environ["TF_USE_LEGACY_KERAS"] = "1"

from absl import app, flags, logging  # noqa: E402

from trainer.cli import exit_without_teardown, fail, parse_flags  # noqa: E402
from trainer.errors import UserError  # noqa: E402
from trainer.gin_flags import define_config_flags, parse_gin  # noqa: E402
from trainer.tools.parity import config as parity_config  # noqa: E402  (imports no Keras)

FLAGS = flags.FLAGS
define_config_flags()
flags.DEFINE_integer("steps", 20, "Train steps on each side.")
flags.DEFINE_float("atol", 1e-6, "Largest allowed absolute difference of any weight and of any step's loss.")
flags.DEFINE_list("replicas", [], "Replica counts for the replica-invariance check instead of fit, e.g. 1,2,4.")
flags.DEFINE_integer("num_workers", 2, "multi_worker_mirrored: worker processes on each side.")
flags.DEFINE_integer(
    "metric_steps",
    300,
    "parameter_server with several workers: steps on each side before the final eval metrics are compared.",
)
flags.DEFINE_float(
    "metric_atol", 0.03, "parameter_server with several workers: largest allowed difference of the final eval accuracy."
)
flags.DEFINE_string("report", None, "Append the table and verdict to this markdown file.")
flags.DEFINE_enum(
    "role",
    "compare",
    ["compare", "ours", "tf_keras_fit", "replicas"],
    "Internal: what this process does (compare runs the others as needed).",
)
flags.DEFINE_string("work_dir", None, "Internal: where worker processes leave their results.")
flags.DEFINE_integer("num_replicas", 0, "Internal: the replica count of a --role=replicas process.")


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


def compare(settings, config, steps: int, atol: float):
    """The comparison this config asks for (see the module docstring); an Outcome or MetricOutcome."""
    from trainer.tools.parity import compare as comparisons

    if FLAGS.replicas:
        try:
            counts = [int(c) for c in FLAGS.replicas]
        except ValueError:
            raise UserError(f"--replicas takes replica counts like 1,2,4, got {','.join(FLAGS.replicas)}") from None
        for count in counts:
            if count < 1 or settings.global_batch_size % count:
                raise UserError(
                    f"--replicas: {count} does not divide train.global_batch_size {settings.global_batch_size}"
                )
        return comparisons.compare_replicas(settings, steps, atol, counts, gin_args())
    mode, precision = settings.mode, settings.mixed_precision
    if not mode.multi_worker:
        return comparisons.compare_in_process(settings, config, steps, atol)
    if precision not in (None, "float32"):
        raise UserError(
            f"parity against tf_keras under {precision} compares different losses: tf_keras "
            "computes the loss in the compute dtype, Keras 3 and our step in float32; check this config "
            "with gin/mirrored.gin (against Keras 3 fit) or without train.mixed_precision"
        )
    if mode.multi_worker and mode.synchronous:
        return comparisons.compare_multi_worker(settings, steps, atol, FLAGS.num_workers, gin_args())
    if mode.multi_worker:
        return comparisons.compare_parameter_server(
            settings, config, steps, atol, gin_args(), metric_steps=FLAGS.metric_steps, metric_atol=FLAGS.metric_atol
        )
    raise UserError(
        f"parity does not support strategy {mode.name!r}; use a local, a multi_worker_mirrored or a "
        "parameter_server config"
    )


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
        from trainer.tools.parity import runs, workers

        settings, config = runs.settings_from_gin(), parity_config.from_gin()
        if FLAGS.role == "ours":
            return workers.worker_ours(settings, FLAGS.steps, FLAGS.work_dir)
        if FLAGS.role == "tf_keras_fit":
            return workers.worker_tf_keras_fit(settings, config, FLAGS.steps, FLAGS.work_dir)
        if FLAGS.role == "replicas":
            return workers.worker_replicas(settings, FLAGS.steps, FLAGS.work_dir, FLAGS.num_replicas)
        outcome = compare(settings, config, FLAGS.steps, FLAGS.atol)
    except UserError as e:
        fail(str(e))
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

    # Leaves without the interpreter's teardown once the outcome is printed, as trainer.main does.
    app.run(exit_without_teardown(run, local_cluster.coordinates_ps_cluster), flags_parser=parse_flags)


if __name__ == "__main__":
    main()
