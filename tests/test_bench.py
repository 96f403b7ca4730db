"""`python -m experiments.bench`: runs end to end and reports every field; no timing is asserted."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from experiments.bench.protocol import KEEP_FREED_MEMORY, Worker, with_tunables
from tests.support import REPO, run_module, subprocess_env

FIELDS = (
    "steps_per_sec",
    "examples_per_sec",
    "steps_per_sec_min_max",
    "chunk_seconds",
    "chunk_cpu_seconds",
    "cores_used",
    "time_to_first_step_s",
    "first_call_steps",
    "compile_count",
    "peak_rss_mib",
    "status",
)
TINY = (
    "--gin_file=gin/single.gin",
    "--gin_bindings=train.model_fn=@mlp",
    "--gin_bindings=train.global_batch_size=32",
    "--gin_bindings=train.steps_per_loop=5",
    "--gin_bindings=train.log_every_steps=5",
    "--gin_bindings=train.checkpoint_every_steps=10",
    "--steps=8",
)
HAVE_ORBIT = importlib.util.find_spec("orbit") is not None


@pytest.mark.slow
def test_bench_runs_end_to_end_and_writes_every_field(tmp_path):
    """One tiny run of every variant (orbit where it is installed)."""
    out, report_path = tmp_path / "bench.json", tmp_path / "bench.md"
    # Every worker is started for up to 100,000 rounds (a million steps); the intervals are narrow enough (at
    # most 10 wide) after the 3 rounds, so every worker is told to finish then, and must end its run early:
    # ours answers only once its run has ended, so one that went on would time out.
    proc = run_module(
        "experiments.bench",
        *TINY,
        "--mode=train",
        "--repeats=3",
        "--max_repeats=100000",
        "--max_width=10",
        "--fit_steps_per_execution=5",
        f"--json={out}",
        f"--report={report_path}",
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result, report = json.loads(out.read_text()), report_path.read_text()
    assert set(result["variants"]) == {
        "limit",
        "limit_input",
        "ours",
        "ours_async",
        "ours_tf_data",
        "orbit",
        "fit_spe5",
    }
    for name in ("limit", "limit_input", "ours", "ours_async", "ours_tf_data", "fit_spe5"):
        variant = result["variants"][name]
        assert variant["status"] == "ok", (name, variant)
        for field in FIELDS:
            assert variant[field] is not None, (name, field)
        assert len(variant["chunk_seconds"]) == len(variant["chunk_cpu_seconds"]) == 3
        assert variant["steps_per_sec"] > 0 and variant["peak_rss_mib"] > 0 and variant["cores_used"] > 0
    # --steps 8 is rounded up to whole calls of 5: chunks of 10 steps.
    assert result["method"]["steps_per_chunk"] == 10 and result["method"]["rounds"] == 3
    assert (result["method"]["least_rounds"], result["method"]["most_rounds"]) == (3, 100000)
    assert result["method"]["rounds_ended"].startswith("every headline interval at most 10 wide")
    assert "3 rounds (3 at least, up to 100000 while" in report
    # Each chunk ran in two turns of one 5-step call, every variant's turn after another's, and was added up.
    assert result["method"]["steps_per_turn"] == 5 and "in turns of 5 steps" in proc.stdout
    # What each variant did besides its steps, counted by its worker: ours one checkpoint and two train records
    # per 10-step chunk, with sync or async saves alike; the limits and fit nothing.
    for name in ("ours", "ours_async", "ours_tf_data"):
        assert result["variants"][name]["work_per_chunk"] == {"checkpoints": 1, "records": 2}, name
    for name in ("limit", "limit_input", "fit_spe5"):
        assert result["variants"][name]["work_per_chunk"] == {}, name
    # The workers that time their compiled step calls (the limits and ours) say how much of each chunk was
    # spent outside them; fit (and Orbit) cannot tell.
    for name in ("limit", "limit_input", "ours", "ours_async"):
        variant = result["variants"][name]
        assert len(variant["chunk_step_seconds"]) == 3, name
        assert all(0 < s <= c for s, c in zip(variant["chunk_step_seconds"], variant["chunk_seconds"])), name
        assert 0 <= variant["outside_step_calls"] < 1, name
    assert result["variants"]["fit_spe5"]["chunk_step_seconds"] == []
    assert result["variants"]["fit_spe5"]["outside_step_calls"] is None
    assert "| outside step calls |" in report
    # Every worker ran on the cores the parent had, and none used CPU while it waited for its turn (stopped).
    assert result["method"]["cpus"] == sorted(os.sched_getaffinity(0))
    assert result["method"]["waiting_workers"] == "stopped"
    # Every worker kept the memory it freed, and said how many page faults each chunk took.
    assert result["method"]["malloc_tunables"] == KEEP_FREED_MEMORY and KEEP_FREED_MEMORY in proc.stdout
    for name in ("limit", "ours", "fit_spe5"):
        faults = result["variants"][name]["chunk_page_faults"]
        assert len(faults) == 3 and min(faults) >= 0 and result["variants"][name]["page_faults_per_chunk"] >= 0
    assert "| page faults per chunk |" in report
    assert all(v["waiting_cpu_s"] < 0.2 for v in result["variants"].values()), result["variants"]
    # Our loop ran calls of 1, 5 and 4 steps (the first step alone, then up to hook boundaries): one trace.
    assert result["ours_compile_count"] == 1 and result["limit_compile_count"] == 1
    assert result["variants"]["fit_spe5"]["first_call_steps"] == 5
    for key in (
        "ours_over_limit",
        "ours_over_fit_spe1",
        "ours_over_fit_best",
        "rss_ours_over_fit",
        "ours_over_orbit",
        "first_step_ours_over_fit",
        "first_step_ours_over_orbit",
    ):
        assert key in result["ratios"]
    assert result["ratios"]["fit_best"] == "fit_spe5" and result["ratios"]["ours_over_fit_best"] > 0
    for key in (
        "ours_over_limit",
        "ours_over_limit_input",
        "limit_input_over_limit",
        "ours_over_fit_best",
        "ours_async_over_ours",
        "ours_async_over_fit_best",
        "ours_over_ours_tf_data",
        "ours_tf_data_over_limit",
    ):
        interval = result["intervals"][key]
        assert interval["rounds"] == 3 and interval["low"] <= interval["geomean"] <= interval["high"], key
    assert set(result["verdicts"]) >= {"ours_over_fit_best", "ours_over_fit_spe5", "ours_async_over_fit_best"}
    assert set(result["verdicts"].values()) <= {"ahead", "tie", "behind"}
    assert result["machine"]["cores"] >= 1 and result["machine"]["tensorflow"]
    assert len(result["load_average"]["before"]) == 3 and result["method"]["others"]["max_cores"] >= 0
    assert "ours/limit" in proc.stdout and "ours/fit best" in proc.stdout
    assert "ours (trainer.train + hooks)" in proc.stdout
    assert report.count("| ours (trainer.train + hooks) |") == 1 and "| ours/this [95%] | verdict |" in report
    if HAVE_ORBIT:  # here rather than in a test of its own: one bench run serves both, however tests are spread
        check_orbit_trained_beside_ours(result, report)
    else:
        assert result["variants"]["orbit"]["status"] == "cannot_run"


def check_orbit_trained_beside_ours(result: dict, report: str) -> None:
    orbit = result["variants"]["orbit"]
    assert orbit["status"] == "ok", orbit
    for field in FIELDS:
        assert orbit[field] is not None, field
    assert len(orbit["chunk_seconds"]) == 3 and orbit["first_call_steps"] == 1
    assert orbit["work_per_chunk"] == {"checkpoints": 1, "records": 2}  # the same saves and records as ours
    assert result["orbit_compile_count"] == 1  # Orbit's loop called with 1, then 5-step calls: one trace
    assert result["ratios"]["ours_over_orbit"] > 0 and result["ratios"]["first_step_ours_over_orbit"] > 0
    assert result["verdicts"]["ours_over_orbit"] in ("ahead", "tie", "behind")
    assert "| Orbit Controller + StandardTrainer |" in report


@pytest.mark.slow
def test_without_orbit_the_variant_is_one_line_and_the_rest_runs(tmp_path):
    hidden = tmp_path / "hide"
    hidden.mkdir()
    (hidden / "orbit.py").write_text("raise ImportError('hidden by the test')\n")
    env = subprocess_env()
    env["PYTHONPATH"] = os.pathsep.join([str(hidden), env["PYTHONPATH"]])
    out = tmp_path / "bench.json"
    proc = run_module(
        "experiments.bench", *TINY, "--repeats=1", "--variants=ours,orbit", f"--json={out}", env=env, timeout=240
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["variants"]["ours"]["status"] == "ok"
    assert result["variants"]["orbit"]["status"] == "cannot_run"
    assert result["ratios"]["ours_over_orbit"] is None and "ours_over_orbit" not in result["intervals"]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("Orbit Controller")]
    assert len(lines) == 1 and "--install_orbit" in lines[0] and "pip install --no-deps" in lines[0], proc.stdout


def _made_up_result(ours_seconds: list[float], fit_seconds: list[float]) -> dict:
    """A bench result on one device from made-up chunk seconds (limit and limit_input 10% faster than ours)."""
    from experiments.bench.plan import Schedule, plan_variants
    from experiments.bench.report import results
    from trainer import data
    from trainer.run.settings import Settings

    settings = Settings(
        strategy="default",
        global_batch_size=64,
        steps_per_loop=10,
        log_every_steps=100,
        checkpoint_every_steps=200,
        jit_compile=False,
        mixed_precision=None,
        data_source=data.Digits(),
        model_fn=len,
    )
    variants = plan_variants(settings, ["limit", "limit_input", "ours", "ours_async", "fit"], [1])
    seconds = {
        "limit": [s * 0.9 for s in ours_seconds],
        "limit_input": [s * 0.9 for s in ours_seconds],
        "ours": ours_seconds,
        "ours_async": ours_seconds,
        "fit_spe1": fit_seconds,
    }
    for v in variants:
        v.chunks = v.cpu = seconds[v.name]
        v.first_step_s, v.compile_count, v.peak_rss_mib = 4.0, 1, 700.0
    rounds = {"rounds": len(ours_seconds), "least_rounds": len(ours_seconds), "most_rounds": len(ours_seconds)}
    return results(
        settings,
        variants,
        plan=Schedule(200, 200, len(ours_seconds)),
        rounds=rounds,
        cpus=[0],
        pause_waiting=True,
        malloc_tunables="",
        load_before=(0.5, 0, 0),
        load_after=(0.6, 0, 0),
        command="python -m experiments.bench --gin_file=gin/single.gin",
    )


def test_readme_shows_every_run_of_a_config_with_its_verdicts(tmp_path):
    from experiments.bench.readme import readme

    rounds = [2.0, 2.4, 2.1, 2.2, 1.9, 2.3]
    ahead = _made_up_result(rounds, [s * 1.2 for s in rounds])  # fit takes 20% longer every round
    behind = _made_up_result(rounds, [s * 0.8 for s in rounds])
    # A result scored by another statistic is scored again from its rounds: the README never shows stale figures.
    ahead["intervals"]["ours_over_fit_best"].update(geomean=5.0, low=4.0, high=6.0, verdict="ahead")
    ahead["method"]["statistic"] = "median of the per-round ratios"
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "mlp_single.json").write_text(json.dumps(ahead))
    (tmp_path / "results" / "mlp_single.run2.json").write_text(json.dumps(behind))
    text = readme(str(tmp_path), "cores (nproc): 2")
    first = [line for line in text.splitlines() if line.startswith("| mlp_single (run 1) |")]
    second = [line for line in text.splitlines() if line.startswith("| mlp_single (run 2) |")]
    assert len(first) == len(second) == 2, text  # one row per run in the summary and in the targets
    assert all("ahead" in line and "behind" not in line for line in first), first
    assert all("behind" in line for line in second), second
    assert "1.200 [1.200, 1.200] ahead" in first[0] and "0.900 [0.900, 0.900]" in first[0]  # fit best, limit
    assert "### mlp_single (run 2): len on Digits" in text and "cores (nproc): 2" in text
    assert "RUNS=2 experiments/bench/run.sh" in text


@pytest.mark.slow
def test_unknown_mode_is_one_error_line():
    proc = run_module("experiments.bench", "--gin_file=gin/single.gin", "--mode=fast", timeout=120)
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "--mode" in errors[0], proc.stderr[-2000:]


@pytest.mark.slow
def test_cores_that_are_not_ours_are_one_error_line():
    proc = run_module("experiments.bench", "--gin_file=gin/single.gin", "--cpus=4096", timeout=120)
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "--cpus" in errors[0] and "subset" in errors[0], proc.stderr[-2000:]


@pytest.mark.slow
def test_an_interval_width_of_zero_is_one_error_line():
    proc = run_module("experiments.bench", "--gin_file=gin/single.gin", "--max_width=0", timeout=120)
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "--max_width must be above 0" in errors[0], proc.stderr[-2000:]


@pytest.mark.slow
def test_a_waiting_worker_is_stopped_until_its_turn(tmp_path):
    """The parent stops a worker between its answer and its next request (every thread: state T in /proc)."""

    def state(pid: int) -> str:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]

    worker = Worker([*TINY[:-1], "--role=limit", "--total_steps=20"], str(tmp_path / "limit.log"), timeout=120)
    try:
        assert worker.receive()["event"] == "ready"
        worker.pause()
        for _ in range(50):
            if state(worker.process.pid) == "T":
                break
            time.sleep(0.1)
        assert state(worker.process.pid) == "T"
        before = worker.cpu_seconds()
        time.sleep(0.5)
        assert worker.cpu_seconds() == before  # stopped: no thread runs
        worker.resume()
        worker.send(until=10)
        answer = worker.receive()
        assert answer["event"] == "chunk" and answer["steps"] == 10 and answer["cpu_seconds"] > 0
    finally:
        worker.close()
    assert worker.process.returncode is not None


FROM_HEAP = """
import ctypes
libc = ctypes.CDLL(None)
libc.malloc.restype = libc.sbrk.restype = ctypes.c_void_p
block = libc.malloc(1 << 20)
print("heap" if block < libc.sbrk(0) else "own mapping")
"""


@pytest.mark.slow
@pytest.mark.parametrize("tunables, where", [(KEEP_FREED_MEMORY, "heap"), ("", "own mapping")])
def test_a_worker_keeps_the_memory_it_frees(tunables, where):
    """glibc ignores a tunable it does not know, so check that the workers' settings take effect: a 1 MiB
    block comes from the heap (kept and reused when freed) instead of a mapping of its own (returned to the
    kernel when freed, its pages faulted in again the next time), as by glibc's defaults."""
    env = Worker.environment(tunables)
    if not tunables:
        env.pop("GLIBC_TUNABLES", None)  # glibc's defaults
    proc = subprocess.run([sys.executable, "-c", FROM_HEAP], env=env, capture_output=True, text=True, timeout=60)
    assert proc.stdout.strip() == where, proc.stderr


