"""`python -m experiments.bench --mode=input`: would a run of this config wait for its input?

It measures, in examples/s, each for `seconds` after a warm-up call, in this one process:

- memory: the config's own train input exactly as the loop builds it (`distribute_train`:
  in memory and gathered in batches where the data fits, else streamed), pulled
  through the distributed dataset by a `tf.function` shaped like the loop's (`steps_per_loop`
  `next(iterator)` per call, each batch handed to `strategy.run`) whose step only counts
  the examples;
- tfrecord: the same train examples written by `trainer.write_tfrecords` into NUM_SHARDS
  shards in a temporary directory, read back and parsed by `TFRecordFiles` through the same
  pipeline as a run (held as serialized records and gathered by index where they fit
  `max_memory_bytes`, else streamed), the pipeline's tf.data options;
- tfrecord_stream: the same files streamed (`max_memory_bytes=0`: shuffle buffer, repeat,
  batch), side by side with the held read;
- step: the config's compiled train step on one batch already on the device(s), the bench's
  `limit` function (experiments/bench/limit.py), so no input at all.

A source whose examples/s is below the step's would starve the step: "input-bound". Where
the CPU runs the step, the pipeline runs inline (no prefetch, docs/design.md, rule 13), so its time
adds to the step's even when it "keeps up": a run then does about 1/(1/input + 1/step).
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
import time
from typing import Any, Callable

from experiments.bench.config import refuse_asynchronous, setup, train_data, train_settings
from experiments.bench.limit import bare_step

NUM_SHARDS = 4  # trainer.write_tfrecords' default


def run_input_bench(
    gin_files: list[str], gin_bindings: list[str], *, seconds: float, print_fn: Callable[[str], None] = print
) -> dict:
    """Measures the config's input sources and its step for `seconds` each; prints a table, returns the figures."""
    from trainer import data
    from trainer.data.pipeline import on_accelerator

    settings = train_settings(gin_files, gin_bindings)
    refuse_asynchronous(settings, "the input bench")
    dist, task = setup(settings)

    def pull(inp) -> dict:
        return _pull_rate(dist, train_data(dist, inp, settings), settings.steps_per_loop, seconds)

    sources = {"memory": {**pull(task.input), "in_memory": task.input.train_arrays() is not None}}
    with tempfile.TemporaryDirectory(prefix="bench-input-") as out_dir:
        written = _write_tfrecords(task.input, out_dir)
        if isinstance(written, str):
            sources["tfrecord"] = {"examples_per_sec": None, "skipped": written}
        else:
            files, write_s = written
            held = data.as_input(files)
            sources["tfrecord"] = {
                **pull(held),
                "in_memory": held.train_arrays() is not None,
                "shards": NUM_SHARDS,
                "bytes": sum(os.path.getsize(f) for f in files.files("train")),
                "write_s": round(write_s, 3),
            }
            sources["tfrecord_stream"] = pull(data.as_input(dataclasses.replace(files, max_memory_bytes=0)))
    step = _step_rate(dist, task, settings, seconds)
    result = {
        "sources": sources,
        "step": step,
        "input_over_step": {
            name: _ratio(source["examples_per_sec"], step["examples_per_sec"]) for name, source in sources.items()
        },
        "settings": {
            "gin_files": list(gin_files),
            "gin_bindings": list(gin_bindings),
            "seconds": seconds,
            "strategy": settings.strategy,
            "num_replicas": dist.num_replicas_in_sync,
            "global_batch_size": settings.global_batch_size,
            "steps_per_loop": settings.steps_per_loop,
            "distribute_method": settings.distribute_method,
            "shard_policy": settings.shard_policy,
            "input": repr(task.input),
            "train_examples": task.input.num_examples("train"),
            "prefetch": on_accelerator(),
            "cores": os.cpu_count(),
        },
    }
    print_fn(text_table(result))
    return result


def _pull_rate(dist, distributed_data, batches_per_call: int, seconds: float) -> dict:
    """Examples/s pulling batches through the distributed iterator in compiled calls, as the loop does.

    The first call (trace, and filling any shuffle buffer) is timed apart as `first_call_s`.
    """
    import tensorflow as tf

    iterator = iter(distributed_data)

    def count(batch):
        return tf.cast(tf.shape(tf.nest.flatten(batch)[0])[0], tf.int64)

    @tf.function
    def pull(num_batches):
        total = tf.constant(0, tf.int64)
        for _ in tf.range(num_batches):
            total += dist.reduce(tf.distribute.ReduceOp.SUM, dist.run(count, args=(next(iterator),)), axis=None)
        return total

    calls = tf.constant(batches_per_call, tf.int32)
    started = time.monotonic()
    int(pull(tf.constant(1, tf.int32)))
    first_call_s = time.monotonic() - started
    examples, batches, elapsed = _timed(lambda: int(pull(calls)), batches_per_call, seconds)
    return {
        "examples_per_sec": examples / elapsed,
        "batches": batches,
        "seconds": round(elapsed, 3),
        "first_call_s": round(first_call_s, 3),
    }


