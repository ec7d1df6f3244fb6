"""A job's weight syncs, seen from the driver: `EngineSync`.

It connects the trainer's weight senders to the engines (`TrainerWorker.connect_engines`, again whenever the set of
live engines changed), sends the weights with the engine set watched meanwhile, releases a send that cannot end
(an engine of it died or froze) and sends again, whole, to the engines that are left. It reaches the trainer through
its `TrainerGroup` and the engines through the actor that owns them (the rollout manager's engine calls: pause,
resume, the live engines, the lost and hung ones); it reports through the callable it is handed.
"""

from __future__ import annotations

from collections.abc import Callable

from slimish.orchestration.ray_cluster import TrainerGroup, ray

SYNC_WATCH_S = 0.5  # during a weight sync: how often the driver asks whether an engine of it died or froze


class EngineSync:
    """`engine_urls`: every engine, in engine order (colocated: engine i on trainer rank i's GPU, `colocated`);
    `master_addr`: where trainer rank 0 hosts the weight-sync groups; `api_key`: the engines' keys; `report(line)`
    shows one line of the job's output."""

    def __init__(self, trainer: TrainerGroup, engines, *, engine_urls: list[str], engine_tp: int, master_addr: str,
                 api_key, colocated: bool, report: Callable[[str], None]):
        self.trainer, self.engines = trainer, engines
        self.engine_urls = list(engine_urls)
        self.engine_tp, self.master_addr, self.api_key = engine_tp, master_addr, api_key
        self.colocated, self.report = colocated, report
        self.synced_engines: list[str] = []  # the engines the trainer's groups now reach
        self.engine_version = 0  # the weight version the engines serve (set by `sync`)

    def connect(self, urls: list[str]) -> dict:
        """(Re)build the weight-sync groups between the trainer's senders and the engines `urls`."""
        self.synced_engines = list(urls)
        by_rank = [url if url in urls else None for url in self.engine_urls] if self.colocated else None
        return self.trainer.call("connect_engines", engine_urls=list(urls), engine_tp=self.engine_tp,
                                 master_addr=self.master_addr, api_key=self.api_key, engines_by_rank=by_rank)

    def sync(self, version: int) -> dict:
        """Send the trainer's weights to the engines as `version`. In retract mode the engines are generating: they
        are paused around the sync, and running requests continue with the new weights. When an engine died or a
        restarted one is ready, the weight-sync group is rebuilt first; a restarted engine is routed to again only
        once it holds these weights. An engine that dies during the sync is restarted like any dead engine, and the
        sync starts over, whole, to the others (`weight_sync_retries`); so does one that hangs (it is killed: see
        `EngineWatchdog.lost_after_failure`), and one that did not answer a bucket by its deadline, though it answers
        other calls (`TrainerWorker.hung_engines`; it is killed too). While the sync runs the engine set is watched,
        and the sync is released as soon as an engine of it is lost (`_watched`). A sync that fails with every
        engine alive and answering fails the job."""
        ray.get(self.engines.pause.remote())
        retries = 0
        while True:
            engines = ray.get(self.engines.engines_for_sync.remote())
            if engines["urls"] != self.synced_engines:
                self.connect(engines["urls"])
            try:
                metrics = self._watched(version, engines["urls"])
                break
            except Exception as exc:
                lost = ray.get(self.engines.engines_lost.remote(engines["urls"]))
                hung = [] if lost else self.trainer.call("hung_engines")
                if hung:  # alive and answering other calls, but not a bucket by its deadline
                    lost = ray.get(self.engines.kill_hung.remote(hung))
                if not lost:
                    raise
                retries += 1
                text = str(exc).strip()
                reason = text.splitlines()[-1][:300] if text else type(exc).__name__
                self.report(f"engine(s) {', '.join(lost)} died or hung during the weight sync to version {version} "
                            f"({reason}); syncing again to the others")
                self.synced_engines = []  # that group held the dead engine: build a new one
        ray.get(self.engines.resume.remote(policy_version=version, joined=engines["joining"]))
        self.engine_version = version
        return {**metrics, "weight_sync_retries": retries}

    def _watched(self, version: int, urls: list[str]) -> dict:
        """Every trainer rank's `sync_weights` to `urls`, with the engine set watched meanwhile: once an engine of
        them is out of service (it died, or froze and the watchdog killed it), every rank is told to release the
        sync (`TrainerGroup.release_sync`), which then fails at once wherever it waits instead of sitting out a
        transfer that cannot end; the caller syncs again to the engines that are left. Told again at every look
        until the ranks return: a rank that had not begun sending yet takes it at the next one."""
        refs = self.trainer.submit("sync_weights", version)
        while True:
            done, _ = ray.wait(refs, num_returns=len(refs), timeout=SYNC_WATCH_S)
            if len(done) == len(refs):
                return ray.get(refs)[0]
            lost = ray.get(self.engines.engines_out.remote(urls))
            if lost:
                self.trainer.release_sync(f"engine(s) {', '.join(lost)} died or froze during the sync")
