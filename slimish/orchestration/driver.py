"""The RL job: start -> [warm-up] -> per step: rollout -> logprobs -> advantages -> train -> sync -> log.

Run with `slimish train --config CONFIG [key=value ...]`. Everything started here (Ray, actors, engines, router)
is stopped in `shutdown()`, also on Ctrl-C / SIGTERM.
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import torch

from slimish.config import JobConfig, save_config
from slimish.orchestration.metrics import MetricsLogger, PhaseTimer, format_line
from slimish.orchestration.ray_cluster import TrainerGroup, init_ray, ray, rollout_actor
from slimish.rollout.data import read_jsonl
from slimish.sample import Sample
from slimish.trainer.losses import grpo_advantages


class RLJob:
    def __init__(self, cfg: JobConfig):
        self.cfg = cfg
        self.run_dir = Path(cfg.run.output_dir) / cfg.run.name
        self.run_dir.mkdir(parents=True, exist_ok=True)
        save_config(cfg, self.run_dir / "config.yaml")
        (self.run_dir / "metrics.jsonl").unlink(missing_ok=True)
        self.timer = PhaseTimer()
        self.metrics = MetricsLogger(self.run_dir)
        self.trainer: TrainerGroup | None = None
        self.rollout_manager = None

    # --------------------------------------------------------------------------------------------- phases
    def start(self) -> dict:
        init_ray(self.cfg)
        # ray.init installs its own SIGTERM handler (it logs and dies without unwinding): take it back, so that
        # SIGTERM (scancel, kill) runs shutdown() and stops everything this job started.
        signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
        self.rollout_manager = rollout_actor(self.cfg, log_dir=str(self.run_dir / "logs"))
        engines = self.rollout_manager.start.remote()   # engines boot while the trainer builds its model
        self.trainer = TrainerGroup(self.cfg)
        info = self.trainer.setup()
        info.update(ray.get(engines))
        (self.run_dir / "pids.json").write_text(json.dumps({"servers": info["pids"]}))
        info.update(self.trainer.call("connect_engines", engine_urls=info["engine_urls"],
                                      engine_tp=self.cfg.rollout.engine.tensor_parallel,
                                      master_addr=info["trainer_master_addr"]))
        return info

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

    def rollout(self, step: int) -> tuple[list[Sample], dict]:
        return ray.get(self.rollout_manager.rollout.remote(step))

    def compute_logprobs(self, samples: list[Sample]) -> dict:
        return self.trainer.call("compute_logprobs", samples)

    def compute_advantages(self, samples: list[Sample]) -> list[float]:
        rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32)
        advantages = grpo_advantages(rewards, self.cfg.rollout.samples_per_prompt,
                                     normalize_std=self.cfg.trainer.loss.normalize_advantage_std)
        # Failed/aborted samples carry an empty loss mask, so their advantage never reaches the loss.
        return advantages.tolist()

    def train(self, advantages: list[float]) -> dict:
        return self.trainer.call("train", advantages)

    def sync_weights(self, version: int) -> dict:
        return self.trainer.call("sync_weights", version)

    # ---------------------------------------------------------------------------------------------- loop
    def run(self) -> Path:
        previous = signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
        try:
            t0 = time.monotonic()
            info = self.start()
            print(f"engines up in {info['time_engines_start_s']:.0f}s at {info['engine_urls']}; router "
                  f"{info['router_url']}; trainer {info['num_params']:,} params", flush=True)
            self.warmup()
            total = self.cfg.rl.num_steps
            for step in range(1, total + 1):
                with self.timer("rollout"):
                    samples, rollout_metrics = self.rollout(step)
                with self.timer("train"):
                    logprob_metrics = self.compute_logprobs(samples)
                    advantages = self.compute_advantages(samples)
                    train_metrics = self.train(advantages)
                with self.timer("sync"):
                    sync_metrics = self.sync_weights(version=step)
                metrics = {**rollout_metrics, **logprob_metrics, **train_metrics, **sync_metrics,
                           **self.timer.pop(), "weight_version": step}
                metrics["tokens_per_s"] = metrics["generated_tokens"] / max(metrics["time_rollout_s"], 1e-9)
                metrics["time_elapsed_s"] = time.monotonic() - t0
                self.metrics.log(step, metrics)
                if step % self.cfg.run.log_every == 0 or step == total:
                    print(format_line(step, total, metrics), flush=True)
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
        self.metrics.close()
        if ray.is_initialized():
            ray.shutdown()

    def _sft_samples(self) -> list[Sample]:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(self.cfg.model.hf_path)
        samples = []
        for i, row in enumerate(read_jsonl(self.cfg.sft.data_path)):
            prompt_ids = tokenizer(row["prompt"])["input_ids"]
            response_ids = tokenizer(row["response"])["input_ids"] + [tokenizer.eos_token_id]
            samples.append(Sample(group_id=i, index=0, prompt=row["prompt"], prompt_ids=prompt_ids,
                                  response=row["response"], response_ids=response_ids,
                                  rollout_logprobs=[0.0] * len(response_ids),
                                  weight_versions=[0] * len(response_ids), loss_mask=[1] * len(response_ids)))
        return samples


def _raise_keyboard_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def train(cfg: JobConfig) -> Path:
    return RLJob(cfg).run()