def test_tunables_the_environment_sets_win():
    assert with_tunables("", "a.b=1:c.d=2") == "a.b=1:c.d=2"
    assert with_tunables("c.d=5:x.y=0", "a.b=1:c.d=2") == "c.d=5:x.y=0:a.b=1"
    assert with_tunables("c.d=5", "") == "c.d=5"


def test_table_says_where_fit_cannot_run():
    from experiments.bench.plan import Schedule, plan_variants
    from experiments.bench.report import markdown, results, text_table
    from trainer import data
    from trainer.run.settings import Settings

    settings = Settings(
        strategy="multi_worker_mirrored",
        global_batch_size=64,
        steps_per_loop=10,
        log_every_steps=100,
        checkpoint_every_steps=200,
        jit_compile=False,
        mixed_precision=None,
        data_source=data.Digits(),
        model_fn=len,
    )
    variants = plan_variants(settings, ["limit", "ours", "fit"], [1, 10])
    assert [v.status for v in variants] == ["ok", "ok", "cannot_run", "cannot_run"]
    for v in variants[:2]:
        v.chunks, v.cpu, v.first_step_s, v.compile_count, v.peak_rss_mib = [2.0, 2.2, 2.1], [4.0] * 3, 5.0, 1, 700.0
    result = results(
        settings,
        variants,
        plan=Schedule(200, 200, 3),
        rounds={"rounds": 3},
        cpus=[0],
        pause_waiting=True,
        malloc_tunables="",
        load_before=(0.5, 0, 0),
        load_after=(0.6, 0, 0),
        command="python -m experiments.bench",
    )
    assert result["ratios"]["ours_over_fit_best"] is None and result["ratios"]["ours_over_limit"] == 1.0
    assert result["intervals"]["ours_over_limit"]["geomean"] == pytest.approx(1.0) and result["verdicts"] == {}
    text = text_table(result)
    assert "cannot run: Keras 3 fit cannot run under MultiWorkerMirroredStrategy" in text
    assert "cannot run" in markdown(result)


