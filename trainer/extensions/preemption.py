"""Stopping on a signal: Ctrl-C (SIGINT) and, with `train.preemption_checkpointing`, SIGTERM make
every worker save the same step and exit, 130 (Ctrl-C) or 42 (`trainer.launch --max_restarts`
restarts the group). Unset, SIGTERM to a run of one process saves as Ctrl-C does and exits 143. The signal is a request to stop after the loop call in flight.

Workers of one synchronous group must stop at the same step, or one would wait in a collective
for a peer that left: `tf.distribute.experimental.PreemptionCheckpointHandler` claims the stop in
the coordination service and makes every worker save after the next loop call (through our
CheckpointSaver). The claiming worker's signal is stored there (`_STOP_SIGNAL_KEY`) so all exit
alike; only the chief prints.

Signals are read by a thread on the interpreter's wakeup fd, not by a Python handler (which runs
only once the main thread is back from the compiled loop call): the stop is claimed at once, and
a second Ctrl-C exits at once without saving. A second SIGTERM is ignored (a launcher ending the
group sends one; this worker is leaving already).

The handler's watcher thread blocks in a read from the chief's coordination service; TensorFlow
stops it only in `__del__`, which may run after the chief exited, so the read fails with a
traceback after a good run. `end` stops it as `__del__` does (private API, no public one), then
waits at a barrier so no chief leaves while a peer's watcher still reads from it.
"""

from __future__ import annotations

import signal
import socket
import sys
import threading
from typing import Callable

import tensorflow as tf

from trainer import internals
from trainer.cli import INTERRUPTED_EXIT_CODE, flush_and_exit
from trainer.extensions.context import Context
from trainer.extensions.protocol import Extension

PREEMPTED_EXIT_CODE = 42
TERMINATED_EXIT_CODE = 128 + signal.SIGTERM  # 143: what a shell reports for a process ended by SIGTERM
_END_BARRIER = "trainer_preemption_watchers_stopped"
_END_BARRIER_TIMEOUT_MS = 60_000
_STOP_SIGNAL_KEY = "trainer_stop_signal"
_EXIT_BARRIER = "trainer_stop_signal_read"
_EXIT_TIMEOUT_MS = 10_000


class StopSignals:
    """Watches `signums` from a thread: the first calls `on_first(signum)`, a later SIGINT `on_again()`.
    An ignored signal (`nohup`, `&`) stays ignored; `uninstall` puts the previous handlers back."""

    def __init__(self, signums: tuple[int, ...], on_first: Callable[[int], None], on_again: Callable[[], None]):
        self._signums = signums
        self._on_first, self._on_again = on_first, on_again
        self.received: int | None = None
        self._previous: dict[int, object] = {}
        self._thread: threading.Thread | None = None

    def install(self) -> None:
        """Only in the main thread (where Python allows handlers); elsewhere signals keep their handlers."""
        if threading.current_thread() is not threading.main_thread():
            return
        self._reader, self._writer = socket.socketpair()
        self._writer.setblocking(False)
        self._previous_fd = signal.set_wakeup_fd(self._writer.fileno(), warn_on_full_buffer=False)
        for signum in self._signums:
            if signal.getsignal(signum) is not signal.SIG_IGN:  # ignored when the process started: stays so
                self._previous[signum] = signal.signal(signum, _seen_by_the_thread)
        self._thread = threading.Thread(target=self._watch, name="trainer-stop-signals", daemon=True)
        self._thread.start()

    def uninstall(self) -> None:
        if self._thread is None:
            return
        for signum, handler in self._previous.items():
            signal.signal(signum, signal.SIG_DFL if handler is None else handler)  # None: one set outside Python
        signal.set_wakeup_fd(self._previous_fd)
        self._writer.close()  # the thread's read returns: it ends
        self._thread.join(timeout=5)
        self._reader.close()
        self._thread = None

    def _watch(self) -> None:
        while True:
            try:
                data = self._reader.recv(64)
            except OSError:  # closed by `uninstall`
                return
            if not data:
                return
            for signum in data:
                if signum not in self._signums:
                    continue
                if self.received is None:
                    self.received = signum
                    self._on_first(signum)
                elif signum == signal.SIGINT:
                    self._on_again()


def _seen_by_the_thread(signum: int, frame: object) -> None:
    """Python-level handler: without one the interpreter would not write the wakeup fd."""


