"""A full disk during a save: one error line, the previous checkpoint intact, a rerun continues.

The run's model_dir is a 3 MB tmpfs, mounted in a private user+mount namespace (`unshare -rm`,
no privileges needed where user namespaces are allowed), so the first checkpoint fits and the
second does not. After the failure the tmpfs is enlarged and the same command runs again.
"""

from __future__ import annotations

import pathlib
import shlex
import subprocess
import sys

import pytest

from tests.support import REPO, subprocess_env

pytestmark = pytest.mark.slow  # every test here starts processes or trains for long

ARGS = [
    "--gin_file=gin/single.gin",
    "--gin_bindings=train.total_steps=60",
    "--gin_bindings=train.log_every_steps=20",
    "--gin_bindings=train.checkpoint_every_steps=20",
    "--gin_bindings=train.eval_every_steps=60",
    "--gin_bindings=train.keep_checkpoints=5",
]


def _namespaces_allowed() -> bool:
    try:
        return subprocess.run(["unshare", "-rm", "true"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def run_on_a_full_disk(command: list[str], tmp_path) -> pathlib.Path:
    """Runs `command --model_dir=<a 3 MB tmpfs>/run`, then enlarges the tmpfs to 64 MB and runs it
    again, in a private user+mount namespace; returns the folder with each run's out, err and rc,
    model_dir's listing after each (after_first.ls, after_second.ls) and the state file after the
    first (state)."""
    mount, out = tmp_path / "disk", tmp_path / "out"
    mount.mkdir()
    out.mkdir()
    line = " ".join(shlex.quote(a) for a in [*command, f"--model_dir={mount}/run"])
    script = f"""
        set -u
        mount -t tmpfs -o size=3m tmpfs {mount}
        {line} > {out}/first.out 2> {out}/first.err; echo $? > {out}/first.rc
        ls {mount}/run > {out}/after_first.ls
        cat {mount}/run/checkpoint > {out}/state
        mount -o remount,size=64m {mount}
        {line} > {out}/second.out 2> {out}/second.err; echo $? > {out}/second.rc
        ls {mount}/run > {out}/after_second.ls
    """
    subprocess.run(["unshare", "-rm", "sh", "-c", script], cwd=REPO, env=subprocess_env(), timeout=400, check=True)
    return out


@pytest.mark.skipif(not _namespaces_allowed(), reason="needs unprivileged user and mount namespaces (unshare -rm)")
@pytest.mark.parametrize("write", ["sync", "async"])
def test_full_disk_during_a_save_is_one_line_and_a_rerun_continues(tmp_path, write):
    """Async: the write of ckpt-40 fails on the writer thread and surfaces as the same one line."""
    out = run_on_a_full_disk(
        [sys.executable, "-m", "trainer.main", *ARGS, f"--gin_bindings=train.async_checkpoint={write == 'async'}"],
        tmp_path,
    )

    first_err = (out / "first.err").read_text()
    assert (out / "first.rc").read_text().strip() == "1", first_err[-3000:]
    assert "Traceback" not in first_err
    errors = [line for line in first_err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and first_err.strip().splitlines()[-1] == errors[0]
    assert "saving checkpoint 40" in errors[0] and "No space left on device" in errors[0]
    assert "ckpt-20 is intact" in errors[0]
    files = (out / "after_first.ls").read_text().split()
    assert "ckpt-20.index" in files and not any(name.startswith("ckpt-40") for name in files)  # partial files removed
    assert 'model_checkpoint_path: "ckpt-20"' in (out / "state").read_text()

    second_out = (out / "second.out").read_text()
    assert (out / "second.rc").read_text().strip() == "0", (out / "second.err").read_text()[-3000:]
    assert "ckpt-20; continuing from step 20" in second_out
    assert "ckpt-60.index" in (out / "after_second.ls").read_text().split()
