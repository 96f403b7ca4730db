"""The run's checkpoint: the task's state and the extensions' items, restored strictly (one that lacks an
item, such as an EMA turned on mid-run, cannot continue the run exactly), and each extension's own JSON
state under `extension_state/<name>`, restored where the checkpoint has it (else the extension starts afresh).
"""

from __future__ import annotations

import json
from typing import Any, Mapping

import tensorflow as tf

STATE_KEY = "extension_state"


class ExtensionState(tf.train.experimental.PythonState):
    """One extension's `state_dict()` as JSON text in the checkpoint; `load_state_dict` on restore."""

    def __init__(self, extension: Any):
        self._extension = extension

    def serialize(self) -> str:
        return json.dumps(self._extension.state_dict(), sort_keys=True)

    def deserialize(self, string_value: bytes | str) -> None:
        self._extension.load_state_dict(json.loads(string_value))


class RunCheckpoint:
    """`root` is what is saved; `restore` reads the items strictly and the states leniently."""

    def __init__(self, items: Mapping[str, Any], states: Mapping[str, ExtensionState]):
        self.root = tf.train.Checkpoint(**items, **({STATE_KEY: dict(states)} if states else {}))
        self._items = tf.train.Checkpoint(**items) if states else self.root
        self._states = tf.train.Checkpoint(**{STATE_KEY: dict(states)}) if states else None

    @classmethod
    def of(cls, checkpoint: tf.train.Checkpoint) -> "RunCheckpoint":
        """A plain checkpoint as one: saved as it is, restored strictly as a whole."""
        run_checkpoint = cls.__new__(cls)
        run_checkpoint.root = run_checkpoint._items = checkpoint
        run_checkpoint._states = None
        return run_checkpoint

    def restore(self, path: str) -> None:
        """Raises AssertionError/ValueError if an item of this run is not in the checkpoint at `path`; what
        the checkpoint holds beyond them (the preemption handler's run count, read by training only) is
        left unread without a warning."""
        self._items.restore(path).expect_partial().assert_existing_objects_matched()
        if self._states is not None:
            self._states.read(path).expect_partial()
        if self._items is not self.root:  # the saved counter of saves was read into the items' own
            self.root.save_counter.assign(self._items.save_counter)

    def write(self, path: str) -> str:
        """Writes the whole checkpoint at the prefix `path` (no state file, no numbering)."""
        return self.root.write(path)
