"""Fault injection for the e2e tests, through hooks the job calls (named in the config by dotted path)."""

from __future__ import annotations

import asyncio
import functools
import itertools
import json
import os
import signal
import time
from pathlib import Path

from slimish.engines.client import EngineAuth
from slimish.network import JOB_KEY_FILE, EngineKeys, auth_headers, read_keys

# {"engine": i, "signal": "SIGKILL" | "SIGSTOP"[, "part": r]}: the test writes it to arm the hook (part r of an engine
# spanning nodes; else the engine's server)
TRIGGER = "fault_between_buckets"
DONE = "faults_between_buckets.jsonl"  # the hook appends {"version", "engine", "signal"} for each fault it made


def job_keys(run_dir: Path) -> EngineKeys:
    """The keys a job wrote to its run directory (admin, then API: its engines and router refuse calls without
    them). An httpx client given `auth=EngineAuth(keys)` sends each endpoint the one it needs."""
    return read_keys(str(run_dir / JOB_KEY_FILE))


def arm_fault_between_buckets(run_dir: Path, *, engine: int, signal_name: str, part: int | None = None) -> None:
    # Whole or not at all (written aside, then renamed): the hook may read it at any moment.
    armed = (run_dir / TRIGGER).with_suffix(".tmp")
    armed.write_text(json.dumps({"engine": engine, "signal": signal_name, **({} if part is None else {"part": part})}))
    armed.rename(run_dir / TRIGGER)


def faults_made(run_dir: Path) -> list[dict]:
    path = run_dir / DONE
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def listening_pid(url: str) -> int:
    """The PID of the process listening on `url`'s port (a restarted engine's server: pids.json has the first)."""
    import psutil

    port = int(url.rsplit(":", 1)[1])
    return next(c.pid for c in psutil.net_connections("tcp")
                if c.status == psutil.CONN_LISTEN and c.laddr.port == port and c.pid)


def fault_between_buckets(version: str, bucket: int, engine_urls: list[str]) -> None:
    """`weight_sync.after_bucket_hook`: once armed (the file TRIGGER in the run directory named by the environment
    variable SLIMISH_TEST_RUN_DIR), send the armed signal to the armed engine's process group right after bucket 1
    of a sync is on its way, so the fault lands between two buckets by construction: SIGKILL (the engine dies) or
    SIGSTOP (it hangs); to one node part of an engine spanning nodes when armed with one."""
    run_dir = Path(os.environ["SLIMISH_TEST_RUN_DIR"])
    trigger = run_dir / TRIGGER
    if bucket != 1 or not trigger.exists():
        return
    armed = json.loads(trigger.read_text())
    engine = json.loads((run_dir / "placement.json").read_text())["engines"][armed["engine"]]
    if engine["url"] not in engine_urls:
        return
    target = engine["parts"][armed["part"]]["url"] if "part" in armed else engine["url"]
    trigger.unlink()
    os.killpg(os.getpgid(listening_pid(target)), getattr(signal, armed["signal"]))
    with (run_dir / DONE).open("a") as f:
        f.write(json.dumps({"version": int(version), **armed}) + "\n")


PACE_S = 4.0  # pace_while_restarting's pause before each rollout while an engine is down


def pace_while_restarting(phase: str, step: int, engine_urls: list[str]) -> None:
    """`run.phase_hook` of the tests that restart an engine under a running job: while fewer engines hold the
    weights than the job placed (placement.json in the run directory SLIMISH_TEST_RUN_DIR names), each rollout
    starts PACE_S late. Steps still run on the engines left, but on this 2-core machine a job at full speed takes
    the cores a restarting engine needs (its start-up took 80-120 s beside it, ~35 s alone); on a cluster the
    restarting engine has its node to itself. Nothing else changes: the same steps, syncs and checks."""
    if phase != "rollout":
        return
    placement = json.loads((Path(os.environ["SLIMISH_TEST_RUN_DIR"]) / "placement.json").read_text())
    if len(engine_urls) < len(placement["engines"]):
        time.sleep(PACE_S)


LONG_TOKENS = 12  # long_response_reward: half of the responses of the abort test's untrained model are this long


def long_response_reward(completions: list[str], samples: list, **kwargs) -> list[float]:
    """`reward.fn` of the abort-mode test: 1.0 for a response of at least LONG_TOKENS tokens. With its stop strings
    the lengths are near geometric, so about half the responses earn it whatever their text: nearly every group has
    reward variance, and dynamic sampling seldom drops one (a continued group among them)."""
    return [1.0 if len(sample.response_ids) >= LONG_TOKENS else 0.0 for sample in samples]


