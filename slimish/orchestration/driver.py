"""The RL job: start -> [warm-up | resume] -> per step: rollout -> logprobs -> advantages -> train -> sync -> log
[-> checkpoint].

Run with `slimish train --config CONFIG [key=value ...]`. Everything started here (Ray, actors, engines, router)
is stopped in `shutdown()`, also on Ctrl-C / SIGTERM. SIGTERM does not save a checkpoint: the job resumes from the
last periodic one (checkpoint.save_every), so a kill during a save costs at most that interval.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

from slimish.config import JobConfig, save_config, to_dict
from slimish.network import JOB_KEY_FILE, new_job_key
from slimish.orchestration import checkpoints
from slimish.orchestration.metrics import MetricsLogger, PhaseTimer, format_line
from slimish.orchestration.placement import Slot, placement_record, release
from slimish.orchestration.ray_cluster import TrainerGroup, init_ray, ray, reserve_slots, rollout_actor
from slimish.rollout.data import read_jsonl
from slimish.sample import Sample, Status


class RLJob:
    def __init__(self, cfg: JobConfig):
        self.cfg = cfg
        self.run_dir = Path(cfg.run.output_dir) / cfg.run.name
        self.run_dir.mkdir(parents=True, exist_ok=True)
        save_config(cfg, self.run_dir / "config.yaml")
        self.resume_from = checkpoints.resume_path(cfg.checkpoint.resume, self.run_dir)
        self.resume_state = checkpoints.read_driver_state(self.resume_from) if self.resume_from else None
        self.timer = PhaseTimer()
        self.metrics = MetricsLogger(self.run_dir, resume_after=self.resume_state["step"] if self.resume_state
                                     else None, wandb_project=cfg.run.wandb_project, run_name=cfg.run.name,
                                     config=to_dict(cfg))
        self.trainer: TrainerGroup | None = None
        self.rollout_manager = None
        self.synced_engines: list[str] = []
        self.slots: dict[str, list[Slot]] = {}
        self.api_key = new_job_key()  # engines and router refuse calls without it

    # --------------------------------------------------------------------------------------------- phases
    def start(self) -> dict:
        self._write_job_key()
        init_ray(self.cfg)
        # ray.init installs its own SIGTERM handler (it logs and dies without unwinding): take it back, so that
        # SIGTERM (scancel, kill) runs shutdown() and stops everything this job started.
        signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
        self.slots = reserve_slots(self.cfg)
        self.rollout_manager = rollout_actor(self.cfg, log_dir=str(self.run_dir / "logs"),
                                             engine_slots=self.slots["engines"], api_key=self.api_key)
        engines = self.rollout_manager.start.remote()   # engines boot while the trainer builds its model
        self.trainer = TrainerGroup(self.cfg, self.slots["trainer"])
        info = self.trainer.setup()
        info.update(ray.get(engines))
        (self.run_dir / "pids.json").write_text(json.dumps({"servers": info["pids"]}))
        (self.run_dir / "placement.json").write_text(json.dumps(placement_record(self.slots, info["engines"]),
                                                                indent=1))
        self.trainer_master_addr = info["trainer_master_addr"]
        info.update(self.connect_engines(info["engine_urls"]))
        return info

    def connect_engines(self, urls: list[str]) -> dict:
        """(Re)build the weight-sync group between trainer rank 0 and the engines `urls`."""
        self.synced_engines = list(urls)
        return self.trainer.call("connect_engines", engine_urls=list(urls),
                                 engine_tp=self.cfg.rollout.engine.tensor_parallel,
                                 master_addr=self.trainer_master_addr, api_key=self.api_key)

    def _write_job_key(self) -> None:
        """The key, readable by the job's user only, for their own calls to the engines (curl -H "Authorization:
        Bearer $(cat RUN_DIR/job_key)"). A new job (also a resumed one) draws a new key."""
        path = self.run_dir / JOB_KEY_FILE
        path.unlink(missing_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(self.api_key + "\n")

    def warmup(self) -> None:
        """Optional SFT warm-up in Megatron, then push the warmed-up weights (version 0) to the engines."""
        sft = self.cfg.sft
        if sft.steps == 0:
            return
        samples = self._sft_samples()
        self.trainer.call("set_learning_rate", sft.lr)
        for step in range(sft.steps):
            batch = [samples[(step * sft.batch_size + i) % len(samples)] for i in range(sft.batch_size)]
            out = self.trainer.call("sft_step", batch)
            if step % 10 == 0 or step == sft.steps - 1:
                print(f"sft {step + 1:>3}/{sft.steps} | loss {out['sft_loss']:.3f}", flush=True)
        self.trainer.call("set_learning_rate", self.cfg.trainer.optimizer.lr)
        self.sync_weights(version=0)

    def restore(self) -> int:
        """Load the resume checkpoint into trainer and data source, push its weights to the engines as its weight
        version (replacing the HF weights they booted with); returns the last completed step."""
        state = self.resume_state
        self.trainer.call("load_checkpoint", str(self.resume_from / checkpoints.TRAINER_DIR))
        rollout = state["rollout"]
        rollout.setdefault("scheduler", {"next_group_id": 0})["groups"] = checkpoints.read_rollout_buffer(
            self.resume_from)
        ray.get(self.rollout_manager.load_state.remote(rollout))
        self.sync_weights(version=state["weight_version"])
        print(f"resumed from {self.resume_from} (step {state['step']}, weight version {state['weight_version']})",
              flush=True)
        return state["step"]

    def save_checkpoint(self, step: int, elapsed_s: float) -> Path:
        """Write checkpoints/step_<step>/ (see checkpoints.py for why a crash here never leaves a complete-looking
        checkpoint), then prune to checkpoint.keep_last."""
        t0 = time.monotonic()
        staging = checkpoints.begin(self.run_dir, step)
        self.trainer.call("save_checkpoint", str(staging / checkpoints.TRAINER_DIR))
        rollout = ray.get(self.rollout_manager.state.remote())
        checkpoints.write_rollout_buffer(staging, rollout["scheduler"].pop("groups"))
        path = checkpoints.commit(staging, {
            "step": step, "weight_version": step, "time_elapsed_s": elapsed_s, "rollout": rollout,
            "layout": {"tensor_parallel": self.cfg.parallel.tensor_parallel,
                       "pipeline_parallel": self.cfg.parallel.pipeline_parallel,
                       "num_trainer_ranks": self.cfg.parallel.num_trainer_ranks}})
        checkpoints.prune(self.run_dir, self.cfg.checkpoint.keep_last)
        print(f"checkpoint {path} saved in {time.monotonic() - t0:.1f}s", flush=True)
        return path

    def rollout(self, step: int) -> tuple[list[Sample], dict]:
        """The step's scored groups; the engines serve (and the trainer holds) weight version step - 1."""
        return ray.get(self.rollout_manager.rollout.remote(policy_version=step - 1))

    def compute_logprobs(self, samples: list[Sample], step: int) -> dict:
        return self.trainer.call("compute_logprobs", samples, policy_version=step - 1)

    def compute_advantages(self) -> list[float]:
        """The trainer's per-token advantages of the step (trainer.loss.advantage_estimator); returns each sample's
        mean over its trained tokens."""
        return self.trainer.call("compute_advantages")

    def train(self) -> dict:
        return self.trainer.call("train")

    def gpu_telemetry(self) -> dict[str, float]:
        """GPU memory and utilisation of every trainer rank and engine now (nothing without GPUs)."""
        out: dict[str, float] = {}
        for rank_metrics in self.trainer.call_all("gpu_telemetry"):
            out.update(rank_metrics)
        out.update(ray.get(self.rollout_manager.gpu_telemetry.remote()))
        return out

    def save_rollouts(self, step: int, samples: list[Sample], advantages: list[float]) -> None:
        """rollouts/step_<step>.jsonl: one sample per line, with its advantage (run.save_rollouts)."""
        out = self.run_dir / "rollouts"
        out.mkdir(exist_ok=True)
        with (out / f"step_{step}.jsonl").open("w") as f:
            for sample, advantage in zip(samples, advantages, strict=True):
                f.write(json.dumps({**sample.to_dict(), "advantage": advantage}) + "\n")

    def evaluate(self, step: int) -> dict:
        """The eval sets (eval.*) at the weights of `step`, which the engines now serve: metrics, a printed line,
        and the samples in eval/step_<step>.jsonl."""
        metrics, samples = ray.get(self.rollout_manager.evaluate.remote())
        out = self.run_dir / "eval"
        out.mkdir(exist_ok=True)
        with (out / f"step_{step}.jsonl").open("w") as f:
            for sample in samples:
                f.write(json.dumps(sample) + "\n")
        results = " | ".join(f"{key[len('eval/'):]} {value:.3f}" for key, value in metrics.items()
                             if key.startswith("eval/") and ("pass@" in key or "reward_mean" in key))
        print(f"eval after step {step}: {results} ({metrics['time_eval_s']:.1f}s)", flush=True)
        return metrics

    def sync_weights(self, version: int) -> dict:
        """Send the trainer's weights to the engines as `version`. In retract mode the engines are generating: they
        are paused around the sync, and running requests continue with the new weights. When an engine died or a
        restarted one is ready, the weight-sync group is rebuilt first; a restarted engine is routed to again only
        once it holds these weights. An engine that dies during the sync is restarted like any dead engine, and the
        sync starts over, whole, to the others (`weight_sync_retries`); so does one that hangs (it is killed: see
        `EngineWatchdog.lost_after_failure`); a sync that fails with every engine alive and answering fails the job."""
        ray.get(self.rollout_manager.pause.remote())
        retries = 0
        while True:
            engines = ray.get(self.rollout_manager.engines_for_sync.remote())
            if engines["urls"] != self.synced_engines:
                self.connect_engines(engines["urls"])
            try:
                metrics = self.trainer.call("sync_weights", version)
                break
            except Exception as exc:
                lost = ray.get(self.rollout_manager.engines_lost.remote(engines["urls"]))
                if not lost:
                    raise
                retries += 1
                text = str(exc).strip()
                reason = text.splitlines()[-1][:300] if text else type(exc).__name__
                print(f"engine(s) {', '.join(lost)} died or hung during the weight sync to version {version} "
                      f"({reason}); syncing again to the others", flush=True)
                self.synced_engines = []  # that group held the dead engine: build a new one
        ray.get(self.rollout_manager.resume.remote(policy_version=version, joined=engines["joining"]))
        return {**metrics, "weight_sync_retries": retries}

    # ---------------------------------------------------------------------------------------------- loop
    def run(self) -> Path:
        previous = signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
        total = self.cfg.rl.num_steps
        if self.resume_state and self.resume_state["step"] >= total:
            print(f"nothing to do: {self.resume_from} is at step {self.resume_state['step']} >= rl.num_steps "
                  f"{total}", flush=True)
            self.metrics.close()
            signal.signal(signal.SIGTERM, previous)
            return self.run_dir
        save_every = self.cfg.checkpoint.save_every
        try:
            t0 = time.monotonic() - (self.resume_state or {}).get("time_elapsed_s", 0.0)
            info = self.start()
            print(f"engines up in {info['time_engines_start_s']:.0f}s at {info['engine_urls']}; router "
                  f"{info['router_url']}; trainer {info['num_params']:,} params", flush=True)
            done = 0
            if self.resume_state:
                done = self.restore()  # no SFT warm-up: the checkpoint already holds its result
            else:
                self.warmup()
            for step in range(done + 1, total + 1):
                with self.timer("rollout"):
                    samples, rollout_metrics = self.rollout(step)
                with self.timer("train"):
                    logprob_metrics = self.compute_logprobs(samples, step)
                    advantages = self.compute_advantages()
                    train_metrics = self.train()
                if self.cfg.run.save_rollouts:
                    self.save_rollouts(step, samples, advantages)
                with self.timer("sync"):
                    sync_metrics = self.sync_weights(version=step)
                metrics = {**rollout_metrics, **logprob_metrics, **train_metrics, **sync_metrics,
                           **self.timer.pop(), **self.gpu_telemetry(), "weight_version": step}
                every = self.cfg.eval.every
                if every and (step % every == 0 or step == total):
                    metrics.update(self.evaluate(step))
                metrics["time_step_s"] = metrics["time_rollout_s"] + metrics["time_train_s"] + metrics["time_sync_s"]
                # Tokens the engines produced per second of the whole step (in retract mode they also generate
                # while the trainer trains).
                metrics["tokens_per_s"] = metrics["engine_tokens"] / max(metrics["time_step_s"], 1e-9)
                metrics["time_elapsed_s"] = time.monotonic() - t0
                self.metrics.log(step, metrics)
                if step % self.cfg.run.log_every == 0 or step == total:
                    print(format_line(step, total, metrics), flush=True)
                if save_every and (step % save_every == 0 or step == total):
                    self.save_checkpoint(step, metrics["time_elapsed_s"])
        finally:
            self.shutdown()
            signal.signal(signal.SIGTERM, previous)
        return self.run_dir

    def shutdown(self) -> None:
        """Stop engines, router, actors and Ray; safe to call on a half-started job."""
        if self.rollout_manager is not None:
            try:
                # Bounded: under scancel the Ray nodes are being stopped at the same time. If this times out the
                # engines still die with the actor (parent-death signal).
                ray.get(self.rollout_manager.shutdown.remote(), timeout=15)
            except Exception as exc:
                print(f"warning: rollout shutdown: {exc}", flush=True)
            ray.kill(self.rollout_manager)
            self.rollout_manager = None
        if self.trainer is not None:
            self.trainer.kill()
            self.trainer = None
        if self.slots:
            release([slot for slots in self.slots.values() for slot in slots])
            self.slots = {}
        self.metrics.close()
        if ray.is_initialized():
            ray.shutdown()

    def _sft_samples(self) -> list[Sample]:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(self.cfg.model.hf_path)
        samples = []
        for i, row in enumerate(read_jsonl(self.cfg.sft.data_path)):
            prompt_ids = tokenizer(row["prompt"])["input_ids"]
            # A response is text, or turns [{"text", "env": bool}] whose environment turns are not trained on.
            turns = row["turns"] if "turns" in row else [{"text": row["response"]}]
            response_ids, loss_mask = [], []
            for turn in turns:
                ids = tokenizer(turn["text"], add_special_tokens=False)["input_ids"]
                response_ids += ids
                loss_mask += [0 if turn.get("env") else 1] * len(ids)
            response_ids.append(tokenizer.eos_token_id)
            loss_mask.append(1)
            samples.append(Sample(group_id=i, index=0, prompt=row["prompt"], prompt_ids=prompt_ids,
                                  status=Status.COMPLETED, response="".join(t["text"] for t in turns),
                                  response_ids=response_ids, rollout_logprobs=[0.0] * len(response_ids),
                                  weight_versions=[0] * len(response_ids), loss_mask=loss_mask))
        return samples


def _raise_keyboard_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def train(cfg: JobConfig) -> Path:
    return RLJob(cfg).run()
