"""Tests of user input functions of any structure through trainer.data, with real TensorFlow."""

import json
import re

import numpy as np
import pytest
import tensorflow as tf

from tests.support import run_python, write_idx
from trainer import data
from trainer.errors import UserError

COUNTS = {"train": 40, "eval": 11}


def regression(split: str) -> tf.data.Dataset:
    """Dict features (float and int, of different shapes) and a float target."""
    rng = np.random.RandomState({"train": 0, "eval": 1}[split])
    count = COUNTS[split]
    features = {"x": rng.normal(size=(count, 3)).astype(np.float32), "ids": rng.randint(0, 9, (count, 4))}
    return tf.data.Dataset.from_tensor_slices((features, rng.normal(size=count).astype(np.float32)))


def streamed(split: str) -> tf.data.Dataset:
    """The same examples, of unknown count: they cannot be held in memory."""
    return regression(split).filter(lambda *example: True)


def _numpy(batch):
    return tf.nest.map_structure(lambda t: t.numpy(), batch)


def _batches(dataset: tf.data.Dataset, count: int) -> list:
    return [_numpy(batch) for batch in dataset.take(count)]


def _assert_same(a: list, b: list) -> None:
    assert len(a) == len(b)
    for left, right in zip(a, b):
        tf.nest.map_structure(np.testing.assert_array_equal, left, right)


def test_input_describes_the_function():
    inp = data.Input(regression)
    features, target = inp.element_spec
    assert features["x"].shape == (3,) and features["ids"].dtype == tf.int64 and target.dtype == tf.float32
    assert inp.num_classes is None and inp.input_shape is None and inp.eval_splits == ("eval",)
    assert inp.num_examples("train") == 40 and data.Input(streamed).num_examples("eval") == 11
    assert not inp.shards_itself and data.as_input(inp) is inp
    digits = data.as_input(data.Digits(), eval_splits=("eval",))
    assert digits.input_shape == (8, 8, 1) and digits.num_classes == 10 and digits.shards_itself


def test_dict_features_and_float_targets_batch_with_their_dtypes():
    for fn in (regression, streamed):
        features, target = next(iter(data.train_dataset(fn, 8, seed=1)))
        assert set(features) == {"x", "ids"} and features["x"].shape == (8, 3) and features["ids"].shape == (8, 4)
        assert target.dtype == tf.float32 and features["ids"].dtype == tf.int64, fn.__name__
        assert not np.array_equal(target.numpy(), np.round(target.numpy()))  # not truncated to integers


def test_in_memory_float_labels_stay_float():
    assert data.sources.label_array(np.array([0.5, 1.5])).dtype == np.float32
    assert data.sources.label_array(np.array([1, 2], np.int64)).dtype == np.int32


@pytest.mark.parametrize("fn", [regression, streamed])
def test_skip_and_drop_give_the_batches_of_the_full_stream(fn):
    inp = data.Input(fn)
    full = _batches(data.train_dataset(inp, 16, seed=3), 14)
    for skip in (3, 7):  # 7 * 16 = 112 = 2 * 40 + 32: starts mid-epoch
        _assert_same(full[skip : skip + 4], _batches(data.train_dataset(inp, 16, seed=3, skip_batches=skip), 4))
    drops = [2, 3, 9]
    kept = [b for i, b in enumerate(full) if i not in drops]
    for skip in (0, 2, 6):
        _assert_same(
            kept[skip : skip + 5],
            _batches(data.train_dataset(inp, 16, seed=3, skip_batches=skip, drop_batches=drops), 5),
        )


def test_sharded_training_keeps_each_pipelines_examples():
    context = tf.distribute.InputContext(num_input_pipelines=2, input_pipeline_id=1, num_replicas_in_sync=2)
    seen = {}
    for fn in (regression, streamed):  # in memory: by index; streamed: Dataset.shard
        batches = _batches(data.train_dataset(fn, 4, seed=0, input_context=context), 5)
        seen[fn.__name__] = np.sort(np.concatenate([target for _, target in batches]))
    expected = np.sort([t for _, t in regression("train").shard(2, 1).as_numpy_iterator()])
    np.testing.assert_array_equal(seen["regression"], expected)
    np.testing.assert_array_equal(seen["streamed"], expected)

    calls = []

    def own_shards(split, input_context=None):
        calls.append(input_context)
        return regression(split).shard(2, input_context.input_pipeline_id) if input_context else regression(split)

    batches = _batches(data.train_dataset(own_shards, 4, seed=0, input_context=context), 5)
    assert calls[-1] is context  # called with the context: it shards itself
    np.testing.assert_array_equal(np.sort(np.concatenate([t for _, t in batches])), expected)


