"""Per-GPU memory of a trainer rank and of an engine, on paper.

Trainer rank (the fullest pipeline stage), bytes:
  weights     parameters x dtype bytes
  grads       parameters x 4 (Megatron's fp32 gradient buffer, grad_reduce_in_fp32)
  optimizer   Adam's two fp32 moments (8 bytes / parameter), plus fp32 main weights (4) when training in bf16;
              divided over the data-parallel ranks with the distributed optimizer (experts over expert-data-parallel).
              trainer.optimizer.cpu_offload's share of it is in host memory instead, with an fp32 host copy of
              those parameters' gradients (4 bytes each): `optimizer_host`
  activations per micro-batch of T tokens (a packed one holds at least the longest sample, s; T / cp per rank of a
              context-parallel group), per layer, what autograd saves for the backward pass, term by term
              (`layer_terms`: norms, linear inputs, q / k / v, q / k norms, RoPE, the core attention's per-token
              tensors, the SwiGLU MLP's five ffn-wide ones, a mixture-of-experts layer's routed copies and experts,
              multi-latent attention's latents; outside the tensor-parallel regions 1/tp with sequence parallelism);
              plus the core attention's [s, s] tensors where the local attention runs (`core_attention`):
                te, sdpa  flash-style, no [s, s] tensor (their log-sum-exp is a `layer_terms` term)
                local     Megatron's DotProductAttention, unfused (slimish sets masked_softmax_fusion off). Per layer
                          until its backward: the fp32 softmax of the scores (kept by softmax's backward) and the
                          probabilities cast back to the model dtype (kept by the bmm with the values), each over
                          heads/tp x sum(len_i^2) elements (a packed row runs sample by sample, a padded one as
                          b x s^2: both T x s at most), and the bool causal mask (one per call, shared by its
                          heads). In the layer being computed (a padded row's b samples at once, a packed row's one
                          sample at a time), also Megatron's global buffer for the scores (in the dtype) and 6 bytes
                          per element at the peak in bf16 (the raw scores and their fp32 copy; in the backward pass
                          two fp32 gradients), 12 in fp32: `core_attention`. Measured against Megatron's class on
                          the CPU by tests/planning/test_plan.py.
              Beside the layers: the final norm and its whole output (the last stage), the MLP backward's extra
              gradient (`backward_working`), and with sequence parallelism Megatron's all-gather buffer of T x h
              (`gather_buffer`, kept between steps). The first stage holds pipeline_parallel micro-batches in
              flight (1F1B; interleaved: `in_flight_layers`). Full recompute keeps each layer's input (T*h, T*h/tp
              with sequence parallelism) and one layer's saved tensors (its MLP backward counted three times:
              measured). Selective recompute drops what its modules save from every layer but the one being
              recomputed (`recomputed_terms`). Checked against the bytes the emulated GPU holds over a training step
              at one rank, TP2 + SP and CP2 within 10% (tests/planning/test_activations.py).
  logits      one chunk of trainer.logprob_chunk_tokens x vocab/tp: the output layer's logits in the dtype, the cross
              entropy's fp32 copy (its softmax) and the entropy's four fp32 temporaries (dtype + 20 bytes each).
  reference   (trainer.loss.kl_coef > 0, or an estimator that needs it: `slimish.trainer.estimators`) the frozen
              initial policy, sharded like it: weights in the model dtype; its forward (no grad) holds one layer's
              working set and one chunk of logits twice (logits, log-softmax), in turn with the policy's training.
  critic      (advantage_estimator ppo) a second whole model with a value head: weights, fp32 grads and optimizer
              state of its trained parameters (its output layer is kept but frozen), and activations as the
              policy's, in turn with the policy's training.
  The roles' weights, grads and optimizer states stay on the GPU together; their activations come one role at a
  time: the total counts the largest.
Engine (one GPU of a tensor-parallel engine): weights / engine tp, and the KV cache of its share of
rollout.max_concurrency requests at full length (prompt + max_new_tokens), at most rollout.engine.max_total_tokens
(SGLang's pool): 2 x layers x kv heads/tp (at least one) x head dim per token, or MLA's compressed latent
(kv_lora_rank + rope dim) per layer, whole on every rank.
Colocated (placement.colocate), one GPU holds a trainer rank and an engine rank in turns
(`slimish.orchestration.colocation`): generate = the engine (the trainer offloaded); train = the trainer rank (the
engine released); sync = the trainer's weights (every role's), the engine's weights and two weight-sync buckets (the
trainer's optimizer states offloaded, the engine's KV cache still released). Host memory per GPU: what the trainer
offloads (every role's weights and optimizer state; gradients are freed, not copied), and what
trainer.optimizer.cpu_offload keeps there. CUDA contexts and allocator
slack are not counted.
"""

