"""launch/train.sbatch and launch/convert.sbatch against a real Slurm: a 2-node cluster simulated on this host.

    .venv/bin/pytest -m slurm tests/slurm      # as root; apt-installs slurm-wlm and munge if sbatch is missing

launch/local_slurm.sh runs the cluster in a network namespace of its own whose only interface is loopback, so all
traffic stays on 127.0.0.0/8 and every process a job starts lives in that namespace: "nothing left behind" means
that once a job is over, the namespace holds no process but the Slurm daemons.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LOCAL_SLURM = REPO / "launch" / "local_slurm.sh"
QUICKSTART = "configs/quickstart_cpu.yaml"
PROBE_DRIVER = "python tests/slurm/ray_probe_driver.py"


def wait_until(predicate, *, timeout: float, what: str, interval: float = 1.0):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(interval)


class LocalSlurm:
    """Client of one launch/local_slurm.sh cluster with its own state directory and network namespace."""

    def __init__(self, state_dir: Path, netns: str):
        self.state_dir = state_dir
        self.netns = netns
        # RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0: what a submitter that has run slimish's local Ray passes on (sbatch
        # exports the environment); the job must still form its multi-node cluster.
        self.env = dict(os.environ, SLIMISH_SLURM_DIR=str(state_dir), SLIMISH_SLURM_NETNS=netns,
                        RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")

    def script(self, *args: str, env: dict[str, str] | None = None, check: bool = True) -> str:
        result = subprocess.run(
            [str(LOCAL_SLURM), *args],
            env={**self.env, **(env or {})},
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
        )
        if check and result.returncode != 0:
            raise AssertionError(f"local_slurm.sh {' '.join(args)} failed:\n{result.stdout}\n{result.stderr}")
        return result.stdout

    def sbatch(self, *args: str, env: dict[str, str] | None = None) -> str:
        return self.script("run", "sbatch", "--parsable", *args, env=env).strip().split(";")[0]

    def in_queue(self, job: str) -> bool:
        return bool(self.script("run", "squeue", "-h", "-j", job, check=False).strip())

    def state(self, job: str) -> tuple[str, str]:
        """(JobState, ExitCode) as scontrol reports them, e.g. ("COMPLETED", "0:0")."""
        text = self.script("run", "scontrol", "show", "job", job)
        return re.search(r"JobState=(\S+)", text)[1], re.search(r"ExitCode=(\S+)", text)[1]

    def wait_done(self, job: str, timeout: float) -> tuple[str, str]:
        wait_until(lambda: not self.in_queue(job), timeout=timeout, what=f"job {job} to leave the queue")
        return self.state(job)

    def _daemon_pids(self) -> set[int]:
        """slurmctld, its helper slurmscriptd, and the slurmd of every node."""
        ctld = int((self.state_dir / "slurmctld.pid").read_text())
        slurmds = {int(f.read_text()) for f in self.state_dir.glob("slurmd-*.pid")}
        children = subprocess.run(["ps", "-o", "pid=", "--ppid", str(ctld)], capture_output=True, text=True).stdout
        return {ctld, *slurmds, *map(int, children.split())}

    def job_processes(self) -> dict[int, str]:
        """Live processes in the cluster's network namespace other than the Slurm daemons: pid -> command line."""
        netns = os.stat(f"/run/netns/{self.netns}").st_ino
        daemons = self._daemon_pids()
        found = {}
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) in daemons:
                continue
            try:
                if os.stat(f"/proc/{entry}/ns/net").st_ino != netns:
                    continue
                if Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                    continue
                found[int(entry)] = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except (FileNotFoundError, ProcessLookupError, PermissionError):
                continue
        return found

    def daemon_logs(self, job: str, lines: int = 40) -> str:
        """The lines of slurmctld's and every slurmd's log that name job `job` (the last `lines` of each): where a
        launch Slurm failed says why, when the job's own output is empty."""
        text = ""
        for log in sorted((self.state_dir / "log").glob("*.log")):
            found = [line for line in log.read_text(errors="replace").splitlines()
                     if re.search(rf"\b(JobId=|job |StepId=|\[){job}\b", line)]
            text += f"\n--- {log.name} ---\n" + "\n".join(found[-lines:])
        return text

    def listeners(self) -> list[str]:
        """Local addresses of the TCP sockets listening in the cluster's network namespace."""
        return [line.split()[3] for line in self.script("run", "ss", "-ltnH").splitlines() if line.strip()]


