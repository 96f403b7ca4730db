"""How many rounds a run measures: `--repeats` at least, then one more at a time while an interval the
run's claims rest on (ours over the bare step, over Orbit, over fit's best) is wider than `--max_width`,
up to `--max_repeats`.

On a shared VM the per-round ratios of one config spread by a few percent in one run and more in
another, so a fixed count of rounds gives a 0.03-wide interval in one comparison and a 0.07-wide one
in the next. Adding rounds until every headline interval is narrow enough spends the machine's time
where the noise is. The rule looks at the widths only, never at where an interval lies: stopping when a
verdict came out would choose the verdict; the width says nothing about it.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from experiments.bench.plan import Variant
from experiments.bench.report import fastest_fit, intervals

# The comparisons whose widths decide the count (key in the report's "intervals", label in its lines).
HEADLINE = (
    ("ours_over_limit", "ours/limit"),
    ("ours_over_orbit", "ours/orbit"),
    ("ours_over_fit_best", "ours/fit best"),
)


def widest(variants: list[Variant], chunk: int) -> tuple[str, float] | None:
    """The headline comparison with the widest 95% interval over the rounds so far, and its width; None
    when none of them can be computed (a variant missing, or failed: its rounds end where it failed)."""
    ok = [v for v in variants if v.status == "ok"]
    fit = fastest_fit(ok, chunk)
    found = intervals(
        {
            "variants": {v.name: {"chunk_seconds": v.chunks} for v in ok},
            "ratios": {"fit_best": fit.name if fit else None},
        }
    )
    widths = [(label, found[key]["width"]) for key, label in HEADLINE if key in found]
    return max(widths, key=lambda w: w[1]) if widths else None


@dataclasses.dataclass
class Rounds:
    """The rule for one run (`least` rounds, then up to `most` while the widest headline interval is wider
    than `max_width`), and, once measured, how many rounds ran and why they ended."""

    least: int
    most: int
    max_width: float
    done: int = 0
    ended: str = ""

    def __post_init__(self):
        self.most = max(self.most, self.least)

    def enough(self, variants: list[Variant], chunk: int, done: int, print_fn: Callable[[str], None]) -> bool:
        """Whether the `done` rounds measured so far are enough; says why when they are not, after `least`."""
        self.done = done
        if done < self.least:
            return False
        found = widest(variants, chunk)
        if found is None:
            self.ended = "no headline comparison ran"
            return True
        label, width = found
        if width <= self.max_width:
            self.ended = f"every headline interval at most {self.max_width:g} wide (the widest: {label}, {width:.3f})"
            return True
        if done >= self.most:
            self.ended = f"{label}'s interval still {width:.3f} wide after the most rounds allowed ({self.most})"
            return True
        print_fn(
            f"after round {done}: {label}'s 95% interval is {width:.3f} wide, more than {self.max_width:g}: "
            f"one more round (at most {self.most})"
        )
        return False

    def summary(self) -> dict:
        return {
            "rounds": self.done,
            "least_rounds": self.least,
            "most_rounds": self.most,
            "max_width": self.max_width,
            "rounds_ended": self.ended,
        }
