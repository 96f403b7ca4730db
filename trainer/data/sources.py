"""The built-in in-memory sources: input functions of unbatched `(image float32, label int32)`.

Each is a frozen, gin-bindable dataclass; calling it, `source(split, input_context=None)`,
makes it an input function (trainer.data.inputs). Being held in numpy arrays, they also
give the pipelines `arrays(split)`, so training gathers whole batches from memory.
"""

import dataclasses
import gzip
import os
from functools import cached_property

import numpy as np
import tensorflow as tf

from trainer.data.inputs import SPLITS, Shard, shard_of
from trainer.errors import UserError
from trainer.validation import check_bool, check_int, check_ints, check_number

Arrays = tuple[np.ndarray, np.ndarray]


def label_array(labels: np.ndarray) -> np.ndarray:
    """Integer (and boolean) labels as int32, anything else as float32: regression targets stay float."""
    if np.issubdtype(labels.dtype, np.integer) or labels.dtype == np.bool_:
        return labels.astype(np.int32, copy=False)
    return labels.astype(np.float32, copy=False)


class _InMemorySource:
    """Shared behaviour of sources held as numpy arrays in `_arrays[split]`."""

    _arrays: dict[str, Arrays]
    splits = SPLITS

    def __call__(self, split: str, input_context: tf.distribute.InputContext | None = None) -> tf.data.Dataset:
        """The input function: `split`'s examples, only this pipeline's share under `input_context`."""
        return self.examples(split, shard_of(input_context))

    def examples(self, split: str, shard: Shard | None = None) -> tf.data.Dataset:
        """Unbatched `(image, label)`; `shard` keeps every n-th example."""
        dataset = tf.data.Dataset.from_tensor_slices(self.arrays(split))
        return dataset.shard(*shard) if shard else dataset

    def arrays(self, split: str) -> Arrays:
        """All of `split` in memory: images float32, labels int32 (float32 if float), to gather whole batches."""
        images, labels = self._arrays[split]
        return images.astype(np.float32, copy=False), label_array(labels)

    def num_examples(self, split: str) -> int:
        return len(self._arrays[split][1])

    def num_files(self, split: str) -> int:
        return 1

    def validate(self) -> None:
        pass


@dataclasses.dataclass(frozen=True)
class Digits(_InMemorySource):
    """scikit-learn's 1,797 8x8 digits: real data that needs no download."""

    eval_fraction: float = 0.2
    seed: int = 0
    input_shape = (8, 8, 1)
    num_classes = 10

    def __post_init__(self) -> None:
        check_number("digits.eval_fraction", self.eval_fraction, below=1.0)
        check_int("digits.seed", self.seed, minimum=0)

    @cached_property
    def _arrays(self) -> dict[str, Arrays]:
        from sklearn.datasets import load_digits

        digits = load_digits()
        images = (digits.images / 16.0).astype(np.float32)[..., None]
        order = np.random.RandomState(self.seed).permutation(len(images))
        num_eval = int(round(len(images) * self.eval_fraction))
        take = lambda idx: (images[idx], digits.target[idx])  # noqa: E731
        return {"train": take(order[num_eval:]), "eval": take(order[:num_eval])}


@dataclasses.dataclass(frozen=True)
class Synthetic(_InMemorySource):
    """Random images of any shape, deterministic by seed, for benchmarks."""

    input_shape: tuple[int, ...] = (8, 8, 1)
    num_classes: int = 10
    num_train: int = 1024
    num_eval: int = 256
    seed: int = 0

    def __post_init__(self) -> None:
        check_ints("synthetic.input_shape", self.input_shape)
        check_int("synthetic.num_classes", self.num_classes)
        check_int("synthetic.num_train", self.num_train, minimum=0)
        check_int("synthetic.num_eval", self.num_eval, minimum=0)
        check_int("synthetic.seed", self.seed, minimum=0)

    @cached_property
    def _arrays(self) -> dict[str, Arrays]:
        rng = np.random.RandomState(self.seed)
        arrays = {}
        for split, count in (("train", self.num_train), ("eval", self.num_eval)):
            images = rng.uniform(size=(count, *self.input_shape)).astype(np.float32)
            arrays[split] = (images, rng.randint(0, self.num_classes, size=count))
        return arrays


