"""Examples of any length (trainer/data/sequences.py): padded to the longest example of each global batch
without changing the order, bucketed by length within windows of the order (every global batch full, a
pure function of the seed and its index, so exact across a restart), ragged features, eval and predict,
one trace of the loop, under every strategy, and the mistakes refused in one line each.
"""

from __future__ import annotations

import collections
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

from tests import sequence_inputs
from tests.sequence_inputs import NUM_EVAL, NUM_TRAIN, length, numbered, ragged_words, streamed_numbered
from tests.support import REPO, read_jsonl, refused_in_one_process, subprocess_env, tree_digest
from tests.test_examples_a import run_in_group
from tests.test_ps import assert_all_gone, server_pids
from tests.test_resume import held_at, kill_group, per_step_losses, wait_for_step
from trainer import data
from trainer.data.sequences import SequenceBatching
from trainer.errors import UserError

pytestmark = pytest.mark.xdist_group("sequences")

BUCKETED = SequenceBatching(bucket_window=4)


def batches(dataset: tf.data.Dataset, count: int) -> list:
    return list(dataset.take(count).as_numpy_iterator())


def assert_padded_rows(tokens: np.ndarray, ids: np.ndarray, pad: int = 0) -> None:
    """Each row is its example's tokens then `pad`, the batch as wide as its longest example."""
    assert tokens.shape == (len(ids), length(ids).max()), (tokens.shape, ids)
    for row, i in zip(tokens, ids):
        n = int(length(i))
        assert list(row) == [i + 1] * n + [pad] * (tokens.shape[1] - n), (row, i)


def test_per_batch_padding_keeps_the_global_order():
    inp = data.Input(numbered, sequences=SequenceBatching(padding_values=-1))
    assert inp.train_arrays() is not None  # held in memory: read by index
    assert inp.element_spec[0] == tf.TensorSpec([None], tf.int32)
    for b, (tokens, ids) in enumerate(batches(data.train_dataset(inp, 8, seed=3), 15)):  # over an epoch's end
        np.testing.assert_array_equal(ids, data.batch_indices(b, 8, NUM_TRAIN, 3))
        assert_padded_rows(tokens, ids, pad=-1)


def test_a_streamed_split_is_padded_per_batch():
    inp = data.Input(streamed_numbered)
    assert inp.train_arrays() is None
    seen = []
    for tokens, ids in batches(data.train_dataset(inp, 8, seed=3), 12):
        assert_padded_rows(tokens, ids)
        seen.extend(ids)
    assert sorted(seen) == list(range(NUM_TRAIN))  # the first epoch, each example once


def window_checks(got: list, window: int, order_of) -> None:
    """Every batch full; each window holds exactly its positions' examples, cut from them sorted by length."""
    for w in range(len(got) // window):
        part = got[w * window : (w + 1) * window]
        assert all(len(ids) == 8 for _, ids in part)
        held = sorted(i for _, ids in part for i in ids)
        assert held == sorted(order_of(w)), w
        spans = sorted((length(ids).min(), length(ids).max()) for _, ids in part)
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), spans  # sorted, then cut
        for tokens, ids in part:
            assert_padded_rows(tokens, ids)


def test_bucketing_is_a_pure_function_of_the_batch_and_keeps_every_batch_full():
    inp = data.Input(numbered, sequences=BUCKETED)
    got = batches(data.train_dataset(inp, 8, seed=3), 24)  # 6 windows of 4 batches, 2 epochs
    window_checks(
        got, 4, lambda w: np.concatenate([data.batch_indices(b, 8, NUM_TRAIN, 3) for b in range(4 * w, 4 * w + 4)])
    )
    # Less padding than per-batch padding of the same order.
    plain = batches(data.train_dataset(data.Input(numbered), 8, seed=3), 24)
    assert sum(t.size for t, _ in got) < 0.8 * sum(t.size for t, _ in plain)
    # A resumed run (batch 9 on, a fresh Input) and a parameter-server closure get exactly the same batches.
    resumed = batches(data.train_dataset(data.Input(numbered, sequences=BUCKETED), 8, seed=3, skip_batches=9), 15)
    indexed = data.indexed_batches(data.Input(numbered, sequences=BUCKETED), 8, seed=3)
    split = next(iter(indexed.source()))
    for b, (tokens, ids) in enumerate(got):
        if b >= 9:
            np.testing.assert_array_equal(resumed[b - 9][1], ids)
            np.testing.assert_array_equal(resumed[b - 9][0], tokens)
        closure_tokens, closure_ids = indexed.batch(split, tf.constant(b, tf.int64))
        np.testing.assert_array_equal(closure_ids, ids)
        np.testing.assert_array_equal(closure_tokens, tokens)