@pytest.fixture(scope="module")
def cluster():
    if os.geteuid() != 0:
        pytest.skip("the local Slurm cluster needs root (slurmd, munged, network namespaces)")
    subprocess.run([str(LOCAL_SLURM), "install"], check=True, timeout=900)
    # Not under pytest's tmp_path: munged runs as the munge user, which must be able to enter the state directory.
    state_dir = Path(tempfile.mkdtemp(prefix="slimish-slurm-test-", dir="/tmp"))
    state_dir.chmod(0o755)
    slurm = LocalSlurm(state_dir, netns=f"slimish-test-{os.getpid()}")
    try:
        slurm.script("start", "2")
        yield slurm
    finally:
        slurm.script("stop", check=False)
        shutil.rmtree(state_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def tiny_assets():
    """The quickstart config's local assets, made the way `make quickstart` makes them."""
    if not (REPO / "artifacts" / "tiny" / "model" / "config.json").exists():
        slimish = Path(sys.executable).parent / "slimish"
        subprocess.run([str(slimish), "make-tiny", "--out", "artifacts/tiny"], cwd=REPO, check=True, timeout=300)


def submit_train(cluster: LocalSlurm, out_dir: Path, name: str, *overrides: str, env=None) -> str:
    args = ["-N", "2", "-o", f"{out_dir}/slurm-%j.out", "launch/train.sbatch", QUICKSTART, *overrides]
    return cluster.sbatch(*args, f"run.output_dir={out_dir}", f"run.name={name}", env=env)


def job_output(out_dir: Path, job: str) -> str:
    """The job's output, then the tail of each Ray node's log (where a node that failed to start says why)."""
    path = out_dir / f"slurm-{job}.out"
    text = path.read_text()[-6000:] if path.exists() else "(no job output)"
    for log in sorted(out_dir.glob(f"*/slurm-{job}/ray-*.log")):
        text += f"\n--- {log.name} ---\n" + log.read_text(errors="replace")[-3000:]
    return text


def metric_steps(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def assert_both_nodes_bootstrapped(log_dir: Path):
    """Each node's srun step started Ray and left its line; Ray then saw both nodes."""
    roles = dict(re.findall(r"node=(\S+) role=(\S+)", (log_dir / "nodes.log").read_text()))
    assert roles == {"n1": "head", "n2": "worker"}
    bootstrap = (log_dir / "bootstrap.log").read_text()
    assert "ray cluster: 2/2 nodes alive" in bootstrap
    assert "ray node: node=n1 " in bootstrap and "ray node: node=n2 " in bootstrap


def assert_nothing_left(cluster: LocalSlurm, run_dir: Path):
    def leftovers() -> dict[int, str]:
        found = cluster.job_processes()
        # Belt and braces (e.g. a process that escaped the namespace): anything still naming the run directory.
        for entry in os.listdir("/proc"):
            if entry.isdigit() and int(entry) != os.getpid():
                try:
                    cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode()
                except (FileNotFoundError, ProcessLookupError, PermissionError):
                    continue
                if str(run_dir) in cmdline:
                    found[int(entry)] = cmdline
        return found

    # The job has left the queue; give exiting processes a moment before calling them leftovers.
    try:
        wait_until(lambda: not leftovers(), timeout=10, what="the job's processes to exit", interval=0.5)
    except AssertionError:
        pytest.fail("processes left behind by the job:\n" + "\n".join(f"{p} {c}" for p, c in leftovers().items()))


# Ports launch/ray_node.sh gives Ray on a 2-node job with the default SLIMISH_RAY_PORT_BASE: the head's and each
# node's services, and each node's worker ports.
RAY_PORTS = set(range(20000, 20030)) | set(range(10000, 12000))


def assert_ray_listens_on_loopback_only(addresses: list[str]):
    """Ray's own listeners: the GCS is up, and none binds anything but loopback (Ray's default is 0.0.0.0)."""
    ray_hosts = {}
    for address in addresses:
        host, port = address.rsplit(":", 1)
        if int(port) in RAY_PORTS:
            ray_hosts[address] = host.strip("[]").removeprefix("::ffff:")
    assert "127.0.0.1:20000" in ray_hosts or "[::ffff:127.0.0.1]:20000" in ray_hosts, addresses
    outside = [a for a, host in ray_hosts.items() if host == "*" or not ipaddress.ip_address(host).is_loopback]
    assert not outside, f"Ray listeners outside loopback: {outside}"


@pytest.mark.timeout(300)
def test_bootstrap_runs_ray_tasks_on_both_nodes_in_a_container(cluster, tiny_assets, tmp_path):
    """The bootstrap alone, with a stand-in driver (fast, and independent of the trainer; train.sbatch still
    validates the quickstart config, whose model must exist: hence `tiny_assets`), run in a container as docs/gpu.md
    describes: SLIMISH_EXEC names the runtime, here a stand-in for it (tests/slurm/fake_container.sh). Every Python
    and Ray command of the job goes through it, on the batch node and in both nodes' Ray steps; the host's venv is
    on no PATH the job sees, so a command that bypassed the runtime would fail."""
    calls = tmp_path / "container-calls.log"
    host_path = os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep) if not p.startswith(sys.prefix))
    job = submit_train(cluster, tmp_path, "probe", "rl.num_steps=2", env={
        "SLIMISH_DRIVER_CMD": PROBE_DRIVER, "SLIMISH_EXEC": str(REPO / "tests/slurm/fake_container.sh"),
        "FAKE_CONTAINER_LOG": str(calls), "FAKE_CONTAINER_VENV": sys.prefix, "PATH": host_path})
    assert cluster.wait_done(job, timeout=240) == ("COMPLETED", "0:0"), job_output(tmp_path, job)

    run_dir = tmp_path / "probe"
    assert_both_nodes_bootstrapped(run_dir / f"slurm-{job}")
    steps = metric_steps(run_dir)
    assert [m["slurm_nodes"] for m in steps] == [["n1", "n2"], ["n1", "n2"]]
    assert [m["in_container"] for m in steps] == [[True, True], [True, True]], "Ray ran outside the container"
    text = calls.read_text()
    for pattern in (r"^n1 python -c ", r"^n1 ray start .*--head", r"^n2 ray start .*--address=",
                    r"^n1 python launch/ray_wait_nodes.py ", r"^n1 python tests/slurm/ray_probe_driver.py --config "):
        assert re.search(pattern, text, flags=re.M), f"{pattern} not run in the container:\n{text}"
    assert_nothing_left(cluster, run_dir)