from __future__ import annotations

from dataclasses import dataclass

from slimish.config.validate import offload_fraction
from slimish.megatron_bridge.hf_config import pipeline_stage_layers
from slimish.planning.params import ParamCount

GB = 1e9
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def planned_attention(attention: str) -> str:
    """The core attention a GPU run of trainer.attention `attention` runs: `auto` is `te` (it resolves to te where
    Transformer Engine imports and CUDA is up, `slimish.trainer.attention.resolve`, and the GPU install ships TE);
    te and sdpa hold the same memory here."""
    return "te" if attention == "auto" else attention


@dataclass(frozen=True, kw_only=True)
class Layout:
    """A trainer rank's place in the parallel layout, as the memory model reads it (`layout`)."""
    tensor_parallel: int
    pipeline_parallel: int
    expert_parallel: int
    data_parallel: int
    sequence_parallel: bool  # in effect: parallel.sequence_parallel at tensor_parallel > 1
    # Seams for parallelisms the config has no keys for yet (1 = off); `layout` is where their keys get read:
    context_parallel: int = 1  # each sample's tokens split over this many ranks: `trainer_rank` divides T by it
    virtual_pipeline: int = 1  # interleaved 1F1B: changes the micro-batches in flight (`in_flight_layers`)


def layout(cfg) -> Layout:
    """The layout of `cfg`'s trainer ranks (context parallelism also divides the data-parallel size)."""
    par = cfg.parallel
    tp, pp, cp = par.tensor_parallel, par.pipeline_parallel, par.context_parallel
    return Layout(tensor_parallel=tp, pipeline_parallel=pp, expert_parallel=par.expert_parallel,
                  data_parallel=par.num_trainer_ranks // (tp * pp * cp),
                  sequence_parallel=par.sequence_parallel and tp > 1, context_parallel=cp,
                  virtual_pipeline=par.virtual_pipeline)


def in_flight_layers(lay: Layout, layers_per_stage: int) -> int:
    """Layers' activations the first pipeline stage holds at its peak: pipeline_parallel micro-batches in flight
    (1F1B), each through its stage's layers. Interleaved (virtual_pipeline v > 1, Megatron's groups of pp
    micro-batches): its warm-up runs 2 (pp - 1) + (v - 1) pp chunk forwards before the first backward, one more in
    flight, each through a chunk's layers_per_stage / v layers: about (1 + (pp - 1) / (pp v)) times 1F1B's."""
    pp, v = lay.pipeline_parallel, lay.virtual_pipeline
    if v == 1:
        return pp * layers_per_stage
    return (2 * (pp - 1) + (v - 1) * pp + 1) * layers_per_stage // v


def core_attention(attention: str, *, dtype: int, heads: float, tokens: float, longest: int,
                   samples_at_once: int) -> tuple[float, float]:
    """(bytes one layer keeps until its backward, more bytes while that layer is computed) of the core attention
    `attention` (te / sdpa / local) over `heads` heads (per tensor-parallel rank) of a micro-batch of `tokens`
    tokens whose samples are at most `longest` long, `samples_at_once` of them in one attention call."""
    if attention != "local":
        return 0.0, 0.0  # flash-style: no [s, s] tensor (its per-token tensors are `layer_terms`')
    square = tokens * longest  # sum of len_i^2 over the micro-batch's samples
    half = dtype < 4  # the scores are cast to fp32 for the softmax, and its output back to the dtype
    mask = square / samples_at_once  # one bool causal mask per call, shared by its heads (and a padded row's samples)
    kept = heads * square * (4 + (dtype if half else 0)) + mask  # the fp32 softmax, the probabilities in dtype
    # Beside them, in the layer being computed: Megatron's global memory buffer the scores are computed beside (in the
    # dtype, sized for the largest call, kept by the rank), and at the peak 6 more bytes per element in half
    # precision (forward: the raw scores and their fp32 copy; backward: two fp32 gradients, less the probabilities it
    # frees), 12 in fp32 (the backward of masked_fill_ on a view of the scores: a zeroed base and a clone).
    computing = heads * samples_at_once * longest ** 2 * (dtype + (6 if half else 12))
    return kept, computing


