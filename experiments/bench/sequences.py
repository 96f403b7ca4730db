"""`python -m experiments.bench.sequences [--strategies=single,mirrored,mwms] [--rounds=5] [--steps=20]`

Examples/s of an Embedding + LSTM classifier on token sequences of 4 to 64 tokens (mean about a third of
the longest), batched three ways side by side in one process per strategy:

- fixed: the input function pads every sequence to 64 itself (shape (64,)), as before sequences of any
  length were taken;
- per_batch: sequences of their own length (shape (None,)), each global batch padded to its longest;
- bucketed: the same with `sequences.bucket_window = 16` (trainer/data/sequences.py);
- fixed_unknown (mwms only): the `fixed` data declared of unknown length (shape (None,), every batch 64
  wide): what an element spec that is not static costs under MultiWorkerMirrored, where TensorFlow's
  distributed iterator adds a cross-worker all-reduce to every get_next.

Each variant is our compiled train loop (`trainer.loops.build.build_sync_loops`: `--steps` steps per call, one
per call on several replicas, `per_call`) on its own model; after one warm-up call, each round times one call of `--steps` steps of every
variant, in alternating order (A B C, C B A, ...), so the variants share the machine's drift alike; a ratio
is the geometric mean of the per-round ratios. The compile count (traces of the loop) is reported per
variant: it stays 1 whatever the lengths. mwms runs 2 worker processes on this machine (TF_CONFIG on
localhost ports); the chief reports.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import subprocess
import sys
import time

NUM_EXAMPLES = 4096
MAX_LENGTH = 64
VOCAB = 1000
BATCH = 64
WINDOW = 16


def lengths(count: int, seed: int = 0):
    """4 to 64, mean about 21: 4 plus an exponential of mean 18, cut at 64."""
    import numpy as np

    rng = np.random.RandomState(seed)
    return np.minimum(4 + rng.exponential(18.0, size=count).astype(int), MAX_LENGTH)


class Sequences:
    """`(tokens int32, label int32)`: tokens 1..VOCAB-1 of their own length, padded to 64 (`fixed`), or declared
    of unknown length even so (`unknown_shape`); the label is whether token 1 occurs in the first half."""

    num_classes = 2

    def __init__(self, fixed: bool, unknown_shape: bool = False):
        self.fixed, self.unknown_shape = fixed, unknown_shape

    def __call__(self, split: str):
        import numpy as np
        import tensorflow as tf

        count = NUM_EXAMPLES if split == "train" else 256
        rng = np.random.RandomState(1 if split == "train" else 2)
        rows = [rng.randint(1, VOCAB, size=n).astype(np.int32) for n in lengths(count, 3 if split == "train" else 4)]
        labels = np.array([int(1 in row[: len(row) // 2]) for row in rows], np.int32)
        if self.fixed:
            padded = np.zeros([count, MAX_LENGTH], np.int32)
            for i, row in enumerate(rows):
                padded[i, : len(row)] = row
            if self.unknown_shape:  # the same 64-wide rows, of unknown length to tf.data
                return tf.data.Dataset.from_tensor_slices((tf.RaggedTensor.from_tensor(padded), labels))
            return tf.data.Dataset.from_tensor_slices((padded, labels))
        return tf.data.Dataset.from_tensor_slices((tf.ragged.constant(rows), labels))


def lstm_classifier():
    import keras

    return keras.Sequential(
        [
            keras.Input(shape=(None,), dtype="int32"),
            keras.layers.Embedding(VOCAB, 64, mask_zero=True),
            keras.layers.LSTM(64),
            keras.layers.Dense(2),
        ]
    )


VARIANTS = {
    "fixed": dict(fixed=True),
    "per_batch": dict(fixed=False),
    "bucketed": dict(fixed=False, window=WINDOW),
    "fixed_unknown": dict(fixed=True, unknown_shape=True),
}


def settings_of(strategy: str, variant: str, steps: int):
    from trainer import data
    from trainer.distribution.devices import DeviceConfig
    from trainer.run.settings import Settings

    spec = VARIANTS[variant]
    return Settings(
        strategy={"single": "default", "mirrored": "mirrored", "mwms": "multi_worker_mirrored"}[strategy],
        device_config=DeviceConfig(logical_cpus_without_gpu=2) if strategy == "mirrored" else None,
        input_fn=Sequences(spec["fixed"], spec.get("unknown_shape", False)),
        model_fn=lstm_classifier,
        global_batch_size=BATCH,
        steps_per_loop=per_call(strategy, steps),
        sequences=data.SequenceBatching(bucket_window=spec.get("window", 0)),
        collective_timeout_secs=300.0 if strategy == "mwms" else None,
        print_fn=lambda line: None,
    )


def per_call(strategy: str, steps: int) -> int:
    """Steps per compiled call: 1 on several replicas, where an Embedding's sparse gradient is summed by an
    all-gather whose size follows the batch's length (the loop refuses more: trainer/loops/sync.py)."""
    return steps if strategy == "single" else 1


