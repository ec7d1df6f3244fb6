"""Engines shared by the e2e jobs that attach to them (`rollout.engine.attach`) instead of starting their own: an
engine's start-up is most of a short job's time on this machine (~45 s of 70 for two engines).

The engines run through tests/e2e, started as a user would start engines to attach to (SGLang's server, the
engine environment of `slimish.engines.server`, an API key in a file). Each job resets them at its start (the
checkpoint reloaded, requests aborted, caches flushed); between tests, `check_engines` makes sure that a job left
them healthy and generating (not paused, not hung), so that a job that broke one fails where it did it. The router
is each job's own, so no membership carries over between jobs.
"""

from __future__ import annotations

import os
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from slimish.engines.client import EngineClient
from slimish.engines.process import ManagedProcess
from slimish.engines.server import engine_argv, engine_env
from slimish.engines.servers import reset_attached
from slimish.network import free_port, new_job_key, read_key

HOST = "127.0.0.1"


@dataclass
class SharedEngines:
    urls: list[str]
    key_file: Path
    model: str
    tp: int = 1
    processes: list[ManagedProcess] = field(default_factory=list)

    def overrides(self, count: int | None = None) -> list[str]:
        """The config overrides of a job attached to the first `count` engines (all by default)."""
        urls = self.urls[:count]
        return [f"rollout.engine.num_engines={len(urls)}", f"rollout.engine.attach=[{', '.join(urls)}]",
                f"rollout.engine.attach_key_file={self.key_file}", f"rollout.engine.tensor_parallel={self.tp}"]

    @property
    def key(self) -> str:
        return read_key(str(self.key_file))

    def client(self, url: str) -> EngineClient:
        return EngineClient(url, timeout_s=120, api_key=self.key)

    def _probe(self, i: int, timeout_s: float) -> str | None:
        """None when engine i answers a generation within `timeout_s`, else what happened instead."""
        client = self.client(self.urls[i])
        try:
            return client.probe("/health_generate", timeout_s=timeout_s)
        finally:
            client.close()

    def problems(self, probe_timeout_s: float = 60.0) -> dict[int, str]:
        """What is wrong with each engine that is not running, answering a generation within `probe_timeout_s` and
        unpaused (a paused engine's /health_generate waits), by index; {} when all are well. The engines are probed
        at once: SGLang's /health_generate looks for its generation's answer once a second, so each probe takes a
        second at least, and every test that attaches checks twice."""
        def problem(i: int) -> str | None:
            process = self.processes[i]
            if not process.alive():
                return f"died (exit code {process.proc.returncode}):\n{process.log_tail()}"
            return self._probe(i, probe_timeout_s)

        with ThreadPoolExecutor(max_workers=len(self.processes)) as pool:
            found = dict(enumerate(pool.map(problem, range(len(self.processes)))))
        return {i: what for i, what in found.items() if what is not None}

    def check_engines(self, when: str, probe_timeout_s: float = 60.0) -> None:
        """Every engine is well; else the engines are mended (`mend`) and the check fails naming what was wrong, so
        that the test that broke one fails and the tests after it find them well."""
        if found := self.problems(probe_timeout_s):
            self.mend(found)
            raise AssertionError("; ".join(f"shared engine {self.urls[i]} {problem} {when} (mended)"
                                           for i, problem in found.items()))

    def mend(self, broken: dict[int, str]) -> None:
        """Make the `broken` engines well: a running one is reset as a job attaching to it would reset it
        (`reset_attached`: continued, its requests aborted, its checkpoint reloaded); one still not generating after
        that, or dead, is restarted."""
        for i in broken:
            if self.processes[i].alive() and self._reset(i) and self._probe(i, 60) is None:
                continue
            self.restart(i)

    def reset(self, i: int) -> None:
        """Reset engine i as a job attaching to it does (`reset_attached`): its checkpoint's weights, no request."""
        reset_attached(self.urls[i], model_path=self.model, api_key=self.key)

    def _reset(self, i: int) -> bool:
        try:
            self.reset(i)
        except Exception:  # noqa: BLE001 - the caller restarts it, whatever went wrong
            return False
        return True

    def restart(self, index: int) -> None:
        """Start engine `index` again (a test killed it), with its port, key and seed; healthy on return."""
        process = self.processes[index]
        process.stop()  # reaps what is left of it
        process.start()
        process.wait_http_ok(f"{self.urls[index]}/health_generate", timeout_s=600)

    def stop(self) -> None:
        for process in self.processes:
            process.stop()


def start(model: str, root: Path, *, count: int = 2, tp: int = 1, seed: int = 1234, max_total_tokens: int = 4096
          ) -> SharedEngines:
    """`count` SGLang CPU engines on `model`, of `tp` tensor-parallel ranks each, each requiring the key in
    `root`/engine_key, healthy on return."""
    root.mkdir(parents=True, exist_ok=True)
    key = new_job_key()
    key_file = root / "engine_key"
    key_file.write_text(key + "\n")
    key_file.chmod(0o600)
    engines = SharedEngines(urls=[], key_file=key_file, model=model, tp=tp)
    try:
        for i in range(count):
            port = free_port()
            fd, config = tempfile.mkstemp(dir=root, suffix=".yaml")  # the key via --config, not the command line
            with os.fdopen(fd, "w") as f:
                yaml.safe_dump({"api-key": key}, f)
            argv = engine_argv(model_path=model, host=HOST, port=port, device="cpu", dtype="float32", tp=tp,
                               max_total_tokens=max_total_tokens, seed=seed + i, extra=["--config", config])
            process = ManagedProcess(f"shared_engine{i}", argv, env=engine_env(tp), log_path=root / f"engine{i}.log")
            process.start()
            engines.processes.append(process)
            engines.urls.append(f"http://{HOST}:{port}")
        for url, process in zip(engines.urls, engines.processes):
            process.wait_http_ok(f"{url}/health_generate", timeout_s=600)
    except BaseException:
        engines.stop()
        raise
    return engines