def test_rounds_alternate_their_order():
    from experiments.bench.plan import Schedule, round_order

    assert [round_order("ABC", i) for i in range(4)] == [list("ABC"), list("CBA"), list("ABC"), list("CBA")]
    assert Schedule(chunk=10, warmup=20, repeats=3).targets() == [
        ("warmup", 20),
        ("round 1", 30),
        ("round 2", 40),
        ("round 3", 50),
    ]


def test_a_round_runs_in_turns_that_end_on_every_call_boundary():
    from experiments.bench.plan import Schedule, schedule
    from trainer import data
    from trainer.errors import UserError
    from trainer.run.settings import Settings

    assert Schedule(chunk=600, warmup=600, repeats=2, turn=200).turn_targets(1200) == [800, 1000, 1200]
    assert Schedule(chunk=600, warmup=600, repeats=2).turn_targets(1200) == [1200]  # no turns: the chunk at once
    with pytest.raises(ValueError):
        Schedule(chunk=600, warmup=600, repeats=2, turn=250)
    settings = Settings(
        strategy="default",
        global_batch_size=128,
        steps_per_loop=100,
        log_every_steps=250,
        checkpoint_every_steps=1500,
        jit_compile=False,
        mixed_precision=None,
        data_source=data.Digits(),
        model_fn=len,
    )
    plan = schedule(settings, [1, 100], steps=0, warmup_steps=0, repeats=12)
    assert (plan.chunk, plan.turn, plan.turns_per_chunk, plan.warmup) == (1500, 100, 15, 1500)
    assert schedule(settings, [1, 100], steps=0, warmup_steps=0, repeats=12, turn_steps=220).turn == 300
    with pytest.raises(UserError, match="--turn_steps 400 .* does not divide a chunk of 1500"):
        schedule(settings, [1, 100], steps=0, warmup_steps=0, repeats=12, turn_steps=400)


