"""Imports TensorFlow without the C++ notices it prints while loading, keeping real errors.

TF_CPP_MIN_LOG_LEVEL=2 does not hide what TensorFlow logs while its shared libraries load:
those lines come from static initializers that log through absl before anything reads the
variable (absl prints "All log messages before absl::InitializeLog() is called are
written to STDERR", then oneDNN's and the CUDA stub's INFO notes, once per library that
carries them), and the failed `cuInit` of a machine without a GPU driver is logged at
ERROR when the devices are first listed. So an entry point imports TensorFlow and lists
its devices here, with file descriptor 2 captured, and replays what TF_CPP_MIN_LOG_LEVEL
would have let through: lines below the level are dropped, as is the `cuInit` failure
when the same lines said no CUDA driver exists (unless the level is 0: everything); everything else (Python warnings, W/E/F
lines, a traceback) is written to stderr as it came. TF_ENABLE_ONEDNN_OPTS is left alone
(it changes numerics).
"""

from __future__ import annotations

import ctypes
import os
import re
import sys
import tempfile

_SEVERITIES = "IWEF"  # absl's line prefixes, in TF_CPP_MIN_LOG_LEVEL's order 0..3
_ABSL_LINE = re.compile(r"^([IWEF])\d{4} ")
_ABSL_HEADER = "All log messages before absl::InitializeLog() is called are written to STDERR"
_NO_DRIVER = "Could not find cuda drivers"
_CUINIT_FAILED = "failed call to cuInit"
_listed: list[bool] = []  # [True] once this process listed its devices here


def kept_lines(lines: list[str], min_level: int, *, no_driver: bool = False) -> list[str]:
    """The captured lines TF_CPP_MIN_LOG_LEVEL=`min_level` means to show; `no_driver`: known to have no CUDA
    driver where the lines cannot say so (TensorFlow was loaded before they were captured)."""
    if min_level <= 0:
        return list(lines)  # asked for everything
    no_driver = no_driver or any(_NO_DRIVER in line for line in lines)
    kept = []
    for line in lines:
        match = _ABSL_LINE.match(line)
        if match and _SEVERITIES.index(match.group(1)) < min_level:
            continue
        if match and no_driver and _CUINIT_FAILED in line:
            continue  # the missing driver again, not an error of this run
        if _ABSL_HEADER in line:
            continue
        kept.append(line)
    return kept


def import_tensorflow() -> None:
    """Imports TensorFlow and lists its devices with stderr filtered (see the module doc). Where the caller
    imported TensorFlow already (a notebook's earlier cell), its devices are still listed here: the
    `cuInit` failure comes with the first listing, not the import."""
    if _listed:
        return
    loaded_before = "tensorflow" in sys.modules  # its load-time lines, the driver's among them, went out then
    min_level = int(os.environ.get("TF_CPP_MIN_LOG_LEVEL", "0") or 0)
    with tempfile.TemporaryFile() as captured:
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(captured.fileno(), 2)
        try:
            import tensorflow as tf

            tf.config.list_physical_devices()
            _listed.append(True)
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            lines = captured.read().decode(errors="replace").splitlines(keepends=True)
            sys.stderr.write("".join(kept_lines(lines, min_level, no_driver=loaded_before and not _has_driver())))
            sys.stderr.flush()


def _has_driver() -> bool:
    """Whether the CUDA driver library loads, as TensorFlow's CUDA stub looks for it ("Could not find cuda
    drivers" where it does not)."""
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True
