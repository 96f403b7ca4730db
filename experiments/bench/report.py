"""What a bench run reports: every figure as one JSON-ready dict, and that dict as the text table
on stdout and as markdown (experiments/bench/run.sh builds its README from the JSON with it).

The speed comparisons are the paired per-round ratios of experiments/bench/intervals.py: the
geometric mean over rounds, its 95% bootstrap interval and, against each peer, the verdict.
"""

from __future__ import annotations

import statistics

from experiments.bench import intervals as intervals_lib
from experiments.bench.plan import WORK, Schedule, Variant

STATISTIC = (
    f"geometric mean of the per-round ratios, {intervals_lib.LEVEL:.0%} percentile bootstrap interval over "
    f"rounds ({intervals_lib.RESAMPLES} resamples)"
)

# Paired comparisons beyond "ours over every other variant" (`ours_over_<name>`): (key, numerator,
# denominator), "fit_best" standing for the faster fit variant that ran. Those against a peer get a verdict.
COMPARISONS = (
    ("ours_over_fit_best", "ours", "fit_best"),
    ("limit_input_over_limit", "limit_input", "limit"),  # what the input costs every variant
    ("ours_async_over_ours", "ours_async", "ours"),  # what saving in line costs
    ("ours_async_over_orbit", "ours_async", "orbit"),
    ("ours_async_over_fit_best", "ours_async", "fit_best"),
    ("ours_epoch_order_over_limit", "ours_epoch_order", "limit"),  # ours/limit before reading by index
    ("ours_tf_data_over_limit", "ours_tf_data", "limit"),  # ours/limit with the split through tf.data
)


def is_peer(key: str) -> bool:
    """Comparisons against another loop (Orbit, fit) get a verdict; against the limits and ourselves not."""
    return key.split("_over_")[-1].startswith(("orbit", "fit"))


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def intervals(res: dict) -> dict:
    """`intervals.summary` of ours over every other variant that ran and of each of COMPARISONS."""
    variants = res["variants"]
    pairs = [(f"ours_over_{name}", "ours", name) for name in variants if name != "ours"] + list(COMPARISONS)
    out = {}
    for key, top, bottom in pairs:
        bottom = res["ratios"].get("fit_best") if bottom == "fit_best" else bottom
        mine = (variants.get(top) or {}).get("chunk_seconds") or []
        theirs = (variants.get(bottom) or {}).get("chunk_seconds") or [] if bottom else []
        if summary := intervals_lib.summary(mine, theirs):
            out[key] = summary
    return out


def fastest_fit(variants: list[Variant], chunk: int) -> Variant | None:
    """ "fit best": the fit variant with the most steps per second (median over its chunks), if any ran."""
    fits = [v for v in variants if v.role == "fit" and v.chunks]
    return max(fits, key=lambda v: v.steps_per_sec(chunk)) if fits else None


def _work(v: Variant) -> dict:
    """What the variant did per measured chunk, on average, by kind (checkpoints, records)."""
    kinds = sorted({kind for chunk in v.work for kind in chunk})
    return {kind: sum(chunk.get(kind, 0) for chunk in v.work) / len(v.work) for kind in kinds} if v.work else {}


def others(variants: list[Variant]) -> dict | None:
    """How much the rest of the machine ran during the measured chunks, in cores (CPU seconds per second):
    the median and the most over chunks, and the cores the hypervisor stole on average."""
    shares = [o / s for v in variants for o, s in zip(v.other_cpu, v.chunks)]
    seconds = sum(s for v in variants for s in v.chunks[: len(v.steal)])
    if not shares or not seconds:
        return None
    return {
        "median_cores": statistics.median(shares),
        "max_cores": max(shares),
        "stolen_cores": sum(x for v in variants for x in v.steal) / seconds,
    }


