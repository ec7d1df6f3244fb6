"""Reward hooks in worker processes that can be killed (`reward.workers`, `reward.timeout_s`).

A reward hook is user code: it can loop, sleep, hold the GIL in one long C call (sympy on `9^{9^{9}}`) or kill its
process. Run in the rollout manager's process, any of these stops the manager's threads (the engine watchdog
included) or the whole job. Here each call goes to one of `workers` processes of its own (`python -m
slimish.rollout.reward_workers`, started at the job's start, so a step never waits for one to start): the hook is
loaded there from the config (`rewards.build_reward_fn`), the samples travel pickled, and their rewards, errors
and `meta` come back. A call past `timeout_s` has its worker killed (SIGKILL) and its samples fail with a
TimeoutError; a worker that dies during a call fails its samples with its exit status. Either way the samples get
`failure_reward`, are counted in `reward_failures`, and a fresh worker takes the dead one's place before the next
call. The job goes on.

Contract of `RewardWorkers.score(samples) -> int`: as `rewards.score` (the number of failed samples; the scored
samples' `reward`, `error` and `meta` set), callable from several threads at once (a call waits for a free worker;
the wait does not count against its time limit).
"""

from __future__ import annotations

import ctypes
import logging
import os
import pickle
import queue
import signal
import socket
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection

from slimish.hooks import HookError
from slimish.rollout import rewards
from slimish.sample import Sample

log = logging.getLogger(__name__)

START_TIMEOUT_S = 120.0  # importing a hook's module (sympy, a tokenizer) can take a while on a busy host


class RewardWorkerError(RuntimeError):
    """A reward worker process could not be started or died without answering."""


class _Worker:
    """One worker process and the socket it answers on."""

    def __init__(self, reward_cfg, failure_reward: float):
        parent, child = socket.socketpair()
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen([sys.executable, "-m", "slimish.rollout.reward_workers", str(child.fileno())],
                                     pass_fds=[child.fileno()], stdin=subprocess.DEVNULL, env=env)
        child.close()
        self.conn = Connection(parent.detach())
        # The worker imports what the rollout process could import (a hook beside the config, a test's module).
        self.conn.send({"sys_path": list(sys.path), "reward": reward_cfg, "failure_reward": failure_reward})
        try:
            reply = self._receive(START_TIMEOUT_S, "starting")
        except (TimeoutError, RewardWorkerError) as exc:  # a hook module that hangs or kills its process at import
            raise HookError(f"reward hook: {exc}") from None
        if "error" in reply:
            self.kill()
            raise HookError(reply["error"])

    def _receive(self, timeout_s: float | None, doing: str) -> dict:
        """The worker's next message; a worker that dies or overruns `timeout_s` (None: no limit) is killed and
        raises RewardWorkerError / TimeoutError."""
        try:
            ready = self.conn.poll(timeout_s)
        except OSError:
            ready = True
        if not ready:
            self.kill()
            limit = "reward.timeout_s" if doing == "scoring" else "importing the hook"
            raise TimeoutError(f"no answer within {timeout_s:g}s ({limit}); the reward worker was killed")
        try:
            return self.conn.recv()
        except (EOFError, OSError, pickle.UnpicklingError) as exc:
            status = self.kill()
            raise RewardWorkerError(f"the reward worker died while {doing} ({_describe(status)})") from exc

    def score(self, samples: list[Sample], timeout_s: float) -> int:
        try:
            self.conn.send(samples)
        except Exception as exc:  # noqa: BLE001 - a worker gone since its last call, or a sample that does not pickle
            status = self.kill()
            raise RewardWorkerError(f"the samples could not be sent to the reward worker ({_describe(status)}): "
                                    f"{type(exc).__name__}: {exc}") from exc
        reply = self._receive(timeout_s if timeout_s > 0 else None, "scoring")
        for sample, (reward, error, meta) in zip(samples, reply["samples"]):
            sample.reward, sample.error, sample.meta = reward, error, meta
        return reply["failures"]

    def kill(self) -> int | None:
        """SIGKILL the process (if it still runs) and reap it; returns its exit status."""
        if self.proc.poll() is None:
            self.proc.kill()
        status = self.proc.wait()
        self.conn.close()
        return status

    def close(self) -> None:
        """Ask the worker to exit (it is idle); kill it if it does not within 5 s."""
        try:
            self.conn.send(None)
            self.proc.wait(5)
        except (OSError, subprocess.TimeoutExpired):
            pass
        self.kill()


def _describe(status: int | None) -> str:
    if status is not None and status < 0:
        return f"killed by {signal.Signals(-status).name}"
    return f"exit status {status}"


