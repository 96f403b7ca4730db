"""What a parity comparison found: a text table with a verdict line, or a markdown section (`--report`)."""

from __future__ import annotations

import dataclasses

from trainer.errors import UserError


def max_abs_difference(a: list, b: list) -> float:
    """The largest |a - b| over every element of two lists of weight arrays (in float64)."""
    if len(a) != len(b) or any(x.shape != y.shape for x, y in zip(a, b)):
        raise UserError(
            "the two models have different weights (count or shapes); model_fn must build the same model on both sides"
        )
    return max((float(abs(x.astype("float64") - y.astype("float64")).max()) for x, y in zip(a, b) if x.size), default=0)


def describe(settings, replicas: int) -> str:
    """`<strategy>, N replica(s), global batch B[, <precision>][, XLA]`: the title's start."""
    extras = [settings.mixed_precision if settings.mixed_precision not in (None, "float32") else None]
    extras += ["XLA" if settings.jit_compile else None]
    return f"{settings.strategy}, {replicas} replica(s), global batch {settings.global_batch_size}" + "".join(
        f", {e}" for e in extras if e
    )


class _Report:
    """The text and markdown forms of a subclass's `table()`, `summary(markdown)` and `verdict()`."""

    title: str
    note = ""
    first_alignment = "---:"

    def text(self) -> str:
        table = self.table()
        widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
        aligned = ["  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in table]
        note = [f"({self.note})"] if self.note else []
        return "\n".join([self.title, *note, *aligned, self.summary(False), self.verdict()])

    def markdown(self, command: str) -> str:
        header, *rows = self.table()
        note = [self.note + ".", ""] if self.note else []
        lines = [f"## {self.title}", "", f"`{command}`", "", *note, "| " + " | ".join(header) + " |"]
        lines += ["|" + self.first_alignment + "|" + "---:|" * (len(header) - 1)]
        lines += ["| " + " | ".join(row) + " |" for row in rows]
        return "\n".join([*lines, "", self.summary(True), "", f"**{self.verdict()}**", ""])


@dataclasses.dataclass
class Outcome(_Report):
    """Per-step losses of several runs (the first is the reference) and the largest weight difference."""

    title: str
    columns: list[str]
    losses: list[list[float]]
    max_dw: float
    atol: float
    num_params: int
    seconds: float = 0.0

    @classmethod
    def of_runs(cls, title: str, columns: list[str], runs: list[dict], atol: float) -> Outcome:
        """From the results of worker processes (trainer/tools/parity/sides.py), the first the reference."""
        reference = runs[0]["final"]
        max_dw = max(max_abs_difference(reference, run["final"]) for run in runs[1:])
        return cls(title, columns, [run["losses"] for run in runs], max_dw, atol, sum(w.size for w in reference))

    @property
    def max_dloss(self) -> float:
        return max(abs(a - b) for other in self.losses[1:] for a, b in zip(self.losses[0], other))

    @property
    def passed(self) -> bool:
        return self.max_dw <= self.atol and self.max_dloss <= self.atol

    def table(self) -> list[list[str]]:
        rows = [["step", *(f"{c} loss" for c in self.columns), "diff"]]
        for step, values in enumerate(zip(*self.losses), start=1):
            diff = max((v - values[0] for v in values[1:]), key=abs)
            rows.append([str(step), *(f"{v:.9f}" for v in values), f"{diff:+.2e}"])
        return rows

    def summary(self, markdown: bool) -> str:
        if markdown:
            return f"max \\|weight difference\\| {self.max_dw:.2e} over {self.num_params} parameters; " + (
                f"{self.seconds:.0f} s on this machine"
            )
        return (
            f"max |weight difference| {self.max_dw:.2e} over {self.num_params} parameters; "
            f"max |loss difference| {self.max_dloss:.2e}; {self.seconds:.0f} s"
        )

    def verdict(self) -> str:
        word, relation = ("PASS", "<=") if self.passed else ("FAIL", "exceeds")
        return (
            f"{word}: max |dw| {self.max_dw:.2e}, max |dloss| {self.max_dloss:.2e} {relation} atol "
            f"{self.atol:g} after {len(self.losses[0])} steps ({self.title})"
        )


@dataclasses.dataclass
class MetricOutcome(_Report):
    """Asynchronous training on both sides: the final eval `metric` compared, not weights. `ours` and `fit`
    hold 'optimizer iterations', 'last train loss' and the eval step's outputs."""

    title: str
    steps: int
    tolerance: float
    ours: dict
    fit: dict
    metric: str = "accuracy"
    seconds: float = 0.0
    first_alignment = "---"

    @property
    def note(self) -> str:
        return (
            "updates from several workers are asynchronous and land in a different order on every run, so "
            f"weights are not comparable; compared: final eval {self.metric}"
        )

    @property
    def difference(self) -> float:
        return abs(self.ours[self.metric] - self.fit[self.metric])

    @property
    def passed(self) -> bool:
        return self.difference <= self.tolerance

    def table(self) -> list[list[str]]:
        names = {"optimizer iterations": "optimizer iterations", "last train loss": "train loss (last loop)"}
        names |= {k: f"eval {k}" for k in self.ours if k not in names and k != "num_examples"}
        rows = [["metric", "ours", "tf_keras fit", "diff"]]
        for key, name in names.items():
            a, b = self.ours[key], self.fit[key]
            exact = isinstance(a, int)
            rows.append(
                [name, *(str(v) if exact else f"{v:.4f}" for v in (a, b)), f"{b - a:+d}" if exact else f"{b - a:+.4f}"]
            )
        return rows

    def summary(self, markdown: bool) -> str:
        return f"{self.seconds:.0f} s" + (" on this machine" if markdown else "")

    def verdict(self) -> str:
        word, relation = ("PASS", "<=") if self.passed else ("FAIL", "exceeds")
        return (
            f"{word}: |eval {self.metric} difference| {self.difference:.4f} {relation} "
            f"{self.tolerance:g} after {self.steps} steps ({self.title})"
        )
