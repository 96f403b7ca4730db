"""Starts one worker process per variant, one after the other (start-up and first step are timed
on a quiet machine), then paces them through the warm-up and interleaved chunks (limit, ours,
fit..., limit, ours, ...): while one runs, the others wait between two of their own calls."""
from __future__ import annotations

import os
import tempfile
import time
from typing import Callable, Iterator

from trainer.tools.bench.plan import Schedule, Variant
from trainer.tools.bench.protocol import Worker, WorkerError


def _running(variants: list[Variant], workers: dict[str, Worker]) -> Iterator[tuple[Variant, Worker]]:
    """The variants still running (checked as each comes up), with their workers."""
    for variant in variants:
        worker = workers.get(variant.name)
        if variant.status == "ok" and worker is not None:
            yield variant, worker


def _ask(variant: Variant, worker: Worker, until: int | None) -> dict | None:
    """Asks the worker to run to step `until` (None: to finish) and returns its answer; None when there
    is none (the variant failed, with the reason)."""
    try:
        worker.send(until=until)
        return worker.receive()
    except WorkerError as e:
        variant.status, variant.reason = "failed", str(e)
        return None


def _start(variant: Variant, gin_args: list[str], schedule: Schedule, log_dir: str, timeout: float,
           print_fn: Callable[[str], None]) -> Worker:
    """Starts the variant's worker and waits for its first call (the variant failed if it did not come)."""
    variant.log_path = os.path.join(log_dir, f"{variant.name}.log")
    args = [*gin_args, f"--role={variant.role}", f"--fit_spe={variant.fit_spe}", f"--total_steps={schedule.total}"]
    started = time.monotonic()
    worker = Worker(args, variant.log_path, timeout)
    try:
        message = worker.receive()
    except WorkerError as e:
        variant.status, variant.reason = "failed", str(e)
        print_fn(f"{variant.name}: failed to start: {e} (log: {variant.log_path})")
        return worker
    variant.first_step_s = time.monotonic() - started
    variant.first_call_steps = message["steps"]
    variant.machine = message.get("machine")
    print_fn(f"{variant.name}: first call ({message['steps']} step(s)) done {variant.first_step_s:.1f} s "
             "after process start")
    return worker


def measure(variants: list[Variant], gin_args: list[str], schedule: Schedule, *, timeout: float,
            print_fn: Callable[[str], None]) -> None:
    """Runs the variants that can run; fills in what each measured, or why it failed."""
    workers: dict[str, Worker] = {}
    log_dir = tempfile.mkdtemp(prefix="bench-logs-")
    try:
        for variant in variants:
            if variant.status == "ok":
                workers[variant.name] = _start(variant, gin_args, schedule, log_dir, timeout, print_fn)
        targets = [("warmup", schedule.warmup)] + [(f"repeat {r + 1}", schedule.warmup + (r + 1) * schedule.chunk)
                                                   for r in range(schedule.repeats)]
        for label, until in targets:
            for variant, worker in _running(variants, workers):
                message = _ask(variant, worker, until)
                if message is None:
                    print_fn(f"{variant.name}: failed in {label}: {variant.reason} (log: {variant.log_path})")
                    continue
                if message.get("steps") != until:
                    raise RuntimeError(f"{variant.name} answered {message} when asked to run to step {until}")
                seconds = message["seconds"]
                if label == "warmup":
                    variant.warmup_s = seconds
                    print_fn(f"{label:>9}  {variant.name:<12} {seconds:.2f} s")
                else:
                    variant.chunks.append(seconds)
                    print_fn(f"{label:>9}  {variant.name:<12} {schedule.chunk / seconds:8.2f} steps/s  "
                             f"({seconds:.2f} s)")
        for variant, worker in _running(variants, workers):
            message = _ask(variant, worker, None)
            if message is None:
                continue
            variant.compile_count = message.get("compile_count")
            variant.peak_rss_mib = message.get("peak_rss_mib")
            variant.peak_gpu_mib = message.get("peak_gpu_mib")
    finally:
        for worker in workers.values():
            worker.close()
