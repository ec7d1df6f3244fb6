"""Benchmark long, long-tailed sequences in the trainer: packed micro-batches against right-padded ones, and the
memory of chunked logprobs.

    python bench/long_sequences.py [--samples 32] [--workdir /tmp]      (or: make bench-long)

One train step (old logprobs + one optimizer step, the trainer's whole work per RL step) on the same 32 samples of a
long-tailed length mix (lognormal, mean ~1k tokens, the longest 8k) with a small Qwen3 model (hidden 256, 2 layers,
2 heads), at one rank, in two fresh processes measured in the same run:
  padded  trainer.micro_batch_size=4: every micro-batch right-padded to its longest sample (the micro-batch size is
          4, not the default 8, so that the padded step fits in this machine's memory: less padding than the
          default, a baseline in its own favour);
  packed  trainer.max_tokens_per_micro_batch=8192: samples back to back, no padding, each attending to itself.
Each process runs the step twice and times the second (the first allocates). tokens/s counts real tokens only.
Peak RSS is the process's high-water mark (model, data and step).

Then the logprob head alone (`slimish.trainer.logprobs.LogprobHead`: output layer, log-softmax, backward) on a
32k-vocabulary model, for sequences of 8k and 16k tokens, chunked (trainer.logprob_chunk_tokens=1024) and with the
whole sequence's logits at once: the memory it adds over what it starts with (high-water mark reset first).

Last line:
    packed_vs_padded_tokens_per_s=<x> packed_peak_rss_mib=<a> padded_peak_rss_mib=<b> logprob_peak_mib=<c>
with x = packed tokens/s / padded tokens/s and c the chunked head's peak at 16k tokens.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODEL_SHAPE = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=2, num_attention_heads=2,
                   num_key_value_heads=1, head_dim=128, max_position_embeddings=16384)
MAX_TOKENS = 8192
MODES = {"padded": ["trainer.micro_batch_size=4"],
         "packed": [f"trainer.max_tokens_per_micro_batch={MAX_TOKENS}", "trainer.micro_batch_size=4"]}
CHUNK = 1024


def peak_mib() -> float:
    """This process's resident-memory high-water mark."""
    return int(re.search(r"VmHWM:\s+(\d+)", Path("/proc/self/status").read_text()).group(1)) / 1024


def rss_mib() -> float:
    return int(re.search(r"VmRSS:\s+(\d+)", Path("/proc/self/status").read_text()).group(1)) / 1024


def reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # Linux: VmHWM := VmRSS


def lengths(count: int, seed: int = 0) -> list[int]:
    """Lognormal lengths with mean ~1k tokens, clipped to [64, 8192]; the longest is set to 8192."""
    rng = random.Random(seed)
    out = [min(max(int(rng.lognormvariate(6.4, 1.0)), 64), MAX_TOKENS) for _ in range(count)]
    out[rng.randrange(count)] = MAX_TOKENS
    return out


def samples(count: int, vocab: int):
    from slimish.sample import Sample, Status

    rng = random.Random(1)
    out = []
    for i, n in enumerate(lengths(count)):
        prompt, response = 32, n - 32
        out.append(Sample(group_id=i // 4, index=i % 4, prompt="p", prompt_ids=[rng.randrange(vocab)
                                                                                for _ in range(prompt)],
                          response_ids=[rng.randrange(vocab) for _ in range(response)],
                          rollout_logprobs=[0.0] * response, weight_versions=[0] * response,
                          loss_mask=[1] * response, status=Status.COMPLETED))
    return out


def world() -> None:
    from slimish.trainer.parallel import ParallelLayout, free_port, init_parallel

    init_parallel(ParallelLayout(rank=0, world_size=1), master_addr="127.0.0.1", master_port=free_port(),
                  backend="gloo", seed=1234)


def child_step(args) -> dict:
    """One mode's train step, timed the second time; its process's peak RSS."""
    import torch

    from slimish.config import load_config
    from slimish.trainer import rl_step
    from slimish.trainer.worker import TrainerWorker

    torch.set_num_threads(2)
    world()
    cfg = load_config(REPO / "configs/quickstart_cpu.yaml", [
        f"model.hf_path={args.model}", f"data.path={args.data}", "eval.every=0", "sft.steps=0",
        "trainer.torch_threads=2",
        f"trainer.logprob_chunk_tokens={CHUNK}", *MODES[args.mode]])
    worker = TrainerWorker(cfg, rank=0, world_size=1)
    worker.setup(master_addr="unused", master_port=0)
    batch = samples(args.samples, worker.arch.vocab_size)
    ctx = worker.step
    # Advantages +1, -1, +1, ... on every token of each sample: the step's work does not depend on their values.
    alternating = dataclasses.replace(ctx.estimator, advantages=lambda inputs, _cfg: [
        torch.full_like(mask, (-1.0) ** i) for i, mask in zip(inputs.indices, inputs.masks)])
    for _ in range(2):
        start = time.perf_counter()
        step_batch, _ = rl_step.prepare(ctx, batch)
        rl_step.advantages(ctx, step_batch, alternating)
        rl_step.train(ctx, step_batch)
        seconds = time.perf_counter() - start
    micro_batches = len(rl_step.plan(ctx, batch, 1)[0][0])
    tokens = sum(len(s.tokens) for s in batch)
    return {"tokens": tokens, "seconds": seconds, "micro_batches": micro_batches, "peak_rss_mib": peak_mib()}


