"""What a bench run measures: the variants, and the chunks every variant runs."""

from __future__ import annotations

import dataclasses
import math
import statistics

from experiments.bench import orbit
from trainer.errors import UserError


def fit_cannot_run(mode) -> str:
    """Why Keras 3 fit cannot run in a multi-worker mode (its known issues)."""
    if mode.synchronous:
        return "Keras 3 fit cannot run under MultiWorkerMirroredStrategy (keras-team/keras 20585)"
    return "Keras 3 fit cannot run under ParameterServerStrategy (keras-team/keras 18624)"


# What each variant does between its steps in a measured chunk, besides running them (the table's
# "work per chunk" counts what its worker did, measured; this says what kind of work that is).
WORK = {
    "limit": "none: the step on one batch held on the device(s)",
    "limit_input": "next(iterator) of the config's distributed input, nothing else",
    "ours": "progress records (metrics.jsonl, TensorBoard) and checkpoints, saved in line",
    "ours_async": "progress records and checkpoints, written on a background thread",
    "ours_tf_data": "as ours; the train data through the tf.data pipeline, not held on the devices",
    "ours_epoch_order": "as ours_tf_data; in-memory data in whole-epoch permutations, not read by index",
    "orbit": "summaries (TensorBoard: the means at log boundaries, its steps/s and a flush after every call) "
    "and checkpoints, saved in line",
    "fit": "none: no callbacks but the pacer (fit's History runs on its own thread)",
}


@dataclasses.dataclass
class Variant:
    """One measured variant and what came back from its worker."""

    name: str
    label: str
    role: str
    fit_spe: int = 0
    status: str = "ok"  # ok | cannot_run | failed
    reason: str = ""
    first_step_s: float | None = None
    first_call_steps: int = 1
    chunks: list[float] = dataclasses.field(default_factory=list)  # seconds per measured chunk
    cpu: list[float] = dataclasses.field(default_factory=list)  # the worker's CPU seconds per measured chunk
    other_cpu: list[float] = dataclasses.field(default_factory=list)  # the rest of the machine's, per chunk
    steal: list[float] = dataclasses.field(default_factory=list)  # CPU seconds the hypervisor stole, per chunk
    page_faults: list[int] = dataclasses.field(default_factory=list)  # the worker's page faults per chunk
    work: list[dict] = dataclasses.field(default_factory=list)  # what the worker did per chunk (saves, records)
    step_seconds: list[float] = dataclasses.field(default_factory=list)  # of each chunk, in compiled step calls
    waiting_cpu_s: float = 0.0  # CPU the worker used while other variants were measured
    warmup_s: float | None = None
    compile_count: int | None = None
    peak_rss_mib: float | None = None
    peak_gpu_mib: float | None = None
    log_path: str = ""
    machine: dict | None = None

    def steps_per_sec(self, steps: int) -> float | None:
        return steps / statistics.median(self.chunks) if self.chunks else None

    def spread(self, steps: int) -> tuple[float, float] | None:
        return (steps / max(self.chunks), steps / min(self.chunks)) if self.chunks else None


# In the order they run in a forward round: ours between the limit and Orbit, fit next to Orbit, so that the
# chunks compared most run close together in time.
VARIANTS = ("limit_input", "ours_async", "ours_tf_data", "limit", "ours", "orbit", "fit")
# On request only: ours with the order in-memory data had before it was read by index (what that costs).
OPTIONAL_VARIANTS = ("ours_epoch_order",)


