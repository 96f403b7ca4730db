"""A run that dies of a user mistake before its first step leaves model_dir as it found it.

Some mistakes show only when the first compiled call runs on real data, after the chief wrote the
run record, operative config and event files: a model_dir that looks like a run to resume, though
it never trained. So the chief notes what model_dir held, and on a UserError before any step
finished removes what this run added and puts back what it rewrote, byte for byte.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from typing import Callable, Iterator

from trainer.errors import UserError

# Files of at most this size are kept in memory before the first write, to be put back if
# rewritten (records and configs; not checkpoints, which a run that finished no step never writes).
MAX_KEPT_BYTES = 1024**2


def _contents(model_dir: str) -> set[str]:
    paths = set()
    for dirpath, dirnames, filenames in os.walk(model_dir):
        paths.update(os.path.join(dirpath, name) for name in dirnames + filenames)
    return paths


@contextlib.contextmanager
def undone_unless_a_step_finishes(model_dir: str, *, is_chief: bool, finished: Callable[[], bool]) -> Iterator[None]:
    """Removes what the block added to `model_dir` if it raises a UserError while `finished()` is
    False (no step of this run finished); the error goes on unchanged. Only the chief writes."""
    existed = is_chief and os.path.isdir(model_dir)
    before = _contents(model_dir) if existed else set()
    kept = {
        path: _read(path)
        for path in before
        if os.path.isfile(path) and not os.path.islink(path) and os.path.getsize(path) <= MAX_KEPT_BYTES
    }
    try:
        yield
    except UserError:
        if is_chief and not finished():
            _undo(model_dir, existed, before, kept)
        raise


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _undo(model_dir: str, existed: bool, before: set[str], kept: dict[str, bytes]) -> None:
    if not existed:
        shutil.rmtree(model_dir, ignore_errors=True)
        return
    added = sorted(_contents(model_dir) - before, key=len, reverse=True)  # the deepest first
    for path in added:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        elif os.path.lexists(path):
            os.remove(path)
    for path, content in kept.items():
        if not os.path.isfile(path) or _read(path) != content:
            with open(path, "wb") as f:
                f.write(content)