def engine_requests(http, url: str, *, waiting: bool = False) -> int:
    """Requests engine `url` is running (with `waiting`: and queueing), from the core section of its /v1/loads,
    summed over its data-parallel ranks. `http`: an httpx.Client with the job's key, if the engines have one."""
    loads = http.get(f"{url}/v1/loads", params={"include": "core"}).json()["loads"]
    keys = ("num_running_reqs", "num_waiting_reqs") if waiting else ("num_running_reqs",)
    return sum(load.get(key, 0) for load in loads for key in keys)


HELD_FOR_SYNC = "held_for_sync.jsonl"  # hold_requests_for_syncs appends {"step", "engine", "running"} per sync
HOLD_TIMEOUT_S = 120.0  # nothing is held only if every request finished while no engine was looked at
CATCH_S = 2.0  # how long one engine is let go at a time, looking for a running request


class EngineFreezer:
    """Makes "requests are running on an engine when X happens" certain rather than a matter of speed: `freeze`
    pauses engines in place (nothing they hold moves; requests sent meanwhile wait at their front door), and
    `hold_running` lets them go one at a time until one is seen running requests, then pauses it in place again,
    and returns once a paused engine holds running requests. A retract pause then retracts exactly those (SGLang
    retracts the running batch, which an in-place pause leaves as it is); a continue lets every engine go."""

    def __init__(self, http):
        self.http = http  # an httpx.Client with the job's key, if the engines have one

    def _control(self, url: str, path: str, body: dict) -> None:
        self.http.post(f"{url}{path}", json=body).raise_for_status()

    def running(self, url: str) -> int:
        return engine_requests(self.http, url)

    def freeze(self, urls: list[str]) -> None:
        for url in urls:
            self._control(url, "/pause_generation", {"mode": "in_place"})

    def hold_running(self, urls: list[str], *, timeout_s: float = HOLD_TIMEOUT_S) -> tuple[str, int]:
        """Of frozen engines `urls`: one that holds running requests, and how many; they stay frozen."""
        deadline = time.monotonic() + timeout_s
        for attempt in itertools.count():
            for url in urls:
                if held := self.running(url):
                    return url, held
            if time.monotonic() > deadline:
                raise RuntimeError(f"no engine of {urls} ran a request in {timeout_s} s")
            url = urls[attempt % len(urls)]
            self._control(url, "/continue_generation", {})
            let_go_until = time.monotonic() + CATCH_S
            while not self.running(url) and time.monotonic() < let_go_until:
                pass  # no sleep: a request may need only a few decode steps
            self.freeze([url])


FROZEN = "frozen_for_step_{}"  # hold_requests_for_syncs creates it once the engines are frozen for a step's training


def hold_requests_for_syncs(phase: str, step: int, engine_urls: list[str]) -> None:
    """`run.phase_hook` of the retract-mode test: every weight sync finds requests running on an engine, however
    fast the engines generate compared with the trainer. As training begins the engines are frozen (and FROZEN
    marks it for `generate_once_frozen`); as the sync begins, `EngineFreezer.hold_running` (the driver's resume
    after the sync lets every engine go). Appends what it held to HELD_FOR_SYNC in the run directory."""
    import httpx

    if phase not in ("train", "sync"):
        return
    run_dir = Path(os.environ["SLIMISH_TEST_RUN_DIR"])
    with httpx.Client(timeout=30, auth=EngineAuth(job_keys(run_dir))) as http:
        freezer = EngineFreezer(http)
        if phase == "train":
            freezer.freeze(engine_urls)
            (run_dir / FROZEN.format(step)).touch()
            return
        url, held = freezer.hold_running(engine_urls)
        with (run_dir / HELD_FOR_SYNC).open("a") as f:
            f.write(json.dumps({"step": step, "engine": url, "running": held}) + "\n")


SECURITY_PROBE = "security_probe.json"  # what probe_security saw, in the run directory


