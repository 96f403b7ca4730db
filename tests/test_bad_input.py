"""Bad input: exit 2 (or 1), one line naming the problem and the fix, nothing in model_dir lost.

The refusals of single-device runs go through trainer.main's flag parsing and `run` in one fresh
interpreter (one TensorFlow start for them all); tests/test_mistakes.py does so for its table too and
checks a few of its cases as real processes as well."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess

import pytest

from tests.support import main_in_one_process, run_main, tree_digest
from trainer.files import run_lock

# The module-scoped fixture below is shared by this file's tests: one worker runs them all.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("bad_input")]

SHORT = [
    "--gin_bindings=train.total_steps=20",
    "--gin_bindings=train.checkpoint_every_steps=10",
    "--gin_bindings=train.eval_every_steps=10",
    "--gin_bindings=train.log_every_steps=10",
]


def last_line(proc) -> str:
    lines = proc.stderr.strip().splitlines()
    assert lines, proc.stdout[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return lines[-1]


def refused(outcome: dict) -> str:
    """The last stderr line of a case of `refusals` that exited 2, without a traceback."""
    assert outcome["code"] == 2 and "Traceback" not in outcome["stderr"], outcome["stderr"][-3000:]
    return outcome["stderr"].strip().splitlines()[-1]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> str:
    model_dir = str(tmp_path_factory.mktemp("bad") / "run")
    proc = run_main("--gin_file=gin/single.gin", f"--model_dir={model_dir}", *SHORT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return model_dir


@pytest.fixture
def copy_of(trained, tmp_path) -> str:
    target = str(tmp_path / "run")
    shutil.copytree(trained, target)
    return target


SINGLE = ["--gin_file=gin/single.gin", *SHORT]
RESUMED = [*SINGLE, "--gin_bindings=train.total_steps=30"]


@pytest.fixture(scope="module")
def refusals(trained, tmp_path_factory) -> tuple[str, dict, dict]:
    """The single-device refusals below, in one interpreter; (their folder, the digests of the copies
    of `trained` before, each case's outcome)."""
    root = tmp_path_factory.mktemp("refusals")
    (root / "file").write_text("keep me")
    for copy in ("resumed", "misspelt"):
        shutil.copytree(trained, root / copy)
    before = {copy: tree_digest(str(root / copy)) for copy in ("resumed", "misspelt")}
    synthetic = [*SINGLE, "--gin_bindings=train.data_source=@synthetic()"]
    cases = {
        "a_file": (SINGLE, f"{root}/file"),
        "below_a_file": (SINGLE, f"{root}/file/run"),
        "proc": (SINGLE, "/proc/trainer-run"),
        # on the same copy, in this order
        "wider": ([*RESUMED, "--gin_bindings=cnn.dense_units=256"], f"{root}/resumed"),
        "batch": ([*RESUMED, "--gin_bindings=train.global_batch_size=32"], f"{root}/resumed"),
        "forced": (
            [*RESUMED, "--gin_bindings=cnn.dense_units=256", "--gin_bindings=train.allow_resume_changes=True"],
            f"{root}/resumed",
        ),
        "empty": ([*synthetic, "--gin_bindings=synthetic.num_train=0"], f"{root}/a"),
        "no_eval": ([*synthetic, "--gin_bindings=synthetic.num_eval=0"], f"{root}/b"),
        "glob": (
            [
                *SINGLE,
                "--gin_bindings=train.data_source=@tfrecord_files()",
                f"--gin_bindings=tfrecord_files.train_pattern='{root}/none-*.tfrecord'",
                f"--gin_bindings=tfrecord_files.eval_pattern='{root}/none-*.tfrecord'",
                "--gin_bindings=tfrecord_files.input_shape=(8, 8, 1)",
                "--gin_bindings=tfrecord_files.num_classes=10",
            ],
            f"{root}/c",
        ),
        "misspelt": (["--gin_file=gin/single.gin", "--gin_bindings=cnn.widht=3"], f"{root}/misspelt"),
    }
    return str(root), before, main_in_one_process(cases, timeout=300)


def test_model_dir_that_is_a_file_or_not_writable(refusals):
    root, _, outcomes = refusals
    assert "is not a directory" in refused(outcomes["a_file"])
    with open(os.path.join(root, "file")) as f:
        assert f.read() == "keep me"
    assert "cannot be created" in refused(outcomes["below_a_file"])
    assert "/proc" in refused(outcomes["proc"])


def test_resume_with_another_model_or_batch_is_refused_unless_allowed(refusals):
    root, before, outcomes = refusals
    line = refused(outcomes["wider"])
    assert "other settings" in line and "[64, 128] -> [64, 256]" in line and "allow_resume_changes" in line
    assert "global_batch_size 64 -> 32" in refused(outcomes["batch"])
    line = refused(outcomes["forced"])
    assert "does not match the model" in line and "ckpt-20" in line and "(64, 128)" in line
    assert tree_digest(os.path.join(root, "resumed")) == before["resumed"]


def _overwritten(path: str) -> None:
    with open(path, "r+b") as f:
        f.seek(100)
        f.write(b"\0" * 2000)


def _cut_short(path: str) -> None:
    os.truncate(path, 800000 if path.endswith("00001") else 100)


def _held(path: str, pid: int | None = None) -> None:
    """The lock of a run on this host: this test's process (alive), or one that is gone."""
    if pid is None:
        gone = subprocess.Popen(["true"])
        gone.wait()
    holder = {"host": socket.gethostname(), "pid": pid or gone.pid, "since": "2026-01-02 03:04:05 UTC"}
    with open(path, "w") as f:
        json.dump({**holder, "process_start": run_lock._process_start(holder["pid"])}, f)


def _garbled(path: str) -> None:
    with open(path, "w") as f:
        f.write('{"trunc' if path.endswith(".json") else "garbage {{{\n")


# Every way a run's files can be unreadable: (file, damage, a piece of the one warning, the step continued from).
DAMAGES = {
    "data_overwritten": ("ckpt-20.data-00000-of-00001", _overwritten, "ckpt-20 cannot be read (", 10),
    "data_cut_short": ("ckpt-20.data-00000-of-00001", _cut_short, "ckpt-20 cannot be read (Read less bytes", 10),
    "data_missing": ("ckpt-20.data-00000-of-00001", os.remove, "ckpt-20 cannot be read (", 10),
    "index_cut_short": ("ckpt-20.index", _cut_short, "ckpt-20 cannot be read (", 10),
    "state_file_garbled": ("checkpoint", _garbled, "checkpoint cannot be read (it is no checkpoint state)", 20),
    "state_file_empty": (
        "checkpoint",
        lambda path: os.truncate(path, 0),
        "checkpoint cannot be read (it is empty)",
        20,
    ),
    "run_record_garbled": ("run_record.json", _garbled, "run_record.json cannot be read (", 20),
    "lock_of_a_gone_run": (".trainer.lock", _held, "is gone (no such process on this host); taking it over", 20),
}
# Readers of a model_dir a live run holds: they never claim it.
ALONGSIDE = {"evaluate": ["--gin_file=gin/single.gin", "--mode=evaluate"], "predict": ["--mode=predict", *SINGLE]}


@pytest.fixture(scope="module")
def resumed_after_damage(trained, tmp_path_factory) -> tuple[str, dict]:
    """Each damage done to a copy of `trained`, then the run continued to step 30, all in one interpreter."""
    root = tmp_path_factory.mktemp("damaged")
    for name, (file, damage, _, _) in DAMAGES.items():
        shutil.copytree(trained, root / name)
        damage(str(root / name / file))
    cases = {name: ([*SINGLE, "--gin_bindings=train.total_steps=30"], str(root / name)) for name in DAMAGES}
    shutil.copytree(trained, root / "held")
    _held(str(root / "held" / ".trainer.lock"), os.getpid())
    cases.update({f"{mode}_while_held": (args, str(root / "held")) for mode, args in ALONGSIDE.items()})
    cases["train_while_held"] = ([*SINGLE, "--gin_bindings=train.total_steps=30"], str(root / "held"))
    return str(root), main_in_one_process(cases, timeout=400)


@pytest.mark.parametrize("name", sorted(DAMAGES))
def test_a_damaged_checkpoint_falls_back_to_the_newest_intact_one_in_one_warning(resumed_after_damage, name):
    root, outcomes = resumed_after_damage
    outcome, (_, _, warning, step) = outcomes[name], DAMAGES[name]
    assert outcome["code"] == 0, outcome["stderr"][-3000:]
    warnings = [line for line in outcome["stdout"].splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and warning in warnings[0], warnings
    assert f"continuing from step {step}" in outcome["stdout"], outcome["stdout"][-2000:]
    assert "Traceback" not in outcome["stderr"] and "Checkpoint ignored" not in outcome["stderr"]
    assert os.path.exists(os.path.join(root, name, "ckpt-30.index"))
    assert json.load(open(os.path.join(root, name, "run_record.json")))["global_batch_size"] == 64


def test_a_model_dir_in_use_refuses_a_second_training_run_and_lets_readers_in(resumed_after_damage):
    root, outcomes = resumed_after_damage
    for mode in ALONGSIDE:
        assert outcomes[f"{mode}_while_held"]["code"] == 0, outcomes[f"{mode}_while_held"]["stderr"][-3000:]
    line = refused(outcomes["train_while_held"])
    assert line == (
        f"error: model_dir {root}/held is in use by another training run (host {socket.gethostname()}, pid "
        f"{os.getpid()}, since 2026-01-02 03:04:05 UTC; {root}/held/.trainer.lock); wait for it to end, stop it, "
        "or train into another --model_dir (evaluate, predict and the sidecar evaluator may read it meanwhile)"
    )
    assert not os.path.exists(os.path.join(root, "held", "ckpt-30.index"))


def test_batch_not_divisible_by_replicas(tmp_path):
    proc = run_main(
        "--gin_file=gin/mirrored.gin",
        f"--model_dir={tmp_path / 'run'}",
        *SHORT,
        "--gin_bindings=train.global_batch_size=63",
    )
    assert proc.returncode == 2 and "not divisible by the 2 replicas" in last_line(proc)
    assert not os.path.exists(tmp_path / "run")


def test_empty_data_and_globs_matching_nothing(refusals):
    root, _, outcomes = refusals
    assert "train split has 0 examples" in refused(outcomes["empty"])
    assert "eval split has no examples" in refused(outcomes["no_eval"])
    assert "no TFRecord files match" in refused(outcomes["glob"])
    assert not any(os.path.exists(os.path.join(root, d)) for d in "abc")


def test_binding_a_parameter_that_does_not_exist(refusals):
    root, before, outcomes = refusals
    assert "widht" in refused(outcomes["misspelt"])
    assert tree_digest(os.path.join(root, "misspelt")) == before["misspelt"]