def test_a_streamed_split_is_bucketed_by_the_same_rule():
    got = batches(data.train_dataset(data.Input(streamed_numbered, sequences=BUCKETED), 8, seed=3), 12)
    window_checks(got, 4, lambda w: [i for _, ids in got[4 * w : 4 * w + 4] for i in ids])
    assert sorted(i for _, ids in got for i in ids) == list(range(NUM_TRAIN))
    again = batches(data.train_dataset(data.Input(streamed_numbered, sequences=BUCKETED), 8, seed=3, skip_batches=5), 7)
    for (t1, i1), (t2, i2) in zip(got[5:], again):
        np.testing.assert_array_equal(i1, i2)
        np.testing.assert_array_equal(t1, t2)


def test_bucket_boundaries_group_lengths_into_buckets():
    config = SequenceBatching(bucket_window=4, bucket_boundaries=[4, 8])
    got = batches(data.train_dataset(data.Input(numbered, sequences=config), 8, seed=3), 4)
    buckets = [np.searchsorted([4, 8], length(ids), side="right") for _, ids in got]
    assert all(len(b) == 8 for b in buckets)
    spans = sorted((b.min(), b.max()) for b in buckets)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), spans


def test_ragged_features_are_padded_dense_in_train_and_eval_batches():
    inp = data.Input(ragged_words)
    assert inp.element_spec[0] == tf.TensorSpec([None, None], tf.int32)
    for words, labels in batches(data.train_dataset(inp, 8, seed=0), 3):
        assert words.ndim == 3 and words.shape[0] == 8 and 1 <= words.shape[1] <= 3 and 1 <= words.shape[2] <= 4
        assert labels.shape == (8,)
    evals = batches(data.eval_dataset(inp, 8, pad_to_multiple_of=16), 10)
    assert [len(w) for _, _, w in evals] == [8, 8, 8, 8]  # 20 examples padded to 32
    weights = np.concatenate([w for _, _, w in evals])
    assert weights.sum() == NUM_EVAL and not weights[NUM_EVAL:].any()
    words = [row for batch, _, _ in evals for row in batch]
    assert (
        words[NUM_EVAL][0, 0] == words[0][0, 0] == 1 and words[NUM_EVAL + 1][1, 0] == words[1][1, 0] == 2
    )  # padding: copies of real examples


def test_eval_batches_are_padded_to_their_own_longest():
    evals = batches(data.eval_dataset(data.Input(numbered), 8, pad_to_multiple_of=8), 10)
    ids = np.concatenate([i for _, i, _ in evals])
    assert list(ids[:NUM_EVAL]) == list(range(NUM_EVAL))
    for tokens, batch_ids, _ in evals:
        assert_padded_rows(tokens, batch_ids)


def test_the_loop_and_eval_trace_once_over_batches_of_every_length():
    from trainer.loops.build import build_sync_loops
    from trainer.run.settings import Settings
    from trainer.run.setup import setup

    settings = Settings(
        input_fn=sequence_inputs.sequence_classes,
        model_fn=sequence_inputs.lstm_classifier,
        global_batch_size=16,
        steps_per_loop=3,
        sequences=SequenceBatching(bucket_window=2),
        print_fn=lambda line: None,
    )
    runtime, task = setup(settings)
    loop, evaluators = build_sync_loops(runtime, task, settings, step_fn=task.step_fn, start_step=0)
    loop.trace("classification_step")
    widths = collections.Counter(
        t[0]["tokens"].shape[1] for t in batches(data.train_dataset(task.input, 16, settings.seed), 12)
    )
    assert len(widths) >= 3, widths  # batches of several lengths
    for _ in range(4):
        loop.run(3)
    assert loop.trace_count == 1
    evaluator = evaluators["eval"]
    evaluator.trace()
    first, second = evaluator.evaluate(), evaluator.evaluate()
    assert first["num_examples"] == 40 and first == second
    assert evaluator._eval_batches.experimental_get_tracing_count() == 1


