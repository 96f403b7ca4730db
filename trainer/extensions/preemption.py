"""Preemption: SIGTERM to any worker makes every worker save the same step and exit 42.

Wraps `tf.distribute.experimental.PreemptionCheckpointHandler`, which agrees on the step
to save at through the coordination service. Saving goes through our CheckpointSaver, so
the chief writes into model_dir and the other workers into temp dirs they delete; exit
code 42 tells a launcher (`trainer.launch --max_restarts`) to restart the group, which
then continues from the saved step.

The handler's watcher thread (`PeerTerminationWatcher-<id>`) blocks in a read from the
chief's coordination service until some worker is preempted. After a run that was not
preempted TensorFlow only stops it in the handler's `__del__`, which need not run before
the chief exits; the read then fails and the thread prints a traceback (UnavailableError:
Connection reset by peer) after a successful run. So the hook's `end` stops it the way
`__del__` does (private API: TensorFlow has no public one), then waits at a barrier until
every worker has, so no chief leaves while a peer's watcher still reads from it.
"""
from __future__ import annotations

import signal
import sys

import tensorflow as tf
from tensorflow.python.eager import context

from trainer.extensions.protocol import Extension
from trainer.hooks.base import Run

PREEMPTED_EXIT_CODE = 42
_END_BARRIER = "trainer_preemption_watchers_stopped"
_END_BARRIER_TIMEOUT_MS = 60_000


class Preemption(Extension):
    """After every loop call (and after its checkpoint), saves and exits if any worker has been told to stop."""

    name = "preemption"
    setting = "train.preemption_checkpointing"
    after = ("checkpoint",)  # a periodic checkpoint of this step comes first: no second save

    def __init__(self) -> None:
        self._step = 0

    def begin(self, run: Run) -> None:
        self._saver = run.saver
        self._print_fn = run.print_fn
        self._step = run.start_step
        # The handler only reads through this manager (it restores the newest checkpoint,
        # as we already did); every write goes through save_fn.
        reader = tf.train.CheckpointManager(run.saver.checkpoint, run.saver.model_dir, max_to_keep=None)
        config = tf.distribute.experimental.TerminationConfig(exit_fn=self._exit, save_fn=self._save)
        self._handler = tf.distribute.experimental.PreemptionCheckpointHandler(
            getattr(run.strategy, "cluster_resolver", None), reader, termination_config=config
        )

    def after_loop(self, run: Run, step: int, metrics: dict[str, float]) -> None:
        self._step = step
        self._handler.save_checkpoint_if_preempted()

    def end(self, run: Run, step: int) -> None:
        """Stops the handler's threads, then waits for every worker to have stopped theirs."""
        handler = self._handler
        watched_peers = getattr(handler, "_cluster_wise_termination_watcher_thread", None) is not None
        handler._stop_cluster_wise_termination_watcher_thread()
        handler._stop_poll_termination_signal_thread()
        if watched_peers:
            try:
                context.context().wait_at_barrier(_END_BARRIER, _END_BARRIER_TIMEOUT_MS)
            except tf.errors.OpError:
                pass  # a peer already gone: this run is done and saved either way

    def _save(self) -> None:
        if self._saver.last_saved_step != self._step:
            self._saver.save(self._step)

    def _exit(self) -> None:
        self._print_fn(
            f"preempted: saved ckpt-{self._step}; exiting {PREEMPTED_EXIT_CODE} so the group can "
            "be restarted (it continues from this step)"
        )
        # A peer that exits first makes the launcher (srun --kill-on-bad-exit, trainer.launch) SIGTERM
        # this process too; it is leaving already, and must leave with the code that asks for a restart.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        sys.exit(PREEMPTED_EXIT_CODE)
