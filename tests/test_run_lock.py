"""One training run per model_dir (trainer/files/run_lock.py): a live holder refuses the next claim,
naming it; a holder whose process is gone or whose lease expired is taken over, saying so. Whole runs
refused, taken over and read alongside a held model_dir: tests/test_bad_input.py."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time

import pytest

from trainer.errors import UserError
from trainer.files import run_lock


def lock_of(pid: int, host: str | None = None) -> dict:
    return {
        "host": host or socket.gethostname(),
        "pid": pid,
        "since": "2026-01-02 03:04:05 UTC",
        "process_start": run_lock._process_start(pid),
    }


def test_a_model_dir_is_claimed_once_and_released_with_the_directory_it_made(tmp_path):
    model_dir = str(tmp_path / "run")
    first = run_lock.claim(model_dir)
    with pytest.raises(UserError) as refused:
        run_lock.claim(model_dir)
    assert str(refused.value).startswith(
        f"model_dir {model_dir} is in use by another training run (host {socket.gethostname()}, pid {os.getpid()}, since "
    )
    assert os.listdir(model_dir) == [run_lock.LOCK_FILE]  # the refused claim left nothing
    first.release()
    assert not os.path.exists(model_dir)  # made by the claim, empty again


def test_a_claim_made_in_a_wrapped_call_is_released_however_it_ends(tmp_path):
    @run_lock.released_at_exit
    def refused_after_the_claim():
        run_lock.claim(str(tmp_path))
        raise UserError("a mistake found later")

    with pytest.raises(UserError):
        refused_after_the_claim()
    assert os.listdir(tmp_path) == []


def test_a_stale_claim_is_taken_over_with_a_word_and_a_live_one_on_another_host_holds(tmp_path):
    gone = subprocess.Popen(["true"])
    gone.wait()
    lock = tmp_path / run_lock.LOCK_FILE
    lock.write_text(json.dumps(lock_of(gone.pid)))
    said = []
    run_lock.claim(str(tmp_path), said.append).release()
    assert said == [
        f"warning: model_dir {tmp_path}: the run that held it (host {socket.gethostname()}, pid {gone.pid}, since "
        "2026-01-02 03:04:05 UTC) is gone (no such process on this host); taking it over"
    ]
    lock.write_text(json.dumps(lock_of(1, host="elsewhere")))  # renewed just now: its lease holds
    with pytest.raises(UserError, match=r"\(host elsewhere, pid 1, since 2026-01-02 03:04:05 UTC; "):
        run_lock.claim(str(tmp_path))
    expired = time.time() - run_lock.LEASE_SECS - 60
    os.utime(lock, (expired, expired))
    said.clear()
    run_lock.claim(str(tmp_path), said.append).release()
    assert len(said) == 1 and "let its lease expire (180 s without renewal, more than 120); taking it over" in said[0]
    assert os.listdir(tmp_path) == []