def _rounds(ours: float, other: float, n: int = 24) -> tuple[list[float], list[float]]:
    """Made-up chunk seconds: each round's machine speed swings by up to 30%, hitting both variants alike,
    plus 1% of noise of their own; `ours` and `other` are their true seconds per chunk."""
    rng = np.random.default_rng(7)
    machine = rng.uniform(0.85, 1.15, n)
    return (list(ours * machine * rng.normal(1, 0.01, n)), list(other * machine * rng.normal(1, 0.01, n)))


def test_verdicts_on_made_up_rounds_lead_tie_and_deficit():
    from experiments.bench import intervals

    lead = intervals.summary(*_rounds(1.0, 1.05))  # the peer takes 5% longer: ours is ahead
    assert lead["verdict"] == "ahead" and lead["low"] > 1.0 and lead["geomean"] == pytest.approx(1.05, abs=0.01)
    tie = intervals.summary(*_rounds(1.0, 1.0))
    assert tie["verdict"] == "tie" and tie["low"] <= 1.0 <= tie["high"]
    deficit = intervals.summary(*_rounds(1.05, 1.0))
    assert deficit["verdict"] == "behind" and deficit["high"] < 1.0
    for s in (lead, tie, deficit):  # pairing cancels the 30% swings: the intervals stay narrow
        assert s["rounds"] == 24 and 0 < s["width"] < 0.02 and s["min"] <= s["low"] <= s["high"] <= s["max"]
    assert intervals.summary(*_rounds(1.0, 1.05)) == lead  # a fixed seed: the same rounds, the same interval
    assert intervals.summary([1.0], []) is None