def probe_security(version: str, bucket: int, engine_urls: list[str]) -> None:
    """`weight_sync.after_bucket_hook`, on trainer rank 0, once (the first bucket of the first sync), while
    everything the job listens on is up: engines, router, the trainer's and the weight-sync group's rendezvous
    stores. Records in SECURITY_PROBE: the answers to control calls made without the job's key, with a wrong one
    and with the right one; every listening socket of the job's processes (the `slimish train` process and its
    descendants); and the ports of the rendezvous stores this process hosts."""
    import httpx
    import psutil
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    run_dir = Path(os.environ["SLIMISH_TEST_RUN_DIR"])
    out = run_dir / SECURITY_PROBE
    if out.exists() or bucket != 1:
        return
    router = json.loads((run_dir / "placement.json").read_text())["router"]["url"]  # a free port, picked at start
    engine = engine_urls[0]
    keys = job_keys(run_dir)
    bearer = auth_headers(keys.api)
    # A connection per call: the router answers a keyless POST with 401 as soon as it has read the headers, and
    # when the body arrives after that answer (a busy machine) it closes the connection without saying so; a pooled
    # connection would then fail the next call ("Server disconnected without sending a response"). Timeout: mid-sync
    # on a loaded machine, a call timing out would fail the sync.
    with httpx.Client(timeout=60, limits=httpx.Limits(max_keepalive_connections=0)) as http:
        calls = {
            "engine_abort_no_key": http.post(f"{engine}/abort_request", json={"abort_all": True}),
            "engine_update_weights_wrong_key": http.post(f"{engine}/update_weights_from_disk",
                                                         json={"model_path": "/x"}, headers=auth_headers("wrong")),
            "engine_pause_no_key": http.post(f"{engine}/pause_generation", json={"mode": "abort"}),
            # The API key (what the router holds) opens generation and reads, never weight updates or pauses.
            "engine_pause_api_key": http.post(f"{engine}/pause_generation", json={"mode": "abort"}, headers=bearer),
            "engine_update_weights_api_key": http.post(f"{engine}/update_weights_from_disk", json={"model_path": "/x"},
                                                       headers=bearer),
            "router_generate_no_key": http.post(f"{router}/generate", json={"text": "1", "sampling_params": {}}),
            "router_workers_no_key": http.get(f"{router}/workers"),
            "engine_model_info_with_key": http.get(f"{engine}/model_info", headers=bearer),
            "router_workers_with_key": http.get(f"{router}/workers", headers=bearer),
        }
    job = psutil.Process()
    while not any("slimish.cli" in part for part in job.cmdline()):
        job = job.parent()
    processes = {p.pid: p for p in [job, *job.children(recursive=True)]}
    listeners = []
    for conn in psutil.net_connections("tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.pid in processes:
            try:
                proc = processes[conn.pid]
                listeners.append({"pid": conn.pid, "name": proc.name(), "cmdline": " ".join(proc.cmdline())[:200],
                                  "ip": conn.laddr.ip, "port": conn.laddr.port})
            except psutil.NoSuchProcess:
                continue
    stores = []
    for _, store in c10d._world.pg_map.values():
        while isinstance(store, dist.PrefixStore):
            store = store.underlying_store
        if isinstance(store, dist.TCPStore):
            stores.append(store.port)
    out.write_text(json.dumps({"calls": {name: resp.status_code for name, resp in calls.items()},
                               "listeners": listeners, "store_ports": sorted(set(stores)), "pid": os.getpid(),
                               "ray_auth_mode": os.environ.get("RAY_AUTH_MODE")},
                              indent=1))


async def wait_for_batch_gate(sample, is_open, *, batch_groups: int, poll_s: float = 0.005) -> None:
    """Until `is_open(b)`, where b = sample.group_id // batch_groups: the 0-based batch the sample's group belongs to
    (without over-sampling and dynamic sampling, group ids run batch by batch). Batch 0 never waits. It polls, as an
    asyncio task: the samples of a batch would use up the default thread pool."""
    batch = sample.group_id // batch_groups
    while batch and not is_open(batch):
        await asyncio.sleep(poll_s)


async def generate_once_frozen(sample, client):
    """`rollout.generate_fn` of the retract-mode test: one generation, as without a program, but the batch trained
    at step s+1 (sent as step s's batch is handed out) sends its requests only once `hold_requests_for_syncs` has
    frozen the engines for step s's training. Otherwise the engines, which generate a batch of this tiny model in
    ~0.2 s, could finish it before the freeze, and a sync would find nothing to hold."""
    run_dir = Path(os.environ["SLIMISH_TEST_RUN_DIR"])
    await wait_for_batch_gate(sample, lambda batch: (run_dir / FROZEN.format(batch)).exists(),
                              batch_groups=_prompts_per_step(run_dir))
    return await client.generate(sample)


@functools.cache
def _prompts_per_step(run_dir: Path) -> int:
    """rollout.prompts_per_step of the job in `run_dir` (its config.yaml), read once per process."""
    import yaml

    return yaml.safe_load((run_dir / "config.yaml").read_text())["rollout"]["prompts_per_step"]


PHASES = "phases.jsonl"  # record_phases appends {"phase", "step"} for each phase the driver begins


def record_phases(phase: str, step: int, engine_urls: list[str]) -> None:
    """`run.phase_hook`: the order of the driver's phases, in the run directory (SLIMISH_TEST_RUN_DIR)."""
    with (Path(os.environ["SLIMISH_TEST_RUN_DIR"]) / PHASES).open("a") as f:
        f.write(json.dumps({"phase": phase, "step": step}) + "\n")


def phases_recorded(run_dir: Path) -> list[tuple[str, int]]:
    return [(r["phase"], r["step"]) for r in map(json.loads, (run_dir / PHASES).read_text().splitlines())]
