"""The built-in in-memory sources: frozen, gin-bindable input functions of unbatched `(image float32, label
int32)` whose `arrays(split)` let training gather whole batches from memory."""

import dataclasses
import os
from functools import cached_property
from typing import Any, Callable

import numpy as np
import tensorflow as tf

from trainer.data import fashion_mnist_files
from trainer.data.inputs import SPLITS, Shard, shard_of
from trainer.errors import UserError
from trainer.validation import check_choice, check_int, check_ints, check_number

Arrays = tuple[np.ndarray, np.ndarray]
DIGITS_FILE = os.path.join(os.path.dirname(__file__), "digits.csv.gz")


def label_array(labels: np.ndarray) -> np.ndarray:
    """Integer (and boolean) labels as int32, anything else as float32: regression targets stay float."""
    if np.issubdtype(labels.dtype, np.integer) or labels.dtype == np.bool_:
        return labels.astype(np.int32, copy=False)
    return labels.astype(np.float32, copy=False)


class _InMemorySource:
    """Sources held as numpy arrays in `_arrays[split]`; `augmentation` (e.g. `@image_augmentation()`,
    trainer/data/augment.py) is their `augment(example, seed)` where set."""

    _arrays: dict[str, Arrays]
    splits = SPLITS
    augmentation: Callable[[Any, tf.Tensor], Any] | None

    @property
    def augment(self) -> Callable[[Any, tf.Tensor], Any] | None:
        return self.augmentation

    def __call__(self, split: str, input_context: tf.distribute.InputContext | None = None) -> tf.data.Dataset:
        return self.examples(split, shard_of(input_context))

    def examples(self, split: str, shard: Shard | None = None) -> tf.data.Dataset:
        dataset = tf.data.Dataset.from_tensor_slices(self.arrays(split))
        return dataset.shard(*shard) if shard else dataset

    def arrays(self, split: str) -> Arrays:
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
    """The 1,797 8x8 digits scikit-learn ships (the test set of UCI's Optical Recognition of Handwritten Digits,
    E. Alpaydin and C. Kaynak, 1998, CC BY 4.0), in this package as scikit-learn's own file (digits.csv.gz: 64
    pixels of 0..16 and the label per row): real data that needs no download and no scikit-learn."""

    eval_fraction: float = 0.2
    seed: int = 0
    augmentation: Callable[[Any, tf.Tensor], Any] | None = None
    input_shape = (8, 8, 1)
    num_classes = 10

    def __post_init__(self) -> None:
        check_number("digits.eval_fraction", self.eval_fraction, below=1.0)
        check_int("digits.seed", self.seed, minimum=0)

    @cached_property
    def _arrays(self) -> dict[str, Arrays]:
        rows = np.loadtxt(DIGITS_FILE, delimiter=",")
        images = (rows[:, :-1].reshape(-1, 8, 8) / 16.0).astype(np.float32)[..., None]
        labels = rows[:, -1].astype(np.int64)
        order = np.random.RandomState(self.seed).permutation(len(images))
        num_eval = int(round(len(images) * self.eval_fraction))
        take = lambda idx: (images[idx], labels[idx])  # noqa: E731
        return {"train": take(order[num_eval:]), "eval": take(order[:num_eval])}


@dataclasses.dataclass(frozen=True)
class Synthetic(_InMemorySource):
    """Random images of any shape, deterministic by seed, for benchmarks."""

    input_shape: tuple[int, ...] = (8, 8, 1)
    num_classes: int = 10
    num_train: int = 1024
    num_eval: int = 256
    seed: int = 0
    augmentation: Callable[[Any, tf.Tensor], Any] | None = None

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


FASHION_MNIST_FILES = fashion_mnist_files.FILES
VALIDATION_FROM = ("front", "back")
STANDARDIZE = ("global", "per_pixel")