@pytest.mark.timeout(300)
def test_a_job_given_gpus_it_cannot_use_stops_in_one_line(cluster, tiny_assets, tmp_path):
    """Nodes that declare a GPU to Ray they do not have (as a node with a broken or too old driver would): the job
    stops before any engine or trainer starts, with one line naming the slot, the node and the cause."""
    job = submit_train(cluster, tmp_path, "gpus", "rl.num_steps=2", "rollout.engine.num_engines=1",
                       env={"SLIMISH_RAY_NUM_GPUS": "1"})
    assert cluster.wait_done(job, timeout=240) == ("FAILED", "2:0"), job_output(tmp_path, job)

    run_dir = tmp_path / "gpus"
    driver_log = (run_dir / f"slurm-{job}" / "driver.log").read_text()
    errors = [line for line in driver_log.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in driver_log, driver_log[-4000:]
    assert re.fullmatch(r"error: (trainer rank 0|engine 0) holds 1 GPU from Ray on n[12], but no NVIDIA driver is "
                        r"installed \(libcuda.so.1 does not load\): .*\(and 1 more slots cannot either\)",
                        errors[0]), errors[0]
    assert not (run_dir / "placement.json").exists() and not (run_dir / "logs").exists(), "something started"
    assert_nothing_left(cluster, run_dir)


def engine_part_pid(cluster: LocalSlurm, *, port: int) -> int | None:
    """The PID of the SGLang server of the cluster started with `--port port` (a node part's leader)."""
    return next((pid for pid, cmdline in cluster.job_processes().items()
                 if "sglang.launch_server" in cmdline and f"--port {port} " in cmdline), None)


@pytest.mark.timeout(900)
def test_engines_spanning_both_nodes_train_restart_whole_and_scancel_leaves_nothing(cluster, tiny_assets, tmp_path):
    """A real RL job on 2 nodes that declare no GPUs (they have none), every trainer rank and engine part reserving
    one CPU of the three each node offers Ray (ray.cpus_per_slot=1, what a CPU cluster would ask). Its two SGLang
    engines of two tensor-parallel ranks each span both nodes (rollout.engine.nodes_per_engine=2: rank 1 on the
    other node, SGLang's --nnodes/--node-rank, the ranks meeting at the store part 0's actor hosts), so every weight
    sync crosses nodes (the sharded broadcast: rank r of each engine receives its own shard over group r, wherever
    it runs): each is checked per rank against the trainer's prediction, and the engines' logprobs equal the
    trainer's. Part 1 of engine 0 (the node part that serves no HTTP) is SIGKILLed between two buckets of a sync
    (the `weight_sync.after_bucket_hook` of tests/e2e/hooks.py, armed by the test): the sync starts over to engine 1
    within the step, engine 0 counts one death, is restarted whole (both parts) while the job goes on with engine
    1, and rejoins (the job paced meanwhile, as in tests/e2e/test_engine_crash.py, so that the restart gets the
    cores). Then the job is cancelled mid-run, engines up: it ends CANCELLED, its teardown ran, and nothing it
    started is left (part 1 of an engine ignores SIGTERM: it is killed)."""
    from tests.e2e import hooks
    from tests.e2e.procs import hook_env

    run_dir = tmp_path / "span"
    job = submit_train(cluster, tmp_path, "span", "rl.num_steps=1000", "rollout.engine.tensor_parallel=2",
                       "rollout.engine.nodes_per_engine=2", "eval.every=0", "ray.cpus_per_slot=1",
                       "weight_sync.after_bucket_hook=tests.e2e.hooks.fault_between_buckets",
                       "run.phase_hook=tests.e2e.hooks.pace_while_restarting",
                       env={**hook_env(run_dir), "SLIMISH_RAY_NUM_CPUS": "3", "SLIMISH_RAY_NUM_GPUS": "0"})

    def steps_or_end(count: int):
        return lambda: len(metric_steps(run_dir)) >= count or not cluster.in_queue(job)

    wait_until(steps_or_end(1), timeout=400, what="the job's first step", interval=2)
    assert cluster.in_queue(job), "the job ended:\n" + job_output(tmp_path, job)
    assert_both_nodes_bootstrapped(run_dir / f"slurm-{job}")
    assert_ray_listens_on_loopback_only(cluster.listeners())
    placement = json.loads((run_dir / "placement.json").read_text())
    [trainer] = placement["trainer"]
    assert placement["gpus"] == 0 and trainer["gpus"] == 0 and trainer["node"] in ("n1", "n2"), placement
    for engine in placement["engines"]:
        assert sorted(part["node"] for part in engine["parts"]) == ["n1", "n2"], placement
        assert all(part["gpus"] == 0 for part in engine["parts"]), placement
    part1_of_engine0 = int(placement["engines"][0]["parts"][1]["url"].rsplit(":", 1)[1])  # a free port of n1 or n2
    assert engine_part_pid(cluster, port=part1_of_engine0) is not None, cluster.job_processes()
    hooks.arm_fault_between_buckets(run_dir, engine=0, part=1, signal_name="SIGKILL")
    killed_at = len(metric_steps(run_dir))

    def rejoined():
        records = metric_steps(run_dir)
        return (any(r["engine_restarts"] >= 1 and r["engines_live"] == 2 for r in records[killed_at:])
                or not cluster.in_queue(job))

    wait_until(rejoined, timeout=400, what="engine 0 to restart and rejoin", interval=2)
    assert cluster.in_queue(job), "the job ended:\n" + job_output(tmp_path, job)
    records = metric_steps(run_dir)  # read before the cancel, which may cut a line short
    cluster.script("run", "scancel", job)
    state, _ = cluster.wait_done(job, timeout=120)
    assert state == "CANCELLED", job_output(tmp_path, job)
    assert "teardown done" in (run_dir / f"slurm-{job}" / "bootstrap.log").read_text(), job_output(tmp_path, job)
    assert_nothing_left(cluster, run_dir)

    assert [r["step"] for r in records] == list(range(1, len(records) + 1))
    assert records[-1]["engine_deaths"] == 1 and records[-1]["engine_restart_failures"] == 0, records[-1]
    [fault] = hooks.faults_made(run_dir)
    assert (fault["engine"], fault["part"], fault["signal"]) == (0, 1, "SIGKILL"), fault
    faulted = records[fault["version"] - 1]
    print(f"\ntime_sync_stalled_s of the faulted sync: {faulted['time_sync_stalled_s']}")
    # Done again to engine 1 within the step, held no longer than the bucket's deadline (60 s + 0.05 MiB at 32 MiB/s)
    assert faulted["weight_sync_retries"] == 1 and 0 <= faulted["time_sync_stalled_s"] < 61, faulted
    assert sum(r["weight_sync_retries"] for r in records) == 1
    assert all(r["logprob_abs_diff_max"] <= 1e-4 for r in records), [r["logprob_abs_diff_max"] for r in records]
    assert all(r["sync_checksums_predicted"] == 1 for r in records), "every sync checked per rank, across nodes"
    # weight_sync.sharded auto: each engine rank (part 1's on the other node) got its own shard over its own group.
    assert all(r["sync_sharded"] == 1 for r in records), "the sharded broadcast, across nodes"


@pytest.mark.timeout(1200)
def test_a_job_warned_of_its_time_limit_saves_its_step_and_its_requeue_resumes_from_it(cluster, tiny_assets,
                                                                                      tmp_path):
    """The signal Slurm sends ahead of a time limit (train.sbatch asks for SIGUSR1 at 300 s with --signal=B:USR1@300),
    sent here by hand once the job has trained two steps, so that it lands at a known point (`scancel --batch
    --signal=USR1`: to the batch script, as Slurm's): the script asks the driver to stop, the driver finishes its
    step, saves a checkpoint of it (the job saves none otherwise: checkpoint.save_every 0) and exits 75, and the
    script requeues the job after its teardown. The requeued job (same id, same arguments) resumes from that
    checkpoint and trains to the end: one metrics line per step, none twice, none missing."""
    run_dir = tmp_path / "requeue"
    job = submit_train(cluster, tmp_path, "requeue", "rl.num_steps=6", "eval.every=0")
    wait_until(lambda: len(metric_steps(run_dir)) >= 2 or not cluster.in_queue(job), timeout=400,
               what="the job's second step", interval=1)
    assert cluster.in_queue(job), "the job ended:\n" + job_output(tmp_path, job)
    cluster.script("run", "scancel", "--batch", "--signal=USR1", job)

    def show() -> dict[str, str]:
        """The job as scontrol shows it; a requeued job keeps its id, and Restarts counts its requeues. (squeue may
        not list it while it goes from one run to the next: the queue is not what to wait on here.)"""
        text = cluster.script("run", "scontrol", "show", "job", job)
        return {key: re.search(rf"\b{key}=(\S+)", text)[1] for key in ("JobState", "ExitCode", "Restarts")}

    final = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")
    wait_until(lambda: int(show()["Restarts"]) >= 1 or show()["JobState"] in final, timeout=400,
               what="the job to stop and requeue itself", interval=1)
    # Slurm holds a requeued job back for a while (BeginTime, about two minutes here): let it start soon. Not now:
    # slurmd refuses a credential made in the same second as the old run's revocation, and slurmctld then kills the
    # job ("Killing non-startable batch JobId=N: Job credential revoked", FAILED 1:0: 2 of 6 fresh clones).
    wait_until(lambda: show()["JobState"] != "REQUEUED", timeout=60, what="the requeue to settle", interval=0.5)
    if show()["JobState"] == "PENDING":
        cluster.script("run", "scontrol", "update", f"JobId={job}", "StartTime=now+3", check=False)
    wait_until(lambda: show()["JobState"] in final, timeout=900, what="the requeued job to end", interval=2)
    text = job_output(tmp_path, job)
    assert show() == {"JobState": "COMPLETED", "ExitCode": "0:0", "Restarts": "1"}, \
        f"{show()}\n{text}\n{cluster.daemon_logs(job)}"
    driver_log = (run_dir / f"slurm-{job}" / "driver.log").read_text()
    stopped = re.search(r"stopped by SIGTERM after step (\d+); saved checkpoint (\S+):", driver_log)
    assert stopped, driver_log[-3000:]
    assert f"resumed from {stopped[2]} (step {stopped[1]}," in driver_log, driver_log[-3000:]
    bootstrap = (run_dir / f"slurm-{job}" / "bootstrap.log").read_text()
    assert "got SIGUSR1" in bootstrap and "driver exited with code 75" in bootstrap, bootstrap
    assert f"requeueing job {job}" in bootstrap, bootstrap
    assert [r["step"] for r in metric_steps(run_dir)] == list(range(1, 7))
    assert_nothing_left(cluster, run_dir)


@pytest.mark.timeout(300)
def test_convert_job_completes(cluster, tiny_assets, tmp_path):
    """The Megatron checkpoint the job writes holds the model: converted back to HF locally, every tensor is
    bit-identical to the one the job was given."""
    from slimish.cli import main
    from tests.megatron_bridge.parity import assert_same_checkpoint

    model = REPO / "artifacts" / "tiny" / "model"
    out = tmp_path / "megatron"
    job = cluster.sbatch(
        "-o", f"{tmp_path}/slurm-%j.out", "launch/convert.sbatch", "--hf", "artifacts/tiny/model", "--out", str(out)
    )
    assert cluster.wait_done(job, timeout=240) == ("COMPLETED", "0:0"), job_output(tmp_path, job)
    assert_nothing_left(cluster, out)
    back = tmp_path / "hf"
    assert main(["convert", "megatron-to-hf", "--megatron", str(out), "--hf-config", str(model), "--out",
                 str(back)]) == 0
    assert_same_checkpoint(back, model)
