"""The data position (trainer/data/order.py, trainer/data/indexed.py, trainer/extensions/data_position.py):
one global order of example indices, the same batches on every path, and every example trained on exactly
once per pass through a real SIGKILL or SIGTERM and a resume on another worker count, counted by the
id-counting run (tests/id_counting.py: 512 ids, global batch 8, 128 steps = two passes)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import numpy as np
import pytest
import tensorflow as tf

from tests import id_counting
from tests.id_counting import COUNTING_RUN
from tests.support import REPO, Main, main_in_one_process, subprocess_env
from tests.test_multiworker import trainer_pids_for
from trainer import data
from trainer.extensions.data_position import INDEXED, SERVICE, STREAM, guarantee, how_to_get_exact

COUNTING = [
    *COUNTING_RUN,
    "--gin_bindings=train.total_steps = 128",  # two passes over the 512 ids
    "--gin_bindings=train.steps_per_loop = 4",
    "--gin_bindings=train.checkpoint_every_steps = 16",
    "--gin_bindings=train.eval_every_steps = 128",
    "--gin_bindings=train.preemption_checkpointing = True",
]


def paused_at(step: int, secs: float = 30) -> list[str]:
    return [
        "--gin_bindings=train.extensions = [@PauseAt()]",
        f"--gin_bindings=PauseAt.step = {step}",
        f"--gin_bindings=PauseAt.secs = {secs}",
    ]


def counts(model_dir) -> list[int]:
    """How many ids were trained on 0, 1, 2, ... times, from the newest checkpoint."""
    return np.bincount(id_counting.seen(str(model_dir))).tolist()


def test_the_order_is_a_permutation_per_epoch_keyed_by_seed_and_epoch_alone():
    count, batch = 10, 4  # batches straddle epochs
    positions = tf.range(3 * count, dtype=tf.int64)
    order = data.example_indices(positions, count, seed=5).numpy().reshape(3, count)
    assert all(sorted(epoch) == list(range(count)) for epoch in order)
    assert len({tuple(epoch) for epoch in order}) == 3  # reshuffled every epoch
    assert not np.array_equal(order, data.example_indices(positions, count, seed=6).numpy().reshape(3, count))
    # Position p names the same example however the positions are asked for: one at a time, any shape.
    assert [int(data.example_indices(p, count, seed=5)) for p in range(3 * count)] == order.ravel().tolist()
    # Global batch i is positions [i * B, (i + 1) * B): what the index batches hand out, from any start.
    batches = [b.numpy().tolist() for b in data.shuffled_index_batches(count, batch, seed=5, first_batch=3).take(4)]
    assert batches == order.ravel()[3 * batch : 7 * batch].reshape(4, batch).tolist()
    assert batches[0] == data.batch_indices(3, batch, count, seed=5).numpy().tolist()


def test_a_closure_gathers_the_batches_the_synchronous_pipeline_gives():
    """The parameter-server path (each worker gathering global batch i from its copy) and the synchronous
    pipeline train on the same examples in the same order, so no path depends on the worker count."""
    source = data.Synthetic(num_train=40, num_eval=8)
    pipeline = [b for b in data.train_dataset(source, 16, seed=3).take(6).as_numpy_iterator()]
    indexed = data.indexed_batches(data.Input(source), 16, seed=3)
    examples = next(iter(indexed.source()))
    for i, (images, labels) in enumerate(pipeline):
        gathered_images, gathered_labels = indexed.batch(examples, tf.constant(i, tf.int64))
        np.testing.assert_array_equal(gathered_images.numpy(), images)
        np.testing.assert_array_equal(gathered_labels.numpy(), labels)
    generated = data.Input(lambda split: tf.data.Dataset.range(40).filter(lambda x: x % 2 == 0))
    assert data.indexed_batches(generated, 16, seed=3) is None  # unknown size: a stream


class NoisyImages(data.Synthetic):
    """Synthetic images with an augmentation: uniform noise drawn from the example's seed."""

    def augment(self, example, seed):
        image, label = example
        return image + tf.random.stateless_uniform(tf.shape(image), seed), label


