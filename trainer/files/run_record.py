"""The run record: what a run was started with (`model_dir/run_record.json`, written once by the chief), kept
to refuse a resume that changes the global batch size, the replica count or the model's variables."""

from __future__ import annotations

import datetime
import json
import os
import platform

import keras
import tensorflow as tf

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
    *, strategy: str, num_replicas: int, num_workers: int, global_batch_size: int, model, config_text: str
) -> dict:
    return {
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "tensorflow": tf.__version__,
        "keras": keras.__version__,
        "python": platform.python_version(),
        "strategy": strategy,
        "num_replicas": num_replicas,
        "num_workers": num_workers,
        "global_batch_size": global_batch_size,
        "model_variables": variable_shapes(model),
        "operative_config": config_text,
    }


def read_record(model_dir: str) -> dict | None:
    path = os.path.join(model_dir, RECORD_FILE)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def write_record(model_dir: str, record: dict) -> None:
    write_text_atomic(os.path.join(model_dir, RECORD_FILE), json.dumps(record, indent=2) + "\n")


def differences(recorded: dict, current: dict) -> list[str]:
    """What a resume would change, in words."""
    keys = ("global_batch_size", "num_replicas")
    found = [f"{key} {recorded.get(key)} -> {current[key]}" for key in keys if recorded.get(key) != current[key]]
    old, new = recorded.get("model_variables", {}), current["model_variables"]
    names = [name for name in sorted(set(old) | set(new)) if old.get(name) != new.get(name)]
    return found + [f"variable {name} {old.get(name, 'absent')} -> {new.get(name, 'absent')}" for name in names]


def check_resume(model_dir: str, current: dict, *, allow_changes: bool) -> None:
    """Raises UserError if the recorded run differs from `current` in what must not change."""
    recorded = read_record(model_dir)
    if recorded is None or allow_changes:
        return
    if found := differences(recorded, current):
        shown = "; ".join(found[:3]) + (f"; and {len(found) - 3} more" if len(found) > 3 else "")
        raise UserError(
            f"model_dir {model_dir} was started with other settings ({shown}); resume with the "
            "original settings, use a fresh --model_dir, or set train.allow_resume_changes = True"
        )