def results(
    settings,
    variants: list[Variant],
    *,
    plan: Schedule,
    rounds: dict,
    cpus: list[int],
    pause_waiting: bool,
    malloc_tunables: str,
    load_before: tuple,
    load_after: tuple,
    command: str,
) -> dict:
    """Everything measured, as one JSON-ready dict; `rounds`: how many rounds ran, by which rule, and why
    they ended (`Rounds.summary()`)."""
    by_name = {v.name: v for v in variants}
    gb, chunk = settings.global_batch_size, plan.chunk
    rate = {v.name: v.steps_per_sec(chunk) for v in variants}
    fits = [v for v in variants if v.role == "fit" and rate[v.name] is not None]
    best_fit = fastest_fit(variants, chunk)
    ours = by_name.get("ours")
    first = {v.name: v.first_step_s for v in variants}
    source = settings.input_fn or settings.data_source
    model_fn = settings.model_fn
    out = {
        "command": command,
        "config": {
            "model": getattr(model_fn, "__name__", str(model_fn)),
            "data": type(source).__name__ if source is not None else "Digits",
            "input_shape": list(getattr(source, "input_shape", None) or (8, 8, 1)),
            "strategy": settings.strategy,
            "global_batch_size": gb,
            "steps_per_loop": settings.steps_per_loop,
            "log_every_steps": settings.log_every_steps,
            "checkpoint_every_steps": settings.checkpoint_every_steps,
            "jit_compile": bool(settings.jit_compile),
            "mixed_precision": settings.mixed_precision or "float32",
        },
        "method": {
            "steps_per_chunk": chunk,
            "warmup_until_step": plan.warmup,
            **rounds,
            "steps_per_turn": plan.turn or chunk,
            "order": [v.name for v in variants],
            "order_rule": "turns of steps_per_turn steps, every variant's turn in forward and backward order "
            "alternately",
            "cpus": cpus,
            "waiting_workers": "stopped" if pause_waiting else "left running",
            "malloc_tunables": malloc_tunables,
            "statistic": STATISTIC,
        },
        "machine": next((v.machine for v in variants if v.machine), None),
        "load_average": {"before": list(load_before), "after": list(load_after)},
        "variants": {},
        "ratios": {  # ratios of the medians over chunks; the paired comparisons are in "intervals"
            "ours_over_limit": ratio(rate.get("ours"), rate.get("limit")),
            "ours_over_fit_spe1": ratio(rate.get("ours"), rate.get("fit_spe1")),
            "ours_over_fit_best": ratio(rate.get("ours"), rate[best_fit.name] if best_fit else None),
            "fit_best": best_fit.name if best_fit else None,
            "ours_over_orbit": ratio(rate.get("ours"), rate.get("orbit")),
            # Time to first step (seconds: lower is better), ours over fit's at steps_per_execution 1 (its
            # first call is one step, as ours) and over Orbit's.
            "first_step_ours_over_fit": ratio(first.get("ours"), first.get("fit_spe1")),
            "first_step_ours_over_orbit": ratio(first.get("ours"), first.get("orbit")),
            "rss_ours_over_fit": ratio(
                ours.peak_rss_mib if ours else None, min((v.peak_rss_mib for v in fits if v.peak_rss_mib), default=None)
            ),
        },
        "ours_compile_count": ours.compile_count if ours else None,
        "limit_compile_count": by_name["limit"].compile_count if "limit" in by_name else None,
        "orbit_compile_count": by_name["orbit"].compile_count if "orbit" in by_name else None,
    }
    for v in variants:
        spread = v.spread(chunk)
        out["variants"][v.name] = {
            "label": v.label,
            "status": v.status,
            "reason": v.reason,
            "steps_per_sec": rate[v.name],
            "examples_per_sec": rate[v.name] * gb if rate[v.name] else None,
            "steps_per_sec_min_max": list(spread) if spread else None,
            "chunk_seconds": v.chunks,
            "chunk_cpu_seconds": v.cpu,
            "chunk_other_cpu_seconds": v.other_cpu,
            "chunk_steal_seconds": v.steal,
            "chunk_page_faults": v.page_faults,
            "cores_used": statistics.median(c / s for c, s in zip(v.cpu, v.chunks)) if v.cpu else None,
            "page_faults_per_chunk": statistics.median(v.page_faults) if v.page_faults else None,
            "work": WORK[v.role],
            "work_per_chunk": _work(v),
            "waiting_cpu_s": v.waiting_cpu_s,
            "chunk_step_seconds": v.step_seconds,
            "outside_step_calls": _outside(v),
            "warmup_seconds": v.warmup_s,
            "time_to_first_step_s": v.first_step_s,
            "first_call_steps": v.first_call_steps,
            "compile_count": v.compile_count,
            "peak_rss_mib": v.peak_rss_mib,
            "peak_gpu_mib": v.peak_gpu_mib,
        }
    out["method"]["others"] = others(variants)
    return score(out)


