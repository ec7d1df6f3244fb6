"""SIGTERM and SIGUSR1 as a request to stop at the next safe point with a checkpoint (`checkpoint.save_on_signal`).

Slurm sends SIGTERM on scancel and preemption, and (with `--signal=B:USR1@N`, as launch/train.sbatch asks) SIGUSR1 N
seconds before the time limit. The first such signal does not interrupt anything: the job finishes the step it is in
(its rollout, training and sync), saves a checkpoint of it unless that step was just saved, and stops with
`REQUEUE_EXIT` (75, EX_TEMPFAIL: "try again"), the code launch/train.sbatch answers with `scontrol requeue`; the
requeued job resumes from that checkpoint (checkpoint.resume auto). While the job starts (engines, the trainer, the
SFT warm-up, a resume's load), before its first RL step, a signal stops it at once: nothing new to save.
Repeated signals (Slurm signals every process of the job; the batch script forwards) are the same request. If no
safe point comes within `checkpoint.signal_grace_s`, the job is interrupted where it is, as without this module:
shut down, and resumed later from its last periodic checkpoint.

Signal handlers here only set a flag and, past the grace, raise; they print nothing (a print in a handler that
interrupts a print raises "reentrant call"): the driver says what happened at the safe point.
"""

from __future__ import annotations

import os
import signal
import threading
import time

REQUEUE_EXIT = 75  # sysexits.h EX_TEMPFAIL


class Terminated(KeyboardInterrupt):
    """SIGTERM (scancel, kill) as an exception, so that the job unwinds through shutdown() like on Ctrl-C."""

    def __init__(self, signum: int):
        super().__init__(f"signal {signum}")
        self.signum = signum


class StoppedOnSignal(Exception):
    """The job stopped at a safe point because it was asked to (`GracefulStop`); `checkpoint` is the checkpoint it
    can resume from (None: none yet), `saved` whether this stop wrote it."""

    def __init__(self, signum: int, step: int, checkpoint, saved: bool):
        name = signal.Signals(signum).name
        where = ("no checkpoint yet" if checkpoint is None else f"saved checkpoint {checkpoint}" if saved else
                 f"its last checkpoint is {checkpoint}")
        super().__init__(f"stopped by {name} after step {step}; {where}: the job continues from it when run again "
                         f"(checkpoint.resume auto; under Slurm, the requeued job does)")
        self.signum, self.step, self.checkpoint, self.saved = signum, step, checkpoint, saved


TERMINATED_BY: list[int] = []  # the signals turned into Terminated, in order


def raise_terminated(signum, frame):
    TERMINATED_BY.append(signum)
    raise Terminated(signum)


class GracefulStop:
    """The stop request: `install()` takes SIGTERM and SIGUSR1; `requested` is the first signal's number (None: no
    request); `check(...)` is called at safe points."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

    def __init__(self, *, enabled: bool, grace_s: float):
        self.enabled, self.grace_s = enabled, grace_s
        self.requested: int | None = None
        self.requested_at: float | None = None
        self._grace_over = False
        self._timer: threading.Timer | None = None

    def install_immediate(self) -> None:
        """While the job starts (nothing of it to save yet): SIGTERM and SIGUSR1 interrupt at once (`Terminated`),
        and the job unwinds through its shutdown. Again after ray.init, which installs a SIGTERM handler of its
        own."""
        for signum in self.SIGNALS:
            signal.signal(signum, raise_terminated)

    def install(self) -> None:
        """From the first RL step on: a signal is a request to stop at the next safe point (without `enabled`, it
        interrupts at once as while starting)."""
        if not self.enabled:
            self.install_immediate()
            return
        for signum in self.SIGNALS:
            signal.signal(signum, self._handle)

    def _handle(self, signum, frame) -> None:
        if self._grace_over:
            raise_terminated(signal.SIGTERM, frame)
        if self.requested is not None:
            return  # the same request again (Slurm and the batch script both signal)
        self.requested, self.requested_at = signum, time.monotonic()
        self._timer = threading.Timer(self.grace_s, self._expire)
        self._timer.daemon = True
        self._timer.start()

    def _expire(self) -> None:
        """No safe point within the grace: interrupt the main thread where it is."""
        self._grace_over = True
        os.kill(os.getpid(), signal.SIGTERM)

    def waited_s(self) -> float:
        return 0.0 if self.requested_at is None else time.monotonic() - self.requested_at

    def cancel(self) -> None:
        """The job is stopping (or done): the grace timer must not fire into its shutdown."""
        if self._timer is not None:
            self._timer.cancel()

    def restore(self) -> None:
        """Ignore the signals while the job shuts down: a second one would cut the shutdown short."""
        self.cancel()
        for signum in self.SIGNALS:
            signal.signal(signum, signal.SIG_IGN)


def stopping_signal(exc: KeyboardInterrupt) -> int:
    """The signal that stopped the job with `exc`: Terminated's own, else the last one `raise_terminated` took (a
    Terminated raised while `ray.get` waits comes out of it as a plain KeyboardInterrupt, its signal number lost),
    else SIGINT (Ctrl-C)."""
    return getattr(exc, "signum", None) or (TERMINATED_BY[-1] if TERMINATED_BY else signal.SIGINT)
