"""A file of predictions that NumPy reads in one call, written in constant memory however long the split.

`np.savez` needs every array whole in memory. Here each key's rows are appended to a raw file of its own as
they come, and `finish` streams those files into an uncompressed `.npz` (a zip of `.npy` members, exactly what
`np.savez` writes): a member's header needs only the row count, dtype and row shape, its data is the raw
file copied in chunks. The `.npz` appears whole (renamed into place) or not at all.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import zipfile
from typing import IO, Mapping

import numpy as np

from trainer.errors import RunFailure, UserError

COPY_CHUNK = 1 << 20


def check_writable(path: str) -> None:
    """Refuses, before anything is computed or written, a path that is a directory or whose nearest
    existing directory cannot take a new file."""
    if os.path.isdir(path):
        raise UserError(f"the output path {path} is a directory: name a file, e.g. {os.path.join(path, 'out.npz')}")
    existing = os.path.dirname(path)
    while existing and not os.path.exists(existing):
        existing = os.path.dirname(existing)
    existing = existing or "."
    if not os.path.isdir(existing) or not os.access(existing, os.W_OK | os.X_OK):
        raise UserError(
            f"cannot write the output {path}: {existing} is not a writable directory; "
            "pass --output=PATH somewhere writable"
        )


class PredictionWriter:
    """Rows of named arrays appended batch by batch, written as one `.npz` by `finish` (one array per key,
    in the order rows were appended). Nothing exists on disk before the first `append`; `discard` (or
    leaving the `with` block by an exception) removes what was started."""

    def __init__(self, path: str):
        self.path = path
        self.count = 0
        self._temp: str | None = None
        self._files: dict[str, IO[bytes]] = {}
        self._rows: dict[str, tuple[np.dtype, tuple[int, ...]]] = {}

    def __enter__(self) -> PredictionWriter:
        return self

    def __exit__(self, kind, value, traceback) -> None:
        if kind is not None:
            self.discard()

    def append(self, rows: Mapping[str, np.ndarray]) -> None:
        """One batch: every key the first batch had, each with the same number of rows."""
        counts = {key: len(array) for key, array in rows.items()}
        if len(set(counts.values())) > 1:
            raise UserError(
                f"the prediction outputs have different numbers of rows in one batch ({counts}); return one "
                "row per example for every output"
            )
        if self._temp is None:
            self._start(rows)
        if set(rows) != set(self._rows):
            raise UserError(f"the prediction outputs changed keys from {sorted(self._rows)} to {sorted(rows)}")
        for key, array in rows.items():
            dtype, shape = self._rows[key]
            if array.dtype != dtype or array.shape[1:] != shape:
                raise UserError(
                    f"prediction output {key!r} changed from rows of {shape} {dtype} to {array.shape[1:]} "
                    f"{array.dtype}: return rows of one shape and dtype in every batch"
                )
            try:
                self._files[key].write(np.ascontiguousarray(array).tobytes())
            except OSError as e:
                raise RunFailure(f"writing the predictions next to {self.path} failed ({e}); free disk space") from e
        self.count += next(iter(counts.values()), 0)

    def _start(self, rows: Mapping[str, np.ndarray]) -> None:
        """The temporary files, beside the output (so the result is renamed into place, not copied)."""
        directory = os.path.dirname(self.path) or "."
        try:
            os.makedirs(directory, exist_ok=True)
            self._temp = tempfile.mkdtemp(dir=directory, prefix=".predictions-")
        except OSError as e:
            raise UserError(f"cannot write the output {self.path} ({e}); pass --output=PATH somewhere writable") from e
        self._rows = {key: (array.dtype, array.shape[1:]) for key, array in rows.items()}
        self._files = {key: open(os.path.join(self._temp, str(i)), "wb") for i, key in enumerate(rows)}

    def finish(self) -> str:
        """Writes the `.npz` at `path` (replacing one there); returns the path."""
        if self._temp is None:
            raise UserError("there were no predictions to write: the split has no examples")
        try:
            partial = os.path.join(self._temp, "out.npz")
            with zipfile.ZipFile(partial, "w", zipfile.ZIP_STORED, allowZip64=True) as archive:
                for key, raw in self._files.items():
                    raw.close()
                    dtype, shape = self._rows[key]
                    header = {
                        "descr": np.lib.format.dtype_to_descr(dtype),
                        "fortran_order": False,
                        "shape": (self.count, *shape),
                    }
                    with archive.open(f"{key}.npy", "w", force_zip64=True) as member, open(raw.name, "rb") as data:
                        np.lib.format.write_array_header_2_0(member, header)
                        shutil.copyfileobj(data, member, COPY_CHUNK)
                    os.remove(raw.name)
            os.replace(partial, self.path)
        except OSError as e:
            raise RunFailure(
                f"writing {self.path} failed ({e}); free disk space or pass --output=PATH elsewhere"
            ) from e
        self.discard()
        return self.path

    def discard(self) -> None:
        for raw in self._files.values():
            raw.close()
        self._files = {}
        if self._temp is not None:
            shutil.rmtree(self._temp, ignore_errors=True)
            self._temp = None
