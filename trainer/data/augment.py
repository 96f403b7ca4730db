"""The built-in image augmentation: random flips, shifts and brightness of an `(image, label, ...)` example,
drawn from stateless ops seeded by the seed the loop gives each example (its place in the order,
trainer/data/order.py). Bound on a built-in source (`digits.augmentation = @image_augmentation()`), it is that
source's `augment(example, seed)`, so a resumed run draws the same, and on the split held on the devices it
runs inside the compiled loop on each replica's slice (trainer/data/device.py)."""

from __future__ import annotations

import dataclasses
from typing import Any

import tensorflow as tf

from trainer.errors import UserError
from trainer.validation import check_bool, check_int, check_number


@dataclasses.dataclass(frozen=True)
class ImageAugmentation:
    """`flip_left_right`: mirror half the images; `max_shift`: move each image by up to this many pixels
    each way (zero-padded, cropped back to its size); `max_brightness`: add a delta in [-it, it]."""

    flip_left_right: bool = False
    max_shift: int = 0
    max_brightness: float = 0.0

    def __post_init__(self) -> None:
        check_bool("image_augmentation.flip_left_right", self.flip_left_right)
        check_int("image_augmentation.max_shift", self.max_shift, minimum=0)
        check_number("image_augmentation.max_brightness", self.max_brightness, strictly=False)

    def __call__(self, example: Any, seed: tf.Tensor) -> Any:
        if not isinstance(example, tuple) or example[0].shape.rank != 3:
            raise UserError(
                "image_augmentation needs examples (image [height, width, channels], label, ...), got "
                f"{example!r}: use it on an image source, or give your input function its own augment"
            )
        image, *rest = example
        flip, shift, brightness = tf.unstack(tf.random.experimental.stateless_split(seed, 3))
        if self.flip_left_right:
            image = tf.image.stateless_random_flip_left_right(image, flip)
        if self.max_shift:
            pad = self.max_shift
            padded = tf.pad(image, [[pad, pad], [pad, pad], [0, 0]])
            image = tf.image.stateless_random_crop(padded, tf.shape(image), shift)
        if self.max_brightness:
            image = tf.image.stateless_random_brightness(image, self.max_brightness, brightness)
        return (image, *rest)