def test_eval_of_a_dict_example_pads_with_copies_and_counts_each_once():
    def features_only(split):
        return regression(split).map(lambda features, target: {**features, "target": target})

    batches = _batches(data.eval_dataset(features_only, 4, pad_to_multiple_of=8), 10)
    assert [len(w) for _, w in batches] == [4, 4, 4, 4]
    examples = {key: np.concatenate([b[key] for b, _ in batches]) for key in ("x", "ids", "target")}
    weights = np.concatenate([w for _, w in batches])
    assert weights.dtype == np.float32 and weights.sum() == 11 and not weights[11:].any()
    expected = next(iter(features_only("eval").batch(100)))
    for key, values in examples.items():
        np.testing.assert_array_equal(values[:11], expected[key].numpy())
        np.testing.assert_array_equal(values[11:], expected[key].numpy()[:5])  # copies of the first examples
        assert values.dtype == expected[key].dtype
    tuples = _batches(data.eval_dataset(regression, 5), 10)
    assert [len(t) for _, t, _ in tuples] == [5, 5, 1] and all(len(b) == 3 for b in tuples)


def test_replica_slices_of_a_dict_structure():
    context = tf.distribute.InputContext(num_input_pipelines=2, input_pipeline_id=1, num_replicas_in_sync=4)
    global_batch = {"x": tf.reshape(tf.range(16.0), [8, 2]), "y": tf.range(8)}
    slices = _batches(data.replica_slices(tf.data.Dataset.from_tensors(global_batch), context), 10)
    assert [list(s["y"]) for s in slices] == [[4, 5], [6, 7]]  # replicas 2 and 3 of 4
    np.testing.assert_array_equal(slices[0]["x"], [[8, 9], [10, 11]])


@pytest.mark.parametrize(
    "bad, words",
    [
        (lambda split: regression(split).batch(4), "of shape (None, 4) at [0]['ids']"),
        (lambda split: [1, 2, 3], "a list, not a tf.data.Dataset"),
        (lambda split: tf.data.Dataset.range(3).map(lambda i: tf.sparse.from_dense(tf.range(i))), "SparseTensorSpec"),
    ],
)
def test_a_bad_input_function_is_one_user_error_line(bad, words):
    with pytest.raises(UserError) as error:
        data.train_dataset(bad, 4, seed=0)
    message = str(error.value)
    assert "\n" not in message and words in message and "'train'" in message and "<lambda>" in message
    assert "unbatched" in message


def test_missing_split_and_sizes_name_the_split():
    with pytest.raises(UserError, match="has no split 'validation'"):
        data.Input(data.Digits(), eval_splits=("validation",)).validate()
    with pytest.raises(UserError, match="the test split has no examples"):
        data.Input(
            lambda split: regression("train").take(0 if split == "test" else 40), eval_splits=("test",)
        ).check_sizes(8)
    with pytest.raises(UserError, match="train split has 40 examples, fewer than one global batch of 64"):
        data.check_sizes(regression, 64)


def _png_records(path, count: int) -> list:
    rng = np.random.RandomState(0)
    examples = []
    with tf.io.TFRecordWriter(str(path)) as writer:
        for i in range(count):
            image = rng.randint(0, 256, (5, 4, 3)).astype(np.uint8)
            tokens = list(range(1, i + 2))  # lengths 1, 2, ...: padded or truncated to 3
            feature = {
                "image": tf.train.Feature(bytes_list=tf.train.BytesList(value=[tf.io.encode_png(image).numpy()])),
                "tokens": tf.train.Feature(int64_list=tf.train.Int64List(value=tokens)),
                "label": tf.train.Feature(int64_list=tf.train.Int64List(value=[i % 3])),
            }
            writer.write(tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString())
            examples.append((image, (tokens + [0, 0])[:3], i % 3))
    return examples