@pytest.mark.parametrize(
    "config, words",
    [
        (dict(bucket_window=4, bucket_boundaries=[8, 8, 16]), "increasing order"),
        (dict(bucket_window=4, bucket_boundaries=[16, 8]), "increasing order"),
        (dict(bucket_boundaries=[8, 16]), "bucket_window is 0"),
        (dict(bucket_window=-1), "sequences.bucket_window"),
    ],
)
def test_bad_bucketing_is_one_line(config, words):
    with pytest.raises(UserError, match=words) as error:
        SequenceBatching(**config)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize(
    "config, words",
    [
        (dict(padding_values=0.5), "gives 0.5 for the feature at [0], which is int32"),
        (dict(padding_values="x"), "gives 'x' for the feature at [0], which is int32"),
        (dict(padding_values=(0, 0, 0)), "is not in the structure"),
        (dict(bucket_window=2, length_feature=1), "is a scalar (int64), not a sequence"),
        (dict(bucket_window=2, length_feature="tokens"), "names no feature"),
    ],
)
def test_bad_padding_and_length_feature_are_one_line(config, words):
    with pytest.raises(UserError) as error:
        data.Input(numbered, sequences=SequenceBatching(**config)).validate()
    assert words in str(error.value) and "\n" not in str(error.value)


def test_bucketing_fixed_shape_examples_is_refused():
    with pytest.raises(UserError, match="every feature of .* has a fixed shape"):
        data.Input(data.Digits(), sequences=BUCKETED).validate()


# --- Runs: the worked example (experiments/text/sequences.gin) under every strategy. ---

STEPS = 40
SHORT = [
    f"train.total_steps={STEPS}",
    f"train.eval_every_steps={STEPS}",
    "train.checkpoint_every_steps=10",
    "train.log_every_steps=1",
    "train.steps_per_loop=1",  # one length per call on several replicas (sparse gradients: trainer/loops/sync.py)
    "TokenSequences.num_train=640",
    "TokenSequences.num_eval=100",
]


# Ten steps per loop call: batches of several lengths in one compiled call.
CALLS_OF_TEN = [*SHORT, "train.log_every_steps=10", "train.steps_per_loop=10"]


def flags(mode: str, model_dir: str, bindings: list[str] = SHORT) -> list[str]:
    return [
        f"--gin_file=gin/{mode}.gin",
        "--gin_file=experiments/text/sequences.gin",
        f"--model_dir={model_dir}",
        *(f"--gin_bindings={b}" for b in bindings),
    ]


def said_data(output: str) -> bool:
    """Whether the run said that its restart is not exact (the `data:` line)."""
    return any(line.startswith("data:") for line in output.splitlines())


def final_eval(model_dir: str) -> dict:
    evals = [r for r in read_jsonl(os.path.join(model_dir, "metrics.jsonl")) if r["split"] == "eval"]
    assert evals and evals[-1]["step"] == STEPS, evals
    return evals[-1]


