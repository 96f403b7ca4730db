"""Finding the four Fashion-MNIST idx files on this machine (never downloaded: the user's directory, else
Keras' cache, else Debian's `dataset-fashion-mnist`) and reading them, checked by content: Debian
recompressed the files, so the published .gz checksums fail although the images are the same. Checked are
each idx header, the size it states, that images and labels agree, and for the original count of examples
the original's label counts, which tell Fashion-MNIST from the MNIST digits of the same layout.
"""

from __future__ import annotations

import gzip
import os
import zlib

import numpy as np

from trainer.errors import UserError

FILES = {
    "train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
    "eval": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"),
}
SYSTEM_DIR = "/usr/share/datasets/fashion-mnist"
INSTALL = "apt-get install dataset-fashion-mnist"
IMAGE_SHAPE = (28, 28)
NUM_CLASSES = 10
ORIGINAL_COUNTS = {"train": 60_000, "eval": 10_000}
_MAGIC = {1: 2049, 3: 2051}  # idx: unsigned bytes, then the number of dimensions


def _missing(directory: str) -> list[str]:
    return [name for pair in FILES.values() for name in pair if not os.path.isfile(os.path.join(directory, name))]


def find_directory(data_dir: str | None) -> str:
    """`data_dir` if given, else the first of Keras' cache and SYSTEM_DIR with all four files."""
    keras_home = os.environ.get("KERAS_HOME") or os.path.join(os.path.expanduser("~"), ".keras")
    keras_dir = os.path.join(keras_home, "datasets", "fashion-mnist")  # where keras.datasets caches it
    elsewhere = f"Keras' cache {keras_dir} or {SYSTEM_DIR} (`{INSTALL}`)"
    if data_dir is not None:
        if missing := _missing(data_dir):
            raise UserError(
                f"Fashion-MNIST file {os.path.join(data_dir, missing[0])} is missing "
                f"(fashion_mnist.data_dir): put the four Fashion-MNIST .gz files there, or unset "
                f"fashion_mnist.data_dir to read them from {elsewhere}"
            )
        return data_dir
    for directory in (keras_dir, SYSTEM_DIR):
        if not _missing(directory):
            return directory
    raise UserError(
        f"Fashion-MNIST files are missing: neither Keras' cache {keras_dir} nor {SYSTEM_DIR} holds "
        f"all four ({', '.join(FILES['train'] + FILES['eval'])}): run `{INSTALL}`, put them in one "
        "of those directories, or set fashion_mnist.data_dir to theirs"
    )


def _read_idx(path: str, num_dims: int) -> np.ndarray:
    try:
        with gzip.open(path, "rb") as f:
            content = f.read()
    except (OSError, EOFError, zlib.error) as e:
        raise UserError(f"Fashion-MNIST file {path} is not a complete gzip file ({e}): replace it") from None
    header = 4 + 4 * num_dims
    magic = int.from_bytes(content[:4], "big") if len(content) >= header else None
    if magic != _MAGIC[num_dims]:
        raise UserError(
            f"Fashion-MNIST file {path} does not start with the idx header {_MAGIC[num_dims]} "
            f"of {num_dims}-dimensional bytes: replace it with the original file"
        )
    shape = tuple(int.from_bytes(content[4 + 4 * i : 8 + 4 * i], "big") for i in range(num_dims))
    if len(content) != header + int(np.prod(shape)):
        raise UserError(
            f"Fashion-MNIST file {path} holds {len(content) - header} bytes after its header, "
            f"its header says {shape} ({int(np.prod(shape))}): replace it with the original file"
        )
    return np.frombuffer(content, np.uint8, offset=header).reshape(shape)


def read_split(directory: str, split: str) -> tuple[np.ndarray, np.ndarray]:
    """`split`'s images (uint8, [n, 28, 28]) and labels (uint8, [n]) from `directory`, checked (see above)."""
    image_file, label_file = (os.path.join(directory, name) for name in FILES[split])
    images, labels = _read_idx(image_file, 3), _read_idx(label_file, 1)
    if images.shape[1:] != IMAGE_SHAPE or len(images) != len(labels):
        raise UserError(
            f"Fashion-MNIST files {image_file} and {label_file} hold images of {images.shape} and "
            f"labels of {labels.shape}, not n 28x28 images and their n labels: replace them"
        )
    counts = np.bincount(labels, minlength=NUM_CLASSES)
    if len(counts) > NUM_CLASSES:
        raise UserError(
            f"Fashion-MNIST file {label_file} holds label {labels.max()}; the classes are "
            f"0..{NUM_CLASSES - 1}: replace it with the original file"
        )
    original = ORIGINAL_COUNTS[split]
    if len(labels) == original and (counts != original // NUM_CLASSES).any():
        raise UserError(
            f"Fashion-MNIST file {label_file} has the original's {original} labels but class counts "
            f"{counts.tolist()}, not {original // NUM_CLASSES} each: it is other data of the same "
            "layout (the MNIST digits?); use the Fashion-MNIST files"
        )
    return images, labels