def test_tfrecord_with_png_images_int64_sequences_and_a_label(tmp_path):
    written = {split: _png_records(tmp_path / f"{split}.tfrecord", n) for split, n in (("train", 6), ("eval", 3))}
    features = {
        "image": data.png_feature((5, 4, 3)),
        "tokens": data.int64_sequence_feature(3),
        "label": data.int64_feature(),
    }
    source = data.TFRecordFiles(str(tmp_path / "train.*"), str(tmp_path / "eval.*"), features=features, num_classes=3)
    inp = data.Input(source)
    inp.validate()
    parts, label = inp.element_spec
    assert parts["image"].shape == (5, 4, 3) and parts["image"].dtype == tf.float32
    assert parts["tokens"].shape == (3,) and parts["tokens"].dtype == tf.int32 and label.dtype == tf.int32
    assert inp.input_shape is None and inp.num_examples("train") == 6 and inp.num_classes == 3
    for (got, got_label), (image, tokens, expected_label) in zip(source("train").as_numpy_iterator(), written["train"]):
        np.testing.assert_allclose(got["image"], image / 255.0, rtol=1e-6)
        assert list(got["tokens"]) == tokens and got_label == expected_label
    assert next(iter(data.train_dataset(inp, 4, seed=0)))[0]["tokens"].shape == (4, 3)

    image_only = data.TFRecordFiles(
        str(tmp_path / "train.*"),
        str(tmp_path / "eval.*"),
        features={"image": data.png_feature((5, 4, 3)), "label": data.int64_feature()},
    )
    assert data.Input(image_only).input_shape == (5, 4, 3)  # one feature left: a single tensor
    unlabeled = data.TFRecordFiles(
        str(tmp_path / "train.*"),
        str(tmp_path / "eval.*"),
        features={"tokens": data.int64_sequence_feature(2)},
        label_key=None,
    )
    assert data.Input(unlabeled).element_spec.shape == (2,)
    parse = lambda record: tf.io.parse_single_example(  # noqa: E731
        record, {"label": tf.io.FixedLenFeature([], tf.int64)}
    )["label"]
    assert list(data.TFRecordFiles(str(tmp_path / "train.*"), "", parse_fn=parse)("train")) == [0, 1, 2, 0, 1, 2]
    with pytest.raises(UserError, match="label_key 'label' is not among"):
        data.TFRecordFiles("a", "b", features={"image": data.float_feature((2,))}).validate()


def test_fashion_mnist_validation_split_and_standardization(tmp_path):
    rng = np.random.RandomState(0)
    raw = {}
    for split, (image_file, label_file), count in zip(data.SPLITS, data.FASHION_MNIST_FILES.values(), (20, 7)):
        raw[split] = rng.randint(0, 256, (count, 28, 28)), rng.randint(0, 10, count)
        raw[split][0][:, 0, 0] = 9  # a constant pixel: divided by 1, not 0
        write_idx(tmp_path / image_file, 2051, raw[split][0])
        write_idx(tmp_path / label_file, 2049, raw[split][1])
    plain = data.FashionMnist(str(tmp_path))
    assert plain.splits == ("train", "eval")
    source = data.FashionMnist(str(tmp_path), validation_size=5, validation_from="back", standardize="per_pixel")
    inp = data.Input(source, eval_splits=("validation", "eval"))
    inp.validate()
    assert source.splits == ("train", "validation", "eval")
    assert [inp.num_examples(s) for s in source.splits] == [15, 5, 7]
    train_images = raw["train"][0][:15] / 255.0
    mean, std = train_images.mean(axis=0), train_images.std(axis=0)
    std[std < 1e-8] = 1
    for split, (images, labels) in (
        ("train", (raw["train"][0][:15], raw["train"][1][:15])),
        ("validation", (raw["train"][0][15:], raw["train"][1][15:])),
        ("eval", raw["eval"]),
    ):
        got_images, got_labels = source.arrays(split)
        np.testing.assert_allclose(got_images[..., 0], (images / 255.0 - mean) / std, rtol=1e-4, atol=1e-5)
        np.testing.assert_array_equal(got_labels, labels)
    standardized = source.arrays("train")[0]
    np.testing.assert_allclose(standardized.mean(axis=0)[1:, 1:], 0, atol=1e-5)
    assert not standardized[:, 0, 0].any()
    eval_batches = list(data.eval_dataset(inp, 4, split="validation").as_numpy_iterator())
    assert sum(len(w) for _, _, w in eval_batches) == 5
    with pytest.raises(UserError, match=re.escape("validation_size 20 leaves no training images")):
        data.FashionMnist(str(tmp_path), validation_size=20, validation_from="front").num_examples("train")


def test_a_split_of_unknown_size_is_counted_with_a_bound_and_a_progress_line(monkeypatch):
    """A generator that never ends is refused once counting passes COUNT_SECONDS, having said how far it got."""

    def endless(split):
        def examples():
            while True:
                yield np.zeros([2], np.float32)

        return tf.data.Dataset.from_generator(examples, output_signature=tf.TensorSpec([2], tf.float32))

    monkeypatch.setattr(data.inputs, "COUNT_SECONDS", 1.0)
    monkeypatch.setattr(data.inputs, "COUNT_PROGRESS_SECONDS", 0.2)
    inp, lines = data.Input(endless), []
    inp.print_fn = lines.append
    with pytest.raises(
        UserError,
        match=r"counting split 'train' .* took more than 1 s \(\d+ examples so far\): an "
        r"endless dataset\?.*assert_cardinality",
    ):
        inp.num_examples("train")
    assert lines and all(
        re.fullmatch(r"counting split 'train' \(its size is unknown to tf.data\): \d+ examples so far", line)
        for line in lines
    )
    assert data.Input(streamed).num_examples("train") == 40  # a finite one of unknown size is counted