def _outside(v: Variant) -> float | None:
    """The median share of a chunk the worker spent outside its compiled step calls (hooks, saves,
    records, the Python between calls); None for a worker that does not time its calls (Orbit, fit)."""
    if not v.step_seconds or len(v.step_seconds) != len(v.chunks):
        return None
    return statistics.median(1 - steps / chunk for steps, chunk in zip(v.step_seconds, v.chunks))


def score(res: dict) -> dict:
    """`res` with its paired comparisons (`intervals`), `verdicts` and `method.statistic` computed from its
    own rounds (every variant's chunk seconds) by the current statistic; the rest is left as measured."""
    res["method"]["statistic"] = STATISTIC
    res["intervals"] = intervals(res)
    res["verdicts"] = {key: s["verdict"] for key, s in res["intervals"].items() if is_peer(key)}
    return res


def number_text(value, spec: str, missing: str = "-") -> str:
    """`value` formatted by `spec`, or `missing` where there is none."""
    return missing if value is None else format(value, spec)


def interval_text(s: dict | None) -> str:
    """`0.981 [0.962, 1.004]`: the geometric mean of the per-round ratios and its 95% interval."""
    return "-" if s is None else f"{s['geomean']:.3f} [{s['low']:.3f}, {s['high']:.3f}]"


def work_text(work: dict) -> str:
    return ", ".join(f"{kind} {n:g}" for kind, n in work.items() if n) or "none"


def table_rows(res: dict) -> list[list[str]]:
    """The header and one row a variant; a variant that did not run has its reason in the second cell."""
    gpu = any(v.get("peak_gpu_mib") is not None for v in res["variants"].values())
    rows = [
        [
            "variant",
            "steps/s",
            "examples/s",
            "min-max steps/s",
            "ours/this [95%]",
            "verdict",
            "cores",
            "page faults per chunk",
            "work per chunk",
            "outside step calls",
            "first step s",
            "peak RSS MiB",
            *(["peak GPU MiB"] if gpu else []),
            "compiles",
        ]
    ]
    for name, v in res["variants"].items():
        if v["status"] != "ok":
            reason = f"{v['status'].replace('_', ' ')}: {v['reason']}"
            rows.append([v["label"], reason, *[""] * (len(rows[0]) - 2)])
            continue
        key = f"ours_over_{name}"
        s = res["intervals"].get(key)
        spread = v["steps_per_sec_min_max"]
        first = number_text(v["time_to_first_step_s"], ".1f") + (
            f" ({v['first_call_steps']} steps)" if v["first_call_steps"] != 1 else ""
        )
        rows.append(
            [
                v["label"],
                number_text(v["steps_per_sec"], ".2f"),
                number_text(v["examples_per_sec"], ".0f"),
                f"{spread[0]:.2f}-{spread[1]:.2f}" if spread else "-",
                interval_text(s),
                s["verdict"] if s and is_peer(key) else "-",
                number_text(v.get("cores_used"), ".2f"),
                number_text(v.get("page_faults_per_chunk"), ",.0f"),
                work_text(v.get("work_per_chunk") or {}),
                number_text(v.get("outside_step_calls"), ".1%"),
                first,
                number_text(v["peak_rss_mib"], ".0f"),
                *([number_text(v.get("peak_gpu_mib"), ".0f")] if gpu else []),
                number_text(v["compile_count"], "d"),
            ]
        )
    return rows


def headline(res: dict) -> str:
    c = res["config"]
    return (
        f"{c['model']} on {c['data']} {tuple(c['input_shape'])}, strategy {c['strategy']}, global batch "
        f"{c['global_batch_size']}, steps_per_loop {c['steps_per_loop']}, {c['mixed_precision']}"
        f"{', XLA' if c['jit_compile'] else ''}"
    )