def layer_terms(arch, layer: int, *, attention: str, dtype: int, tp: int, etp: int, sp: bool,
                cp: int = 1) -> dict[str, float]:
    """Bytes per token of the micro-batch (this rank's share of it) that layer `layer` keeps for its backward pass,
    by name, as autograd saves them in Megatron's layer with the core attention `attention` (te / sdpa / local;
    local's [s, s] tensors are `core_attention`'s), each storage once. Listed with
    `torch.autograd.graph.saved_tensors_hooks` (tests/planning/test_activations.py checks the sum for the tiny Qwen3
    and Llama layers with sdpa, byte for byte; te's terms are read from Transformer Engine's code, not measured):
      norms         each of the two norms' input and its normalised input (x * rstd) in fp32 (the local norms work
                    in fp32), and its fp32 rstd; TE's fused norm keeps its input in the dtype and rstd only
      linear_inputs the normalised input of linear_qkv and linear_fc1
      qkv           the fused q / k / v projection's output (the values are views of it) and the query's copy
                    (grouped-query heads reshaped)
      qk_norm       the query and key norms' fp32 inputs and normalised inputs, and each head's rstd (Qwen3; TE's
                    fused norm keeps its input and rstd)
      rope          the rotated query and key; the local spec's unfused RoPE also keeps a cos and a sin per call
                    (4 x head dim, whole on every tensor-parallel rank)
      attention     sdpa: each sample's output and the fp32 log-sum-exp per head, and linear_proj's input (the
                    samples' outputs joined); te: the output (linear_proj's input) and the log-sum-exp; local:
                    the context and linear_proj's input, and the keys and values repeated to every head (grouped
                    heads); the CPU's context-parallel stand-in also the keys and values gathered over the group
      mlp           a gated (SwiGLU) MLP: linear_fc1's output (2 x ffn), the activation's output, the linear half
                    plus its offset (a copy), and their product (linear_fc2's input): 5 x ffn / tp
      router, routed, shared  a mixture-of-experts layer: the router's logits, probabilities, map and indices;
                    each of topk routed copies of the token in (h) and its expert's MLP (6 x ffn / etp: the
                    routing probability scales the product); the shared experts' MLP
      mla           multi-latent attention's latents: the q / kv norms' inputs, normalised inputs and rstd, the up
                    projections' inputs; its rotated q and k are `rope`'s, and sdpa pads v and its output to the
                    q / k head width
    Outside the tensor-parallel regions (norms, linear inputs) the tokens are split over TP with sequence
    parallelism (Megatron's column-parallel linear keeps its input before the sequence all-gather)."""
    h, a, g, d = arch.hidden_size, arch.num_attention_heads, arch.num_query_groups, arch.kv_channels
    outside = 1 / tp if sp else 1.0
    fused_norms = attention == "te"
    # The local spec's norms compute in fp32: they keep an fp32 copy of their input and x * rstd whatever the dtype.
    terms = {"norms": outside * 2 * ((h * dtype if fused_norms else 2 * h * 4) + 4),
             "linear_inputs": outside * 2 * h * dtype}
    if arch.mla is not None:
        m = arch.mla
        qk, v = a * (m.qk_nope_head_dim + m.qk_rope_head_dim), a * m.v_head_dim
        q_lora = m.q_lora_rank or 0
        norm_bytes = dtype if fused_norms else 4  # the local norms work in fp32
        # The q / kv latents' norms: their inputs (the down projections' outputs), normalised inputs and rstd; the
        # up projections' inputs (TE fuses them into the norm's output).
        terms["mla"] = ((q_lora + m.kv_lora_rank + m.qk_rope_head_dim) * norm_bytes
                        + (q_lora + m.kv_lora_rank) * norm_bytes + (0 if fused_norms else (q_lora + m.kv_lora_rank)
                                                                    * dtype) + 8)
        terms["rope"] = (2 * qk / tp + (0 if fused_norms else 4 * m.qk_rope_head_dim)) * dtype
        q = v  # linear_proj's input width
        padded = a * max(m.qk_nope_head_dim + m.qk_rope_head_dim, m.v_head_dim)  # sdpa pads v to the q / k width
    else:
        q, kv = a * d, g * d
        terms["qkv"] = (q + 2 * kv) / tp * dtype
        rstd = (a + g) / tp * 4  # each head's fp32 rstd
        if arch.qk_layernorm and fused_norms:  # TE's norm keeps its input: the query's copy (the key's is a view)
            terms["qk_norm"] = q / tp * dtype + rstd
        elif arch.qk_layernorm:  # fp32: the inputs (the key's a view of qkv in fp32, a copy in half precision)
            terms["qk_norm"] = (2 * q + kv + (kv if dtype < 4 else 0)) / tp * 4 + rstd
        # Partial rotary (GLM-4.5): the cos / sin cover the rotating share of each head's channels.
        terms["rope"] = ((q + kv) / tp + (0 if attention == "te" else 4 * d * arch.rotary_percent)) * dtype
        padded = 0
    lse = 4 * a / tp
    if attention == "te":
        terms["attention"] = q / tp * dtype + lse
    elif attention == "sdpa":  # each sample's output, linear_proj's input (their join); MLA: v and out padded
        terms["attention"] = (q + (2 * padded if padded else q)) / tp * dtype + lse
        if cp > 1:  # the stand-in keeps the group's keys and values (its own among them) for the backward pass
            terms["attention"] += (cp - 1) * 2 * (qk if arch.mla is not None else g * d) / tp * dtype
    else:
        repeated = 2 * q / tp if arch.mla is None and g < a else 0
        terms["attention"] = (2 * q / tp + repeated) * dtype
    moe = arch.moe
    if moe is not None and moe.is_sparse(layer):
        # The router's fp32 logits and probabilities, its bool routing map and two sets of int64 top-k indices;
        # per routed copy of the token: the permuted input, its expert's fc1 output (2 x ffn), activation, linear
        # half's copy, their product and that scaled by the routing probability (fc2's input), and the fp32
        # probability.
        terms["router"] = 9 * moe.num_experts + 16 * moe.topk
        terms["routed"] = moe.topk * ((h + 6 * moe.ffn_hidden_size / etp) * dtype + 4)
        if moe.shared_ffn_hidden_size:
            terms["shared"] = 5 * moe.shared_ffn_hidden_size / tp * dtype
    else:
        terms["mlp"] = 5 * arch.ffn_hidden_size / tp * dtype
    return terms