class Preemption(Extension):
    """After every loop call (and after its checkpoint), saves and exits if a stop signal came."""

    name = "preemption"
    setting = "train.preemption_checkpointing"
    after = ("checkpoint",)  # a periodic checkpoint of this step comes first: no second save

    def __init__(self, on_sigterm: bool | None = True) -> None:
        """`on_sigterm`: True, SIGTERM saves and exits 42 (preemption); None, on one process it saves and exits
        143 (with a line as Ctrl-C's), across processes SIGTERM is left alone; False, left alone. Ctrl-C always
        saves and exits 130."""
        self.on_sigterm = on_sigterm
        self._step = 0
        self._handler = None
        self._signals: StopSignals | None = None

    def begin(self, context: Context) -> None:
        self._saver = context.saver
        self._console = context.console
        self._is_chief = context.runtime.is_chief
        self._step = context.start_step
        previous_sigterm = signal.getsignal(signal.SIGTERM)
        if context.runtime.spans_processes and context.runtime.mode.synchronous:
            # The handler only reads through this manager (it restores the newest checkpoint,
            # as we already did); every write goes through save_fn.
            reader = tf.train.CheckpointManager(context.saver.checkpoint, context.saver.model_dir, max_to_keep=None)
            config = tf.distribute.experimental.TerminationConfig(exit_fn=self._exit, save_fn=self._save)
            self._handler = tf.distribute.experimental.PreemptionCheckpointHandler(
                context.runtime.strategy.cluster_resolver, reader, termination_config=config
            )
            # The handler set its own SIGTERM handler; ours (below) decides.
            signal.signal(signal.SIGTERM, signal.SIG_DFL if previous_sigterm is None else previous_sigterm)
        # Unset (None), SIGTERM on a run of one process saves and ends it as Ctrl-C does; across processes a
        # launcher's SIGTERM ends a group, and only `train.preemption_checkpointing = True` coordinates it.
        saves_on_sigterm = self.on_sigterm or (self.on_sigterm is None and not context.runtime.spans_processes)
        signums = (signal.SIGINT, signal.SIGTERM) if saves_on_sigterm else (signal.SIGINT,)
        self._signals = StopSignals(signums, on_first=self._claim, on_again=self._leave_at_once)
        self._signals.install()

    def after_loop(self, context: Context, step: int, metrics: dict[str, float]) -> None:
        self._step = step
        if self._handler is not None:
            with internals.silenced_deprecation():
                self._handler.save_checkpoint_if_preempted()  # saves and exits once every worker is there
        elif self._signals.received is not None:
            self._save()
            self._exit()

    def close(self, context: Context) -> None:
        if self._signals is not None:
            self._signals.uninstall()

    def end(self, context: Context, step: int) -> None:
        """Stops the handler's threads, then waits for every worker to have stopped theirs."""
        self.close(context)
        handler = self._handler
        if handler is None:
            return
        if internals.stop_preemption_watchers(handler):
            try:
                internals.coordination_service().wait_at_barrier(_END_BARRIER, _END_BARRIER_TIMEOUT_MS)
            except tf.errors.OpError:
                pass  # a peer already gone: this run is done and saved either way

    def _claim(self, signum: int) -> None:
        """(The signal thread.) Asks every worker to stop; the first worker's signal is the one all exit by."""
        if self._handler is None:
            return  # after_loop sees `received`
        try:
            try:
                internals.coordination_service().set_config_key_value(_STOP_SIGNAL_KEY, str(signum))
            except tf.errors.AlreadyExistsError:
                pass  # a peer claimed first, with its signal
            internals.tell_preemption_handler(self._handler)
        except tf.errors.OpError as e:  # the coordination service gone: training will fail on its own
            self._console.print(
                f"could not ask the other workers to stop ({type(e).__name__}); Ctrl-C again exits at once"
            )

    def _stop_signal(self) -> int:
        """The claiming worker's signal; all read it, then meet at a barrier so the chief (the
        coordination service) is there for each read."""
        if self._handler is None:
            return self._signals.received
        try:
            signum = int(internals.coordination_service().get_config_key_value(_STOP_SIGNAL_KEY, _EXIT_TIMEOUT_MS))
        except tf.errors.OpError:  # the chief gone already: this worker's own signal, else preemption
            return self._signals.received or signal.SIGTERM
        try:
            internals.coordination_service().wait_at_barrier(_EXIT_BARRIER, _EXIT_TIMEOUT_MS)
        except tf.errors.OpError:
            pass  # a peer gone: it read the signal already, or never will
        return signum

    def _save(self) -> None:
        if self._saver.last_saved_step != self._step:
            self._saver.save(self._step)

    def _exit(self) -> None:
        signum = self._stop_signal()
        self._signals.uninstall()
        if self._handler is not None:
            # A peer that exits first makes the launcher (srun --kill-on-bad-exit, trainer.launch) SIGTERM
            # this process too; it is leaving already, and must leave with the code it chose.
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if signum == signal.SIGINT:
            if self._is_chief:
                self._console.close_live()
                self._console.print(
                    f"interrupted at step {self._step}, saved ckpt-{self._step}; rerun the same command to continue"
                )
            sys.exit(INTERRUPTED_EXIT_CODE)
        if not self.on_sigterm:  # unset: a SIGTERM to a run of one process
            self._console.close_live()
            self._console.print(
                f"terminated (SIGTERM) at step {self._step}, saved ckpt-{self._step}; rerun the same command to "
                "continue"
            )
            sys.exit(TERMINATED_EXIT_CODE)
        self._console.print(
            f"preempted: saved ckpt-{self._step}; exiting {PREEMPTED_EXIT_CODE} so the group can "
            "be restarted (it continues from this step)"
        )
        sys.exit(PREEMPTED_EXIT_CODE)

    def _leave_at_once(self) -> None:
        """(The signal thread.) A second Ctrl-C: no save, no waiting for peers."""
        self._console.close_live()
        self._console.print(
            "interrupted again: exiting at once without saving; a rerun continues from the newest checkpoint"
        )
        flush_and_exit(INTERRUPTED_EXIT_CODE)
