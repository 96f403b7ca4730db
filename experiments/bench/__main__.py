"""`python -m experiments.bench --gin_file=gin/<mode>.gin [--gin_bindings=...] [--steps=N] [--json=PATH]`

How fast does our loop train this config, next to the bare step, Orbit and Keras `fit`?
For the config's model, data, optimizer, strategy and speed options it measures, in one run:

- limit: a `tf.function` with the structure of our compiled loop (`steps_per_loop` steps
  per call in a `tf.range` loop: `strategy.run` of the same replica step, with the same XLA
  and precision settings, outputs SUM-reduced and added up) on one batch already on the
  device(s) instead of `next(iterator)`: no input pipeline, no hooks, no Python between
  steps. (Without the per-step reduce and sum it measured slower on this CPU, not faster.)
- limit_input: the same function on `next(iterator)` of the config's distributed train data:
  what the input costs every loop (under mirrored, mostly TensorFlow's distributed iterator);
- ours: `trainer.train.train` itself, unchanged, with its default hooks (progress records
  to metrics.jsonl and TensorBoard every `log_every_steps`, checkpoints every
  `checkpoint_every_steps`, the operative config) and `steps_per_loop` as configured, in a
  temporary model_dir. Eval runs once, after the last measured step (fit gets no
  validation data either); ours_async: the same with `train.async_checkpoint = True`, so
  that the two side by side show what saving in line costs; ours_epoch_order (on request:
  `--variants=limit,ours,ours_epoch_order`): the same with in-memory data in whole-epoch
  permutations (experiments/bench/epoch_order.py), the order before it was read by index, so
  that the two side by side show what reading by index costs;
- orbit: Orbit's `Controller` over an `orbit.StandardTrainer` (TensorFlow Model Garden's loop)
  on the same model, optimizer, step, distributed dataset and strategy, with its checkpoint
  manager and summaries at our intervals (experiments/bench/orbit.py). Orbit is not a
  dependency: `--install_orbit` installs it (pip, without dependencies) into this Python; where
  it is absent the table says so in one line and the rest runs;
- fit: Keras 3 `model.fit` on the same model, optimizer, input pipeline and strategy, with
  the step's loss and an accuracy metric and no callbacks (no saves), at each
  `--fit_steps_per_execution` (default 1 and `steps_per_loop`); the best one is "fit best".
  Under multi_worker_mirrored and parameter_server Keras 3 `fit` cannot run (docs/design.md,
  rule 7): the table says so.

Method. Each variant runs in its own process (so peak RSS is its own), started one after
the other (so start-up and first step are timed on a quiet machine), every one pinned to the
same cores (`--cpus`, default every core the parent may use) and with glibc's malloc told to
keep the memory it frees (`--malloc_tunables`): by default glibc hands freed memory back to the
kernel, the step's tensors then fault their pages in again every step, and how often differs
from process to process (on this 2-core VM two processes of the same variant ran 5% apart, and
the mirrored CNN spent a fifth of its time on it). Time to first step is from
process start to the end of its first compiled call (1 step for limit and ours,
`steps_per_execution` steps for fit). Then every variant runs a warm-up chunk and `--repeats`
rounds of one chunk of `--steps` steps each, then one more round at a time while the interval of
ours/limit, ours/orbit or ours/fit best is wider than `--max_width`, up to `--max_repeats`
(experiments/bench/rounds.py). A round runs in turns of `--turn_steps` steps
(about a second): every variant runs a turn, in alternating order (limit, ours, ..., fit, then
fit, ..., ours, limit, ...), then every variant its next turn, until each has run its chunk, so
the chunks of one round are spread alike over the same stretch of time. (On this kind of shared
VM the machine's speed drifts by 10-20% over tens of seconds; chunks run one after the other,
seconds apart, each saw a different drift, and the per-round ratios spread by +-10%.) Only the
variant being measured runs: every other worker is stopped (SIGSTOP) from its answer to its
next request, so no thread of it competes; the CPU each used while waiting is recorded. A
chunk's time includes everything its process does between the chunk's boundaries (hooks,
Python, input); its worker also reports its CPU, what it did besides its steps (checkpoints,
records) and the CPU the rest of the machine used meanwhile. Each comparison is the geometric
mean over rounds of the round's ratio (chunk i of two variants ran in round i, so their ratio
cancels how fast the machine was then) with its 95% percentile bootstrap interval over rounds
(a fixed seed); against Orbit and fit the verdict is ahead (the interval above 1.0), tie (it
holds 1.0) or behind (experiments/bench/intervals.py). The compile count is how often the
variant's outer function was traced; ours must stay at 1 although its calls have different step
counts (1, then steps_per_loop, then shorter calls ending on hook boundaries).

Output: a table on stdout, `--json=PATH` (every figure, every round, and the machine), and
`--report=FILE` appends a markdown table (experiments/bench/run.sh builds its README from the
JSON with experiments/bench/readme.py).
Exit 0 when everything ran, 1 when a variant other than fit failed, 2 on a user mistake.

`--mode` picks what is measured: `train` (the above), `input` (the input pipeline alone, for
`--input_seconds`, against what the step consumes; with `--input_latency_ms`, a slow source read by a
per-worker pipeline against a tf.data service, experiments/bench/service_input.py) or `save_stall` (the training stall per
checkpoint save of a `--save_stall_params`-parameter model, `--saves` times, the step on
`--save_stall_step_threads` threads or every core); `--json` writes
what those modes return too.

This module parses the flags; the parts are in experiments/bench/ (its __init__ lists them).
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from trainer.cli import exit_without_teardown, fail, import_tensorflow_quietly, parse_flags  # noqa: E402
from trainer.distribution import netns  # noqa: E402

if any(arg.startswith("--input_latency_ms") for arg in sys.argv[1:]):
    # Its tf.data service listens on every address: into the private network namespace before any thread.
    netns.isolate("the input bench's tf.data service")
import_tensorflow_quietly()  # this module runs only as the program; the parts below import TensorFlow

from absl import app, flags, logging  # noqa: E402

from experiments.bench.compare import compare  # noqa: E402
from experiments.bench.orbit import INSTALL as ORBIT_INSTALL  # noqa: E402
from experiments.bench.plan import VARIANTS  # noqa: E402
from experiments.bench.protocol import KEEP_FREED_MEMORY  # noqa: E402
from experiments.bench.worker import run_worker  # noqa: E402
from trainer.errors import UserError  # noqa: E402
from trainer.gin_flags import define_config_flags  # noqa: E402

FLAGS = flags.FLAGS


def define_flags() -> None:
    """Only when run as a program: importing this module must not claim flag names
    (`--steps` is trainer.parity's too)."""
    define_config_flags()
    flags.DEFINE_enum(
        "mode",
        "train",
        ["train", "input", "save_stall"],
        "train: our loop against limit, Orbit and fit; input: the input pipeline alone; save_stall: "
        "the training stall per checkpoint save.",
    )
    flags.DEFINE_float("input_seconds", 5, "--mode=input: seconds each input source is read.")
    flags.DEFINE_float(
        "input_latency_ms",
        0,
        "--mode=input: > 0 compares a per-worker pipeline with a tf.data service on a source of this read "
        "latency per example instead (experiments/bench/service_input.py).",
    )
    flags.DEFINE_integer("input_data_workers", 2, "--mode=input with --input_latency_ms: the service's data workers.")
    flags.DEFINE_integer("save_stall_params", 100_000_000, "--mode=save_stall: parameters of the saved model.")
    flags.DEFINE_integer("saves", 5, "--mode=save_stall: checkpoint saves measured.")
    flags.DEFINE_integer(
        "save_stall_step_threads",
        0,
        "--mode=save_stall: threads of TensorFlow's op pools for the "
        "step (0: TensorFlow's default, every core); fewer leave cores free for the writer, as a step "
        "on an accelerator does.",
    )
    flags.DEFINE_bool(
        "install_orbit",
        False,
        f"First install Orbit into this Python: pip install --no-deps "
        f"{ORBIT_INSTALL} (its metadata pins another TensorFlow; it works with this one).",
    )
    flags.DEFINE_integer(
        "steps",
        0,
        "Steps per measured chunk, rounded up to a multiple of every call length (0: "
        "the least multiple of log_every_steps and checkpoint_every_steps, so that every chunk holds "
        "the same hook work: one checkpoint and chunk/log_every_steps progress records).",
    )
    flags.DEFINE_integer(
        "repeats",
        12,
        "Measured rounds at least: each runs one chunk of every variant, in turns; "
        "the 95% intervals of the ratios are over the rounds.",
    )
    flags.DEFINE_integer(
        "max_repeats",
        24,
        "Measured rounds at most: after --repeats, one more round at a time while "
        "the interval of ours/limit, ours/orbit or ours/fit best is wider than --max_width (at most "
        "--repeats: exactly --repeats rounds).",
    )
    flags.DEFINE_float(
        "max_width",
        0.06,
        "The widest 95% interval of ours/limit, ours/orbit and ours/fit best that "
        "ends the rounds before --max_repeats.",
    )
    flags.DEFINE_integer(
        "turn_steps",
        0,
        "Steps a variant runs per turn, a multiple of every call length that "
        "divides the chunk (0: the least multiple of steps_per_loop and fit's steps_per_execution "
        "values).",
    )
    flags.DEFINE_integer(
        "warmup_steps", 0, "Steps each variant runs after its first call before measuring (0: one chunk)."
    )
    flags.DEFINE_list(
        "variants",
        list(VARIANTS),
        "Which variants to run, in the order of a forward round: "
        + ", ".join(VARIANTS)
        + " (orbit is reported as not runnable where it is not installed).",
    )
    flags.DEFINE_list(
        "fit_steps_per_execution", [], "fit's steps_per_execution values (default: 1 and steps_per_loop)."
    )
    flags.DEFINE_list("cpus", [], "Cores every variant is pinned to (default: every core this process may use).")
    flags.DEFINE_bool(
        "pause_waiting",
        True,
        "Stop (SIGSTOP) every worker but the one being measured; "
        "--nopause_waiting leaves them running, blocked on their input, to measure what that costs.",
    )
    flags.DEFINE_string(
        "malloc_tunables",
        KEEP_FREED_MEMORY,
        "glibc malloc settings added to every worker's "
        "GLIBC_TUNABLES (default: keep freed memory in the process, so that no variant faults its "
        "tensors' pages in again every step, more in one process than in another); empty: glibc's "
        "defaults, as a user's process runs.",
    )
    flags.DEFINE_string("json", None, "Write all results as JSON here.")
    flags.DEFINE_string("report", None, "Append a markdown table to this file.")
    flags.DEFINE_integer("timeout_secs", 3600, "Longest a variant may take to answer one request.")
    flags.DEFINE_string("role", "compare", "Internal: 'compare', or the variant this worker process runs.")
    flags.DEFINE_integer("fit_spe", 1, "Internal: steps_per_execution of a fit worker.")
    flags.DEFINE_integer("total_steps", 0, "Internal: the steps a worker will run in all.")


def install_orbit() -> None:
    """Installs the Orbit wheel into this interpreter without its dependencies, reported in one line."""
    command = [sys.executable, "-m", "pip", "install", "--no-deps", ORBIT_INSTALL]
    proc = subprocess.run(command, capture_output=True, text=True)
    if proc.returncode != 0:
        lines = [line for line in (proc.stderr + proc.stdout).splitlines() if line.strip()]
        fail(f"{' '.join(command[2:])} failed: {lines[-1] if lines else f'exit {proc.returncode}'}", exit_code=1)
    importlib.invalidate_caches()
    print(f"installed {ORBIT_INSTALL} (orbit) into {sys.prefix} without its dependencies", flush=True)


def dispatch(mode: str) -> tuple[int, dict | None]:
    """Runs `mode`; its exit code, and the dict `--json` writes for the modes that return one."""
    print_fn = lambda line: print(line, flush=True)  # noqa: E731
    if mode == "input" and FLAGS.input_latency_ms > 0:
        from experiments.bench.service_input import run_service_bench

        return 0, run_service_bench(
            latency_ms=FLAGS.input_latency_ms,
            data_workers=FLAGS.input_data_workers,
            seconds=FLAGS.input_seconds,
            print_fn=print_fn,
        )
    if mode == "input":
        from experiments.bench.input_only import run_input_bench

        return 0, run_input_bench(FLAGS.gin_file, FLAGS.gin_bindings, seconds=FLAGS.input_seconds, print_fn=print_fn)
    if mode == "save_stall":
        from experiments.bench.save_stall import run_save_stall

        return 0, run_save_stall(
            params=FLAGS.save_stall_params,
            saves=FLAGS.saves,
            step_threads=FLAGS.save_stall_step_threads,
            print_fn=print_fn,
        )
    return compare(
        FLAGS.gin_file,
        FLAGS.gin_bindings,
        variants=FLAGS.variants,
        steps=FLAGS.steps,
        repeats=FLAGS.repeats,
        max_repeats=FLAGS.max_repeats,
        max_width=FLAGS.max_width,
        warmup_steps=FLAGS.warmup_steps,
        turn_steps=FLAGS.turn_steps,
        fit_steps_per_execution=FLAGS.fit_steps_per_execution,
        cpus=FLAGS.cpus,
        pause_waiting=FLAGS.pause_waiting,
        malloc_tunables=FLAGS.malloc_tunables,
        timeout_secs=FLAGS.timeout_secs,
        json_path=FLAGS.json,
        report_path=FLAGS.report,
        argv=sys.argv[1:],
    ), None


def run(argv: list[str]) -> None:
    del argv
    if not FLAGS["verbosity"].present:
        logging.set_verbosity(logging.WARNING)
    if FLAGS.role != "compare":
        run_worker(FLAGS.role, FLAGS.gin_file, FLAGS.gin_bindings, fit_spe=FLAGS.fit_spe, total_steps=FLAGS.total_steps)
        return
    if FLAGS.install_orbit:
        install_orbit()
    try:
        code, result = dispatch(FLAGS.mode)
    except UserError as e:
        fail(str(e))
    if result is not None and FLAGS.json:
        with open(FLAGS.json, "w") as f:
            json.dump(result, f, indent=2)
    sys.exit(code)


def main() -> None:
    from trainer.distribution import local_cluster

    define_flags()
    # Every process, the comparing one and each variant's worker, leaves without the interpreter's teardown.
    app.run(exit_without_teardown(run, local_cluster.coordinates_ps_cluster), flags_parser=parse_flags)


if __name__ == "__main__":
    main()
