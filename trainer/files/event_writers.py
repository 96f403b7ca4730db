"""TensorBoard event writers: one per event directory in a process, its file created at first use.

One per directory: TensorBoard reads only the newest event file of a run directory as it grows,
so two writers of `model_dir/train` (the metrics log's, the step's own `tf.summary` calls) would
hide each other's events. Created at first use: the train loop captures its writer when traced,
which happens before anything may be written to model_dir, and `tf.summary.create_file_writer`
creates its file at once; an `EventWriter` names the resource and creates it, with its file, at `init()`.
"""

from __future__ import annotations

import itertools
import os

import tensorflow as tf

from trainer import internals

# Event files reach disk at most this long after a write (and at close). A flush syncs the file:
# flushing every train record cost ~25 ms each, 2% of the CNN bench's steps/s on 2 cores.
FLUSH_MILLIS = 5_000

_names = itertools.count()
_open: dict[str, "EventWriter"] = {}


class EventWriter(tf.summary.SummaryWriter):
    """A summary file writer of `logdir` whose resource and event file are created by `init()`; before
    it, it can be the default writer of a function being traced (ops refer to the resource's handle)."""

    def __init__(self, logdir: str, *, flush_millis: int = FLUSH_MILLIS):
        self.logdir = logdir
        self._flush_millis = flush_millis
        self._initialized = self._closed = False
        with tf.device("cpu:0"):
            # The handle of a writer resource by name, which `init` creates (a handle op alone creates nothing).
            self._handle = tf.raw_ops.SummaryWriter(
                shared_name=f"trainer_events_{os.getpid()}_{next(_names)}", container=""
            )
        internals.set_summary_resource(self, self._handle)

    def init(self) -> None:
        """Creates the writer and its event file (and `logdir`); again: nothing."""
        if self._initialized or self._closed:
            return
        with tf.device("cpu:0"):
            tf.raw_ops.CreateSummaryFileWriter(
                writer=self._handle,
                logdir=self.logdir,
                max_queue=10,
                flush_millis=self._flush_millis,
                filename_suffix=".v2",
            )
        self._initialized = True

    def flush(self) -> None:
        if self._initialized and not self._closed:
            with tf.device("cpu:0"):
                tf.raw_ops.FlushSummaryWriter(writer=self._handle)

    def close(self) -> None:
        """Flushes and closes the event file; `event_writer` then makes a new writer for `logdir`."""
        if _open.get(os.path.abspath(self.logdir)) is self:
            del _open[os.path.abspath(self.logdir)]
        if self._initialized and not self._closed:
            self.flush()
            with tf.device("cpu:0"):
                tf.raw_ops.CloseSummaryWriter(writer=self._handle)
        self._closed = True


def event_writer(logdir: str) -> EventWriter:
    """The open writer of `logdir` in this process, made (not yet initialized) if there is none."""
    key = os.path.abspath(logdir)
    if key not in _open:
        _open[key] = EventWriter(logdir)
    return _open[key]
