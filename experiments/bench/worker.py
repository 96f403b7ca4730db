"""A worker process's main: builds the config, runs one variant, and on failure sends the
parent one line (the traceback goes to the worker's log)."""

from __future__ import annotations

import re
import sys
import traceback

from experiments.bench.config import train_settings
from experiments.bench.epoch_order import use_epoch_order
from experiments.bench.fit import run_fit
from experiments.bench.limit import run_limit
from experiments.bench.orbit import run_orbit
from experiments.bench.ours import run_ours
from experiments.bench.protocol import Channel, die_with_parent
from trainer.errors import UserError

KNOWN_FIT_FAILURES = {
    "You must feed a value for placeholder tensor": "keras-team/keras#19246: fit with steps_per_execution > 1 under "
    "MirroredStrategy",
}


def error_summary(error: BaseException, role: str) -> str:
    """One line: the TensorFlow status message if there is one, and a known issue it matches."""
    text = str(error).strip()
    status = re.search(
        r"\b(?:INVALID_ARGUMENT|FAILED_PRECONDITION|UNIMPLEMENTED|INTERNAL|NOT_FOUND|UNKNOWN|"
        r"RESOURCE_EXHAUSTED|OUT_OF_RANGE|ABORTED|UNAVAILABLE):\s*(.+)",
        text,
    )
    detail = status.group(1).strip() if status else (text.splitlines()[0] if text else "")
    summary = f"{type(error).__name__}: {detail}"
    known = next((issue for symptom, issue in KNOWN_FIT_FAILURES.items() if symptom in text), None)
    return f"{summary} ({known})" if known and role == "fit" else summary


def run_worker(role: str, gin_files: list[str], gin_bindings: list[str], *, fit_spe: int, total_steps: int) -> None:
    """Runs variant `role` (limit, limit_input, ours, ours_async, ours_tf_data, orbit or fit at `fit_spe`) for `total_steps`
    steps, as the parent paces it."""
    die_with_parent()
    channel = Channel()
    try:
        settings = train_settings(gin_files, gin_bindings)
        if role in ("limit", "limit_input"):
            run_limit(settings, channel, from_input=role == "limit_input")
        elif role in ("ours", "ours_async", "ours_tf_data"):
            run_ours(
                settings, channel, total_steps, async_checkpoint=role == "ours_async", tf_data=role == "ours_tf_data"
            )
        elif role == "ours_epoch_order":
            use_epoch_order()
            run_ours(settings, channel, total_steps, tf_data=True)
        elif role == "orbit":
            run_orbit(settings, channel)
        elif role == "fit":
            run_fit(settings, channel, fit_spe, total_steps)
        else:
            raise UserError(f"unknown --role {role!r}")
    except SystemExit:
        raise
    except BaseException as e:  # the parent reports it; the traceback goes to this worker's log
        traceback.print_exc()
        channel.send(event="error", message=error_summary(e, role), user_error=isinstance(e, UserError))
        sys.exit(2 if isinstance(e, UserError) else 1)