def child_logprobs(args) -> dict:
    """Peak memory the logprob head adds for 8k and 16k tokens, chunked and whole (forward and backward)."""
    import torch

    from slimish.megatron_bridge.hf_config import architecture_from_hf, read_hf_config
    from slimish.trainer.logprobs import LogprobHead
    from slimish.trainer.model import build_gpt_model

    torch.set_num_threads(2)
    world()
    model = build_gpt_model(architecture_from_hf(read_hf_config(args.model)), tensor_parallel=1,
                            pipeline_parallel=1)
    head = LogprobHead(model, chunk_tokens=CHUNK)  # from here the model returns its last hidden states
    out = {}
    for name, chunk in (("chunked", CHUNK), ("whole", None)):
        for seq in (8192, 16384):
            head.chunk_tokens = chunk or seq
            tokens = torch.randint(0, model.vocab_size, (1, seq))
            with torch.no_grad():
                hidden = model(tokens, torch.arange(seq)[None], None,
                               packed_seq_params=_one_sample(seq)).detach().requires_grad_()
            reset_peak()
            before = rss_mib()
            logprobs, _ = head.logprobs(hidden, tokens)
            logprobs.sum().backward()
            out[f"{name}_{seq}"] = peak_mib() - before
            del logprobs, hidden
    return out


def _one_sample(seq: int):
    import torch
    from megatron.core.packed_seq_params import PackedSeqParams

    bounds = torch.tensor([0, seq], dtype=torch.int32)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=bounds, cu_seqlens_kv=bounds, max_seqlen_q=seq,
                           max_seqlen_kv=seq)


def run_child(*args: str) -> dict:
    result = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, cwd=REPO)
    if result.returncode:
        sys.exit(f"bench child {args[:2]} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def build_assets(root: Path) -> tuple[Path, Path, Path]:
    from slimish.tasks import echo_digit
    from slimish.tasks.tiny_model import build_tiny_model

    model = build_tiny_model(root / "model", corpus=echo_digit.corpus(), **MODEL_SHAPE)
    big_vocab = build_tiny_model(root / "vocab32k", corpus=echo_digit.corpus(), hidden_size=256,
                                 intermediate_size=256, num_hidden_layers=1, num_attention_heads=2,
                                 num_key_value_heads=1, head_dim=128, max_position_embeddings=16384)
    cfg_path = big_vocab / "config.json"  # only config.json is read: the head's model is randomly initialised
    cfg = json.loads(cfg_path.read_text())
    cfg_path.write_text(json.dumps({**cfg, "vocab_size": 32768}))
    data = echo_digit.write_datasets(root / "data")["train"]
    return model, big_vocab, Path(data)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--child", choices=["step", "logprobs"])
    parser.add_argument("--mode", choices=list(MODES))
    parser.add_argument("--model")
    parser.add_argument("--data")
    args = parser.parse_args()
    if args.child:
        sys.path.insert(0, str(REPO))
        print(json.dumps(child_step(args) if args.child == "step" else child_logprobs(args)))
        return
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        model, big_vocab, data = build_assets(Path(tmp))
        mix = lengths(args.samples)
        print(f"{args.samples} samples: {sum(mix)} tokens, mean {sum(mix) / len(mix):.0f}, "
              f"median {sorted(mix)[len(mix) // 2]}, max {max(mix)}")
        steps = {mode: run_child("--child", "step", "--mode", mode, "--model", str(model), "--data", str(data),
                                 "--samples", str(args.samples)) for mode in MODES}
        for mode, r in steps.items():
            print(f"{mode}: {r['micro_batches']} micro-batches, step {r['seconds']:.1f}s, "
                  f"{r['tokens'] / r['seconds']:.0f} tokens/s, peak RSS {r['peak_rss_mib']:.0f} MiB")
        heads = run_child("--child", "logprobs", "--model", str(big_vocab))
        print("logprob head peak MiB (vocab 32768): " + ", ".join(f"{k}={v:.0f}" for k, v in heads.items()))
    ratio = (steps["packed"]["tokens"] / steps["packed"]["seconds"]) / (
        steps["padded"]["tokens"] / steps["padded"]["seconds"])
    print(f"packed_vs_padded_tokens_per_s={ratio:.2f} packed_peak_rss_mib={steps['packed']['peak_rss_mib']:.0f} "
          f"padded_peak_rss_mib={steps['padded']['peak_rss_mib']:.0f} logprob_peak_mib={heads['chunked_16384']:.0f}")


if __name__ == "__main__":
    main()
