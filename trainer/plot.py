"""Learning curves from `metrics.jsonl`: `python -m trainer.plot --model_dir=D [--model_dir=E ...] [--out=curves.png]`.

Three panels against the global step (train loss, eval loss, eval accuracy), each run one colour labelled by
its directory name, drawn without a display; each run read as one history (a step trained again after a
resume drawn once, at its last value). Needs matplotlib (`pip install -e '.[plot]'`).
"""

from __future__ import annotations

import os
from typing import Callable, Sequence

from absl import app, flags

from trainer.cli import fail, parse_flags
from trainer.errors import UserError
from trainer.files.metrics_log import read_history  # no TensorFlow

PANELS = (("train", "loss", "train loss"), ("eval", "loss", "eval loss"), ("eval", "accuracy", "eval accuracy"))

FLAGS = flags.FLAGS


def define_flags() -> None:
    """Only when run as a program: importing this module must not claim trainer.main's `--model_dir`."""
    flags.DEFINE_multi_string("model_dir", [], "A run's model_dir (repeat to overlay several runs).")
    flags.DEFINE_string("out", "curves.png", "Where to write the PNG.")
    flags.DEFINE_string("title", None, "Figure title (default: none).")


def run_labels(model_dirs: Sequence[str]) -> list[str]:
    """Directory names; where two are equal, enough parent directories to tell them apart."""
    parts = [os.path.normpath(os.path.abspath(d)).split(os.sep) for d in model_dirs]
    depth = 1
    while True:
        labels = [os.sep.join(p[-depth:]) for p in parts]
        if len(set(labels)) == len(labels) or depth >= max(len(p) for p in parts):
            return labels
        depth += 1


def build_figure(runs: dict[str, list[dict]], title: str | None = None):
    """A matplotlib Figure of the runs' curves (label -> `read_history` records) and its legend labels."""
    from matplotlib.figure import Figure  # no pyplot: no display, no global state

    figure = Figure(figsize=(15, 4.5), layout="constrained")
    axes = figure.subplots(1, len(PANELS))
    colours = [f"C{i % 10}" for i in range(len(runs))]
    handles = {}
    for ax, (split, metric, name) in zip(axes, PANELS):
        for colour, (label, records) in zip(colours, runs.items()):
            points = sorted((r["step"], r[metric]) for r in records if r.get("split") == split and metric in r)
            if points:
                marker = "o" if split == "eval" or len(points) < 50 else None
                (line,) = ax.plot(*zip(*points), color=colour, label=label, markersize=3, marker=marker)
                handles.setdefault(label, line)
        ax.set_title(name)
        ax.set_xlabel("step")
        ax.grid(True, alpha=0.3)
        if not ax.lines:
            ax.text(0.5, 0.5, f"no {split} records", ha="center", va="center", transform=ax.transAxes)
    labels = [label for label in runs if label in handles]
    figure.legend(
        [handles[label] for label in labels], labels, loc="outside lower center", ncols=min(len(labels), 4) or 1
    )
    if title:
        figure.suptitle(title)
    return figure, labels


def numbers_only(runs: dict[str, list[dict]], say: Callable[[str], None] = print) -> dict[str, list[dict]]:
    """The runs with every plotted value that is no number (`"loss": "n/a"`) left out, each said in one line:
    matplotlib would draw strings as categories, in file order, on the y axis."""
    kept = {}
    for label, records in runs.items():
        kept[label] = []
        for record in records:
            bad = [m for _, m, _ in PANELS if m in record and not _is_number(record[m])]
            for metric in dict.fromkeys(bad):
                say(
                    f"warning: {label}: metrics.jsonl's {record.get('split')} record of step {record.get('step')} has "
                    f"{metric} {record[metric]!r}, no number; left out of the plot"
                )
            kept[label].append({k: v for k, v in record.items() if k not in bad})
    return kept


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def plot(model_dirs: Sequence[str], out: str, title: str | None = None) -> list[str]:
    """Writes the PNG of the runs' curves to `out`; returns the legend labels."""
    if not model_dirs:
        raise UserError("no --model_dir given; pass one or more run directories")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise UserError("trainer.plot needs matplotlib: pip install -e '.[plot]' (or pip install matplotlib)") from None
    runs = numbers_only(dict(zip(run_labels(model_dirs), (read_history(d) for d in model_dirs))))
    figure, labels = build_figure(runs, title)
    directory = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(directory):
        raise UserError(f"--out {out}: directory {directory} does not exist")
    figure.savefig(out, format="png", dpi=100)
    return labels


def run(argv: list[str]) -> None:
    if len(argv) > 1:
        fail(f"unexpected arguments {' '.join(argv[1:])}; use --model_dir=DIR (repeated) and --out=FILE")
    try:
        labels = plot(FLAGS.model_dir, FLAGS.out, FLAGS.title)
    except UserError as e:
        fail(str(e))
    print(f"wrote {FLAGS.out}: {', '.join(labels)}")


def main() -> None:
    define_flags()
    app.run(run, flags_parser=parse_flags)


if __name__ == "__main__":
    main()