def recomputed_terms(terms: dict[str, float], *, attention: str, modules: list[str], dtype: int, arch,
                     tp: int, sp: bool) -> float:
    """Of a layer's `layer_terms`, the bytes per token Megatron's selective recompute of `modules` drops after the
    forward pass (and holds again while it recomputes that layer in the backward pass): core_attn the core
    attention's own (what it saves beyond its inputs and its output); layernorm the two norms' normalised inputs,
    rstd and outputs (the linear inputs: freed after the forward, recomputed into the same storage), the local norms
    only; mlp / moe / shared_experts their MLPs; mla_up_proj multi-latent attention's up projections."""
    dropped = 0.0
    h, a = arch.hidden_size, arch.num_attention_heads
    if "core_attn" in modules:
        q = a * (arch.mla.v_head_dim if arch.mla is not None else arch.kv_channels)
        dropped += terms["attention"] - q / tp * dtype  # linear_proj's input is the checkpoint's output: kept
    if "layernorm" in modules and attention != "te":
        dropped += (1 / tp if sp else 1.0) * 2 * (h * 4 + 4) + terms["linear_inputs"]  # fp32 x * rstd, rstd
    if "mlp" in modules:
        dropped += terms.get("mlp", 0.0)
    if "moe" in modules:
        dropped += terms.get("router", 0.0) + terms.get("routed", 0.0)
    if "shared_experts" in modules:
        dropped += terms.get("shared", 0.0)
    if "mla_up_proj" in modules and arch.mla is not None:
        m = arch.mla  # the up projections' outputs as they reach the attention: the rotated q and k
        dropped += 2 * a * (m.qk_nope_head_dim + m.qk_rope_head_dim) / tp * dtype
    return dropped


def backward_working(arch, layer: int, *, dtype: int, tp: int, etp: int) -> float:
    """Bytes per token a layer's backward pass holds beyond what it saved, at its peak: the MLP's, where the
    gradients of its intermediate (ffn / tp wide, the routed experts' topk x ffn / etp) outnumber the saved tensors
    it has freed by one. Measured: the peak of a training step on the emulated GPU is the layers' saved tensors, the
    head's and this (tests/planning/test_activations.py)."""
    moe = arch.moe
    if moe is not None and moe.is_sparse(layer):
        return moe.topk * moe.ffn_hidden_size / etp * dtype
    return arch.ffn_hidden_size / tp * dtype


