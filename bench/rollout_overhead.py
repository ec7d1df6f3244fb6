"""Rollout overhead: one step's batch through slimish's rollout manager vs sent straight to the engine.

    python bench/rollout_overhead.py [--steps 10] [--workdir /tmp]

A ~1M-parameter Qwen3 (the quickstart's tokenizer), 1 SGLang CPU engine, 8 prompts x 8 samples x up to 16 new tokens
per step. The manager path is what a job does: the driver's Ray call to the rollout manager actor, which sends one
request per sample through the router and scores each group with the quickstart's reward. The direct path is the
least overhead SGLang allows: one /generate request to the engine itself holding the step's 64 prompts (input_ids
batched), with logprobs, as the manager asks for. Both run in the same invocation, against the same engine,
alternating step by step; the median step is reported. The last line is
    manager_vs_direct_tokens_per_s=<x> rollout_s=<a> direct_s=<b>
(tokens per second of the manager path over the direct path's; the seconds are median per step).
"""

from __future__ import annotations

import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
from rl_jobs import bench_parser

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
SHAPE = dict(hidden_size=128, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32)
PROMPTS, SAMPLES, NEW_TOKENS = 8, 8, 16


def main() -> None:
    args = bench_parser(__doc__, steps=10).parse_args()

    import ray
    from safetensors.torch import load_file

    from slimish.config import load_config
    from slimish.network import auth_headers, new_job_key
    from slimish.orchestration.placement import release
    from slimish.orchestration.ray_cluster import init_ray, reserve_slots, rollout_actor
    from slimish.tasks import echo_digit
    from slimish.tasks.tiny_model import build_tiny_model

    root = Path(tempfile.mkdtemp(prefix="slimish-bench-overhead-", dir=args.workdir))
    model = build_tiny_model(root / "model", corpus=echo_digit.corpus(), **SHAPE)
    data = echo_digit.write_datasets(root / "data")
    params = sum(t.numel() for t in load_file(str(model / "model.safetensors")).values())
    cfg = load_config(REPO / "configs/quickstart_cpu.yaml", [
        f"model.hf_path={model}", f"data.path={data['train']}", f"sft.data_path={data['sft']}", "eval.every=0",
        f"run.output_dir={root / 'runs'}", "rollout.engine.num_engines=1", f"rollout.prompts_per_step={PROMPTS}",
        f"rollout.samples_per_prompt={SAMPLES}", f"rollout.max_new_tokens={NEW_TOKENS}",
        # ports of its own: it can run beside a job or the tests on the default ones
        "rollout.engine.base_port=32100", "rollout.router.port=32099", "rollout.router.prometheus_port=32098"])
    key = new_job_key()
    init_ray(cfg)
    slots = reserve_slots(cfg)
    manager = rollout_actor(cfg, log_dir=str(root / "logs"), engine_slots=slots["engines"], api_key=key)
    try:
        info = ray.get(manager.start.remote())
        engine = info["engine_urls"][0]
        http = httpx.Client(timeout=300, headers=auth_headers(key))
        sampling = {"max_new_tokens": NEW_TOKENS, "temperature": cfg.rollout.temperature, "top_p": 1.0}
        manager_s, manager_tokens, direct_s, direct_tokens = [], [], [], []
        for step in range(args.steps + 1):  # step 0 warms both paths up and is not counted
            t0 = time.perf_counter()
            samples, metrics = ray.get(manager.rollout.remote(policy_version=0))
            elapsed = time.perf_counter() - t0
            prompts = [s.prompt_ids for s in samples]
            t1 = time.perf_counter()
            reply = http.post(f"{engine}/generate", json={"input_ids": prompts, "sampling_params": sampling,
                                                          "return_logprob": True})
            reply.raise_for_status()
            direct = time.perf_counter() - t1
            if step:
                manager_s.append(elapsed)
                manager_tokens.append(metrics["generated_tokens"])
                direct_s.append(direct)
                direct_tokens.append(sum(len(r["output_ids"]) for r in reply.json()))
        m_s, d_s = statistics.median(manager_s), statistics.median(direct_s)
        m_tps, d_tps = sum(manager_tokens) / sum(manager_s), sum(direct_tokens) / sum(direct_s)
        print(f"model {params / 1e6:.2f}M params, {PROMPTS}x{SAMPLES} samples x <= {NEW_TOKENS} tokens, "
              f"{args.steps} steps")
        print(f"manager: median {m_s:.3f} s/step, {m_tps:.0f} tokens/s ({statistics.mean(manager_tokens):.0f} "
              f"tokens/step)")
        print(f"direct:  median {d_s:.3f} s/step, {d_tps:.0f} tokens/s ({statistics.mean(direct_tokens):.0f} "
              f"tokens/step)")
        print(f"manager_vs_direct_tokens_per_s={m_tps / d_tps:.2f} rollout_s={m_s:.3f} direct_s={d_s:.3f}")
    finally:
        try:
            ray.get(manager.shutdown.remote(), timeout=30)
        finally:
            release([s for group in slots.values() for s in group])
            ray.shutdown()
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