@dataclasses.dataclass(frozen=True)
class FashionMnist(_InMemorySource):
    """The tutorial's Fashion-MNIST, read from local idx files (trainer/data/fashion_mnist_files.py).

    `validation_size` training images are held out as split 'validation', the first ones ('front', the
    tutorial's `x_train_all[:5000]`) or the last ('back'); 'eval' is the t10k files. `standardize` is fitted
    on 'train' only, so nothing leaks from held-out data: 'global' (one mean and deviation over all raw
    pixels, the tutorial's StandardScaler on `x_train.reshape(-1, 1)`: keeps contrast), 'per_pixel' (each
    pixel its own, on [0, 1]: a dark border pixel becomes as loud as the centre), None (pixels / 255).
    """

    data_dir: str | None = None
    validation_size: int = 0
    validation_from: str | None = None
    standardize: str | None = None
    augmentation: Callable[[Any, tf.Tensor], Any] | None = None
    input_shape = (28, 28, 1)
    num_classes = 10

    def __post_init__(self) -> None:
        if self.data_dir is not None and not isinstance(self.data_dir, str):
            raise UserError(f"fashion_mnist.data_dir must be a directory path or None, got {self.data_dir!r}")
        check_int("fashion_mnist.validation_size", self.validation_size, minimum=0)
        if self.validation_size and self.validation_from is None:
            raise UserError(
                f"fashion_mnist.validation_size = {self.validation_size} needs "
                "fashion_mnist.validation_from: 'front' holds out the first images (the tutorial's "
                "split), 'back' the last ones (what validation_size alone did before)"
            )
        if self.validation_from is not None:
            check_choice("fashion_mnist.validation_from", self.validation_from, VALIDATION_FROM)
            if not self.validation_size:
                raise UserError(
                    "fashion_mnist.validation_from needs fashion_mnist.validation_size, the number "
                    "of training images to hold out"
                )
        if isinstance(self.standardize, bool):
            raise UserError(
                f"fashion_mnist.standardize = {self.standardize} is no longer a switch: write 'global' "
                "(one mean and deviation over all training pixels, the tutorial's StandardScaler), "
                "'per_pixel' (each pixel its own, what True did) or None (no scaling, what False did)"
            )
        if self.standardize is not None:
            check_choice("fashion_mnist.standardize", self.standardize, STANDARDIZE)

    @property
    def splits(self) -> tuple[str, ...]:
        return ("train", "validation", "eval") if self.validation_size > 0 else SPLITS

    @property
    def directory(self) -> str:
        return fashion_mnist_files.find_directory(self.data_dir)

    def validate(self) -> None:
        _ = self._arrays  # reads and checks the files, so a bad one is reported before anything is written

    @cached_property
    def _arrays(self) -> dict[str, Arrays]:
        directory = self.directory
        (images, labels), test = (fashion_mnist_files.read_split(directory, split) for split in FASHION_MNIST_FILES)
        if self.validation_size >= len(labels):
            raise UserError(
                f"fashion_mnist.validation_size {self.validation_size} leaves no training images "
                f"(there are {len(labels)}): use fewer"
            )
        cut = self.validation_size if self.validation_from == "front" else len(labels) - self.validation_size
        first, rest = (images[:cut], labels[:cut]), (images[cut:], labels[cut:])
        train, validation = (rest, first) if self.validation_from == "front" else (first, rest)
        arrays = {"train": train, "eval": test, **({"validation": validation} if self.validation_size else {})}
        scale = {"global": _standardize_globally, "per_pixel": _standardize_per_pixel}.get(self.standardize, _unit)
        return scale(arrays, self.input_shape)


def _shaped(arrays: dict[str, Arrays], shape: tuple[int, ...]) -> dict[str, Arrays]:
    return {split: (x.reshape(len(x), *shape), y) for split, (x, y) in arrays.items()}


def _unit(arrays: dict[str, Arrays], shape: tuple[int, ...]) -> dict[str, Arrays]:
    return {split: (x.astype(np.float32) / 255.0, y) for split, (x, y) in _shaped(arrays, shape).items()}


def _standardize_per_pixel(arrays: dict[str, Arrays], shape: tuple[int, ...]) -> dict[str, Arrays]:
    arrays = _unit(arrays, shape)
    mean = arrays["train"][0].mean(axis=0, dtype=np.float64)
    std = arrays["train"][0].std(axis=0, dtype=np.float64)
    std[std < 1e-8] = 1.0  # constant pixels (up to rounding), as StandardScaler does
    return {split: (((x - mean) / std).astype(np.float32), y) for split, (x, y) in arrays.items()}


def _standardize_globally(arrays: dict[str, Arrays], shape: tuple[int, ...]) -> dict[str, Arrays]:
    """As StandardScaler on the float32 pixels: statistics in float64, applied in float32."""
    train = arrays["train"][0].astype(np.float32)
    mean, std = train.mean(dtype=np.float64), train.std(dtype=np.float64)
    std = std if std >= 10 * np.finfo(np.float64).eps else 1.0  # a constant image set, as StandardScaler does
    mean, std = np.float32(mean), np.float32(std)
    return {split: ((x.astype(np.float32) - mean) / std, y) for split, (x, y) in _shaped(arrays, shape).items()}