def verdict_line(res: dict) -> str:
    """Ours (and ours with async checkpoints) against each peer: the interval and the verdict."""
    s, r = res["intervals"], res["ratios"]
    parts = []
    for key, label in (
        ("ours_over_limit", "ours/limit"),
        ("ours_over_orbit", "ours/orbit"),
        ("ours_over_fit_best", f"ours/fit best ({r['fit_best'] or '-'})"),
        ("ours_async_over_ours", "ours_async/ours"),
        ("ours_async_over_orbit", "ours_async/orbit"),
        ("ours_async_over_fit_best", "ours_async/fit best"),
        ("ours_tf_data_over_limit", "ours_tf_data/limit (the train data through tf.data)"),
        ("ours_over_ours_tf_data", "ours/ours_tf_data (the split on the devices over tf.data)"),
        ("limit_input_over_limit", "limit_input/limit (the input's cost)"),
        ("ours_over_limit_input", "ours/limit_input"),
    ):
        if key in s:
            parts.append(f"{label} {interval_text(s[key])}" + (f" {s[key]['verdict']}" if is_peer(key) else ""))
    return "; ".join(parts)


def ratio_line(res: dict) -> str:
    r = res["ratios"]
    return "; ".join(
        [
            f"first step ours/fit {number_text(r.get('first_step_ours_over_fit'), '.2f')}, ours/orbit "
            f"{number_text(r.get('first_step_ours_over_orbit'), '.2f')}",
            f"peak RSS ours/fit {number_text(r['rss_ours_over_fit'], '.2f')}",
            f"ours compile count {number_text(res['ours_compile_count'], 'd')}",
        ]
    )


def method_line(res: dict) -> str:
    m, load = res["method"], res["load_average"]
    waiting = sum(v.get("waiting_cpu_s") or 0.0 for v in res["variants"].values())
    o = m.get("others")
    busy = (
        f" Other processes ran on a median {o['median_cores']:.2f} cores (at most {o['max_cores']:.2f}) during "
        f"the chunks; the hypervisor stole {o['stolen_cores']:.2f} cores."
        if o
        else ""
    )
    turns = f"in turns of {m['steps_per_turn']} steps, " if m["steps_per_turn"] < m["steps_per_chunk"] else ""
    malloc = (
        f"GLIBC_TUNABLES {m['malloc_tunables']}"
        if m["malloc_tunables"]
        else "glibc's malloc as the environment sets it"
    )
    rule = (
        f" ({m['least_rounds']} at least, up to {m['most_rounds']} while an interval of ours/limit, ours/orbit "
        f"or ours/fit best was wider than {m['max_width']:g}; ended: {m['rounds_ended']})"
        if m.get("most_rounds", 0) > m.get("least_rounds", m["rounds"])
        else ""
    )
    return (
        f"{m['rounds']} rounds{rule} of one {m['steps_per_chunk']}-step chunk per variant, {turns}forward and "
        f"backward in turn, after warm-up to step {m['warmup_until_step']}; on cores "
        f"{','.join(map(str, m['cpus']))}; {malloc}; "
        f"waiting workers {m['waiting_workers']} (their CPU while others ran: {waiting:.2f} s); ratios: "
        f"geometric mean of the per-round ratios [95% bootstrap interval]. Load average (1 min) "
        f"{load['before'][0]:.2f} before, {load['after'][0]:.2f} after.{busy}"
    )


def text_table(res: dict) -> str:
    rows = table_rows(res)
    widths = [max(len(row[i]) for row in rows if len(row[1]) < 40 or row is rows[0]) for i in range(len(rows[0]))]
    lines = []
    for row in rows:
        if row[2] == "" and row[1]:  # a variant that did not run: one long cell
            lines.append(f"{row[0].ljust(widths[0])}  {row[1]}")
        else:
            lines.append(
                "  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
            )
    return "\n".join([headline(res), method_line(res), *lines, verdict_line(res), ratio_line(res)])


def markdown(res: dict) -> str:
    rows = table_rows(res)
    lines = [
        f"### {headline(res)}",
        "",
        f"`{res['command']}`",
        "",
        method_line(res),
        "",
        "| " + " | ".join(rows[0]) + " |",
        "|---|" + "---:|" * (len(rows[0]) - 1),
    ]
    lines += ["| " + " | ".join(row) + " |" for row in rows[1:]]
    lines += ["", f"**{verdict_line(res)}**", "", ratio_line(res), ""]
    return "\n".join(lines)