@pytest.fixture(scope="module")
def mirrored_dir(tmp_path_factory) -> str:
    """One bucketed mirrored run (2 logical CPUs) logging every step: the reference of the resume test."""
    model_dir = str(tmp_path_factory.mktemp("mirrored"))
    code, output = run_in_group(["-m", "trainer.main", *flags("mirrored", model_dir)], 200)
    assert code == 0, output[-3000:]
    assert "on 2 replica(s)" in output and not said_data(output), output[-3000:]  # held: an exact restart
    # Held padded to the longest of all, so the host cuts each batch to its own longest: not the device split.
    assert "train data: through the tf.data pipeline (examples of varying length" in output, output[-3000:]
    return model_dir


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_bucketed_example_trains_mirrored_and_predicts(mirrored_dir, tmp_path):
    assert final_eval(mirrored_dir)["accuracy"] > 0.6
    out = str(tmp_path / "predictions.npz")
    code, output = run_in_group(
        ["-m", "trainer.main", *flags("mirrored", mirrored_dir), "--mode=predict", f"--output={out}"], 200
    )
    assert code == 0, output[-3000:]
    assert len(np.load(out)["output"]) == 100  # every eval example once, the padded rows left out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_killed_bucketed_run_resumes_exactly(mirrored_dir, tmp_path):
    """SIGKILL after a checkpoint, the same command again: the per-step losses of the uninterrupted run."""
    model_dir = str(tmp_path / "resumed")
    args = ["-m", "trainer.main", *flags("mirrored", model_dir)]
    first = subprocess.Popen(
        [sys.executable, *args, *held_at(27)],
        cwd=REPO,
        env=subprocess_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        wait_for_step(model_dir, 27, first)
    finally:
        kill_group(first)
    code, output = run_in_group(args, 200)
    assert code == 0, output[-3000:]
    restored = int(output.split("continuing from step ")[1].split()[0])
    assert 10 <= restored < 27
    expected, got = per_step_losses(mirrored_dir), per_step_losses(model_dir)
    for step in range(restored + 1, STEPS + 1):
        assert got[step] == expected[step], (step, got[step], expected[step])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_bucketed_example_trains_on_two_multi_worker_mirrored_workers(tmp_path, mirrored_dir):
    """The same global batches as on 2 mirrored replicas: the same eval loss, to float rounding."""
    model_dir = str(tmp_path / "run")
    args = [
        "-m",
        "trainer.launch",
        "--num_workers=2",
        "--",
        *flags("mwms", model_dir, [*SHORT, "train.log_every_steps=10"]),
    ]
    code, output = run_in_group(args, 250)
    assert code == 0, output[-3000:]
    assert "on 2 replica(s) (2 worker(s))" in output, output[-3000:]
    assert final_eval(model_dir)["loss"] == pytest.approx(final_eval(mirrored_dir)["loss"], rel=1e-5)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_bucketed_example_trains_under_central_storage(tmp_path, mirrored_dir):
    """Ten steps per call on 2 replicas whose variables live on one device: the mirrored run's eval loss."""
    model_dir = str(tmp_path / "run")
    code, output = run_in_group(["-m", "trainer.main", *flags("central_storage", model_dir, CALLS_OF_TEN)], 250)
    assert code == 0, output[-3000:]
    assert "on 2 replica(s)" in output, output[-3000:]
    assert final_eval(model_dir)["loss"] == pytest.approx(final_eval(mirrored_dir)["loss"], rel=1e-5)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_bucketed_example_trains_on_parameter_servers(tmp_path):
    model_dir = str(tmp_path / "run")
    code, output = run_in_group(["-m", "trainer.main", *flags("ps", model_dir, CALLS_OF_TEN)], 250)
    assert code == 0, output[-3000:]
    assert "strategy 'parameter_server'" in output and not said_data(output), output[-3000:]
    assert_all_gone(server_pids(output))
    assert final_eval(model_dir)["accuracy"] > 0.6


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sequence_mistakes_are_refused_before_anything_is_written(tmp_path):
    example = ["--gin_file=gin/single.gin", "--gin_file=experiments/text/sequences.gin"]
    lines = refused_in_one_process(
        tmp_path,
        {
            "padding_dtype": [*example, "--gin_bindings=sequences.padding_values = 0.5"],
            "padding_structure": [*example, "--gin_bindings=sequences.padding_values = {'tokens': 0}"],
            "boundaries": [*example, "--gin_bindings=sequences.bucket_boundaries = [16, 8]"],
            "length_feature": [*example, "--gin_bindings=sequences.length_feature = 1"],
            "with_the_service": [*example, "--gin_bindings=train.data_service = 'local'"],
        },
    )
    # Several lengths in one call on 2 replicas: the Embedding's sparse gradient is summed by an all-gather.
    mirrored = [*flags("mirrored", str(tmp_path / "mirrored"), CALLS_OF_TEN)]
    code, output = run_in_group(["-m", "trainer.main", *mirrored], 200)
    assert code == 2 and "set train.steps_per_loop = 1" in output, output[-3000:]
    assert not os.path.exists(tmp_path / "mirrored" / "metrics.jsonl")
    assert "gives 0.5 for the feature at [0], which is int32" in lines["padding_dtype"]
    assert "is not in the structure" in lines["padding_structure"]
    assert "increasing order" in lines["boundaries"]
    assert "not a sequence" in lines["length_feature"]
    assert "train.data_service hands out its own stream" in lines["with_the_service"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sequences_train_from_the_data_service(tmp_path):
    """The service's data workers pad each batch to its longest (no bucketing: it hands out its own stream)."""
    model_dir = str(tmp_path / "run")
    bindings = [*CALLS_OF_TEN, "sequences.bucket_window = 0", "train.data_service = 'local'"]
    code, output = run_in_group(["-m", "trainer.main", *flags("single", model_dir, bindings)], 250)
    assert code == 0, output[-3000:]
    assert said_data(output), output[-3000:]  # the service's at-most-once guarantee, said
    assert final_eval(model_dir)["accuracy"] > 0.6


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_resuming_with_another_bucket_window_is_refused(mirrored_dir, tmp_path):
    """Another window would name other examples at the checkpoint's position: one line, nothing written."""
    model_dir = str(tmp_path / "copy")
    shutil.copytree(mirrored_dir, model_dir)
    before = tree_digest(model_dir)
    code, output = run_in_group(
        ["-m", "trainer.main", *flags("mirrored", model_dir, [*SHORT, "sequences.bucket_window = 4"])], 200
    )
    assert code == 2, output[-3000:]
    assert "bucket_window 8 -> 4" in output and "allow_resume_changes" in output, output[-3000:]
    assert tree_digest(model_dir) == before
