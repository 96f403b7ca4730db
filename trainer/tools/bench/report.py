"""What a bench run reports: every figure as one JSON-ready dict, and that dict as the text table
on stdout and as markdown (experiments/bench/run.sh builds its README from the JSON with it)."""
from __future__ import annotations

import statistics

from trainer.tools.bench.plan import Variant


def _per_chunk(every: int, warmup: int, chunk: int, repeats: int) -> float:
    """How many multiples of `every` the measured steps (warmup, warmup + repeats * chunk] hold, per chunk."""
    end = warmup + repeats * chunk
    return (end // every - warmup // every) / repeats


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def paired_ratios(res: dict) -> dict:
    """Ours over each peer chunk by chunk: chunk i of every variant ran in the same round of the
    interleaved schedule, so their ratio cancels the machine's speed in that round (on a shared
    2-core machine whole rounds run 10-20% fast or slow together). The median and min-max of
    the per-round ratios, for limit, orbit and fit's best; None where a variant did not run."""
    variants = res["variants"]
    ours = (variants.get("ours") or {}).get("chunk_seconds") or []
    out = {}
    for key, name in (("ours_over_limit", "limit"), ("ours_over_orbit", "orbit"),
                      ("ours_over_fit_best", res["ratios"].get("fit_best"))):
        other = (variants.get(name) or {}).get("chunk_seconds") or [] if name else []
        per_round = [theirs / mine for mine, theirs in zip(ours, other)]  # seconds: theirs/ours is speed ours/theirs
        out[key] = ({"median": statistics.median(per_round), "min": min(per_round), "max": max(per_round)}
                    if per_round else None)
    return out


def results(settings, variants: list[Variant], *, chunk: int, warmup: int, repeats: int,
            load_before: tuple, load_after: tuple, command: str) -> dict:
    """Everything measured, as one JSON-ready dict."""
    by_name = {v.name: v for v in variants}
    gb = settings.global_batch_size
    rate = {v.name: v.steps_per_sec(chunk) for v in variants}
    fits = [v for v in variants if v.role == "fit" and rate[v.name] is not None]
    best_fit = max(fits, key=lambda v: rate[v.name]) if fits else None
    ours, limit, orbit = by_name.get("ours"), by_name.get("limit"), by_name.get("orbit")
    first = {v.name: v.first_step_s for v in variants}
    source = settings.input_fn or settings.data_source
    model_fn = settings.model_fn
    mach = next((v.machine for v in variants if v.machine), None)
    out = {
        "command": command,
        "config": {
            "model": getattr(model_fn, "__name__", str(model_fn)),
            "data": type(source).__name__ if source is not None else "Digits",
            "input_shape": list(getattr(source, "input_shape", None) or (8, 8, 1)),
            "strategy": settings.strategy, "global_batch_size": gb,
            "steps_per_loop": settings.steps_per_loop, "log_every_steps": settings.log_every_steps,
            "checkpoint_every_steps": settings.checkpoint_every_steps,
            "jit_compile": bool(settings.jit_compile),
            "mixed_precision": settings.mixed_precision or "float32",
        },
        "method": {"steps_per_chunk": chunk, "warmup_until_step": warmup, "repeats": repeats,
                   "order": [v.name for v in variants], "statistic": "median over chunks",
                   # What our loop's hooks did in the measured chunks, per chunk on average.
                   "ours_progress_records_per_chunk": _per_chunk(settings.log_every_steps, warmup, chunk, repeats),
                   "ours_checkpoints_per_chunk": _per_chunk(settings.checkpoint_every_steps, warmup, chunk,
                                                            repeats)},
        "machine": mach,
        "load_average": {"before": list(load_before), "after": list(load_after)},
        "variants": {},
        "ratios": {
            "ours_over_limit": ratio(rate.get("ours"), rate.get("limit")),
            "ours_over_fit_spe1": ratio(rate.get("ours"), rate.get("fit_spe1")),
            "ours_over_fit_best": ratio(rate.get("ours"), rate[best_fit.name] if best_fit else None),
            "fit_best": best_fit.name if best_fit else None,
            "ours_over_orbit": ratio(rate.get("ours"), rate.get("orbit")),
            # Time to first step (seconds: lower is better), ours over fit's at steps_per_execution 1 (its
            # first call is one step, as ours) and over Orbit's.
            "first_step_ours_over_fit": ratio(first.get("ours"), first.get("fit_spe1")),
            "first_step_ours_over_orbit": ratio(first.get("ours"), first.get("orbit")),
            "rss_ours_over_fit": ratio(ours.peak_rss_mib if ours else None,
                                       min((v.peak_rss_mib for v in fits if v.peak_rss_mib), default=None)),
        },
        "ours_compile_count": ours.compile_count if ours else None,
        "limit_compile_count": limit.compile_count if limit else None,
        "orbit_compile_count": orbit.compile_count if orbit else None,
    }
    for v in variants:
        spread = v.spread(chunk)
        out["variants"][v.name] = {
            "label": v.label, "status": v.status, "reason": v.reason,
            "steps_per_sec": rate[v.name], "examples_per_sec": rate[v.name] * gb if rate[v.name] else None,
            "steps_per_sec_min_max": list(spread) if spread else None,
            "chunk_seconds": v.chunks, "warmup_seconds": v.warmup_s,
            "time_to_first_step_s": v.first_step_s, "first_call_steps": v.first_call_steps,
            "compile_count": v.compile_count, "peak_rss_mib": v.peak_rss_mib, "peak_gpu_mib": v.peak_gpu_mib,
        }
    out["paired_ratios"] = paired_ratios(out)
    return out


def _fmt(value, spec: str, missing: str = "-") -> str:
    return missing if value is None else format(value, spec)


def table_rows(res: dict) -> list[list[str]]:
    """The header and one row a variant; a variant that did not run has its reason in the second cell."""
    limit_rate = (res["variants"].get("limit") or {}).get("steps_per_sec")
    gpu = any(v.get("peak_gpu_mib") is not None for v in res["variants"].values())
    rows = [["variant", "steps/s", "examples/s", "min-max steps/s", "vs limit", "first step s", "peak RSS MiB",
             *(["peak GPU MiB"] if gpu else []), "compiles"]]
    for v in res["variants"].values():
        if v["status"] != "ok":
            reason = f"{v['status'].replace('_', ' ')}: {v['reason']}"
            rows.append([v["label"], reason, *[""] * (len(rows[0]) - 2)])
            continue
        spread = v["steps_per_sec_min_max"]
        first = _fmt(v["time_to_first_step_s"], ".1f") + (f" ({v['first_call_steps']} steps)"
                                                          if v["first_call_steps"] != 1 else "")
        rows.append([v["label"], _fmt(v["steps_per_sec"], ".2f"), _fmt(v["examples_per_sec"], ".0f"),
                     f"{spread[0]:.2f}-{spread[1]:.2f}" if spread else "-",
                     _fmt(ratio(v["steps_per_sec"], limit_rate), ".3f"), first, _fmt(v["peak_rss_mib"], ".0f"),
                     *([_fmt(v.get("peak_gpu_mib"), ".0f")] if gpu else []), _fmt(v["compile_count"], "d")])
    return rows


def headline(res: dict) -> str:
    c = res["config"]
    return (f"{c['model']} on {c['data']} {tuple(c['input_shape'])}, strategy {c['strategy']}, global batch "
            f"{c['global_batch_size']}, steps_per_loop {c['steps_per_loop']}, {c['mixed_precision']}"
            f"{', XLA' if c['jit_compile'] else ''}")


def ratio_line(res: dict) -> str:
    r = res["ratios"]
    parts = [f"ours/limit {_fmt(r['ours_over_limit'], '.3f')}",
             f"ours/fit(spe 1) {_fmt(r['ours_over_fit_spe1'], '.2f')}",
             f"ours/fit(best{', ' + r['fit_best'] if r['fit_best'] else ''}) {_fmt(r['ours_over_fit_best'], '.2f')}",
             # .get: results written before Orbit was measured have none of these
             f"ours/orbit {_fmt(r.get('ours_over_orbit'), '.3f')}",
             f"first step ours/fit {_fmt(r.get('first_step_ours_over_fit'), '.2f')}, ours/orbit "
             f"{_fmt(r.get('first_step_ours_over_orbit'), '.2f')}",
             f"peak RSS ours/fit {_fmt(r['rss_ours_over_fit'], '.2f')}",
             f"ours compile count {_fmt(res['ours_compile_count'], 'd')}"]
    return "; ".join(parts)


def method_line(res: dict) -> str:
    m, load = res["method"], res["load_average"]
    return (f"{m['repeats']} interleaved chunks of {m['steps_per_chunk']} steps per variant after warm-up to step "
            f"{m['warmup_until_step']}; medians; our loop's hooks per chunk: "
            f"{m['ours_progress_records_per_chunk']:g} progress record(s), {m['ours_checkpoints_per_chunk']:g} "
            f"checkpoint(s). Load average (1 min) {load['before'][0]:.2f} before, {load['after'][0]:.2f} after.")


def text_table(res: dict) -> str:
    rows = table_rows(res)
    widths = [max(len(row[i]) for row in rows if len(row[1]) < 40 or row is rows[0]) for i in range(len(rows[0]))]
    lines = []
    for row in rows:
        if row[2] == "" and row[1]:  # a variant that did not run: one long cell
            lines.append(f"{row[0].ljust(widths[0])}  {row[1]}")
        else:
            lines.append("  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in
                                   enumerate(zip(row, widths))))
    return "\n".join([headline(res), method_line(res), *lines, ratio_line(res)])


def markdown(res: dict) -> str:
    rows = table_rows(res)
    lines = [f"### {headline(res)}", "", f"`{res['command']}`", "", method_line(res), "",
             "| " + " | ".join(rows[0]) + " |", "|---|" + "---:|" * (len(rows[0]) - 1)]
    lines += ["| " + " | ".join(row) + " |" for row in rows[1:]]
    lines += ["", f"**{ratio_line(res)}**", ""]
    return "\n".join(lines)
