"""trainer.plot: learning curves of several runs in one PNG, labelled by run directory."""

from __future__ import annotations

import os

import pytest

from tests.support import run_module, subprocess_env

pytestmark = pytest.mark.slow  # every test here starts processes or trains for long

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def test_two_runs_overlaid_in_one_png_with_both_labels(profiled_run, trained_single_dir, tmp_path):
    from trainer import plot
    from trainer.files.metrics_log import read_history

    run_a, run_b = profiled_run[0], trained_single_dir
    labels = [os.path.basename(run_a), os.path.basename(run_b)]
    runs = {label: read_history(d) for label, d in zip(labels, (run_a, run_b))}
    figure, legend = plot.build_figure(runs)
    assert legend == labels
    assert [t.get_text() for t in figure.legends[0].get_texts()] == labels
    for ax in figure.axes:  # every panel has a curve of each run
        assert sorted(line.get_label() for line in ax.lines) == sorted(labels), ax.get_title()

    out = tmp_path / "curves.png"
    proc = run_module("trainer.plot", f"--model_dir={run_a}", f"--model_dir={run_b}", f"--out={out}", timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == f"wrote {out}: {', '.join(labels)}"
    data = out.read_bytes()
    assert data.startswith(PNG_SIGNATURE) and len(data) > 10_000


def test_missing_matplotlib_or_run_is_one_line_and_exit_2(tmp_path, profiled_run):
    blocker = tmp_path / "blocked" / "matplotlib"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ImportError('matplotlib is not installed')\n")
    env = subprocess_env()
    env["PYTHONPATH"] = os.pathsep.join([str(blocker.parent), env["PYTHONPATH"]])
    no_matplotlib = run_module(
        "trainer.plot", f"--model_dir={profiled_run[0]}", f"--out={tmp_path / 'x.png'}", env=env, timeout=120
    )
    assert no_matplotlib.returncode == 2
    assert no_matplotlib.stderr.strip().splitlines() == [
        "error: trainer.plot needs matplotlib: pip install -e '.[plot]' (or pip install matplotlib)"
    ]
    missing = run_module("trainer.plot", f"--model_dir={tmp_path / 'nowhere'}", timeout=120)
    assert missing.returncode == 2 and "no metrics.jsonl in" in missing.stderr
    assert not (tmp_path / "x.png").exists()
