"""`python -m trainer.bench`: runs end to end and reports every field; no timing is asserted."""
from __future__ import annotations

import json

from tests.support import run_module

FIELDS = ("steps_per_sec", "examples_per_sec", "steps_per_sec_min_max", "chunk_seconds", "time_to_first_step_s",
          "first_call_steps", "compile_count", "peak_rss_mib", "status")


def test_bench_runs_end_to_end_and_writes_every_field(tmp_path):
    out, report = tmp_path / "bench.json", tmp_path / "bench.md"
    proc = run_module(
        "trainer.bench", "--gin_file=gin/single.gin", "--gin_bindings=train.model_fn=@mlp",
        "--gin_bindings=train.global_batch_size=32", "--gin_bindings=train.steps_per_loop=5",
        "--gin_bindings=train.log_every_steps=5", "--gin_bindings=train.checkpoint_every_steps=10",
        "--steps=8", "--repeats=2", "--fit_steps_per_execution=5", f"--json={out}", f"--report={report}",
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert set(result["variants"]) == {"limit", "ours", "fit_spe5"}
    for name, variant in result["variants"].items():
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
    for key in ("ours_over_limit", "ours_over_fit_spe1", "ours_over_fit_best", "rss_ours_over_fit"):
        assert key in result["ratios"]
    assert result["ratios"]["fit_best"] == "fit_spe5" and result["ratios"]["ours_over_fit_best"] > 0
    assert result["machine"]["cores"] >= 1 and result["machine"]["tensorflow"]
    assert len(result["load_average"]["before"]) == 3
    assert "ours/limit" in proc.stdout and "ours (trainer.train + hooks)" in proc.stdout
    assert report.read_text().count("| ours (trainer.train + hooks) |") == 1


def test_table_says_where_fit_cannot_run():
    from trainer import bench, data

    settings = {"strategy": "multi_worker_mirrored", "global_batch_size": 64, "steps_per_loop": 10,
                "log_every_steps": 100, "checkpoint_every_steps": 200, "jit_compile": False,
                "mixed_precision": None, "data_source": data.Digits(), "model_fn": len}
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
