"""The run record: what a run was started with (`model_dir/run_record.json`, written by the chief), kept to
refuse a resume that changes the global batch size or the model's variables, or the worker and replica
counts where that would change the global batches; the counts a run continued on are kept in `layouts`."""

from __future__ import annotations

import datetime
import json
import os
import platform
from typing import Callable

import keras
import tensorflow as tf

from trainer.distribution import modes
from trainer.errors import UserError
from trainer.files.atomic import write_text_atomic
from trainer.task.structure import named

RECORD_FILE = "run_record.json"


def variable_shapes(models) -> dict[str, list[int]]:
    """Name -> shape of every model variable; in a dict of models the key leads (`generator/dense/kernel`)."""
    shapes = {}
    for key, model in named(models, default="").items():
        for v in [*model.trainable_variables, *getattr(model, "non_trainable_variables", [])]:
            name = getattr(v, "path", None) or v.name
            shapes[f"{key}/{name}" if key else name] = [int(d) for d in v.shape]
    return shapes


def make_record(
    *,
    strategy: str,
    num_replicas: int,
    num_workers: int,
    global_batch_size: int,
    model,
    config_text: str,
    batches_independent_of_workers: bool = True,
    data_service: bool = False,
) -> dict:
    """`batches_independent_of_workers`: the global batch of a step holds the same examples whatever the
    worker and replica counts (False where each worker reads its own files or its own stream);
    `data_service`: the tf.data service hands out the batches in its own order, whatever the counts."""
    return {
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "tensorflow": tf.__version__,
        "keras": keras.__version__,
        "python": platform.python_version(),
        "strategy": strategy,
        "num_replicas": num_replicas,
        "num_workers": num_workers,
        "global_batch_size": global_batch_size,
        "batches_independent_of_workers": batches_independent_of_workers,
        "data_service": data_service,
        # The worker and replica counts from each step on where they changed (a resume on another count).
        "layouts": [{"from_step": 0, "num_workers": num_workers, "num_replicas": num_replicas}],
        "model_variables": variable_shapes(model),
        "operative_config": config_text,
    }


def read_record(model_dir: str, print_fn: Callable[[str], None] | None = None) -> dict | None:
    """The recorded run (None: none, or a record that cannot be read, said through `print_fn`: a resume
    goes on unchecked against it and this run's record replaces it)."""
    path = os.path.join(model_dir, RECORD_FILE)
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            record = json.load(f)
        if not isinstance(record, dict):
            raise ValueError(f"a JSON {type(record).__name__}, not an object")
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
        if print_fn is not None:
            print_fn(
                f"warning: {path} cannot be read ({e}); the run's settings are not checked against it, and "
                "this run's record replaces it"
            )
        return None
    return record


def write_record(model_dir: str, record: dict) -> None:
    write_text_atomic(os.path.join(model_dir, RECORD_FILE), json.dumps(record, indent=2) + "\n")


def save(model_dir: str, current: dict, start_step: int) -> None:
    """Writes the record of a fresh run (the first one stays); a run resumed on other worker or replica
    counts adds them to the recorded `layouts` from `start_step` on."""
    recorded = read_record(model_dir)
    if recorded is None:
        if start_step == 0 or os.path.exists(os.path.join(model_dir, RECORD_FILE)):  # fresh, or unreadable
            write_record(model_dir, current)
        return
    if start_step > 0 and _layout(current) != _layout(recorded):
        counts = _layout(current)
        layouts = [entry for entry in _layouts(recorded) if entry["from_step"] < start_step]
        write_record(model_dir, {**recorded, "layouts": [*layouts, {"from_step": start_step, **counts}]})


def _layouts(record: dict) -> list[dict]:
    """The recorded layouts (a record written before they were kept has its first counts only)."""
    first = {"from_step": 0, "num_workers": record.get("num_workers"), "num_replicas": record.get("num_replicas")}
    return record.get("layouts") or [first]


def _layout(record: dict) -> dict:
    """The worker and replica counts a record's run trains on now."""
    latest = _layouts(record)[-1]
    return {"num_workers": latest["num_workers"], "num_replicas": latest["num_replicas"]}


def _counts(layout: dict) -> str:
    workers, replicas = layout["num_workers"], layout["num_replicas"]
    return f"{workers} worker(s)" + ("" if replicas == workers else f" with {replicas} replica(s)")


def _same_updates(recorded: dict, current: dict) -> bool:
    """Whether a synchronous run continued on other counts makes the updates it would have made: the same
    global batch of the same examples at every step (the sum over replicas differs in rounding only)."""
    return (
        modes.get(current["strategy"]).synchronous
        and recorded.get("global_batch_size") == current["global_batch_size"]
        and recorded.get("batches_independent_of_workers", False)
        and current["batches_independent_of_workers"]
    )


def differences(recorded: dict, current: dict) -> list[str]:
    """What a resume would change that makes it another training, in words."""
    found = []
    if recorded.get("global_batch_size") != current["global_batch_size"]:
        found.append(f"global_batch_size {recorded.get('global_batch_size')} -> {current['global_batch_size']}")
    before, now = _layout(recorded), _layout(current)
    if (
        not found
        and before != now
        and modes.get(current["strategy"]).synchronous
        and not current.get("data_service")
        and not _same_updates(recorded, current)
    ):
        found.append(
            f"{_counts(before)} -> {_counts(now)}, whose global batches hold other examples "
            "(each worker reads its own files)"
        )
    old, new = recorded.get("model_variables", {}), current["model_variables"]
    names = [name for name in sorted(set(old) | set(new)) if old.get(name) != new.get(name)]
    return found + [f"variable {name} {old.get(name, 'absent')} -> {new.get(name, 'absent')}" for name in names]


def layout_change(recorded: dict, current: dict) -> str | None:
    """The line a resume on other worker or replica counts prints (None where they are the same)."""
    before, now = _layout(recorded), _layout(current)
    if before == now:
        return None
    was = (
        before["num_workers"]
        if now["num_replicas"] == now["num_workers"] and before["num_replicas"] == before["num_workers"]
        else _counts(before)
    )
    line = f"resuming on {_counts(now)} (was {was})"
    if _same_updates(recorded, current):
        return f"{line}; same global batch {current['global_batch_size']}, so the same updates"
    if not modes.get(current["strategy"]).synchronous:
        return f"{line}; {current['strategy']} updates are asynchronous, so the steps differ from here on anyway"
    if current.get("data_service"):
        return f"{line}; the tf.data service hands out the batches in its own order, so the steps differ anyway"
    return f"{line}, with train.allow_resume_changes: the global batches change from here on"


def check_resume(
    model_dir: str, current: dict, *, allow_changes: bool, print_fn: Callable[[str], None] = print
) -> None:
    """Raises UserError if the recorded run differs from `current` in what must not change; prints the line
    of a resume on other worker or replica counts."""
    recorded = read_record(model_dir, print_fn)
    if recorded is None:
        return
    if not allow_changes and (found := differences(recorded, current)):
        shown = "; ".join(found[:3]) + (f"; and {len(found) - 3} more" if len(found) > 3 else "")
        raise UserError(
            f"model_dir {model_dir} was started with other settings ({shown}); resume with the "
            "original settings, use a fresh --model_dir, or set train.allow_resume_changes = True"
        )
    if line := layout_change(recorded, current):
        print_fn(line)
