"""Optimizers with the tutorial's batch-size advice built in: the learning rate scaled by
global_batch_size / reference_batch_size (the linear scaling rule), reached linearly over `warmup_steps`."""

from __future__ import annotations

import math

import keras
import tensorflow as tf

from trainer.errors import UserError
from trainer.validation import check_int, check_number

OPTIMIZERS = ("sgd", "adam", "adamw", "rmsprop")
DECAYS = ("constant", "cosine")
ADAMW_DEFAULT_DECAY = 0.004  # keras.optimizers.AdamW's own default


@keras.saving.register_keras_serializable(package="trainer")
class ScaledWarmupSchedule(keras.optimizers.schedules.LearningRateSchedule):
    """peak = base * scale; linear warm-up to peak, then constant or cosine decay to 0."""

    def __init__(self, base_learning_rate, scale=1.0, warmup_steps=0, decay="constant", decay_steps=0):
        super().__init__()
        self.base_learning_rate = float(base_learning_rate)
        self.scale = float(scale)
        self.warmup_steps = int(warmup_steps)
        self.decay = decay
        self.decay_steps = int(decay_steps)

    def __call__(self, step):
        step = tf.cast(step, tf.float32)
        peak = self.base_learning_rate * self.scale
        lr = tf.constant(peak, tf.float32)
        if self.decay == "cosine" and self.decay_steps > self.warmup_steps:
            span = float(self.decay_steps - self.warmup_steps)
            progress = tf.clip_by_value((step - self.warmup_steps) / span, 0.0, 1.0)
            lr = peak * 0.5 * (1.0 + tf.cos(math.pi * progress))
        if self.warmup_steps > 0:
            lr = lr * tf.minimum(1.0, (step + 1.0) / self.warmup_steps)
        return lr

    def get_config(self):
        return {k: getattr(self, k) for k in ("base_learning_rate", "scale", "warmup_steps", "decay", "decay_steps")}


def learning_rate_schedule(
    learning_rate: float,
    *,
    global_batch_size: int,
    reference_batch_size: int | None = None,
    warmup_steps: int = 0,
    decay: str = "constant",
    total_steps: int = 0,
) -> float | keras.optimizers.schedules.LearningRateSchedule:
    """A plain float when nothing is scaled, warmed up or decayed (what Keras fit would get)."""
    if decay not in DECAYS:
        raise UserError(f"unknown decay {decay!r}; use one of: {', '.join(DECAYS)}")
    scale = global_batch_size / reference_batch_size if reference_batch_size else 1.0
    if scale == 1.0 and warmup_steps == 0 and decay == "constant":
        return learning_rate
    return ScaledWarmupSchedule(learning_rate, scale, warmup_steps, decay, total_steps)


def make_optimizer(
    *,
    global_batch_size: int,
    total_steps: int,
    name: str = "adam",
    learning_rate: float = 1e-3,
    momentum: float = 0.0,
    weight_decay: float | None = None,
    reference_batch_size: int | None = None,
    warmup_steps: int = 0,
    decay: str = "constant",
) -> keras.optimizers.Optimizer:
    """A Keras 3 optimizer (built by the loop under the scope, rule 1). `learning_rate` is the rate at
    `reference_batch_size`, scaled linearly to the global batch (None: no scaling); `momentum` is for sgd and
    rmsprop; `weight_decay` is Keras 3's decoupled decay (0: none, None: Keras' default, 0.004 for adamw and
    none for the others); `decay` 'cosine' reaches 0 at total_steps."""
    check_number("make_optimizer.learning_rate", learning_rate)
    check_number("make_optimizer.momentum", momentum, strictly=False, below=1.0)
    check_number("make_optimizer.weight_decay", weight_decay, strictly=False, optional=True)
    check_int("make_optimizer.reference_batch_size", reference_batch_size, optional=True)
    check_int("make_optimizer.warmup_steps", warmup_steps, minimum=0)
    lr = learning_rate_schedule(
        learning_rate,
        global_batch_size=global_batch_size,
        reference_batch_size=reference_batch_size,
        warmup_steps=warmup_steps,
        decay=decay,
        total_steps=total_steps,
    )
    if name == "adamw":  # Keras' AdamW needs a number; 0.0 decays nothing
        return keras.optimizers.AdamW(lr, weight_decay=ADAMW_DEFAULT_DECAY if weight_decay is None else weight_decay)
    decay_option = {"weight_decay": weight_decay or None}  # None: Keras adds no decay ops at all
    if name == "sgd":
        return keras.optimizers.SGD(lr, momentum=momentum, **decay_option)
    if name == "adam":
        return keras.optimizers.Adam(lr, **decay_option)
    if name == "rmsprop":
        return keras.optimizers.RMSprop(lr, momentum=momentum, **decay_option)
    raise UserError(f"unknown optimizer {name!r}; set make_optimizer.name to one of: {', '.join(OPTIMIZERS)}")
