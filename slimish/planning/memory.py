"""Per-GPU memory of a trainer rank and of an engine, on paper.

Trainer rank (the fullest pipeline stage), bytes:
  weights     parameters x dtype bytes
  grads       parameters x 4 (Megatron's fp32 gradient buffer, grad_reduce_in_fp32)
  optimizer   Adam's two fp32 moments (8 bytes / parameter), plus fp32 main weights (4) when training in bf16;
              divided over the data-parallel ranks with the distributed optimizer (experts over expert-data-parallel)
  activations per micro-batch of T tokens, longest sample s, per layer (Korthikanti et al. 2022, no sequence
              parallelism, scaled to the activation dtype): T*h*(10 + 24/tp) half-precision bytes, plus the local
              attention's scores and probabilities, heads/tp x T x s elements; the first stage holds pipeline_parallel
              micro-batches in flight (1F1B). Full recompute keeps each layer's input (T*h) and one layer's working set.
  logits      one chunk of trainer.logprob_chunk_tokens x vocab/tp in fp32, three copies (logits, softmax, grad).
Engine (one GPU of a tensor-parallel engine): weights / engine tp, and the KV cache of its share of
rollout.max_concurrency requests at full length (prompt + max_new_tokens), at most rollout.engine.max_total_tokens
(SGLang's pool): 2 x layers x kv heads/tp (at least one) x head dim per token, or MLA's compressed latent
(kv_lora_rank + rope dim) per layer, whole on every rank.
Colocated (placement.colocate), one GPU holds a trainer rank and an engine rank in turns
(`slimish.orchestration.colocation`): generate = the engine (the trainer offloaded); train = the trainer rank (the
engine released); sync = the trainer's weights, the engine's weights and two weight-sync buckets (the trainer's
optimizer state offloaded, the engine's KV cache still released). Host memory per GPU: what the trainer offloads
(weights and optimizer state; gradients are freed, not copied). CUDA contexts and allocator slack are not counted.
"""

from __future__ import annotations

from dataclasses import dataclass

from slimish.planning.params import ParamCount

GB = 1e9
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True, kw_only=True)
class TrainerMemory:
    weights: float
    grads: float
    optimizer: float                # as configured
    optimizer_other: float          # with the distributed optimizer switched the other way
    activations: float              # as configured
    activations_other: float        # with recompute switched the other way
    logits: float

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer + self.activations + self.logits


def trainer_rank(cfg, arch, params: ParamCount, *, prompt_tokens: int) -> TrainerMemory:
    par, tr = cfg.parallel, cfg.trainer
    tp, pp, ep = par.tensor_parallel, par.pipeline_parallel, par.expert_parallel
    etp = par.expert_tensor_parallel or tp
    dp, edp = par.num_trainer_ranks // (tp * pp), par.num_trainer_ranks // (etp * ep * pp)
    stages = [params.rank(tensor_parallel=tp, pipeline_parallel=pp, expert_parallel=ep, expert_tensor_parallel=etp,
                          stage=s) for s in range(pp)]
    dense, experts = max(stages, key=sum)
    dtype = DTYPE_BYTES[cfg.model.dtype]
    state = 8 + (4 if dtype < 4 else 0)

    def optimizer(distributed: bool) -> float:
        if not distributed:
            return (dense + experts) * state
        return dense * state / dp + experts * state / max(edp, 1)

    longest = prompt_tokens + cfg.rollout.max_new_tokens
    tokens = tr.max_tokens_per_micro_batch or tr.micro_batch_size * longest
    layers = -(-arch.num_layers // pp)
    h, heads = arch.hidden_size, arch.num_attention_heads
    scale = dtype / 2  # the per-layer formula counts half-precision bytes
    working = tokens * h * (10 + 24 / tp) * scale + 2 * dtype * (heads / tp) * tokens * longest

    def activations(recompute: bool) -> float:
        if recompute:
            return pp * layers * tokens * h * dtype + working
        return pp * layers * working

    full = tr.recompute == "full"
    logits = 3 * 4 * min(tr.logprob_chunk_tokens, tokens) * arch.vocab_size / tp
    return TrainerMemory(weights=(dense + experts) * dtype, grads=(dense + experts) * 4,
                         optimizer=optimizer(tr.optimizer.distributed),
                         optimizer_other=optimizer(not tr.optimizer.distributed), activations=activations(full),
                         activations_other=activations(not full), logits=logits)


@dataclass(frozen=True, kw_only=True)
class EngineMemory:
    weights: float
    kv_cache: float
    kv_tokens: int

    @property
    def total(self) -> float:
        return self.weights + self.kv_cache


def engine_gpu(cfg, arch, params: ParamCount, *, prompt_tokens: int) -> EngineMemory:
    engine, ro = cfg.rollout.engine, cfg.rollout
    dtype = DTYPE_BYTES[cfg.model.dtype]
    requests = -(-ro.max_concurrency // engine.num_engines)
    # SGLang's KV pool holds at most max_total_tokens: past it, requests wait (the plan says so by the count).
    kv_tokens = min(requests * (prompt_tokens + ro.max_new_tokens), engine.max_total_tokens)
    if arch.mla is not None:
        per_token = arch.num_layers * (arch.mla.kv_lora_rank + arch.mla.qk_rope_head_dim) * dtype
    else:
        kv_heads = max(arch.num_query_groups // engine.tensor_parallel, 1)
        per_token = 2 * arch.num_layers * kv_heads * arch.kv_channels * dtype
    return EngineMemory(weights=params.total * dtype / engine.tensor_parallel, kv_cache=kv_tokens * per_token,
                        kv_tokens=kv_tokens)


@dataclass(frozen=True, kw_only=True)
class ColocatedMemory:
    generate: float
    train: float
    sync: float
    host: float  # host memory per GPU the trainer offloads to

    @property
    def peak(self) -> float:
        return max(self.generate, self.train, self.sync)


def colocated_gpu(cfg, trainer: TrainerMemory, engine: EngineMemory) -> ColocatedMemory:
    buckets = 2 * cfg.weight_sync.bucket_mb * 2**20
    return ColocatedMemory(generate=engine.total, train=trainer.total,
                           sync=trainer.weights + engine.weights + buckets,
                           host=trainer.weights + trainer.optimizer)
