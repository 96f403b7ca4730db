"""trainer.plot: learning curves of several runs in one PNG, labelled by run directory."""

from __future__ import annotations

import json
import os

import pytest

from tests.support import run_module, subprocess_env

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
@pytest.mark.xdist_group("single_runs")
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
    env = subprocess_env(full=True)  # with matplotlib
    proc = run_module(
        "trainer.plot", f"--model_dir={run_a}", f"--model_dir={run_b}", f"--out={out}", env=env, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == f"wrote {out}: {', '.join(labels)}"
    data = out.read_bytes()
    assert data.startswith(PNG_SIGNATURE) and len(data) > 10_000


@pytest.mark.slow
@pytest.mark.xdist_group("single_runs")
def test_missing_matplotlib_or_run_is_one_line_and_exit_2(tmp_path, profiled_run):
    blocker = tmp_path / "blocked" / "matplotlib"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ImportError('matplotlib is not installed')\n")
    env = subprocess_env(full=True)  # matplotlib installed, and blocked here
    env["PYTHONPATH"] = os.pathsep.join([str(blocker.parent), env["PYTHONPATH"]])
    no_matplotlib = run_module(
        "trainer.plot", f"--model_dir={profiled_run[0]}", f"--out={tmp_path / 'x.png'}", env=env, timeout=120
    )
    assert no_matplotlib.returncode == 2
    assert no_matplotlib.stderr.strip().splitlines() == [
        "error: trainer.plot needs matplotlib: pip install -e '.[plot]' (or pip install matplotlib)"
    ]
    missing = run_module(
        "trainer.plot", f"--model_dir={tmp_path / 'nowhere'}", env=subprocess_env(full=True), timeout=120
    )
    assert missing.returncode == 2 and "no metrics.jsonl in" in missing.stderr
    assert not (tmp_path / "x.png").exists()


def _write_history(model_dir, lines: list[dict]) -> str:
    os.makedirs(model_dir)
    with open(os.path.join(model_dir, "metrics.jsonl"), "w") as f:
        f.writelines(json.dumps(line) + "\n" for line in lines)
    return str(model_dir)


def test_runs_of_one_name_are_told_apart_and_each_panel_draws_the_history(tmp_path):
    """Curves from `metrics.jsonl` as the contract writes it, without a run: a step trained again
    after a resume is drawn once; a run without eval records says so in the eval panels."""
    from trainer import plot

    first = _write_history(
        tmp_path / "a" / "run",
        [
            {"step": 10, "split": "train", "loss": 2.0},
            {"step": 20, "split": "train", "loss": 9.0},
            {"step": 10, "split": "resumed"},
            {"step": 20, "split": "train", "loss": 1.0},
            {"step": 20, "split": "eval", "loss": 1.5, "accuracy": 0.5},
        ],
    )
    second = _write_history(tmp_path / "b" / "run", [{"step": 10, "split": "train", "loss": 3.0}])
    out = tmp_path / "curves.png"
    assert plot.plot([first, second], str(out), title="lr") == ["a/run", "b/run"]
    assert out.read_bytes().startswith(PNG_SIGNATURE)
    assert plot.run_labels(["x/run", "y/other"]) == ["run", "other"]

    runs = {"a/run": plot.read_history(first), "b/run": plot.read_history(second)}
    figure, labels = plot.build_figure(runs)
    train, eval_loss, eval_accuracy = figure.axes
    assert [list(line.get_ydata()) for line in train.lines] == [[2.0, 1.0], [3.0]]
    assert [line.get_label() for line in eval_loss.lines] == ["a/run"] and labels == ["a/run", "b/run"]
    assert [list(line.get_ydata()) for line in eval_accuracy.lines] == [[0.5]]
    empty, _ = plot.build_figure({"b/run": runs["b/run"]})
    assert [t.get_text() for t in empty.axes[1].texts] == ["no eval records"]


def test_no_run_or_no_directory_for_the_png_is_a_user_error(tmp_path):
    from trainer import plot
    from trainer.errors import UserError

    run = _write_history(tmp_path / "run", [{"step": 1, "split": "train", "loss": 1.0}])
    with pytest.raises(UserError, match="no --model_dir given; pass one or more run directories"):
        plot.plot([], str(tmp_path / "x.png"))
    with pytest.raises(UserError, match=f"--out {tmp_path}/no/x.png: directory {tmp_path}/no does not exist"):
        plot.plot([run], str(tmp_path / "no" / "x.png"))
    with pytest.raises(UserError, match="no metrics.jsonl in"):
        plot.plot([str(tmp_path)], str(tmp_path / "x.png"))


def test_a_value_that_is_no_number_is_left_out_with_a_word(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from trainer import plot

    run = _write_history(
        tmp_path / "run",
        [
            {"step": 10, "split": "train", "loss": 2.0},
            {"step": 20, "split": "train", "loss": "n/a"},
            {"step": 30, "split": "train", "loss": 1.0},
        ],
    )
    assert plot.plot([run], str(tmp_path / "x.png")) == ["run"]
    assert capsys.readouterr().out.splitlines() == [
        "warning: run: metrics.jsonl's train record of step 20 has loss 'n/a', no number; left out of the plot"
    ]
    figure, _ = plot.build_figure(plot.numbers_only({"run": plot.read_history(run)}, lambda line: None))
    assert [list(line.get_ydata()) for line in figure.axes[0].lines] == [[2.0, 1.0]]  # the loss that fell