def test_rounds_go_on_while_a_headline_interval_is_too_wide():
    """Made-up rounds: ours and the limit move with the machine, the fit variant has 5% noise of its own."""
    from experiments.bench.plan import Variant
    from experiments.bench.rounds import Rounds, widest

    ours, limit = _rounds(1.0, 0.9, n=12)
    noisy = list(np.asarray(ours) * np.random.default_rng(5).normal(1.0, 0.05, 12))  # 5% of its own a round
    variants = [
        Variant("limit", "", "limit"),
        Variant("ours", "", "ours"),
        Variant("fit_spe1", "", "fit"),
        Variant("orbit", "", "orbit", status="cannot_run"),
    ]

    def measured(rounds: int) -> list[Variant]:
        for v, seconds in zip(variants, (limit, ours, noisy)):
            v.chunks = seconds[:rounds]
        return variants

    # ours/fit best's interval is 0.059, 0.075, 0.064, 0.056, 0.051 wide after rounds 4 to 8 (ours/limit's under 0.01).
    lines = []
    rule = Rounds(least=4, most=12, max_width=0.052)
    assert [rule.enough(measured(n), 100, n, lines.append) for n in range(1, 9)] == [False] * 7 + [True]
    assert [line.split(":")[0] for line in lines] == [f"after round {n}" for n in range(4, 8)]
    assert "ours/fit best's 95% interval is 0.059 wide, more than 0.052: one more round (at most 12)" in lines[0]
    assert rule.summary() == {
        "rounds": 8,
        "least_rounds": 4,
        "most_rounds": 12,
        "max_width": 0.052,
        "rounds_ended": "every headline interval at most 0.052 wide (the widest: ours/fit best, 0.051)",
    }
    strict = Rounds(least=4, most=12, max_width=0.045)  # never reached: it ends at the most rounds allowed
    assert [strict.enough(measured(n), 100, n, lines.append) for n in range(1, 13)] == [False] * 11 + [True]
    assert strict.summary()["rounds_ended"] == (
        "ours/fit best's interval still 0.050 wide after the most rounds allowed (12)"
    )
    assert Rounds(least=4, most=2, max_width=0.5).most == 4  # never fewer than the least
    variants[2].chunks, variants[0].status = [], "failed"  # no fit, and the limit failed: nothing to compare
    assert widest(variants, 100) is None and Rounds(least=1, most=8, max_width=0.06).enough(variants, 100, 1, print)