def plan_variants(settings, names: list[str], fit_spes: list[int]) -> list[Variant]:
    """The variants `names` ask for (fit once per steps_per_execution), fit marked where it cannot run,
    orbit where it is not installed."""
    variants = []
    for name in names:
        if name == "limit":
            variants.append(Variant("limit", "limit (bare step, batch in memory)", "limit"))
        elif name == "limit_input":
            variants.append(Variant("limit_input", "limit + input (bare step on next(iterator))", "limit_input"))
        elif name == "ours":
            variants.append(Variant("ours", "ours (trainer.train + hooks)", "ours"))
        elif name == "ours_async":
            variants.append(Variant("ours_async", "ours, train.async_checkpoint = True", "ours_async"))
        elif name == "ours_tf_data":
            variants.append(Variant("ours_tf_data", "ours, train data through tf.data", "ours_tf_data"))
        elif name == "ours_epoch_order":
            variants.append(Variant("ours_epoch_order", "ours, epoch-permutation order", "ours_epoch_order"))
        elif name == "orbit":
            variant = Variant("orbit", "Orbit Controller + StandardTrainer", "orbit")
            if reason := orbit.missing():
                variant.status, variant.reason = "cannot_run", reason
            variants.append(variant)
        elif name == "fit":
            for spe in fit_spes:
                variant = Variant(
                    f"fit_spe{spe}", f"Keras fit, steps_per_execution {spe}", "fit", fit_spe=spe, first_call_steps=spe
                )
                if settings.mode.multi_worker:
                    variant.status, variant.reason = "cannot_run", fit_cannot_run(settings.mode)
                variants.append(variant)
        else:
            raise UserError(f"unknown --variants entry {name!r}: use {', '.join(VARIANTS + OPTIONAL_VARIANTS)}")
    return variants


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Measured rounds of one `chunk`-step chunk per variant after a warm-up to step `warmup`: `repeats`
    rounds, and up to `max_repeats` while the intervals are too wide (0: exactly `repeats`); `total` steps
    at most. A round's chunks are run in turns of `turn` steps (a divisor of `chunk`; 0: the whole chunk at
    once): every variant runs one turn, then every variant the next, and so on, so the chunks of one round
    are spread alike over the same stretch of time."""

    chunk: int
    warmup: int
    repeats: int
    turn: int = 0
    max_repeats: int = 0

    def __post_init__(self):
        if self.turn and self.chunk % self.turn:
            raise ValueError(f"a turn of {self.turn} steps does not divide a chunk of {self.chunk}")

    @property
    def most_rounds(self) -> int:
        return max(self.repeats, self.max_repeats)

    @property
    def total(self) -> int:
        """The steps a worker runs if every round is needed (it stops early when told the rounds are done)."""
        return self.warmup + self.most_rounds * self.chunk

    @property
    def turns_per_chunk(self) -> int:
        return self.chunk // self.turn if self.turn else 1

    def targets(self) -> list[tuple[str, int]]:
        """(label, the step every variant runs to) for the warm-up and each round that may run."""
        return [("warmup", self.warmup)] + [
            (f"round {r + 1}", self.warmup + (r + 1) * self.chunk) for r in range(self.most_rounds)
        ]

    def turn_targets(self, until: int) -> list[int]:
        """The steps a round that ends at step `until` runs to, turn by turn."""
        step = self.turn or self.chunk
        return list(range(until - self.chunk + step, until + 1, step))


def round_order(variants: list, index: int) -> list:
    """The order of turn `index` (0 is the warm-up): forward, then backward, alternately (A B C, C B A,
    A B C, ...), so that each variant runs as often early in a turn as late in one and a drift of the
    machine's speed across a pair of turns falls on every variant alike."""
    return list(variants) if index % 2 == 0 else list(reversed(variants))


def schedule(
    settings,
    fit_spes: list[int],
    *,
    steps: int,
    warmup_steps: int,
    repeats: int,
    turn_steps: int = 0,
    max_repeats: int = 0,
) -> Schedule:
    """Chunks that end on a call boundary of every variant (a multiple of steps_per_loop and of fit's
    values) and, by default, hold the same hook work: the least multiple of both hook intervals. Turns
    are, by default, the shortest stretch that ends on every variant's call boundaries (the same unit):
    the machine's speed drifts by 10-20% over tens of seconds on a shared VM, and only chunks spread over
    the same seconds see the same drift."""
    unit = math.lcm(settings.steps_per_loop, *fit_spes)
    hooks_unit = math.lcm(settings.log_every_steps, settings.checkpoint_every_steps)
    chunk = round_up(steps or (hooks_unit if hooks_unit <= 20_000 else 1000), unit)
    turn = round_up(turn_steps or unit, unit)
    if chunk % turn:
        raise UserError(
            f"--turn_steps {turn_steps} (rounded up to {turn}, a multiple of every variant's call "
            f"length {unit}) does not divide a chunk of {chunk} steps: pick a divisor of {chunk}"
        )
    # Warm-up ends on a chunk boundary beyond every variant's first call (fit's first call is unit steps long).
    warmup = round_up(max(warmup_steps or chunk, unit + 1), chunk)
    return Schedule(chunk, warmup, repeats, turn, max_repeats)
