"""One training run per model_dir: the chief's claim, `model_dir/.trainer.lock`.

Two runs training into one directory interleave their metrics, event files and checkpoints, and both
exit 0. So the chief claims model_dir before its first write: it links a complete lock file (host,
pid, since when) into place, which fails where another run holds it. The holder renews the file's
time every `RENEW_SECS` (its lease). A claim is stale when its process is gone (same host) or its
lease expired (another host, `LEASE_SECS` without renewal): a new run takes it over, saying so.
Readers (evaluate, predict, the sidecar evaluator) never claim. Claims made in a call of a function
wrapped by `released_at_exit` (`train`) are released when it returns or raises, however early.
"""

from __future__ import annotations

import contextvars
import datetime
import functools
import json
import os
import socket
import threading
import time
from typing import Any, Callable

from trainer.errors import UserError

LOCK_FILE = ".trainer.lock"
LEASE_SECS = 120.0
RENEW_SECS = 30.0

_HELD: contextvars.ContextVar[list["Claim"] | None] = contextvars.ContextVar("trainer_run_claims", default=None)


class Claim:
    """This process's claim on a model_dir; `release` removes the lock (and the directory, if the claim
    made it and nothing else is in it)."""

    def __init__(self, model_dir: str, holder: dict[str, Any], made_dir: bool):
        self.path = os.path.join(model_dir, LOCK_FILE)
        self._model_dir, self._holder, self._made_dir = model_dir, holder, made_dir
        self._stop = threading.Event()
        self._renewer = threading.Thread(target=self._renew, name="trainer-model-dir-lease", daemon=True)
        self._renewer.start()

    def _renew(self) -> None:
        while not self._stop.wait(RENEW_SECS):
            try:
                os.utime(self.path)
            except OSError:
                return  # the file is gone (moved away by hand): nothing left to renew

    def release(self) -> None:
        """Idempotent: called at the run's end and again when `train` returns (a model_dir put back as it was
        after a refusal may hold the lock again)."""
        self._stop.set()
        if _read(self.path) == self._holder:  # still ours (not taken over after an expired lease)
            os.remove(self.path)
        if self._made_dir:
            try:
                os.rmdir(self._model_dir)  # only if empty: a run refused before any write leaves none
            except OSError:
                pass


def claim(model_dir: str, print_fn: Callable[[str], None] = print) -> Claim:
    """Claims `model_dir` for this process; a UserError naming the holder where a live run has it."""
    made_dir = not os.path.isdir(model_dir)
    os.makedirs(model_dir, exist_ok=True)
    path = os.path.join(model_dir, LOCK_FILE)
    holder = _this_process()
    staged = f"{path}.{holder['host']}.{holder['pid']}"
    with open(staged, "w") as f:
        json.dump(holder, f)
    try:
        for _ in range(2):  # a stale claim is removed once, then linked over
            try:
                os.link(staged, path)  # atomic, and the file is complete when it appears
                break
            except FileExistsError:
                found = _read(path)
                why = _stale(found, path)
                if why is None:
                    raise UserError(_in_use(model_dir, found, path)) from None
                if _read(path) == found:
                    os.remove(path)
                print_fn(f"warning: model_dir {model_dir}: {_named(found, why)}; taking it over")
        else:
            raise UserError(_in_use(model_dir, _read(path), path))
    finally:
        os.remove(staged)
    held = Claim(model_dir, holder, made_dir)
    claims = _HELD.get()
    if claims is not None:
        claims.append(held)
    return held


def in_a_claiming_call() -> bool:
    """Whether a function wrapped by `released_at_exit` (training) runs: readers (evaluate, predict) build
    the same extensions outside it and claim nothing."""
    return _HELD.get() is not None


def released_at_exit(function: Callable) -> Callable:
    """`function` with every claim made during its call released when it returns or raises."""

    @functools.wraps(function)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        token = _HELD.set([])
        try:
            return function(*args, **kwargs)
        finally:
            for held in reversed(_HELD.get()):
                held.release()
            _HELD.reset(token)

    return wrapped


def _this_process() -> dict[str, Any]:
    now = datetime.datetime.now(datetime.timezone.utc)
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "since": now.strftime("%Y-%m-%d %H:%M:%S UTC"),
        "process_start": _process_start(os.getpid()),
    }


def _process_start(pid: int) -> str | None:
    """When process `pid` started (Linux: /proc/<pid>/stat field 22), telling a reused pid from its holder."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _read(path: str) -> dict[str, Any] | None:
    try:
        with open(path) as f:
            found = json.load(f)
    except (OSError, ValueError):
        return None
    return found if isinstance(found, dict) else None


def _stale(found: dict[str, Any] | None, path: str) -> str | None:
    """Why the claim `found` no longer holds (None: it holds)."""
    if found is None:
        return "cannot be read"
    if found.get("host") == socket.gethostname():
        pid = found.get("pid")
        if not isinstance(pid, int) or not _alive(pid) or _process_start(pid) != found.get("process_start"):
            return "is gone (no such process on this host)"
        return None
    try:
        idle = time.time() - os.stat(path).st_mtime
    except OSError:
        return "is gone (its lock was removed)"
    return (
        f"let its lease expire ({idle:.0f} s without renewal, more than {LEASE_SECS:.0f})"
        if idle > LEASE_SECS
        else None
    )


def _alive(pid: int) -> bool:
    """Whether `pid` runs: a killed process its parent has not reaped yet (a zombie) holds nothing."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):  # no /proc (not Linux): os.kill's answer stands
        return True


def _named(found: dict[str, Any] | None, why: str) -> str:
    if found is None:
        return f"its lock {why}"
    return f"the run that held it (host {found.get('host')}, pid {found.get('pid')}, since {found.get('since')}) {why}"


def _in_use(model_dir: str, found: dict[str, Any] | None, path: str) -> str:
    holder = (
        f"host {found.get('host')}, pid {found.get('pid')}, since {found.get('since')}"
        if found
        else "a run that is starting"
    )
    return (
        f"model_dir {model_dir} is in use by another training run ({holder}; {path}); wait for it to end, stop "
        "it, or train into another --model_dir (evaluate, predict and the sidecar evaluator may read it meanwhile)"
    )
