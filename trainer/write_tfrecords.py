"""Writes a built-in dataset to sharded TFRecord files (the built-in format of trainer.data.tfrecord), so FILE
sharding can be used and tried, and prints the gin bindings that train on them:

    python -m trainer.write_tfrecords --dataset=digits --out_dir=/tmp/digits --num_shards=4

Example i goes into shard i % N, so that `TFRecordFiles` reads them back in the original order.
"""

import os
from collections.abc import Sequence

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # as trainer.main: TensorFlow's INFO lines are noise here

from trainer import quiet_start  # noqa: E402

quiet_start.import_tensorflow()  # so its load-time C++ notices do not reach stderr

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from absl import app, flags  # noqa: E402

from trainer import data  # noqa: E402
from trainer.cli import fail, parse_flags  # noqa: E402
from trainer.errors import UserError  # noqa: E402

_DATASET = flags.DEFINE_enum("dataset", "digits", ["digits", "fashion_mnist", "synthetic"], "Dataset to write.")
_OUT_DIR = flags.DEFINE_string("out_dir", None, "Directory to write the shards into (created if missing).")
_NUM_SHARDS = flags.DEFINE_integer("num_shards", 4, "Number of files per split.")
_FASHION_MNIST_DIR = flags.DEFINE_string(
    "fashion_mnist_dir", None, "Directory of the four Fashion-MNIST .gz files (default: Keras' cache)."
)


def make_source(name: str, fashion_mnist_dir: str | None = None) -> data.DataSource:
    if name == "fashion_mnist":
        return data.FashionMnist(fashion_mnist_dir)
    if source := {"digits": data.Digits, "synthetic": data.Synthetic}.get(name):
        return source()
    raise UserError(f"unknown dataset {name!r}: use digits, fashion_mnist or synthetic")


def shard_paths(out_dir: str, split: str, num_shards: int) -> list[str]:
    return [os.path.join(out_dir, f"{split}-{i:05d}-of-{num_shards:05d}.tfrecord") for i in range(num_shards)]


def serialize(image: np.ndarray, label: int) -> bytes:
    features = {
        "image": tf.train.Feature(float_list=tf.train.FloatList(value=image.reshape(-1).tolist())),
        "label": tf.train.Feature(int64_list=tf.train.Int64List(value=[int(label)])),
    }
    return tf.train.Example(features=tf.train.Features(feature=features)).SerializeToString()


def write_split(source: data.DataSource, split: str, out_dir: str, num_shards: int) -> None:
    writers = [tf.io.TFRecordWriter(path) for path in shard_paths(out_dir, split, num_shards)]
    for i, (image, label) in enumerate(source.examples(split).as_numpy_iterator()):
        writers[i % num_shards].write(serialize(image, label))
    for writer in writers:
        writer.close()


def write(source: data.DataSource, out_dir: str, num_shards: int) -> data.TFRecordFiles:
    if num_shards < 1:
        raise UserError(f"--num_shards must be at least 1, got {num_shards}")
    source.validate()
    tf.io.gfile.makedirs(out_dir)
    for split in data.SPLITS:
        write_split(source, split, out_dir, num_shards)
    pattern = lambda split: os.path.join(out_dir, f"{split}-*-of-{num_shards:05d}.tfrecord")  # noqa: E731
    return data.TFRecordFiles(pattern("train"), pattern("eval"), tuple(source.input_shape), source.num_classes)


def main(argv: Sequence[str]) -> None:
    if len(argv) > 1:
        fail(f"unexpected arguments {argv[1:]}: pass everything as --flags")
    try:
        if not _OUT_DIR.value:
            raise UserError("--out_dir is required: pass the directory to write the shards into")
        source = make_source(_DATASET.value, _FASHION_MNIST_DIR.value)
        written = write(source, os.path.abspath(_OUT_DIR.value), _NUM_SHARDS.value)  # patterns valid anywhere
    except UserError as error:
        fail(str(error))
    print(gin_bindings(written), end="")


def gin_bindings(written: data.TFRecordFiles) -> str:
    """The gin lines that train on the written files (for a gin file or --gin_bindings)."""
    return (
        f"train.input_fn = @tfrecord_files()\n"
        f"tfrecord_files.train_pattern = '{written.train_pattern}'\n"
        f"tfrecord_files.eval_pattern = '{written.eval_pattern}'\n"
        f"tfrecord_files.input_shape = {written.input_shape}\n"
        f"tfrecord_files.num_classes = {written.num_classes}\n"
    )


if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags)
