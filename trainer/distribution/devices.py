"""Physical and logical device setup, done once before TensorFlow initialises its runtime: logical devices
let one CPU (or GPU) stand in for several replicas (`mirrored.gin` on a laptop, the multi-device tests)."""

from __future__ import annotations

import dataclasses

import tensorflow as tf

from trainer.errors import UserError
from trainer.validation import check_bool, check_int, check_ints


@dataclasses.dataclass(frozen=True)
class DeviceConfig:
    """What to do with the devices before the first op runs."""

    gpu_memory_growth: bool = True  # allocate GPU memory as needed instead of all at once
    visible_gpus: tuple[int, ...] | None = None  # indices of the physical GPUs to use; None keeps all
    logical_gpus_per_gpu: int = 0  # split each visible GPU into this many (0: no split)
    logical_gpu_memory_mb: int | None = None  # memory of each logical GPU (required with a split)
    logical_cpus: int = 0  # split the CPU into this many (0: no split)
    logical_cpus_without_gpu: int = 0  # the same, only where no GPU is visible (N replicas on a laptop)
    log_device_placement: bool = False
    soft_placement: bool = True  # fall back to a supported device when an op cannot run where asked

    def __post_init__(self) -> None:
        for name in ("gpu_memory_growth", "log_device_placement", "soft_placement"):
            check_bool(f"devices.{name}", getattr(self, name))
        check_ints("devices.visible_gpus", self.visible_gpus, minimum=0, optional=True, allow_empty=True)
        for name in ("logical_gpus_per_gpu", "logical_cpus", "logical_cpus_without_gpu"):
            check_int(f"devices.{name}", getattr(self, name), minimum=0)
        check_int("devices.logical_gpu_memory_mb", self.logical_gpu_memory_mb, optional=True)


def configure_devices(config: DeviceConfig) -> None:
    """Applies `config`, leaving alone what is already so: a second run in one process (a notebook's) with
    the same devices works; asking for others once TensorFlow has initialised them is one UserError line."""
    try:
        _configure(config)
    except RuntimeError as e:
        raise UserError(
            f"device setup failed ({e}); TensorFlow fixes its devices when it runs its first op, so configure "
            "them before that: from Python call trainer.configure_devices(...) before the first run, or use a "
            "fresh process"
        ) from e


def _configure(config: DeviceConfig) -> None:
    gpus = tf.config.list_physical_devices("GPU")
    if config.visible_gpus is not None:
        if bad := [i for i in config.visible_gpus if not 0 <= i < len(gpus)]:
            raise UserError(
                f"visible_gpus {list(config.visible_gpus)} names GPU {bad[0]} but this machine has "
                f"{len(gpus)} GPU(s); pick indices in 0..{len(gpus) - 1} or leave visible_gpus unset"
            )
        gpus = [gpus[i] for i in config.visible_gpus]
        if tf.config.get_visible_devices("GPU") != gpus:
            tf.config.set_visible_devices(gpus, "GPU")
    if config.logical_gpus_per_gpu > 0 and gpus:
        if not config.logical_gpu_memory_mb:
            raise UserError("logical_gpus_per_gpu needs logical_gpu_memory_mb (memory per logical GPU in MB)")
        logical = tf.config.LogicalDeviceConfiguration(memory_limit=config.logical_gpu_memory_mb)
        for gpu in gpus:
            _split(gpu, [logical] * config.logical_gpus_per_gpu)
    elif config.gpu_memory_growth:
        for gpu in gpus:
            if not tf.config.experimental.get_memory_growth(gpu):
                tf.config.experimental.set_memory_growth(gpu, True)
    num_cpus = config.logical_cpus or (config.logical_cpus_without_gpu if not gpus else 0)
    if num_cpus > 1:
        cpu = tf.config.list_physical_devices("CPU")[0]
        _split(cpu, [tf.config.LogicalDeviceConfiguration()] * num_cpus)
    tf.debugging.set_log_device_placement(config.log_device_placement)
    tf.config.set_soft_device_placement(config.soft_placement)


def _split(device: tf.config.PhysicalDevice, logical: list[tf.config.LogicalDeviceConfiguration]) -> None:
    """Splits `device` into `logical` unless it is split so already (TensorFlow refuses any change, even
    to the same split, once its devices are initialised)."""
    if tf.config.get_logical_device_configuration(device) != logical:
        tf.config.set_logical_device_configuration(device, logical)


def compute_devices() -> list[str]:
    """The devices replicas should run on: logical GPUs if any, else logical CPUs."""
    gpus = tf.config.list_logical_devices("GPU")
    return [d.name for d in (gpus or tf.config.list_logical_devices("CPU"))]
