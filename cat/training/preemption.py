"""Stopping training on a signal: save where every rank stands, then exit to be requeued.

A scheduler that preempts a job (Slurm: SIGTERM to every process of the job, then SIGKILL
after the partition's grace time), one that warns ahead of a time limit (`sbatch
--signal=USR1@120`), and a user at the terminal (Ctrl-C: SIGINT) all ask the same thing:
stop soon, lose nothing. `StopRequest` turns SIGTERM, SIGUSR1 and SIGINT into a flag; the
trainer (`cat.training.manager.Manager`) shares it among the ranks in the all-reduce it
makes before every update anyway, so all ranks stop after the same update, the one in
flight; then it writes a checkpoint with the exact stream position of every rank and
DataLoader worker (without the dev evaluation, which the grace time may not cover) and
raises `TrainingStopped`. The entry point exits with `STOPPED_EXIT_STATUS` (75, sysexits'
EX_TEMPFAIL: try again later); the Slurm job script then requeues itself unless a user
cancelled the job (`cat.training.jobs`), and a local re-run of stage 3 resumes: the epoch
then trains exactly the utterances it had not trained.

A second SIGINT stops at once (KeyboardInterrupt), as a user pressing Ctrl-C twice
expects; the checkpoints written before are kept. DataLoader workers ignore the three
signals (`cat.core.process.loader_worker_init`): Slurm signals every process of a job
step, and a worker killed by it would end the epoch with an error before the save.

Usage:
    with StopRequest() as stop:
        ... if stop.signal: save and raise TrainingStopped(stop.signal, step)
"""

from __future__ import annotations

import logging
import signal
import threading
from types import FrameType, TracebackType

logger = logging.getLogger(__name__)

#: Exit status of a training run stopped by a signal after saving (requeue and resume).
STOPPED_EXIT_STATUS = 75
#: The signals that ask training to save and stop.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


class TrainingStopped(Exception):
    """Training saved a checkpoint and stopped because a signal asked it to."""

    def __init__(self, signal_name: str, step: int, checkpoint: str | None = None) -> None:
        self.signal_name = signal_name
        self.step = step
        where = f" ({checkpoint})" if checkpoint else ""
        super().__init__(f"stopped by {signal_name} after update {step}; the checkpoint"
                         f"{where} holds every rank's position: resume to continue")


class StopRequest:
    """A flag the stop signals set while the block runs (main thread only; elsewhere it
    installs nothing and never fires)."""

    def __init__(self, signals: tuple[signal.Signals, ...] = STOP_SIGNALS) -> None:
        self.signals = signals
        self.signal: str | None = None
        self._previous: dict[int, object] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        del frame
        name = signal.Signals(signum).name
        if self.signal is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: stop now
        if self.signal is None:
            logger.warning("%s received: training stops after the update in flight and saves "
                           "a checkpoint", name)
            self.signal = name

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            for signum in self.signals:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 traceback: TracebackType | None) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)  # type: ignore[arg-type]
        self._previous.clear()


class NoStopRequest:
    """Never asks to stop (training driven by code that handles signals itself)."""

    signal: str | None = None