def test_checking_many_eval_splits_says_how_far_it_got(monkeypatch):
    """Thousands of train.eval_splits take seconds to check and count before the run starts: a progress
    line says how many are done (issue 47), each split is still checked, and a missing one is still named."""

    def any_split(split):
        if split == "s7":
            raise KeyError(split)
        return tf.data.Dataset.from_tensor_slices(np.zeros([3 if split == "train" else 2, 2], np.float32))

    monkeypatch.setattr(data.inputs, "COUNT_PROGRESS_SECONDS", 0.0)  # a line after every split
    names = [f"s{i}" for i in range(7)]
    inp, lines = data.Input(any_split, eval_splits=names), []
    inp.print_fn = lines.append
    inp.validate()
    inp.check_sizes(3)
    assert lines == [
        *(f"checking the splits of train.input_fn: {done} of 8 splits" for done in range(1, 8)),
        *(f"counting the examples of train.eval_splits: {done} of 7 splits" for done in range(1, 7)),
    ]
    assert [inp.num_examples(name) for name in names] == [2] * 7
    with pytest.raises(UserError, match="raised KeyError: 's7' for split 's7'"):
        data.Input(any_split, eval_splits=[*names, "s7"]).validate()


def test_an_input_function_without_a_split_parameter_is_refused():
    with pytest.raises(UserError, match=r"train.input_fn .*\(\) takes no split.*add a first parameter `split`"):
        data.Input(lambda: regression("train"))
    data.Input(lambda name: regression(name))  # any name for the one positional parameter
    data.Input(lambda split, path="x": regression(split))


def test_what_an_input_function_raises_names_it_and_the_split():
    def broken(split):
        return {"train": regression("train")}[split]

    with pytest.raises(
        UserError,
        match=r"train.input_fn = @.*broken raised KeyError: 'eval' for split 'eval' "
        r"\(one of train.eval_splits\)",
    ) as caught:
        data.Input(broken).validate()
    assert "in broken" in caught.value.details and "tensorflow" not in caught.value.details


# Eval splits of two example structures (int32 and int64 labels), each of its own data and size: the splits
# of one structure share one traced pass (issue 47), and each must still evaluate its own examples.
MANY_SPLITS = """
import json, os, sys
import trainer

trainer.configure_devices(logical_cpus=2)
import numpy as np, tensorflow as tf

def any_split(split):
    count = 64 if split == "train" else 5 + int(split[1:])
    rng = np.random.default_rng(count)
    labels = rng.integers(0, 10, count).astype(np.int64 if split.startswith("w") else np.int32)
    return tf.data.Dataset.from_tensor_slices((rng.random((count, 8, 8, 1), dtype=np.float32), labels))

any_split.num_classes = 10
names = ["s1", "s2", "w3", "s4", "w5", "s6"]
results, lines = [], []
for order in (names, names[::-1]):
    model_dir = os.path.join(sys.argv[1], "-".join(order))
    trainer.train(model_dir=model_dir, input_fn=any_split, eval_splits=order, strategy="mirrored", total_steps=4,
                  steps_per_loop=2, eval_every_steps=2, log_every_steps=2, global_batch_size=8, print_fn=lines.append)
    with open(os.path.join(model_dir, "metrics.jsonl")) as f:
        results.append(sorted(json.dumps(record, sort_keys=True) for record in map(json.loads, f)
                              if record.get("split") in names))
print(json.dumps({"results": results, "lines": lines}))
"""


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_eval_splits_sharing_one_traced_pass_each_evaluate_their_own_examples(tmp_path):
    out = run_python(MANY_SPLITS.replace("sys.argv[1]", repr(str(tmp_path))), timeout=280)
    first, reversed_order = out["results"]
    assert first and first == reversed_order  # the same results by split whichever split was traced
    for name in ("s1", "s2", "w3", "s4", "w5", "s6"):  # each its own size, at each eval
        counted = [line for line in out["lines"] if line.startswith(f"eval on {name} at step ")]
        assert len(counted) == 4 and all(line.endswith(f"({5 + int(name[1:])} examples)") for line in counted)
    assert len({json.loads(record)["loss"] for record in first}) > 6  # not one split's loss repeated