def test_augmentation_is_keyed_by_seed_and_position_so_a_resume_and_a_closure_draw_the_same():
    source = NoisyImages(num_train=40, num_eval=8)
    full = [b for b in data.train_dataset(source, 16, seed=3).take(6).as_numpy_iterator()]
    plain = [b for b in data.train_dataset(data.Synthetic(num_train=40, num_eval=8), 16, seed=3).take(6)]
    assert not np.allclose(full[0][0], plain[0][0].numpy()) and np.array_equal(full[0][1], plain[0][1].numpy())
    resumed = [b for b in data.train_dataset(source, 16, seed=3, skip_batches=3).take(3).as_numpy_iterator()]
    for expected, got in zip(full[3:], resumed):
        np.testing.assert_array_equal(expected[0], got[0])
    indexed = data.indexed_batches(data.Input(source), 16, seed=3)
    examples = next(iter(indexed.source()))
    np.testing.assert_array_equal(indexed.batch(examples, tf.constant(4, tf.int64))[0].numpy(), full[4][0])
    # The same example in the next epoch gets another draw.
    order = data.example_indices(tf.range(80, dtype=tf.int64), 40, seed=3).numpy()
    again = 40 + int(np.flatnonzero(order[40:] == order[0])[0])
    assert not np.allclose(full[0][0][0], full[again // 16][0][again % 16])
    np.testing.assert_array_equal(full[0][1][0], full[again // 16][1][again % 16])


def test_tfrecord_files_that_fit_are_held_and_give_the_order_of_the_same_data_from_memory(tmp_path):
    """TFRecord files under tfrecord_files.max_memory_bytes are read once as serialized records and each
    global batch gathered by index and parsed: the same batches as the same examples from memory, on the
    synchronous pipeline from any resumed batch and on a parameter-server closure, with the schema's batched
    parsing and with a parse_fn of one record at a time; over the budget they stream."""
    train, eval_ = id_counting.write_tfrecords(str(tmp_path))
    features = {"x": data.float_feature((1,)), "label": data.int64_feature()}
    spec = {name: feature.parse_spec() for name, feature in features.items()}

    def parse_one(record):
        parsed = tf.io.parse_single_example(record, spec)
        return parsed["x"], tf.cast(parsed["label"], tf.int32)

    def from_memory(split):
        x, ids = next(id_counting.ids(split).batch(1024).as_numpy_iterator())
        return tf.data.Dataset.from_tensor_slices((x, ids.astype(np.int32)))

    expected = [b for b in data.train_dataset(from_memory, 8, seed=3).take(70).as_numpy_iterator()]  # > 1 pass
    for files in (
        data.TFRecordFiles(train, eval_, features=features),
        data.TFRecordFiles(train, eval_, parse_fn=parse_one),
    ):
        inp = data.Input(files)
        assert inp.train_arrays() is not None and inp.train_arrays()[0].dtype == object
        got = [b for b in data.train_dataset(inp, 8, seed=3).take(70).as_numpy_iterator()]
        resumed = [b for b in data.train_dataset(inp, 8, seed=3, skip_batches=61).take(9).as_numpy_iterator()]
        indexed = data.indexed_batches(inp, 8, seed=3)
        closure = indexed.batch(next(iter(indexed.source())), tf.constant(66, tf.int64))
        for want, have in zip(expected, got):
            np.testing.assert_array_equal(want[1], have[1])
            np.testing.assert_array_equal(want[0], have[0])
        assert [b[1].tolist() for b in resumed] == [b[1].tolist() for b in expected[61:]]
        assert closure[1].numpy().tolist() == expected[66][1].tolist()
    streamed = data.Input(data.TFRecordFiles(train, eval_, features=features, max_memory_bytes=1024))
    assert streamed.train_arrays() is None and data.indexed_batches(streamed, 8, seed=3) is None
    with_files = data.Input(data.TFRecordFiles(train, eval_, features=features))  # FILE: each worker its own files
    assert data.pipeline.held_train(with_files, "FILE") is None and data.pipeline.held_train(with_files, "AUTO")
    pipelines = tf.distribute.InputContext(num_input_pipelines=3)  # 3 files: AUTO shards them by file only streamed
    assert not data.shards_by_file(with_files, "AUTO", pipelines) and data.shards_by_file(streamed, "AUTO", pipelines)
    assert "train.shard_policy to 'AUTO' or 'DATA'" in how_to_get_exact(with_files, "FILE")
    assert "raise tfrecord_files.max_memory_bytes (1024) to at least" in how_to_get_exact(streamed, "AUTO")


def test_the_start_line_says_what_a_restart_guarantees_where_it_is_not_exact():
    assert guarantee(INDEXED, asynchronous=True, workers=3, deterministic=True) is None
    served = guarantee(SERVICE, asynchronous=False, workers=2, deterministic=True)
    assert "at most once" in served and "from_tensor_slices" in served
    assert "(approximate)" in guarantee(STREAM, asynchronous=True, workers=2, deterministic=True)
    assert "exact only on the same worker count" in guarantee(STREAM, asynchronous=True, workers=1, deterministic=True)
    assert "(approximate)" in guarantee(STREAM, asynchronous=False, workers=1, deterministic=False)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_change_of_the_data_at_restore_is_one_line_or_allowed_with_what_the_position_then_means(tmp_path):
    model_dir = str(tmp_path / "run")
    digits = ["--gin_file=gin/single.gin", "--gin_bindings=train.checkpoint_every_steps = 4"]
    results = main_in_one_process(
        {
            "first": ([*digits, "--gin_bindings=train.total_steps = 4"], model_dir),
            "other seed": (
                [*digits, "--gin_bindings=train.total_steps = 8", "--gin_bindings=train.seed = 1"],
                model_dir,
            ),
            "other data": (
                [
                    *digits,
                    "--gin_bindings=train.total_steps = 8",
                    "--gin_bindings=train.input_fn = @digits()",
                    "--gin_bindings=digits.eval_fraction = 0.5",
                ],
                model_dir,
            ),
            "allowed": (
                [
                    *digits,
                    "--gin_bindings=train.total_steps = 8",
                    "--gin_bindings=train.seed = 1",
                    "--gin_bindings=train.allow_resume_changes = True",
                ],
                model_dir,
            ),
        }
    )
    assert results["first"]["code"] == 0, results["first"]["stderr"][-3000:]
    for case, change in (("other seed", "seed 0 -> 1"), ("other data", "num_examples 1438 -> 899")):
        refused = results[case]
        assert refused["code"] == 2 and refused["unchanged"], (case, refused["stdout"][-3000:])
        (line,) = [line for line in refused["stderr"].splitlines() if line.startswith("error:")]
        assert change in line and "256 examples into the order of 1438" in line and "allow_resume_changes" in line
    allowed = results["allowed"]
    assert allowed["code"] == 0, allowed["stderr"][-3000:]
    assert (
        "seed 0 -> 1), with train.allow_resume_changes: going on at global batch 4 of the new order"
        in (allowed["stdout"])
    )


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_tfrecord_files_resume_at_exactly_the_next_example_and_say_how_to_when_they_stream(tmp_path):
    """The counting run on TFRecord files (one device): stopped at step 48 and resumed, every id is trained
    on exactly twice in two passes and nothing says otherwise; over tfrecord_files.max_memory_bytes the same
    files stream, and the run's start says so and what budget would hold them."""
    files = [*COUNTING, *id_counting.tfrecord_bindings(str(tmp_path)), "--gin_file=gin/single.gin"]
    model_dir = str(tmp_path / "run")
    results = main_in_one_process(
        {
            "first": ([*files, "--gin_bindings=train.total_steps = 48"], model_dir),
            "resumed": (files, model_dir),
            "streamed": (
                [
                    *files,
                    "--gin_bindings=train.total_steps = 4",
                    "--gin_bindings=tfrecord_files.max_memory_bytes = 1024",
                ],
                str(tmp_path / "streamed"),
            ),
        }
    )
    for case in ("first", "resumed", "streamed"):
        assert results[case]["code"] == 0, (case, results[case]["stderr"][-3000:])
    assert counts(model_dir) == [0, 0, 512]
    assert "restored" in results["resumed"]["stdout"]  # its first lines are in the tail it keeps
    for case in ("first", "resumed"):
        assert not any(line.startswith("data: ") for line in results[case]["stdout"].splitlines())
    (line,) = [line for line in results["streamed"]["stdout"].splitlines() if line.startswith("data: ")]
    assert "a stream without random access" in line and "raise tfrecord_files.max_memory_bytes (1024)" in line


def run_to_the_end(model_dir, *args: str) -> str:
    """Reruns the counting run in `model_dir` to step 128; returns its stdout."""
    main = Main(*COUNTING, *args, f"--model_dir={model_dir}")
    assert main.finish(timeout=300) == 0, main.tail()
    return main.stdout


@pytest.mark.slow
@pytest.mark.timeout(700)
def test_parameter_servers_killed_and_resumed_on_3_workers_train_every_id_exactly_twice(tmp_path):
    """The embedded cluster (1 ps, 2 workers) SIGKILLed as a whole process group after the checkpoint at
    step 48, then resumed on 3 workers: each closure's batches are given by index, so the 48 steps kept
    are 384 distinct ids, and the two passes end with every id trained on exactly twice."""
    model_dir = tmp_path / "run"
    main = Main("--gin_file=gin/ps.gin", *COUNTING, *paused_at(48), f"--model_dir={model_dir}")
    try:
        main.wait_for("paused at step 48", timeout=300)
        os.killpg(main.proc.pid, signal.SIGKILL)
    finally:
        main.finish(timeout=60)
    assert counts(model_dir) == [128, 384]
    out = run_to_the_end(model_dir, "--gin_file=gin/ps.gin", "--gin_bindings=local_cluster.num_workers = 3")
    assert "(3 worker(s))" in out and "restored" in out
    assert not any(line.startswith("data: ") for line in out.splitlines())  # exact: no guarantee line
    assert counts(model_dir) == [0, 0, 512]


@pytest.mark.slow
@pytest.mark.timeout(700)
def test_parameter_servers_preempted_with_sigterm_train_every_id_exactly_twice(tmp_path):
    """SIGTERM to the coordinator mid-run: the preemption save lands between periodic checkpoints (step 40),
    and the rerun goes on from there. The ids are TFRecord files here: held as their records, each closure
    gathers and parses its global batches by index, as from arrays."""
    model_dir = tmp_path / "run"
    files = id_counting.tfrecord_bindings(str(tmp_path))
    main = Main("--gin_file=gin/ps.gin", *COUNTING, *files, *paused_at(36, secs=3), f"--model_dir={model_dir}")
    try:
        main.wait_for("paused at step 36", timeout=300)
        main.proc.send_signal(signal.SIGTERM)
        assert main.finish(timeout=120) == 42, main.tail()
    finally:
        main.kill()
    assert "preempted: saved ckpt-40" in main.stdout and counts(model_dir) == [192, 320]
    assert not any(line.startswith("data: ") for line in main.stdout.splitlines())  # exact: no guarantee line
    run_to_the_end(model_dir, "--gin_file=gin/ps.gin", *files)
    assert counts(model_dir) == [0, 0, 512]


@pytest.mark.slow
@pytest.mark.timeout(700)
def test_multi_worker_mirrored_killed_and_resumed_on_1_worker_trains_every_id_exactly_twice(tmp_path):
    """2 MultiWorkerMirrored workers under the launcher, each SIGKILLed with its process group after the
    checkpoint at step 48; the run resumed on 1 worker trains on the same global batches."""
    model_dir = str(tmp_path / "run")
    args = ["--gin_file=gin/mwms.gin", *COUNTING, *paused_at(48), f"--model_dir={model_dir}"]
    launcher = subprocess.Popen(
        [sys.executable, "-m", "trainer.launch", "--num_workers=2", "--", *args],
        cwd=REPO,
        env=subprocess_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    paused = threading.Event()
    lines: list[str] = []

    def read() -> None:
        # Every worker pauses after its own part of the save at 48; the chief may still be writing ckpt-48
        # when the other worker's line comes, and a kill then leaves ckpt-32 the newest intact checkpoint.
        for line in launcher.stdout:
            lines.append(line)
            if sum("paused at step 48" in seen for seen in lines) == 2:
                paused.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert paused.wait(timeout=300), "".join(lines[-20:])
        for pid in trainer_pids_for(model_dir):  # the workers (each in its own session) and the launcher
            os.killpg(pid, signal.SIGKILL)
        launcher.wait(timeout=60)
    finally:
        for pid in trainer_pids_for(model_dir):
            os.killpg(pid, signal.SIGKILL)
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait(timeout=30)
    assert counts(model_dir) == [128, 384]
    out = run_to_the_end(model_dir, "--gin_file=gin/mwms.gin")
    assert "resuming on 1 worker(s) (was 2)" in out
    assert counts(model_dir) == [0, 0, 512]