class RewardWorkers:
    """`workers` reward worker processes running the hook `reward_cfg` (RewardConfig) names; see the module."""

    def __init__(self, reward_cfg, *, workers: int, timeout_s: float, failure_reward: float):
        if workers < 1:
            raise ValueError(f"reward.workers must be at least 1 here, got {workers}")
        self.reward_cfg, self.timeout_s, self.failure_reward = reward_cfg, timeout_s, failure_reward
        self._idle: queue.Queue[_Worker | None] = queue.Queue()
        self._closed = threading.Event()
        # Every worker is started from this one thread, which lives as long as the pool: Linux sends a worker its
        # PR_SET_PDEATHSIG when the *thread* that forked it ends, and a caller's thread (asyncio.to_thread's, under
        # an event loop that is closed after an evaluation) may end long before the worker should.
        self._spawner = ThreadPoolExecutor(1, thread_name_prefix="reward-spawner")
        started: list[_Worker] = []
        try:
            for _ in range(workers):  # started now: a bad hook fails the job's start with its one line
                started.append(self._spawn())
        except BaseException:
            for worker in started:
                worker.kill()
            self._spawner.shutdown()
            raise
        for worker in started:
            self._idle.put(worker)
        self.restarts = 0  # workers replaced after a timeout or a death

    def score(self, samples: list[Sample]) -> int:
        scored = [s for s in samples if s.scored]
        if not scored:
            return 0
        worker = self._idle.get()
        try:
            if worker is None:  # its predecessor was killed: a fresh one before the call (not on the call's clock)
                worker = self._spawn()
            failures = worker.score(scored, self.timeout_s)
        except (TimeoutError, RewardWorkerError, HookError) as exc:
            log.warning("reward hook failed %d sample(s): %s", len(scored), exc)
            self.restarts += 1
            worker = None
            return rewards.fail(scored, exc, self.failure_reward)
        finally:
            if self._closed.is_set() and worker is not None:
                worker.close()
            else:
                self._idle.put(worker)
        return failures

    def _spawn(self) -> _Worker:
        return self._spawner.submit(_Worker, self.reward_cfg, self.failure_reward).result()

    def pids(self) -> list[int]:
        """The idle workers' pids (for tests and `ps`)."""
        workers = list(self._idle.queue)
        return [w.proc.pid for w in workers if w is not None]

    def close(self) -> None:
        """Stop the idle workers; a busy one stops when its call returns."""
        self._closed.set()
        while True:
            try:
                worker = self._idle.get_nowait()
            except queue.Empty:
                break
            if worker is not None:
                worker.close()
        self._spawner.shutdown(wait=False)


class InProcessReward:
    """The hook called in the rollout process itself (`reward.workers: 0`): `rewards.score` with its thread-based
    time limit, which cannot stop a hook that holds the GIL. For debugging a hook under pdb."""

    def __init__(self, fn, *, timeout_s: float, failure_reward: float):
        self.fn, self.timeout_s, self.failure_reward = fn, timeout_s, failure_reward

    def score(self, samples: list[Sample]) -> int:
        return rewards.score(samples, self.fn, failure_reward=self.failure_reward, timeout_s=self.timeout_s)

    def close(self) -> None:
        pass


def build(reward_cfg):
    """The job's reward scorer as `reward_cfg` (RewardConfig) says: worker processes, or in process."""
    if reward_cfg.workers > 0:
        return RewardWorkers(reward_cfg, workers=reward_cfg.workers, timeout_s=reward_cfg.timeout_s,
                             failure_reward=reward_cfg.failure_reward)
    return InProcessReward(rewards.build_reward_fn(reward_cfg), timeout_s=reward_cfg.timeout_s,
                           failure_reward=reward_cfg.failure_reward)


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this worker when the process that started it dies (a hook stuck in C never reads the
    closed socket)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _serve(fd: int) -> None:
    _die_with_parent()
    conn = Connection(fd)
    # The socket is the protocol; what the hook prints goes to the worker's stderr, i.e. the rollout process's log.
    os.dup2(2, 1)
    init = conn.recv()
    sys.path[:] = init["sys_path"]
    try:
        fn = rewards.build_reward_fn(init["reward"])
    except Exception as exc:  # the hook's import: a syntax error, an exception at import, a missing name
        conn.send({"error": f"reward hook: {type(exc).__name__}: {exc}"})
        return
    conn.send({"ready": True})
    failure_reward = init["failure_reward"]
    while True:
        try:
            samples = conn.recv()
        except EOFError:
            return
        if samples is None:
            return
        failures = rewards.score(samples, fn, failure_reward=failure_reward)
        conn.send({"failures": failures, "samples": [(s.reward, s.error, s.meta) for s in samples]})


if __name__ == "__main__":
    _serve(int(sys.argv[1]))