FASHION_MNIST_FILES = {
    "train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
    "eval": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"),
}


def _read_idx(path: str, header_bytes: int) -> np.ndarray:
    with gzip.open(path, "rb") as f:
        return np.frombuffer(f.read(), np.uint8, offset=header_bytes)


@dataclasses.dataclass(frozen=True)
class FashionMnist(_InMemorySource):
    """The tutorial's Fashion-MNIST, read from local idx files; never downloaded.

    `validation_size` holds out the LAST that many training images as split 'validation'
    ('train' is the rest); 'eval' is always the t10k test files. `standardize` does what
    the tutorial's StandardScaler does on the flattened images: subtracts each pixel's
    mean and divides by its standard deviation (1 where a pixel is constant), both taken
    on the 'train' split only and applied to every split, so nothing leaks from held-out data.
    """

    data_dir: str | None = None
    validation_size: int = 0
    standardize: bool = False
    input_shape = (28, 28, 1)
    num_classes = 10

    def __post_init__(self) -> None:
        if self.data_dir is not None and not isinstance(self.data_dir, str):
            raise UserError(f"fashion_mnist.data_dir must be a directory path or None, got {self.data_dir!r}")
        check_int("fashion_mnist.validation_size", self.validation_size, minimum=0)
        check_bool("fashion_mnist.standardize", self.standardize)

    @property
    def splits(self) -> tuple[str, ...]:
        return ("train", "validation", "eval") if self.validation_size > 0 else SPLITS

    @property
    def directory(self) -> str:
        """`data_dir`, else where `keras.datasets.fashion_mnist.load_data` caches its files."""
        keras_home = os.environ.get("KERAS_HOME") or os.path.join(os.path.expanduser("~"), ".keras")
        return self.data_dir or os.path.join(keras_home, "datasets", "fashion-mnist")

    def validate(self) -> None:
        for name in sum(FASHION_MNIST_FILES.values(), ()):
            path = os.path.join(self.directory, name)
            if not os.path.exists(path):
                raise UserError(f"Fashion-MNIST file {path} is missing (searched {self.directory}): put the four "
                                "Fashion-MNIST .gz files there or set fashion_mnist.data_dir")
        if self.validation_size < 0:
            raise UserError(f"fashion_mnist.validation_size must not be negative, got {self.validation_size}")

    @cached_property
    def _arrays(self) -> dict[str, Arrays]:
        self.validate()
        files = {}
        for split, (image_file, label_file) in FASHION_MNIST_FILES.items():
            labels = _read_idx(os.path.join(self.directory, label_file), 8)
            images = _read_idx(os.path.join(self.directory, image_file), 16)
            files[split] = images.reshape(len(labels), *self.input_shape).astype(np.float32) / 255.0, labels
        images, labels = files["train"]
        if self.validation_size >= len(labels):
            raise UserError(f"fashion_mnist.validation_size {self.validation_size} leaves no training images "
                            f"(there are {len(labels)}): use fewer")
        cut = len(labels) - self.validation_size
        arrays = {"train": (images[:cut], labels[:cut]), "eval": files["eval"]}
        if self.validation_size:
            arrays["validation"] = images[cut:], labels[cut:]
        if self.standardize:
            mean = arrays["train"][0].mean(axis=0, dtype=np.float64)
            std = arrays["train"][0].std(axis=0, dtype=np.float64)
            std[std < 1e-8] = 1.0  # constant pixels (up to rounding), as StandardScaler does
            arrays = {split: (((x - mean) / std).astype(np.float32), y) for split, (x, y) in arrays.items()}
        return arrays
