"""How long training stalls per checkpoint, synchronous vs `train.async_checkpoint`.

A Keras model of about `params` float32 parameters (square Dense layers) with Adam, so the
checkpoint holds the weights and two slot variables each, trains with a compiled step. Both
savers are the run's own `CheckpointSaver` (trainer/files/checkpoints.py), on the same
checkpoint object, each in a directory of its own.

What is measured, and why this way: the training thread's loss of wall time per save. A window
is `save()` + K steps + `wait()`, timed on the training thread; its stall is the window minus
K steps without a save (the mean of the two save-free windows beside it). The time `save()`
blocks its caller alone would flatter the asynchronous save: its cost also comes later, as the
copy-on-write of each variable's buffer in the next update and as the background write's share
of the CPU while the steps run. Both land inside the window, and so does a write that is still
running after K steps (`wait()` blocks until it is done), so nothing is left outside. K is sized
so that the steps cover about twice a synchronous save. Sync and async windows alternate (their
order flips each round) so that drift in the machine's speed falls on both alike; the medians
over `saves` rounds are reported, with every value.

What async can reach: the write costs CPU wherever it runs (`sync_save_cpu_s`, the process's
CPU time while a synchronous save blocks an idle step: serialising, checksums, the kernel's
copy into the page cache). Where the step uses every core, as a CPU-only machine's step does,
the writer takes its CPU-seconds from the steps, up to `sync_save_cpu_s / cores` of wall time
(less where the step leaves gaps); where the step leaves cores idle (an accelerator runs it;
here `step_threads` fewer than `cores`), the write runs beside it nearly for free.
"""

from __future__ import annotations

import math
import os
import resource
import shutil
import statistics
import tempfile
import time
from typing import Callable

import keras
import tensorflow as tf

from trainer.files.checkpoints import CheckpointSaver

LAYERS = 4
BATCH = 8


def run_save_stall(
    *, params: int = 100_000_000, saves: int = 5, step_threads: int = 0, print_fn: Callable[[str], None] = print
) -> dict:
    """Measures the stall per save (median over `saves` of each, interleaved); returns a JSON-able dict.

    `step_threads` > 0 sets TensorFlow's intra- and inter-op pools to that many threads (before
    anything runs in this process), so that the step leaves cores to the writer, as a step on an
    accelerator leaves the host's; 0 keeps TensorFlow's default (every core).
    """
    if step_threads:
        tf.config.threading.set_intra_op_parallelism_threads(step_threads)
        tf.config.threading.set_inter_op_parallelism_threads(step_threads)
    width = max(1, round(math.sqrt(params / LAYERS)))
    model = keras.Sequential([keras.Input((width,)), *(keras.layers.Dense(width) for _ in range(LAYERS))])
    optimizer = keras.optimizers.Adam(1e-5)
    optimizer.build(model.trainable_variables)
    checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer)
    x, y = tf.random.normal([BATCH, width], seed=1), tf.random.normal([BATCH, width], seed=2)

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x) - y))
        optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
        return loss

    def train(num_steps: int) -> float:
        started = time.perf_counter()
        for _ in range(num_steps):
            loss = step()
        float(loss)
        return time.perf_counter() - started

    root = tempfile.mkdtemp(prefix="trainer-save-stall-")
    try:
        savers = {
            mode: CheckpointSaver(
                checkpoint, os.path.join(root, mode), is_chief=True, max_to_keep=1, async_checkpoint=mode == "async"
            )
            for mode in ("sync", "async")
        }
        number = iter(range(1, 10**6))
        train(3)  # traced and warm
        step_s = train(5) / 5
        started = time.perf_counter()
        savers["sync"].save(next(number))
        sync_save_s = time.perf_counter() - started
        savers["async"].save(next(number))  # the writer thread and its first trace, outside the windows
        savers["async"].wait()
        window = max(3, math.ceil(2 * sync_save_s / step_s))
        sync_dir = os.path.join(root, "sync")
        checkpoint_bytes = sum(
            os.path.getsize(os.path.join(sync_dir, n)) for n in os.listdir(sync_dir) if n.startswith("ckpt-")
        )

        def with_save(saver: CheckpointSaver) -> tuple[float, float, float]:
            started, cpu = time.perf_counter(), _cpu_seconds()
            saver.save(next(number))
            blocked, blocked_cpu = time.perf_counter() - started, _cpu_seconds() - cpu
            train(window)
            saver.wait()
            return time.perf_counter() - started, blocked, blocked_cpu

        stalls: dict[str, list[float]] = {"sync": [], "async": []}
        blocks: dict[str, list[float]] = {"sync": [], "async": []}
        save_cpu: list[float] = []
        before = train(window)
        for round_index in range(saves):
            for mode in ("sync", "async") if round_index % 2 == 0 else ("async", "sync"):
                total, blocked, blocked_cpu = with_save(savers[mode])
                after = train(window)
                stalls[mode].append(total - (before + after) / 2)
                blocks[mode].append(blocked)
                if mode == "sync":
                    save_cpu.append(blocked_cpu)
                before = after
    finally:
        shutil.rmtree(root, ignore_errors=True)

    sync_stall, async_stall = statistics.median(stalls["sync"]), statistics.median(stalls["async"])
    cores = len(os.sched_getaffinity(0))
    sync_save_cpu = statistics.median(save_cpu)
    result = {
        "params": model.count_params(),
        "checkpoint_bytes": checkpoint_bytes,
        "sync_stall_s": sync_stall,
        "async_stall_s": async_stall,
        "async_over_sync": async_stall / sync_stall if sync_stall > 0 else None,
        "sync_stalls": stalls["sync"],
        "async_stalls": stalls["async"],
        "sync_save_blocks_s": statistics.median(blocks["sync"]),
        "async_save_blocks_s": statistics.median(blocks["async"]),
        "sync_save_cpu_s": sync_save_cpu,
        "cores": cores,
        "step_threads": step_threads or None,
        "steps_per_window": window,
        "step_s": step_s,
    }
    _print_table(result, print_fn)
    return result


def _cpu_seconds() -> float:
    """This process's CPU time so far, user and system (the kernel's part of a write is most of it)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _print_table(result: dict, print_fn: Callable[[str], None]) -> None:
    threads = f"{result['step_threads']} thread(s)" if result["step_threads"] else "every core"
    print_fn(
        f"save stall: {result['params'] / 1e6:.1f}M params, checkpoint {result['checkpoint_bytes'] / 1e9:.2f} GB, "
        f"the step on {threads}, "
        f"{len(result['sync_stalls'])} saves each, window = save + {result['steps_per_window']} steps "
        f"({result['step_s']:.3f} s/step)"
    )
    print_fn(f"{'':<7}{'stall (median)':>15}{'save() blocks':>15}   stalls (s)")
    for mode in ("sync", "async"):
        shown = " ".join(f"{s:.3f}" for s in result[f"{mode}_stalls"])
        print_fn(f"{mode:<7}{result[f'{mode}_stall_s']:>13.3f} s{result[f'{mode}_save_blocks_s']:>13.3f} s   {shown}")
    ratio, cpu, cores = result["async_over_sync"], result["sync_save_cpu_s"], result["cores"]
    shown = f"{ratio:.3f}" if ratio is not None else "n/a (no sync stall measured)"
    print_fn(
        f"async/sync stall: {shown}; a save takes {cpu:.2f} CPU-s, which a step on all {cores} cores "
        "shares its cores with (--save_stall_step_threads leaves some to the writer)"
    )
