"""Checks and writes of files in `model_dir`: refuse bad directories early, write atomically."""
from __future__ import annotations

import os
import tempfile

from trainer.errors import UserError


def check_model_dir(model_dir: str) -> None:
    """Raises UserError if `model_dir` cannot hold a run; creates nothing."""
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
    """Tries it (permission bits say nothing for root or read-only mounts); leaves nothing."""
    try:
        fd, probe = tempfile.mkstemp(dir=directory, prefix=".trainer-probe-")
    except OSError:
        return False
    os.close(fd)
    os.remove(probe)
    return True


def prepare_model_dir(model_dir: str) -> None:
    os.makedirs(model_dir, exist_ok=True)


def write_text_atomic(path: str, text: str) -> None:
    """Writes to a temp file beside `path`, then renames, so readers never see half a file."""
    directory = os.path.dirname(path) or "."
    fd, temp = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=os.path.basename(path))
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(temp, 0o666 & ~umask)  # mkstemp makes it 0600; give it a plain file's mode
        os.replace(temp, path)
    except BaseException:
        if os.path.exists(temp):
            os.remove(temp)
        raise
