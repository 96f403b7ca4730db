"""Starts one worker process per variant, one after the other (start-up and first step are timed
on a quiet machine), then paces them through the warm-up and the measured rounds, one chunk per
variant a round. A round runs in turns (`Schedule.turn` steps each, about a second): every variant
runs its turn, then every variant its next one, in alternating order (A B C, C B A, ...:
`plan.round_order`), so that the chunks of a round, added up from their turns, cover the same
stretch of time and see the same drifts of the machine's speed.

Only the variant being measured runs: every other worker is stopped (SIGSTOP) between its answer
and its next request, so no thread of a waiting process (TensorFlow's pools, a checkpoint writer,
Keras' callback thread, a summary writer) competes with it; the CPU each worker used while it
waited is recorded, and is 0 when that works. `pause_waiting=False` leaves the waiting workers
running, blocked on their input as before, to measure what that costs.
"""

from __future__ import annotations

import os
import tempfile
import time
from typing import Callable, Iterator

from experiments.bench.plan import Schedule, Variant, round_order
from experiments.bench.protocol import Worker, WorkerError


def _running(variants: list[Variant], workers: dict[str, Worker]) -> Iterator[tuple[Variant, Worker]]:
    """The variants still running (checked as each comes up), with their workers."""
    for variant in variants:
        worker = workers.get(variant.name)
        if variant.status == "ok" and worker is not None:
            yield variant, worker


class Turns:
    """Lets one worker run at a time: the others are stopped, and their CPU time is watched."""

    def __init__(self, workers: dict[str, Worker], pause_waiting: bool):
        self.workers, self.pause_waiting = workers, pause_waiting
        self.waiting_cpu: dict[str, float] = {}  # by variant: CPU seconds used while another one ran

    def ask(self, variant: Variant, worker: Worker, until: int | None) -> dict | None:
        """Asks the worker to run to step `until` (None: to finish) and returns its answer; None when there
        is none (the variant failed, with the reason). While it runs to a step, the CPU the other workers
        use is added to their `waiting_cpu`."""
        watched = {name: w.cpu_seconds() for name, w in self.workers.items() if w is not worker and until is not None}
        worker.resume()
        try:
            worker.send(until=until)
            message = worker.receive()
        except WorkerError as e:
            variant.status, variant.reason = "failed", str(e)
            message = None
        self.wait(worker)
        for name, before in watched.items():
            self.waiting_cpu[name] = self.waiting_cpu.get(name, 0.0) + self.workers[name].cpu_seconds() - before
        return message

    def wait(self, worker: Worker) -> None:
        """The worker waits for its next request: stopped, unless waiting workers are left running."""
        if self.pause_waiting:
            worker.pause()


def _start(
    variant: Variant,
    gin_args: list[str],
    schedule: Schedule,
    log_dir: str,
    timeout: float,
    malloc_tunables: str,
    print_fn: Callable[[str], None],
) -> Worker:
    """Starts the variant's worker and waits for its first call (the variant failed if it did not come)."""
    variant.log_path = os.path.join(log_dir, f"{variant.name}.log")
    args = [*gin_args, f"--role={variant.role}", f"--fit_spe={variant.fit_spe}", f"--total_steps={schedule.total}"]
    started = time.monotonic()
    worker = Worker(args, variant.log_path, timeout, malloc_tunables)
    try:
        message = worker.receive()
    except WorkerError as e:
        variant.status, variant.reason = "failed", str(e)
        print_fn(f"{variant.name}: failed to start: {e} (log: {variant.log_path})")
        return worker
    variant.first_step_s = time.monotonic() - started
    variant.first_call_steps = message["steps"]
    variant.machine = message.get("machine")
    print_fn(
        f"{variant.name}: first call ({message['steps']} step(s)) done {variant.first_step_s:.1f} s after process start"
    )
    return worker


def _record(
    variant: Variant, label: str, answers: list[dict], schedule: Schedule, print_fn: Callable[[str], None]
) -> None:
    """Adds up the answers of the variant's turns in one round (or the warm-up) into its chunk."""
    seconds = sum(m["seconds"] for m in answers)
    if label == "warmup":
        variant.warmup_s = seconds
        print_fn(f"{label:>9}  {variant.name:<12} {seconds:.2f} s")
        return
    cpu = sum(m["cpu_seconds"] for m in answers)
    work: dict[str, int] = {}
    for m in answers:
        for kind, count in (m.get("work") or {}).items():
            work[kind] = work.get(kind, 0) + count
    variant.chunks.append(seconds)
    variant.cpu.append(cpu)
    variant.other_cpu.append(sum(m["other_cpu_seconds"] for m in answers))
    variant.steal.append(sum(m["steal_seconds"] for m in answers))
    variant.page_faults.append(sum(m["page_faults"] for m in answers))
    variant.work.append(work)
    if all(m.get("step_seconds") is not None for m in answers):  # the workers that time their step calls
        variant.step_seconds.append(sum(m["step_seconds"] for m in answers))
    print_fn(
        f"{label:>9}  {variant.name:<12} {schedule.chunk / seconds:8.2f} steps/s  "
        f"({seconds:.2f} s, {cpu / seconds:.2f} cores)"
    )


def measure(
    variants: list[Variant],
    gin_args: list[str],
    schedule: Schedule,
    *,
    timeout: float,
    pause_waiting: bool,
    malloc_tunables: str,
    print_fn: Callable[[str], None],
    enough: Callable[[int], bool] = lambda rounds: False,
) -> None:
    """Runs the variants that can run, each worker with `malloc_tunables` added to its GLIBC_TUNABLES,
    through the schedule's rounds, ending after the round where `enough(rounds measured)` says so (each
    worker is then told to finish); fills in what each measured, or why it failed."""
    workers: dict[str, Worker] = {}
    turns = Turns(workers, pause_waiting)
    log_dir = tempfile.mkdtemp(prefix="bench-logs-")
    try:
        for variant in variants:
            if variant.status == "ok":
                worker = _start(variant, gin_args, schedule, log_dir, timeout, malloc_tunables, print_fn)
                workers[variant.name] = worker
                turns.wait(worker)
        turn_index = 0
        for measured, (label, until) in enumerate(schedule.targets()):  # the warm-up first: 0 rounds measured
            steps = [until] if label == "warmup" else schedule.turn_targets(until)
            done = {variant.name: [] for variant in variants}
            for step in steps:
                for variant, worker in _running(round_order(variants, turn_index), workers):
                    message = turns.ask(variant, worker, step)
                    if message is None:
                        print_fn(f"{variant.name}: failed in {label}: {variant.reason} (log: {variant.log_path})")
                    elif message.get("steps") != step:
                        raise RuntimeError(f"{variant.name} answered {message} when asked to run to step {step}")
                    else:
                        done[variant.name].append(message)
                turn_index += 1
            for variant, _ in _running(variants, workers):
                _record(variant, label, done[variant.name], schedule, print_fn)
            if measured and enough(measured):
                break
        for variant, worker in _running(variants, workers):
            message = turns.ask(variant, worker, None)
            if message is None:
                continue
            variant.compile_count = message.get("compile_count")
            variant.peak_rss_mib = message.get("peak_rss_mib")
            variant.peak_gpu_mib = message.get("peak_gpu_mib")
    finally:
        for worker in workers.values():
            worker.close()
        for variant in variants:
            variant.waiting_cpu_s = turns.waiting_cpu.get(variant.name, 0.0)