def loop_of(runtime, settings):
    """Our compiled train loop for `settings`, on the runtime already made (one strategy per process)."""
    import keras

    from trainer.loops.build import build_sync_loops
    from trainer.task.task import build_task

    inp = settings.make_input()
    inp.validate()
    keras.utils.set_random_seed(settings.seed)
    task = build_task(
        runtime,
        inp,
        model_fn=settings.model_fn,
        optimizer_fn=settings.optimizer_fn,
        step_fn=settings.step_fn,
        eval_step_fn=settings.eval_step_fn,
        global_batch_size=settings.global_batch_size,
        total_steps=10**6,
    )
    loop, _ = build_sync_loops(runtime, task, settings, step_fn=task.step_fn, start_step=0)
    loop.trace("classification_step")
    return loop


def measure(strategy: str, variants: list[str], rounds: int, steps: int) -> dict:
    """Examples/s of each variant per round, and its compile count, in this process."""
    from trainer.distribution.runtime import make_runtime

    runtime = make_runtime(settings_of(strategy, variants[0], steps))
    loops = {v: loop_of(runtime, settings_of(strategy, v, steps)) for v in variants}
    calls, size = steps // per_call(strategy, steps), per_call(strategy, steps)
    for loop in loops.values():
        for _ in range(calls):  # warm-up: the first call's one-time costs
            loop.run(size)
    rates: dict[str, list[float]] = {v: [] for v in variants}
    for r in range(rounds):
        for v in variants if r % 2 == 0 else variants[::-1]:
            started = time.perf_counter()
            for _ in range(calls):
                loops[v].run(size)
            rates[v].append(steps * BATCH / (time.perf_counter() - started))
    return {
        "strategy": strategy,
        "replicas": runtime.num_replicas,
        "rates": rates,
        "compile_counts": {v: loop.trace_count for v, loop in loops.items()},
    }


def summary(result: dict, baseline: str = "fixed") -> list[str]:
    """Markdown rows: each variant's median examples/s, its ratio to the baseline (geometric mean of the
    per-round ratios, with the lowest and highest round) and its compile count."""
    rates, rows = result["rates"], []
    for v, values in rates.items():
        ratios = [a / b for a, b in zip(values, rates[baseline])]
        mean = math.exp(sum(map(math.log, ratios)) / len(ratios))
        median = sorted(values)[len(values) // 2]
        rows.append(
            f"| {result['strategy']} ({result['replicas']} replica(s)) | {v} | {median:,.0f} | {mean:.2f} "
            f"[{min(ratios):.2f}, {max(ratios):.2f}] | {result['compile_counts'][v]} |"
        )
    return rows


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def run_mwms(args) -> dict:
    """2 worker processes of this module (`--worker`), TF_CONFIG on localhost; the chief's result."""
    ports = [free_port(), free_port()]
    cluster = {"worker": [f"localhost:{p}" for p in ports]}
    procs = []
    for index in range(2):
        env = dict(os.environ, TF_CONFIG=json.dumps({"cluster": cluster, "task": {"type": "worker", "index": index}}))
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "experiments.bench.sequences", "--worker=mwms", *forwarded(args)],
                env=env,
                stdout=subprocess.PIPE,
                text=True,
            )
        )
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=args.timeout)[0])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    if procs[0].returncode != 0:
        raise SystemExit(f"mwms chief failed ({procs[0].returncode}):\n{outputs[0][-3000:]}")
    return json.loads(outputs[0].strip().splitlines()[-1])


def forwarded(args) -> list[str]:
    return [f"--rounds={args.rounds}", f"--steps={args.steps}"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--strategies", default="single,mirrored,mwms")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # a process of the comparison
    args = parser.parse_args()
    if args.worker:
        variants = ["fixed", "fixed_unknown", "per_batch", "bucketed"] if args.worker == "mwms" else list(VARIANTS)[:3]
        print(json.dumps(measure(args.worker, variants, args.rounds, args.steps)), flush=True)
        return
    print("| strategy | variant | examples/s (median) | / fixed [lowest, highest round] | compile count |")
    print("|---|---|---:|---:|---:|")
    for strategy in args.strategies.split(","):
        if strategy == "mwms":
            result = run_mwms(args)
        else:  # a fresh process: mirrored splits the CPU before TensorFlow starts
            proc = subprocess.run(
                [sys.executable, "-m", "experiments.bench.sequences", f"--worker={strategy}", *forwarded(args)],
                capture_output=True,
                text=True,
                timeout=args.timeout,
            )
            if proc.returncode != 0:
                raise SystemExit(f"{strategy} failed:\n{proc.stderr[-3000:]}")
            result = json.loads(proc.stdout.strip().splitlines()[-1])
        print("\n".join(summary(result)), flush=True)


if __name__ == "__main__":
    main()