def test_the_interval_narrows_as_more_rounds_agree():
    from experiments.bench.intervals import bootstrap_interval

    rounds = list(np.random.default_rng(3).normal(1.02, 0.04, 8))  # ratios spread by 4% a round
    widths = [high - low for low, high in (bootstrap_interval(rounds * k) for k in (1, 2, 4))]
    assert widths[0] > widths[1] > widths[2] > 0, widths  # the same rounds seen 1, 2 and 4 times
    assert widths[0] > 0.06 > widths[1]  # 8 such rounds are too few for a 0.06-wide interval, 16 enough
    assert bootstrap_interval(rounds) == bootstrap_interval(list(rounds))  # a fixed seed
    assert bootstrap_interval([1.03] * 10) == (1.03, 1.03)  # rounds that all agree: no width at all


def test_a_slow_round_cancels_in_the_paired_ratios():
    from experiments.bench.report import intervals

    # Round 2 ran 2x slow for everyone: the ratio of medians sees noise, the per-round ratios do not.
    res = {
        "ratios": {"fit_best": "fit_spe1"},
        "variants": {
            "ours": {"chunk_seconds": [1.0, 2.0, 1.0]},
            "limit": {"chunk_seconds": [0.9, 1.8, 0.9]},
            "orbit": {"chunk_seconds": [1.1, 2.2, 1.1]},
            "fit_spe1": {"chunk_seconds": []},
        },
    }
    paired = intervals(res)
    assert paired["ours_over_limit"]["geomean"] == pytest.approx(0.9)
    orbit = paired["ours_over_orbit"]
    assert (orbit["geomean"], orbit["low"], orbit["high"]) == pytest.approx((1.1, 1.1, 1.1))
    assert orbit["verdict"] == "ahead" and "ours_over_fit_best" not in paired


