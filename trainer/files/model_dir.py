"""model_dir itself: refused early when it cannot hold a run; made (with the run record) at the first write."""

from __future__ import annotations

import os
import tempfile

from trainer.errors import UserError
from trainer.files import run_record


def check_model_dir(model_dir: str) -> None:
    if not model_dir:
        raise UserError("model_dir is empty; pass --model_dir=DIR")
    if os.path.exists(model_dir):
        if not os.path.isdir(model_dir):
            raise UserError(f"model_dir {model_dir} exists and is not a directory; pick another --model_dir")
        if not _can_write_in(model_dir):
            raise UserError(f"model_dir {model_dir} is not writable; fix its permissions or pick another --model_dir")
        return
    parent = os.path.dirname(os.path.abspath(model_dir))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent) or not _can_write_in(parent):
        raise UserError(f"model_dir {model_dir} cannot be created: {parent} is not a writable directory")


def _can_write_in(directory: str) -> bool:
    # Tried, not read from permission bits: they say nothing for root or read-only mounts.
    try:
        fd, probe = tempfile.mkstemp(dir=directory, prefix=".trainer-probe-")
    except OSError:
        return False
    os.close(fd)
    os.remove(probe)
    return True


def prepare(model_dir: str, record: dict, *, is_chief: bool, start_step: int) -> None:
    """The run's first write (chief): the directory, and the run record (trainer/files/run_record.save)."""
    if not is_chief:
        return
    os.makedirs(model_dir, exist_ok=True)
    run_record.save(model_dir, record, start_step)
