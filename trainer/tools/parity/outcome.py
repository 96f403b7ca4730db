"""What a parity comparison found, as a text table with a verdict line and as a markdown section."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from trainer.errors import UserError


def max_abs_difference(a: list, b: list) -> float:
    """The largest |a - b| over every element of two lists of weight arrays (in float64)."""
    if len(a) != len(b) or any(x.shape != y.shape for x, y in zip(a, b)):
        raise UserError(
            "the two models have different weights (count or shapes); model_fn must build the same model on both sides"
        )
    return max(
        (float(abs(x.astype("float64") - y.astype("float64")).max()) for x, y in zip(a, b) if x.size), default=0.0
    )


def describe(settings: Mapping[str, Any], replicas: int) -> str:
    """`<strategy>, N replica(s), global batch B[, <precision>][, XLA]`: the title's start."""
    precision = settings.mixed_precision
    extras = [
        e
        for e in (precision if precision not in (None, "float32") else None, "XLA" if settings.jit_compile else None)
        if e
    ]
    return f"{settings.strategy}, {replicas} replica(s), global batch {settings.global_batch_size}" + "".join(
        f", {e}" for e in extras
    )


def _aligned(table: list[list[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    return ["  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in table]


@dataclasses.dataclass
class Outcome:
    """Per-step losses of several runs (the first is the reference) and the weight difference."""

    title: str
    columns: list[str]
    losses: list[list[float]]
    max_dw: float
    atol: float
    num_params: int
    seconds: float = 0.0

    @property
    def max_dloss(self) -> float:
        reference = self.losses[0]
        return max(abs(a - b) for other in self.losses[1:] for a, b in zip(reference, other))

    @property
    def passed(self) -> bool:
        return self.max_dw <= self.atol and self.max_dloss <= self.atol

    def rows(self) -> list[list[str]]:
        rows = []
        for step, values in enumerate(zip(*self.losses), start=1):
            diff = max((v - values[0] for v in values[1:]), key=abs)
            rows.append([str(step), *(f"{v:.9f}" for v in values), f"{diff:+.2e}"])
        return rows

    def header(self) -> list[str]:
        return ["step", *(f"{c} loss" for c in self.columns), "diff"]

    def verdict(self) -> str:
        word, relation = ("PASS", "<=") if self.passed else ("FAIL", "exceeds")
        return (
            f"{word}: max |dw| {self.max_dw:.2e}, max |dloss| {self.max_dloss:.2e} {relation} atol "
            f"{self.atol:g} after {len(self.losses[0])} steps ({self.title})"
        )

    def text(self) -> str:
        lines = _aligned([self.header(), *self.rows()])
        lines.append(
            f"max |weight difference| {self.max_dw:.2e} over {self.num_params} parameters; "
            f"max |loss difference| {self.max_dloss:.2e}; {self.seconds:.0f} s"
        )
        return "\n".join([self.title, *lines, self.verdict()])

    def markdown(self, command: str) -> str:
        table = [self.header(), *self.rows()]
        lines = [
            f"## {self.title}",
            "",
            f"`{command}`",
            "",
            "| " + " | ".join(table[0]) + " |",
            "|" + "---:|" * len(table[0]),
        ]
        lines += ["| " + " | ".join(row) + " |" for row in table[1:]]
        lines += [
            "",
            f"max \\|weight difference\\| {self.max_dw:.2e} over {self.num_params} parameters; "
            f"{self.seconds:.0f} s on this machine",
            "",
            f"**{self.verdict()}**",
            "",
        ]
        return "\n".join(lines)


@dataclasses.dataclass
class MetricOutcome:
    """Asynchronous training on both sides: final metrics compared, not weights.

    `ours` and `fit` hold 'optimizer iterations', 'last train loss' and the eval step's
    outputs; `metric` names the eval output that decides (gin: `parity.metric`).
    """

    title: str
    steps: int
    tolerance: float
    ours: dict
    fit: dict
    metric: str = "accuracy"
    seconds: float = 0.0

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

    def rows(self) -> list[list[str]]:
        names = {"optimizer iterations": "optimizer iterations", "last train loss": "train loss (last loop)"}
        names |= {k: f"eval {k}" for k in self.ours if k not in names and k != "num_examples"}

        def cell(value) -> str:
            return str(value) if isinstance(value, int) else f"{value:.4f}"

        def diff(a, b) -> str:
            return f"{b - a:+d}" if isinstance(a, int) else f"{b - a:+.4f}"

        return [
            [name, cell(self.ours[k]), cell(self.fit[k]), diff(self.ours[k], self.fit[k])] for k, name in names.items()
        ]

    def verdict(self) -> str:
        word, relation = ("PASS", "<=") if self.passed else ("FAIL", "exceeds")
        return (
            f"{word}: |eval {self.metric} difference| {self.difference:.4f} {relation} "
            f"{self.tolerance:g} after {self.steps} steps ({self.title})"
        )

    def text(self) -> str:
        lines = _aligned([["metric", "ours", "tf_keras fit", "diff"], *self.rows()])
        return "\n".join([self.title, f"({self.note})", *lines, f"{self.seconds:.0f} s", self.verdict()])

    def markdown(self, command: str) -> str:
        lines = [
            f"## {self.title}",
            "",
            f"`{command}`",
            "",
            self.note + ".",
            "",
            "| metric | ours | tf_keras fit | diff |",
            "|---|---:|---:|---:|",
        ]
        lines += ["| " + " | ".join(row) + " |" for row in self.rows()]
        lines += ["", f"{self.seconds:.0f} s on this machine", "", f"**{self.verdict()}**", ""]
        return "\n".join(lines)