def _step_rate(dist, task, settings, seconds: float) -> dict:
    """Examples/s of the bench's bare step (limit) in calls of `steps_per_loop` steps."""
    run_steps, _ = bare_step(dist, task, settings)
    run_steps(1)  # the trace
    per_call, batch_size = settings.steps_per_loop, settings.global_batch_size

    def call() -> int:
        run_steps(per_call)
        return per_call * batch_size

    examples, steps, elapsed = _timed(call, per_call, seconds)
    return {"examples_per_sec": examples / elapsed, "steps": steps, "seconds": round(elapsed, 3)}


def _timed(call: Callable[[], int], batches_per_call: int, seconds: float) -> tuple[int, int, float]:
    """Repeats `call` (which returns the examples it handled) for at least `seconds`, at least once:
    (examples, batches, elapsed seconds)."""
    examples = batches = 0
    started = time.monotonic()
    while True:
        examples += call()
        batches += batches_per_call
        elapsed = time.monotonic() - started
        if elapsed >= seconds:
            return examples, batches, elapsed


def _write_tfrecords(inp, out_dir: str) -> tuple[Any, float] | str:
    """The input's examples as NUM_SHARDS TFRecord shards per split, and the seconds it took; or why not.

    trainer.write_tfrecords writes the built-in format, `(image float, integer label)`; other
    structures are skipped with the reason.
    """
    from trainer import write_tfrecords

    spec = inp.element_spec
    if not (
        isinstance(spec, tuple)
        and len(spec) == 2
        and spec[0].dtype.is_floating
        and spec[1].dtype.is_integer
        and spec[1].shape.rank == 0
    ):
        return f"trainer.write_tfrecords writes (float image, integer label) examples; this input's are {spec}"
    started = time.monotonic()
    files = write_tfrecords.write(inp, out_dir, NUM_SHARDS)
    return files, time.monotonic() - started


def _ratio(value: float | None, reference: float) -> float | None:
    return None if value is None or not reference else round(value / reference, 3)


def verdict(ratio: float | None) -> str:
    """'input-bound' where the source delivers fewer examples/s than the step consumes."""
    if ratio is None:
        return "not measured"
    return "input-bound" if ratio < 1.0 else "keeps up"


def text_table(result: dict) -> str:
    """The table a user reads at a glance: each source's examples/s against the step's."""
    s, step = result["settings"], result["step"]
    lines = [
        f"input bench: strategy {s['strategy']}, {s['num_replicas']} replica(s), global batch "
        f"{s['global_batch_size']}, {s['train_examples']} train examples, {s['seconds']:g} s per measurement",
        f"{'source':<34}{'examples/s':>12}{'input/step':>12}  verdict",
    ]
    for name, source in result["sources"].items():
        if name == "memory":
            label = "memory (config's input, in memory)" if source["in_memory"] else "config's input (streamed)"
        elif name == "tfrecord_stream":
            label = "tfrecord, the same streamed"
        else:
            label = (
                f"tfrecord ({source['shards']} shards, {source['bytes'] / 2**20:.1f} MiB"
                + (", held)" if source.get("in_memory") else ")")
                if source["examples_per_sec"] is not None
                else "tfrecord"
            )
        ratio = result["input_over_step"][name]
        rate = "-" if source["examples_per_sec"] is None else f"{source['examples_per_sec']:,.0f}"
        ratio_text = "-" if ratio is None else f"{ratio:.2f}x"
        lines.append(
            f"{label:<34}{rate:>12}{ratio_text:>12}  {verdict(ratio)}"
            + (f": {source['skipped']}" if "skipped" in source else "")
        )
    lines.append(f"{'step (compiled, batch on device)':<34}{step['examples_per_sec']:>12,.0f}")
    if not s["prefetch"]:
        lines.append(
            "no accelerator: the pipeline runs inline, its time adds to the step's "
            "(a run does about 1 / (1/input + 1/step) examples/s)"
        )
    return "\n".join(lines)