@dataclass(frozen=True, kw_only=True)
class TrainerMemory:
    weights: float
    grads: float
    optimizer: float                # as configured
    optimizer_other: float          # with the distributed optimizer switched the other way (no CPU offload)
    activations: float              # as configured
    activations_other: float        # with full recompute, or with none when it is full
    logits: float
    tokens: int                     # per micro-batch (per rank of its sequence)
    attention: str                  # the core attention planned (`planned_attention`)
    activations_attention_other: float  # as configured, with local attention for te / sdpa, te for local
    reference: float = 0.0          # the reference model's weights (0: none)
    reference_activations: float = 0.0
    critic_weights: float = 0.0     # the critic's (0: none)
    critic_grads: float = 0.0
    critic_optimizer: float = 0.0
    optimizer_host: float = 0.0     # in host memory: trainer.optimizer.cpu_offload's share (policy and critic)
    gather_buffer: float = 0.0      # of `activations`: kept from one step to the next (sequence parallelism's buffer)
    critic_activations: float = 0.0

    @property
    def critic(self) -> float:
        return self.critic_weights + self.critic_grads + self.critic_optimizer

    @property
    def total(self) -> float:
        """Every role's weights, grads and optimizer state, and the activations of the role that holds the most
        (the roles run one at a time)."""
        static = self.weights + self.grads + self.optimizer + self.reference + self.critic
        return static + max(self.activations + self.logits, self.reference_activations, self.critic_activations)


def builds_roles(cfg) -> tuple[bool, bool]:
    """(reference model, critic): whether the trainer builds them, as `TrainerWorker.setup` decides."""
    from slimish.trainer.estimators import ESTIMATORS

    loss = cfg.trainer.loss
    estimator = ESTIMATORS[loss.advantage_estimator]
    return loss.kl_coef > 0 or estimator.needs_ref(cfg.trainer), estimator.needs_values


