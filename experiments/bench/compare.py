"""The parent's main: checks the flags, pins itself (and so every worker it starts) to the same
cores, plans the variants and chunks, measures, prints the table, writes `--json` and appends
`--report`."""

from __future__ import annotations

import json
import os
import shlex

from experiments.bench.config import refuse_asynchronous, train_settings
from experiments.bench.measure import measure
from experiments.bench.plan import plan_variants, schedule
from experiments.bench.report import markdown, results, text_table
from experiments.bench.rounds import Rounds
from trainer.cli import sigterm_unwinds
from trainer.errors import UserError


def pin(cpus: list[str]) -> list[int]:
    """Pins this process to `cpus` (empty: every core it may use now); the workers it starts inherit it,
    so every variant runs on the same cores, and TensorFlow sizes its thread pools alike in each."""
    allowed = sorted(os.sched_getaffinity(0))
    try:
        chosen = sorted({int(c) for c in cpus}) or allowed
    except ValueError:
        raise UserError(f"--cpus takes core numbers, got {cpus}") from None
    if not set(chosen) <= set(allowed):
        raise UserError(
            f"--cpus {','.join(map(str, chosen))} is not a subset of the cores this process may use "
            f"({','.join(map(str, allowed))}); pick among those"
        )
    os.sched_setaffinity(0, chosen)
    return chosen


def compare(
    gin_files: list[str],
    gin_bindings: list[str],
    *,
    variants: list[str],
    steps: int,
    repeats: int,
    max_repeats: int,
    max_width: float,
    warmup_steps: int,
    turn_steps: int,
    fit_steps_per_execution: list[str],
    cpus: list[str],
    pause_waiting: bool,
    malloc_tunables: str,
    timeout_secs: float,
    json_path: str | None,
    report_path: str | None,
    argv: list[str],
) -> int:
    """Runs the bench: `repeats` rounds, then more while a headline interval is wider than `max_width`, up
    to `max_repeats` (experiments/bench/rounds.py); the exit code: 0 when everything ran, 1 when a
    variant other than fit failed. `argv` (the command line's arguments) goes into the report as the
    command to rerun it."""
    settings = train_settings(gin_files, gin_bindings)
    refuse_asynchronous(settings, "experiments.bench")
    if steps < 0 or repeats < 1 or warmup_steps < 0 or turn_steps < 0 or max_repeats < 0:
        raise UserError(
            "--repeats must be at least 1, --steps, --warmup_steps, --turn_steps and --max_repeats at least 0"
        )
    if not max_width > 0:
        raise UserError(
            f"--max_width must be above 0 (got {max_width}); --max_repeats={repeats} runs exactly --repeats rounds"
        )
    pinned = pin(cpus)
    try:
        fit_spes = sorted({int(s) for s in fit_steps_per_execution} or {1, settings.steps_per_loop})
    except ValueError:
        raise UserError(f"--fit_steps_per_execution takes integers, got {fit_steps_per_execution}") from None
    if min(fit_spes) < 1:
        raise UserError("--fit_steps_per_execution values must be at least 1")
    planned = plan_variants(settings, variants, fit_spes)
    plan = schedule(
        settings,
        fit_spes,
        steps=steps,
        warmup_steps=warmup_steps,
        repeats=repeats,
        turn_steps=turn_steps,
        max_repeats=max_repeats,
    )
    rounds = Rounds(least=repeats, most=plan.most_rounds, max_width=max_width)
    gin_args = [*(f"--gin_file={f}" for f in gin_files), *(f"--gin_bindings={b}" for b in gin_bindings)]
    command = shlex.join(
        ["python", "-m", "experiments.bench", *(a for a in argv if not a.startswith(("--json", "--report")))]
    )
    print_fn = lambda line: print(line, flush=True)  # noqa: E731
    more = (
        f" (up to {rounds.most} while an interval of ours/limit, ours/orbit or ours/fit best is wider than "
        f"{max_width:g})"
        if rounds.most > repeats
        else ""
    )
    print_fn(
        f"bench: {', '.join(v.name for v in planned)}; {repeats} rounds{more} of {plan.chunk} steps each, in "
        f"turns of {plan.turn}, after warm-up to step {plan.warmup}, on cores {','.join(map(str, pinned))}"
    )
    load_before = os.getloadavg()
    with sigterm_unwinds():  # a SIGTERM to the bench ends its workers (measure's finally) before it exits
        measure(
            planned,
            gin_args,
            plan,
            timeout=timeout_secs,
            pause_waiting=pause_waiting,
            malloc_tunables=malloc_tunables,
            print_fn=print_fn,
            enough=lambda done: rounds.enough(planned, plan.chunk, done, print_fn),
        )
    res = results(
        settings,
        planned,
        plan=plan,
        rounds=rounds.summary(),
        cpus=pinned,
        pause_waiting=pause_waiting,
        malloc_tunables=malloc_tunables,
        load_before=load_before,
        load_after=os.getloadavg(),
        command=command,
    )
    print_fn("")
    print_fn(text_table(res))
    if json_path:
        with open(json_path, "w") as f:
            json.dump(res, f, indent=2)
    if report_path:
        with open(report_path, "a") as f:
            f.write(markdown(res) + "\n")
    return 1 if any(v.status == "failed" and v.role != "fit" for v in planned) else 0
