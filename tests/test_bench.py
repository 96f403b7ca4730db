"""`python -m trainer.bench`: runs end to end and reports every field; no timing is asserted."""
from __future__ import annotations

import importlib.util
import json
import os

import pytest

from tests.support import run_module, subprocess_env

# The module-scoped fixture below is shared by this file's tests: one worker runs them all.
pytestmark = pytest.mark.xdist_group("bench")

FIELDS = ("steps_per_sec", "examples_per_sec", "steps_per_sec_min_max", "chunk_seconds", "time_to_first_step_s",
          "first_call_steps", "compile_count", "peak_rss_mib", "status")
TINY = ("--gin_file=gin/single.gin", "--gin_bindings=train.model_fn=@mlp", "--gin_bindings=train.global_batch_size=32",
        "--gin_bindings=train.steps_per_loop=5", "--gin_bindings=train.log_every_steps=5",
        "--gin_bindings=train.checkpoint_every_steps=10", "--steps=8")
HAVE_ORBIT = importlib.util.find_spec("orbit") is not None


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory):
    """One tiny run of every variant (orbit where it is installed), shared by the tests below."""
    tmp = tmp_path_factory.mktemp("bench")
    out, report = tmp / "bench.json", tmp / "bench.md"
    proc = run_module("trainer.bench", *TINY, "--mode=train", "--repeats=2", "--fit_steps_per_execution=5",
                      f"--json={out}", f"--report={report}", timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, json.loads(out.read_text()), report.read_text()


def test_bench_runs_end_to_end_and_writes_every_field(bench_run):
    proc, result, report = bench_run
    assert set(result["variants"]) == {"limit", "ours", "orbit", "fit_spe5"}
    for name in ("limit", "ours", "fit_spe5"):
        variant = result["variants"][name]
        assert variant["status"] == "ok", (name, variant)
        for field in FIELDS:
            assert variant[field] is not None, (name, field)
        assert len(variant["chunk_seconds"]) == 2
        assert variant["steps_per_sec"] > 0 and variant["peak_rss_mib"] > 0
    # --steps 8 is rounded up to whole calls of 5: chunks of 10 steps.
    assert result["method"]["steps_per_chunk"] == 10
    assert result["method"]["ours_progress_records_per_chunk"] == 2 and result["method"]["ours_checkpoints_per_chunk"] == 1
    # Our loop ran calls of 1, 5 and 4 steps (the first step alone, then up to hook boundaries): one trace.
    assert result["ours_compile_count"] == 1 and result["limit_compile_count"] == 1
    assert result["variants"]["fit_spe5"]["first_call_steps"] == 5
    for key in ("ours_over_limit", "ours_over_fit_spe1", "ours_over_fit_best", "rss_ours_over_fit", "ours_over_orbit",
                "first_step_ours_over_fit", "first_step_ours_over_orbit"):
        assert key in result["ratios"]
    assert result["ratios"]["fit_best"] == "fit_spe5" and result["ratios"]["ours_over_fit_best"] > 0
    assert result["machine"]["cores"] >= 1 and result["machine"]["tensorflow"]
    assert len(result["load_average"]["before"]) == 3
    assert "ours/limit" in proc.stdout and "ours/orbit" in proc.stdout and "ours (trainer.train + hooks)" in proc.stdout
    assert report.count("| ours (trainer.train + hooks) |") == 1


@pytest.mark.skipif(not HAVE_ORBIT, reason="orbit is not installed (pip install --no-deps tf-models-official==2.20.0); "
                                           "its absence is tested below")
def test_orbit_variant_trains_beside_ours(bench_run):
    _, result, report = bench_run
    orbit = result["variants"]["orbit"]
    assert orbit["status"] == "ok", orbit
    for field in FIELDS:
        assert orbit[field] is not None, field
    assert len(orbit["chunk_seconds"]) == 2 and orbit["first_call_steps"] == 1
    assert result["orbit_compile_count"] == 1  # Orbit's loop called with 1, then 5-step calls: one trace
    assert result["ratios"]["ours_over_orbit"] > 0 and result["ratios"]["first_step_ours_over_orbit"] > 0
    assert "| Orbit Controller + StandardTrainer |" in report


def test_without_orbit_the_variant_is_one_line_and_the_rest_runs(tmp_path):
    hidden = tmp_path / "hide"
    hidden.mkdir()
    (hidden / "orbit.py").write_text("raise ImportError('hidden by the test')\n")
    env = subprocess_env()
    env["PYTHONPATH"] = os.pathsep.join([str(hidden), env["PYTHONPATH"]])
    out = tmp_path / "bench.json"
    proc = run_module("trainer.bench", *TINY, "--repeats=1", "--variants=ours,orbit", f"--json={out}", env=env,
                      timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["variants"]["ours"]["status"] == "ok"
    assert result["variants"]["orbit"]["status"] == "cannot_run"
    assert result["ratios"]["ours_over_orbit"] is None
    lines = [line for line in proc.stdout.splitlines() if line.startswith("Orbit Controller")]
    assert len(lines) == 1 and "--install_orbit" in lines[0] and "pip install --no-deps" in lines[0], proc.stdout


def test_unknown_mode_is_one_error_line():
    proc = run_module("trainer.bench", "--gin_file=gin/single.gin", "--mode=fast", timeout=120)
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "--mode" in errors[0], proc.stderr[-2000:]


def test_table_says_where_fit_cannot_run():
    from trainer import bench, data
    from trainer.run.settings import Settings

    settings = Settings(strategy="multi_worker_mirrored", global_batch_size=64, steps_per_loop=10,
                        log_every_steps=100, checkpoint_every_steps=200, jit_compile=False,
                        mixed_precision=None, data_source=data.Digits(), model_fn=len)
    variants = bench.plan_variants(settings, ["limit", "ours", "fit"], [1, 10])
    assert [v.status for v in variants] == ["ok", "ok", "cannot_run", "cannot_run"]
    for v in variants[:2]:
        v.chunks, v.first_step_s, v.compile_count, v.peak_rss_mib = [2.0, 2.2, 2.1], 5.0, 1, 700.0
    result = bench.results(settings, variants, chunk=200, warmup=200, repeats=3, load_before=(0.5, 0, 0),
                           load_after=(0.6, 0, 0), command="python -m trainer.bench")
    assert result["ratios"]["ours_over_fit_best"] is None and result["ratios"]["ours_over_limit"] == 1.0
    text = bench.text_table(result)
    assert "cannot run: Keras 3 fit cannot run under MultiWorkerMirroredStrategy" in text
    assert "cannot run" in bench.markdown(result)


def test_paired_ratios_pair_each_round_so_a_slow_round_cancels():
    from trainer.tools.bench.report import paired_ratios

    # Round 2 ran 2x slow for everyone: the ratio of medians sees noise, the per-round ratios do not.
    res = {"ratios": {"fit_best": "fit_spe1"}, "variants": {
        "ours": {"chunk_seconds": [1.0, 2.0, 1.0]},
        "limit": {"chunk_seconds": [0.9, 1.8, 0.9]},
        "orbit": {"chunk_seconds": [1.1, 2.2, 1.1]},
        "fit_spe1": {"chunk_seconds": []},
    }}
    paired = paired_ratios(res)
    assert paired["ours_over_limit"]["median"] == pytest.approx(0.9)
    assert paired["ours_over_orbit"] == {"median": pytest.approx(1.1), "min": pytest.approx(1.1),
                                         "max": pytest.approx(1.1)}
    assert paired["ours_over_fit_best"] is None