def trainer_rank(cfg, arch, params: ParamCount, *, prompt_tokens: int) -> TrainerMemory:
    tr, lay, par = cfg.trainer, layout(cfg), cfg.parallel
    tp, pp, ep, dp = lay.tensor_parallel, lay.pipeline_parallel, lay.expert_parallel, lay.data_parallel
    etp = par.expert_tensor_parallel or tp
    # Megatron's distributed optimizer shards over the data x context-parallel group; the experts' over EDP.
    dp_cp, edp = dp * lay.context_parallel, par.num_trainer_ranks // (etp * ep * pp)
    split = pipeline_stage_layers(arch.num_layers, pp, first=par.first_stage_layers, last=par.last_stage_layers,
                                  virtual_pipeline=par.virtual_pipeline)
    stages = [params.rank(tensor_parallel=tp, pipeline_parallel=pp, expert_parallel=ep, expert_tensor_parallel=etp,
                          stage=s, stage_layers=split) for s in range(pp)]
    fullest = max(range(pp), key=lambda s: sum(stages[s]))
    dense, experts = stages[fullest]
    dtype = DTYPE_BYTES[cfg.model.dtype]
    state = 8 + (4 if dtype < 4 else 0)

    def optimizer(dense: float, experts: float, distributed: bool) -> float:
        if not distributed:
            return (dense + experts) * state
        return dense * state / dp_cp + experts * state / max(edp, 1)

    offloaded = offload_fraction(tr.optimizer.cpu_offload)  # Megatron's CPU offload: of the distributed optimizer

    longest = prompt_tokens + cfg.rollout.max_new_tokens
    if tr.max_tokens_per_micro_batch:  # packed: a longer sample gets a micro-batch of its own
        tokens, samples_at_once = max(tr.max_tokens_per_micro_batch, longest), 1
    else:
        tokens, samples_at_once = tr.micro_batch_size * longest, tr.micro_batch_size
    tokens /= lay.context_parallel
    layers = max(split)  # the activations of the fullest stage
    h, sp = arch.hidden_size, lay.sequence_parallel
    layer_input = tokens * h * dtype / (tp if sp else 1)
    in_flight = in_flight_layers(lay, layers)

    def final_norm(attention: str) -> float:
        """The last stage's final norm (as `layer_terms` counts a layer's) and its output whole in the dtype (gathered
        under sequence parallelism), kept by the logprob head's checkpointed chunks. At pp > 1 the first stage, with
        more micro-batches in flight, is the one counted."""
        if pp > 1:
            return 0.0
        return tokens * ((1 / tp if sp else 1) * ((h * dtype if attention == "te" else 2 * h * 4) + 4) + h * dtype)
    working = tokens * max(backward_working(arch, k, dtype=dtype, tp=tp, etp=etp) for k in range(arch.num_layers))
    # Sequence parallelism all-gathers each column-parallel linear's input into Megatron's global memory buffer
    # (`get_global_memory_buffer`, "mpu"): the whole sequence in the dtype, kept by the rank from its first step on.
    gather_buffer = tokens * h * dtype if sp else 0.0

    def attention_bytes(attention: str) -> tuple[float, float]:
        return core_attention(attention, dtype=dtype, heads=arch.num_attention_heads / tp, tokens=tokens,
                              longest=longest, samples_at_once=samples_at_once)

    def per_layer(attention: str) -> list[dict[str, float]]:
        return [layer_terms(arch, k, attention=attention, dtype=dtype, tp=tp, etp=etp, sp=sp,
                            cp=lay.context_parallel) for k in range(arch.num_layers)]

    def activations(recompute: str, attention: str) -> float:
        square, computing = attention_bytes(attention)  # the local attention's [s, s] tensors (0 for te / sdpa)
        terms = per_layer(attention)
        whole = [sum(t.values()) for t in terms]
        if recompute == "full":  # each layer's input kept; one layer's working set while it is recomputed
            return in_flight * layer_input + tokens * max(whole) + square + computing + 3 * working \
                + final_norm(attention) + gather_buffer
        modules = tr.recompute_modules if recompute == "selective" else []
        dropped = [recomputed_terms(t, attention=attention, modules=modules, dtype=dtype, arch=arch, tp=tp, sp=sp)
                   for t in terms]
        kept = tokens * sum(w - d for w, d in zip(whole, dropped)) / len(whole)  # an average layer of the model
        if "core_attn" in modules:  # the [s, s] tensors in the layer being recomputed only
            return in_flight * kept + tokens * max(dropped) + square + computing + working + final_norm(attention) \
                + gather_buffer
        return in_flight * (kept + square) + tokens * max(dropped) + computing + working + final_norm(attention) \
            + gather_buffer

    recompute, attention = tr.recompute, planned_attention(tr.attention)
    other_recompute = "none" if recompute == "full" else "full"
    # One chunk's logits at a time (`slimish.trainer.logprobs`): the output layer's, in the dtype; the cross entropy's
    # fp32 copy (turned into its softmax in place, kept for its backward); the entropy's fp32 scaled logits, shifted
    # logits, their exponentials and a product, beside them at the peak.
    chunk_logits = min(tr.logprob_chunk_tokens, tokens) * arch.vocab_size / tp
    mem = dict(weights=(dense + experts) * dtype, grads=(dense + experts) * 4,
               optimizer=optimizer(dense, experts, tr.optimizer.distributed) * (1 - offloaded),
               optimizer_host=optimizer(dense, experts, tr.optimizer.distributed) * offloaded * (state + 4) / state,
               optimizer_other=optimizer(dense, experts, not tr.optimizer.distributed),
               activations=activations(recompute, attention),
               activations_other=activations(other_recompute, attention),
               activations_attention_other=activations(recompute, "te" if attention == "local" else "local"),
               logits=chunk_logits * (dtype + 4 + 16), tokens=round(tokens), attention=attention,
               gather_buffer=gather_buffer)
    reference, critic = builds_roles(cfg)
    if reference:  # forward only: one layer's working set, and a chunk's logits and its fp32 log-softmax
        mem.update(reference=(dense + experts) * dtype,
                   reference_activations=tokens * max(map(sum, map(dict.values, per_layer(attention))))
                   + sum(attention_bytes(attention)) + chunk_logits * (dtype + 4))
    if critic:  # trained: all but the output layer (frozen), plus the value head (hidden -> 1) on the last stage
        head = h + 1 if fullest == pp - 1 else 0
        trained = dense - (params.output // tp if head else 0) + head
        mem.update(critic_weights=(dense + experts + head) * dtype, critic_grads=(trained + experts) * 4,
                   critic_optimizer=optimizer(trained, experts, tr.optimizer.distributed) * (1 - offloaded),
                   optimizer_host=mem["optimizer_host"] + optimizer(trained, experts, tr.optimizer.distributed)
                   * offloaded * (state + 4) / state,
                   critic_activations=activations(recompute, attention))
    return TrainerMemory(**mem)


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
    weights = trainer.weights + trainer.reference + trainer.critic_weights  # every role's
    return ColocatedMemory(generate=engine.total, train=trainer.total, sync=weights + engine.weights + buckets,
                           host=weights + trainer.optimizer + trainer.critic_optimizer + trainer.optimizer_host)
