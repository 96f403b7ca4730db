"""What a worker reports about where it ran: the machine, the CPU the whole machine used (to tell
a chunk that shared the cores with another process), and its own peak memory."""

from __future__ import annotations

import os
import platform
import resource


def machine() -> dict:
    """What this process runs on: CPU, cores, accelerators, versions."""
    import keras
    import tensorflow as tf

    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    gpus = []
    for gpu in tf.config.list_physical_devices("GPU"):
        details = tf.config.experimental.get_device_details(gpu)
        gpus.append(details.get("device_name", gpu.name))
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "gpus": gpus,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "tensorflow": tf.__version__,
        "keras": keras.__version__,
    }


def peak_rss_mib() -> float:
    """This process's peak resident memory (each variant runs in its own process, so it is the variant's)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # KiB on Linux


def page_faults() -> int:
    """Page faults of this process so far, every thread (minor: a page the kernel maps in again, often
    one the allocator had given back; major: one read from disk)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_minflt + usage.ru_majflt


def peak_gpu_mib() -> float | None:
    """Peak memory TensorFlow allocated on the first GPU (None without a GPU)."""
    import tensorflow as tf

    if not tf.config.list_logical_devices("GPU"):
        return None
    return tf.config.experimental.get_memory_info("GPU:0")["peak"] / 2**20


def machine_cpu_seconds() -> tuple[float, float]:
    """CPU seconds since boot the whole machine has been busy (every process and the kernel), and that
    the hypervisor stole from it; (0, 0) where /proc/stat cannot be read."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return 0.0, 0.0
    user, nice, system, _idle, _iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    tick = os.sysconf("SC_CLK_TCK")
    return (user + nice + system + irq + softirq) / tick, steal / tick