def _children(pid: int) -> set[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return {int(p) for p in f.read().split()}
    except OSError:
        return set()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL])
def test_a_bench_that_is_killed_leaves_no_worker_behind(signum):
    """SIGTERM: the parent ends its workers (stopped ones too) and exits 143; SIGKILL: the kernel kills
    them (they die with their parent)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "experiments.bench", *TINY, "--variants=limit,ours", "--repeats=500"],
        cwd=REPO,
        env=subprocess_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    workers: set[int] = set()
    try:
        for line in proc.stdout:  # both workers are up, and at least one of them is stopped, when rounds run
            workers |= _children(proc.pid)
            if line.lstrip().startswith("round 1 "):
                break
        assert len(workers) == 2, workers
        proc.send_signal(signum)
        proc.wait(timeout=120)
        deadline = time.monotonic() + 60
        while any(_alive(pid) for pid in workers) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(_alive(pid) for pid in workers), workers
        assert proc.returncode == (143 if signum == signal.SIGTERM else -signal.SIGKILL)
    finally:
        proc.kill()
        for pid in workers:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait()


def test_the_epoch_order_baseline_takes_the_pipelines_arguments_and_gives_every_example_once_an_epoch():
    """`ours_epoch_order` replaces the pipeline's index batches with its own: a keyword the pipeline gains
    (bucketing did) must reach it, or the variant fails to start while the default ones run."""
    import inspect

    from experiments.bench import epoch_order
    from trainer.data import pipeline

    theirs = inspect.signature(pipeline.shuffled_index_batches).parameters
    assert list(inspect.signature(epoch_order.epoch_permutation_batches).parameters) == list(theirs)
    flat = np.concatenate(list(epoch_order.epoch_permutation_batches(10, 4, seed=1).take(5).as_numpy_iterator()))
    assert sorted(flat[:10]) == list(range(10)) and sorted(flat[10:20]) == list(range(10))
    assert flat[:10].tolist() != flat[10:20].tolist()  # another permutation each epoch
