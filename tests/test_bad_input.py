"""Bad input: exit 2 (or 1), one line naming the problem and the fix, nothing in model_dir lost."""

from __future__ import annotations

import os
import shutil

import pytest

from tests.support import run_main, tree_digest

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


def test_model_dir_that_is_a_file_or_not_writable(tmp_path):
    a_file = tmp_path / "file"
    a_file.write_text("keep me")
    proc = run_main("--gin_file=gin/single.gin", f"--model_dir={a_file}", *SHORT)
    assert proc.returncode == 2 and "is not a directory" in last_line(proc)
    assert a_file.read_text() == "keep me"
    proc = run_main("--gin_file=gin/single.gin", f"--model_dir={a_file}/run", *SHORT)
    assert proc.returncode == 2 and "cannot be created" in last_line(proc)
    proc = run_main("--gin_file=gin/single.gin", "--model_dir=/proc/trainer-run", *SHORT)
    assert proc.returncode == 2 and "/proc" in last_line(proc)


def test_resume_with_another_model_or_batch_is_refused_unless_allowed(copy_of):
    before = tree_digest(copy_of)
    wider = run_main(
        "--gin_file=gin/single.gin",
        f"--model_dir={copy_of}",
        *SHORT,
        "--gin_bindings=train.total_steps=30",
        "--gin_bindings=cnn.dense_units=256",
    )
    assert wider.returncode == 2
    line = last_line(wider)
    assert "other settings" in line and "[64, 128] -> [64, 256]" in line and "allow_resume_changes" in line
    batch = run_main(
        "--gin_file=gin/single.gin",
        f"--model_dir={copy_of}",
        *SHORT,
        "--gin_bindings=train.total_steps=30",
        "--gin_bindings=train.global_batch_size=32",
    )
    assert batch.returncode == 2 and "global_batch_size 64 -> 32" in last_line(batch)
    forced = run_main(
        "--gin_file=gin/single.gin",
        f"--model_dir={copy_of}",
        *SHORT,
        "--gin_bindings=train.total_steps=30",
        "--gin_bindings=cnn.dense_units=256",
        "--gin_bindings=train.allow_resume_changes=True",
    )
    assert forced.returncode == 2
    line = last_line(forced)
    assert "does not match the model" in line and "ckpt-20" in line and "(64, 128)" in line
    assert tree_digest(copy_of) == before


def test_corrupted_newest_checkpoint_falls_back_to_the_previous_one(copy_of):
    data_file = os.path.join(copy_of, "ckpt-20.data-00000-of-00001")
    with open(data_file, "r+b") as f:
        f.seek(100)
        f.write(b"\0" * 2000)
    proc = run_main(
        "--gin_file=gin/single.gin", f"--model_dir={copy_of}", *SHORT, "--gin_bindings=train.total_steps=30"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ckpt-20 cannot be read" in proc.stdout and "trying the checkpoint before it" in proc.stdout
    assert "continuing from step 10" in proc.stdout
    assert os.path.exists(os.path.join(copy_of, "ckpt-30.index"))


def test_batch_not_divisible_by_replicas(tmp_path):
    proc = run_main(
        "--gin_file=gin/mirrored.gin",
        f"--model_dir={tmp_path / 'run'}",
        *SHORT,
        "--gin_bindings=train.global_batch_size=63",
    )
    assert proc.returncode == 2 and "not divisible by the 2 replicas" in last_line(proc)
    assert not os.path.exists(tmp_path / "run")


def test_empty_data_and_globs_matching_nothing(tmp_path):
    empty = run_main(
        "--gin_file=gin/single.gin",
        f"--model_dir={tmp_path / 'a'}",
        *SHORT,
        "--gin_bindings=train.data_source=@synthetic()",
        "--gin_bindings=synthetic.num_train=0",
    )
    assert empty.returncode == 2 and "train split has 0 examples" in last_line(empty)
    no_eval = run_main(
        "--gin_file=gin/single.gin",
        f"--model_dir={tmp_path / 'b'}",
        *SHORT,
        "--gin_bindings=train.data_source=@synthetic()",
        "--gin_bindings=synthetic.num_eval=0",
    )
    assert no_eval.returncode == 2 and "eval split has no examples" in last_line(no_eval)
    glob = run_main(
        "--gin_file=gin/single.gin",
        f"--model_dir={tmp_path / 'c'}",
        *SHORT,
        "--gin_bindings=train.data_source=@tfrecord_files()",
        f"--gin_bindings=tfrecord_files.train_pattern='{tmp_path}/none-*.tfrecord'",
        f"--gin_bindings=tfrecord_files.eval_pattern='{tmp_path}/none-*.tfrecord'",
        "--gin_bindings=tfrecord_files.input_shape=(8, 8, 1)",
        "--gin_bindings=tfrecord_files.num_classes=10",
    )
    assert glob.returncode == 2 and "no TFRecord files match" in last_line(glob)
    assert not any(os.path.exists(tmp_path / d) for d in "abc")


def test_binding_a_parameter_that_does_not_exist(copy_of):
    before = tree_digest(copy_of)
    proc = run_main("--gin_file=gin/single.gin", f"--model_dir={copy_of}", "--gin_bindings=cnn.widht=3")
    assert proc.returncode == 2 and "widht" in last_line(proc)
    assert tree_digest(copy_of) == before
