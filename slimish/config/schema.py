"""Typed configuration of a slimish job.

Every section is a keyword-only dataclass owned by the component that reads it; every field carries a one-line
`help`. `Literal[...]` annotations are the allowed values that validation reports. Cross-field rules live in
`validate.py` and only explain; they never rewrite a value.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


def doc(default, help: str):  # noqa: A002 - "help" reads best at call sites
    """A dataclass field with a default and a one-line description."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help})
    return field(default=default, metadata={"help": help})


@dataclass(kw_only=True)
class RunConfig:
    name: str = doc("run", "Run name: outputs go to <output_dir>/<name>/.")
    output_dir: str = doc("runs", "Directory holding one folder per run.")
    seed: int = doc(1234, "Seed for data order, sampling seeds and model init.")
    log_every: int = doc(1, "Print one line every this many steps.")
    log_level: Literal["debug", "info", "warning", "error"] = doc(
        "info", "Least severe log record shown, from the driver and every actor (one format: slimish/log.py).")
    save_rollouts: bool = doc(False, "Write every step's samples (tokens, logprobs, versions, reward, advantage, "
                                     "status) to <run dir>/rollouts/step_<N>.jsonl.")
    wandb_project: str = doc("", "Also log every step's metrics to this Weights & Biases project (needs a W&B login, "
                                 "or WANDB_MODE=offline for files under the run directory); '' = off.")
    phase_hook: str = doc("", "Dotted path of fn(phase: str, step: int, engine_urls: list[str]) -> None, called by "
                              "the driver as each phase of an RL step begins: 'rollout', 'train', 'sync' (before the "
                              "engines are paused for it); for profilers, external monitors and fault-injection "
                              "tests; '' = none.")


@dataclass(kw_only=True)
class ModelConfig:
    hf_path: str = doc("", "Hugging Face checkpoint directory (config.json, safetensors, tokenizer files).")
    megatron_path: str = doc("", "Start the policy and the reference model from this Megatron-Core torch_dist "
                                 "checkpoint (what `slimish convert hf-to-megatron` writes, at any layout; or a "
                                 "run's checkpoints/step_<N>/trainer) instead of hf_path's safetensors; config.json, "
                                 "the tokenizer and the engines' first weights still come from hf_path, and the "
                                 "engines get these weights before the first rollout. '' = start from hf_path.")
    dtype: Literal["float32", "bfloat16"] = doc("float32", "Parameter and compute dtype of trainer and engines.")


@dataclass(kw_only=True)
class ParallelConfig:
    tensor_parallel: int = doc(1, "Megatron tensor-parallel size.")
    pipeline_parallel: int = doc(1, "Megatron pipeline-parallel size.")
    virtual_pipeline: int = doc(1, "Model chunks per pipeline rank (Megatron's interleaved 1F1B schedule: the "
                                   "pipeline's bubble shrinks by this factor); the layers split over pipeline_parallel "
                                   "x virtual_pipeline chunks, rank r holding chunks r, r + pipeline_parallel, ...")
    first_stage_layers: int = doc(0, "Transformer layers on the first pipeline stage (it also holds the embedding); "
                                     "0: an even share. With last_stage_layers, for layer counts pipeline_parallel "
                                     "does not divide (DeepSeek-V3's 61 over PP4: 16, then 15 on each other stage).")
    last_stage_layers: int = doc(0, "Transformer layers on the last pipeline stage (it also holds the output layer "
                                    "and the loss); 0: an even share. The stages between share the rest evenly.")
    expert_parallel: int = doc(1, "Megatron expert-parallel size (MoE only).")
    expert_tensor_parallel: int = doc(0, "Megatron expert-tensor-parallel size: how many ranks split each expert's "
                                         "weights (MoE only); 0: tensor_parallel. The experts' data-parallel size is "
                                         "num_trainer_ranks / (expert_tensor_parallel * expert_parallel * "
                                         "pipeline_parallel), which must be whole.")
    sequence_parallel: bool = doc(False, "Megatron sequence parallelism (at tensor_parallel > 1): the norms, "
                                         "residuals and dropouts hold 1/tensor_parallel of the sequence; "
                                         "micro-batches are padded to a multiple of tensor_parallel tokens.")
    context_parallel: int = doc(1, "Megatron context-parallel size: each sequence split into 2 x context_parallel "
                                   "load-balanced chunks over this many ranks (attention: Transformer Engine's on a "
                                   "GPU, `slimish/trainer/context_parallel_attention.py` without it); rows are padded "
                                   "to a multiple of 2 x context_parallel tokens (each packed sequence too).")
    cp_comm_type: Literal["p2p", "all_gather", "a2a"] = doc(
        "p2p", "How Transformer Engine's context-parallel attention exchanges keys and values: p2p (ring), "
               "all_gather, a2a (all-to-all over heads). Without TE keys and values are all-gathered.")
    num_trainer_ranks: int = doc(1, "Number of trainer processes (tensor * pipeline * context * data parallel).")
    backend: Literal["auto", "gloo", "nccl"] = doc("auto", "torch.distributed backend; auto: nccl on GPU, else gloo.")


@dataclass(kw_only=True)
class OptimizerConfig:
    lr: float = doc(1e-3, "Adam learning rate: the peak of the schedule below (`slimish/trainer/lr_schedule.py`).")
    lr_warmup_steps: int = doc(0, "Linear warm-up over this many optimizer steps (trainer.num_minibatches per RL "
                                  "step): step k of them trains at lr x k / lr_warmup_steps. 0: none.")
    lr_decay_style: Literal["constant", "linear", "cosine"] = doc(
        "constant", "After the warm-up: constant lr, or linear / cosine decay to lr x min_lr_ratio.")
    lr_decay_steps: int = doc(0, "The optimizer step where the decay reaches its minimum (warm-up included); 0: the "
                                 "run's last, rl.num_steps x trainer.num_minibatches.")
    min_lr_ratio: float = doc(0.0, "Where linear / cosine decay ends, as a fraction of lr (of trainer.critic.lr for "
                                   "the critic, which follows the same schedule).")
    weight_decay: float = doc(0.0, "Decoupled weight decay.")
    adam_beta1: float = doc(0.9, "Adam beta1.")
    adam_beta2: float = doc(0.999, "Adam beta2.")
    adam_eps: float = doc(1e-8, "Adam epsilon.")
    clip_grad: float = doc(1.0, "Global gradient-norm clip (0 disables).")
    distributed: bool = doc(False, "Megatron's distributed optimizer: fp32 main weights, grads and Adam moments "
                                   "sharded over data-parallel ranks (grads reduce-scattered, weights all-gathered).")
    adam: Literal["auto", "torch", "te_fused"] = doc(
        "auto", "Which Adam runs (`slimish/trainer/adam.py`; each trainer rank logs it at INFO): torch = "
                "torch.optim.AdamW; te_fused = Transformer Engine's FusedAdam (needs TE and a CUDA GPU); auto = "
                "te_fused where TE imports and CUDA is up, else torch. Both make the same AdamW update, and a "
                "checkpoint of either loads into the other.")
    cpu_offload: bool | float = doc(
        False, "Megatron's optimizer CPU offload: the fp32 main weights and Adam moments of this fraction of the "
               "parameters (true = 1.0, all) live in host memory, updated there by torch's AdamW (their gradients "
               "copied over, the new weights copied back), the rest on the GPU. Needs "
               "trainer.optimizer.distributed=true, model.dtype=bfloat16 and trainers on GPUs; false or 0 = off.")
    cpu_offload_overlap: bool = doc(True, "With cpu_offload: overlap the copies to and from host memory with the "
                                          "CPU's Adam (one CPU optimizer per parameter, CUDA streams; Megatron's "
                                          "overlap_cpu_optimizer_d2h_h2d).")


# The samples per prompt each advantage estimator needs (a group baseline needs 2): data the config checks read
# without importing the trainer; `slimish/trainer/estimators.py` holds the estimators, one per key here.
ESTIMATOR_MIN_GROUP_SIZE = {"grpo": 2, "dr_grpo": 2, "rloo": 2, "reinforce_plus_plus": 1,
                            "reinforce_plus_plus_baseline": 2, "gspo": 2, "ppo": 1}


@dataclass(kw_only=True)
class LossConfig:
    advantage_estimator: Literal["grpo", "dr_grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline",
                                 "gspo", "ppo"] = doc(
        "grpo", "How per-token advantages are computed (`slimish/trainer/estimators.py`): grpo (group-normalised "
                "rewards); dr_grpo (group-centred, no std, constant loss normaliser); rloo (leave-one-out baseline); "
                "reinforce_plus_plus (KL-shaped token returns, whitened over the step; _baseline: group mean "
                "subtracted first); gspo (GRPO advantages, sequence-level ratio and clipping: use small clip_eps); "
                "ppo (GAE over a critic's values: trainer.critic).")
    normalize_advantage_std: bool = doc(True, "grpo / gspo: divide group-centred rewards by the group std.")
    reward_kl_coef: float = doc(0.0, "reinforce_plus_plus* and ppo: weight of the per-token KL to the reference policy "
                                     "subtracted from the rewards (0: no shaping, no reference model for it).")
    clip_eps_low: float = doc(0.2, "Lower PPO ratio clip: ratio >= 1 - clip_eps_low.")
    clip_eps_high: float = doc(0.2, "Upper PPO ratio clip: ratio <= 1 + clip_eps_high (DAPO clip-higher > low).")
    kl_coef: float = doc(0.0, "Weight of the KL penalty to the reference (initial) policy; 0 disables it.")
    kl_estimator: Literal["k1", "k2", "k3"] = doc("k3", "Per-token KL estimator used for the penalty.")
    token_aggregation: Literal["token_mean", "seq_mean", "constant"] = doc(
        "token_mean", "How per-token losses are averaged: over the minibatch's trained tokens, per sequence then over "
                      "sequences, or summed over a constant (minibatch samples x rollout.max_new_tokens; Dr. GRPO). "
                      "dr_grpo always uses constant, gspo seq_mean.")
    tis_cap: float = doc(0.0, "Truncated importance sampling: weight each token's policy loss by min(pi_old / "
                              "pi_rollout, tis_cap), correcting for tokens the engines sampled with older weights or "
                              "other numerics (partial rollouts); 0 disables it.")
    mis_low: float = doc(0.0, "Masked importance sampling: tokens whose behaviour ratio pi_old / pi_rollout is below "
                              "this are left out of the loss (with mis_high).")
    mis_high: float = doc(0.0, "Masked importance sampling: tokens whose behaviour ratio is above this are left out "
                               "of the loss; 0 disables the mask.")
    is_level: Literal["token", "sequence"] = doc("token", "Behaviour ratio of TIS and MIS per token, or per sequence "
                                                          "(the product over its tokens; MIS then drops whole "
                                                          "sequences).")


@dataclass(kw_only=True)
class CriticConfig:
    """The value model of advantage_estimator 'ppo' (built from model.hf_path, with a value head)."""
    lr: float = doc(1e-5, "The critic's Adam learning rate (the rest of trainer.optimizer applies to it too).")
    value_clip: float = doc(0.2, "PPO value clipping: a value moves at most this far from its old value in a step.")
    gamma: float = doc(1.0, "GAE discount per token.")
    lam: float = doc(0.95, "GAE lambda.")


@dataclass(kw_only=True)
class TrainerConfig:
    micro_batch_size: int = doc(8, "Sequences per forward/backward micro-batch (when not packing).")
    max_tokens_per_micro_batch: int = doc(0, "Pack samples back to back into micro-batches of at most this many "
                                             "tokens (no padding; the micro-batch count follows from the tokens; a "
                                             "longer sample gets one of its own); 0 = micro_batch_size samples, "
                                             "right-padded.")
    logprob_chunk_tokens: int = doc(4096, "Logits exist for at most this many tokens at a time (output layer and "
                                          "log-softmax applied chunk by chunk, recomputed in the backward pass).")
    num_minibatches: int = doc(1, "Optimizer steps per rollout batch (1 = strictly on-policy).")
    max_skipped_steps: int = doc(3, "Stop the job after this many RL steps in a row that each skipped an optimizer "
                                    "step because its loss or gradient was not finite (NaN or inf: such a step is "
                                    "never applied); 0 = never stop for it.")
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    torch_threads: int = doc(1, "torch intra-op threads per trainer process.")
    recompute: Literal["none", "full", "selective"] = doc(
        "none", "Activation recomputation: full = keep only each transformer layer's input and recompute the layer in "
                "the backward pass; selective = recompute only trainer.recompute_modules of every layer (Megatron's "
                "selective granularity).")
    recompute_modules: list[Literal["core_attn", "layernorm", "mlp", "moe", "shared_experts", "mla_up_proj"]] = doc(
        ["core_attn"], "What trainer.recompute=selective recomputes in the backward pass, in every layer: core_attn "
                       "(the core attention: with trainer.attention=local its [s, s] scores and softmax; te and sdpa "
                       "keep little to drop), layernorm "
                       "(the norms before the attention and the MLP; none to recompute in TE's spec, where the "
                       "norms are fused into the next linear), mlp (a dense MLP), moe (a whole mixture-of-experts "
                       "layer), shared_experts (its shared experts), mla_up_proj (multi-latent attention's up "
                       "projections and RoPE). Megatron's moe_act needs its grouped GEMM, which the trainer never "
                       "builds.")
    attention: Literal["auto", "te", "sdpa", "local"] = doc(
        "auto", "The trainer's core attention (`slimish/trainer/attention.py`): te = Transformer Engine's fused "
                "attention (Megatron's TE layer spec; needs TE and a GPU); sdpa = torch's scaled_dot_product_attention "
                "(memory linear in the sequence); local = Megatron's DotProductAttention (every head's [s, s] scores, "
                "the reference the others are tested against); auto = te where TE imports and CUDA is up, else sdpa.")


@dataclass(kw_only=True)
class SftConfig:
    steps: int = doc(0, "Supervised warm-up steps in Megatron before RL (0 = none).")
    lr: float = doc(3e-3, "Warm-up learning rate.")
    batch_size: int = doc(32, "Warm-up sequences per step.")
    data_path: str = doc("", "jsonl with 'prompt' and 'response' fields for the warm-up.")


@dataclass(kw_only=True)
class EngineConfig:
    num_engines: int = doc(2, "SGLang servers to launch (each one process group).")
    tensor_parallel: int = doc(1, "SGLang --tp-size of each engine.")
    nodes_per_engine: int = doc(1, "Nodes one engine spans (SGLang --nnodes): its tensor_parallel ranks split "
                                   "evenly, tensor_parallel / nodes_per_engine on each node, one Ray actor per node "
                                   "part, every part on a node of its own. Part 0 serves HTTP (the router sees one "
                                   "worker); the whole engine restarts when any part dies. For models larger than "
                                   "one node (DeepSeek-V3 in bf16, 405B on H100 nodes); not with the 'tensor' "
                                   "transport (its handles are node-local).")
    expert_parallel: int = doc(1, "SGLang --ep-size: how many of an engine's tensor-parallel ranks its experts are "
                                  "split over (mixture-of-experts models; must divide tensor_parallel; each expert "
                                  "is split tensor_parallel / expert_parallel ways).")
    attention_data_parallel: int = doc(1, "SGLang --attn-dp-size (DP attention): data-parallel attention groups "
                                          "inside an engine's tensor-parallel ranks, each with its own KV cache and "
                                          "requests, the MLP and experts staying parallel over all ranks (for MLA "
                                          "models such as DeepSeek-V3; must divide tensor_parallel).")
    moe_a2a_backend: str = doc("none", "SGLang --moe-a2a-backend: the all-to-all of expert parallelism; 'none' "
                                       "(all-reduce), or e.g. 'deepep' / 'mooncake', which SGLang runs with "
                                       "expert_parallel == tensor_parallel.")
    mem_fraction_static: float = doc(0.0, "SGLang --mem-fraction-static: the share of each GPU for weights and KV "
                                          "cache (0 = SGLang's choice).")
    cuda_graphs: bool = doc(True, "Decode with SGLang's CUDA graphs (false: --disable-cuda-graph).")
    cuda_graph_max_bs: int = doc(0, "SGLang --cuda-graph-max-bs: the largest decode batch captured in a CUDA graph "
                                    "(0 = SGLang's choice).")
    device: Literal["auto", "cpu", "cuda"] = doc("auto", "SGLang --device; auto = cuda when available, else cpu.")
    base_port: int = doc(0, "0 = each engine listens on a free port of its node, picked at its start (so jobs "
                            "run side by side); else engine i listens on base_port + i on its node's address "
                            "(loopback on a local Ray), and part r > 0 of an engine spanning nodes on base_port + "
                            "r * num_engines + i (its health only).")
    max_total_tokens: int = doc(4096, "SGLang KV-cache size in tokens.")
    startup_timeout_s: float = doc(300.0, "Seconds to wait for an engine to become healthy.")
    restart_dead: bool = doc(True, "Restart an engine whose process died; it rejoins at the next weight sync.")
    watch_interval_s: float = doc(2.0, "Seconds between checks that every engine process is alive.")
    health_interval_s: float = doc(30.0, "Seconds between probes of every live engine's /health_generate (0 = no "
                                         "probes); one that fails the probe is hung: it is killed and restarted.")
    hang_timeout_s: float = doc(60.0, "Seconds a /health_generate probe may take before its engine counts as hung "
                                      "(SGLang itself answers 503 after 20 s without scheduler progress).")
    extra_args: list = doc([], "Extra command-line arguments passed verbatim to sglang.launch_server.")
    attach: list[str] = doc([], "URLs of running SGLang engines to use instead of starting num_engines (num_engines "
                           "must equal their count): engines kept up between jobs, e.g. while iterating on a "
                           "reward. At the job's start each is reset (the checkpoint in model.hf_path reloaded, "
                           "requests aborted, caches flushed); at its end each is left running. The job cannot "
                           "restart them: no watchdog runs for attached engines.")
    attach_key_file: str = doc("", "File holding the key the attached engines were started with (SGLang "
                                    "--api-key): one line, or their admin key (--admin-api-key) then their API key; "
                                    "the job's router and clients use it. Required with attach.")


@dataclass(kw_only=True)
class RouterConfig:
    port: int = doc(0, "sglang-router HTTP port (loopback); 0 = a free one, picked at the start.")
    prometheus_port: int = doc(0, "sglang-router Prometheus port (loopback); 0 = a free one, picked at the start.")
    policy: Literal["cache_aware", "round_robin", "random", "power_of_two"] = doc(
        "round_robin", "sglang-router load-balancing policy."
    )


@dataclass(kw_only=True)
class PartialRolloutConfig:
    mode: Literal["off", "abort", "retract"] = doc(
        "off", "off: a step waits for all its samples; abort: over-sample, and once prompts_per_step groups are done "
               "abort the rest and continue them first next step; retract: generation never stops, weight syncs "
               "pause the engines in retract mode and running requests continue with the new weights.")
    over_sampling: int = doc(0, "Groups kept in flight beyond prompts_per_step (abort / retract modes).")
    max_staleness: int = doc(4, "A group whose oldest token is more than this many weight versions older than the "
                                "policy it would train is generated again from its prompt (0 = no bound).")


@dataclass(kw_only=True)
class DynamicSamplingConfig:
    enabled: bool = doc(False, "Drop every scored group whose rewards are all equal (it carries no GRPO signal) and "
                               "draw a new group in its place, until prompts_per_step informative groups are "
                               "collected (DAPO's dynamic sampling).")
    max_extra_groups: int = doc(64, "Groups a step may drop, and so draw beyond prompts_per_step; past it, "
                                    "uninformative groups are kept and trained (counted in groups_kept_uninformative).")


@dataclass(kw_only=True)
class OverlongConfig:
    mode: Literal["train", "filter", "penalty"] = doc(
        "train", "Responses cut at max_new_tokens (status truncated): 'train' = trained as they are; 'filter' = kept "
                 "out of the loss (their rewards still count in their group's baseline); 'penalty' = every response "
                 "gets DAPO's soft length penalty added to its reward (see buffer_tokens).")
    buffer_tokens: int = doc(0, "penalty: the penalty is 0 up to max_new_tokens - buffer_tokens tokens, then falls "
                                "linearly to -penalty_factor at max_new_tokens (DAPO's L_cache).")
    penalty_factor: float = doc(1.0, "penalty: the largest penalty (at max_new_tokens).")


@dataclass(kw_only=True)
class RolloutConfig:
    prompts_per_step: int = doc(16, "Prompts drawn per RL step.")
    samples_per_prompt: int = doc(8, "Responses sampled per prompt (the GRPO group size).")
    max_new_tokens: int = doc(16, "Maximum response length in tokens.")
    temperature: float = doc(1.0, "Sampling temperature T (> 0). The trainer's logprobs (old, new, reference, "
                                  "parity) are of softmax(logits / T), the distribution the engines sample from.")
    top_p: float = doc(1.0, "Nucleus sampling threshold; only 1.0 (SGLang's logprobs ignore the truncation).")
    stop: list[str] = doc([], "Stop strings: a response ends (status completed) after the first one it produces.")
    generate_fn: str = doc("", "Dotted path of a rollout program, async fn(sample, client) -> Sample | list[Sample] "
                               "(multi-turn, tools; slimish/rollout/programs.py); empty = one generation per sample.")
    max_concurrency: int = doc(64, "Maximum in-flight /generate requests (one carries a group's samples).")
    request_timeout_s: float = doc(600.0, "Timeout of one /generate request.")
    max_retries: int = doc(3, "Times a request whose engine failed (connection error, HTTP 5xx) is sent again; "
                              "timeouts and rejected requests are not retried.")
    partial: PartialRolloutConfig = field(default_factory=PartialRolloutConfig)
    overlong: OverlongConfig = field(default_factory=OverlongConfig)
    dynamic_sampling: DynamicSamplingConfig = field(default_factory=DynamicSamplingConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    router: RouterConfig = field(default_factory=RouterConfig)


@dataclass(kw_only=True)
class DataConfig:
    path: str = doc("", "Prompt dataset: .jsonl, .parquet, .json / .csv (datasets.load_dataset on the local file), or "
                        "a directory written by datasets' save_to_disk.")
    prompt_key: str = doc("prompt", "Column holding the prompt: text, or a list of chat messages.")
    label_key: str = doc("label", "Column holding the label passed to the reward function (`labels`).")
    split: str = doc("train", "The split to read when data.path is a saved Hugging Face DatasetDict.")
    shuffle: bool = doc(True, "Shuffle prompts each epoch (seeded by run.seed).")
    apply_chat_template: bool = doc(False, "Render each prompt as one user message with the tokenizer's chat "
                                           "template, the assistant's turn opened (instruct / reasoning models).")


@dataclass(kw_only=True)
class RewardConfig:
    fn: str = doc("", "Dotted path of fn(completions, **kwargs) -> list[float], called as TRL calls reward "
                      "functions: prompts, labels, samples and every dataset column by name.")
    fns: list[str] = doc([], "More reward hooks (dotted paths); the reward is the weighted sum of every term.")
    weights: list[float] = doc([], "One weight per term, in the order fn, fns..., url; empty = all 1.")
    url: str = doc("", "A reward service over HTTP (`slimish/rollout/remote_reward.py`), a term like a hook.")
    max_concurrency: int = doc(8, "reward.url: requests in flight at once.")
    retries: int = doc(2, "reward.url: retries of a request that failed to connect, timed out or got a 5xx.")
    request_timeout_s: float = doc(30.0, "reward.url: seconds one request may take.")
    batch_size: int = doc(16, "reward.url: completions per request.")
    failure_reward: float = doc(0.0, "Reward given when the reward function raises (the failure is counted).")
    timeout_s: float = doc(60.0, "Seconds one reward call (a group's completions) may take; past it the worker "
                                 "process running it is killed and its samples get failure_reward (counted). "
                                 "0 = no limit.")
    workers: int = doc(2, "Worker processes that run the reward hook (slimish/rollout/reward_workers.py): a hook "
                          "that hangs, holds the GIL or crashes is killed there and the job goes on. 0 = call it "
                          "in the rollout process (a thread-based time limit that cannot stop a hook holding the "
                          "GIL; for debugging a hook).")


@dataclass(kw_only=True)
class WeightSyncConfig:
    transport: Literal["broadcast", "tensor", "disk"] = doc(
        "broadcast", "How buckets reach the engines: 'broadcast' = a torch.distributed group with every engine "
        "(gloo on CPU, NCCL on GPU); 'tensor' = engines on the sending rank's node map each bucket from its memory "
        "(shared memory on CPU, CUDA IPC on GPU); 'disk' = safetensors shards in weight_sync.disk_dir that the "
        "engines load (a shared filesystem, no network group).")
    disk_dir: str = doc("", "Directory of the disk transport's shards, readable by every engine; '' = "
                            "<run dir>/weight_sync. A run writes under a directory of its own there "
                            "(<run name>-<hash>), whose leftovers from a killed job the next start removes.")
    bucket_mb: float = doc(64.0, "Maximum bucket size in MiB per broadcast (the sharded sync: per engine rank).")
    sharded: Literal["auto", "on", "off"] = doc(
        "auto", "Send each engine tensor-parallel rank only the parameters it holds, in SGLang's layout (loaded by "
                "name), instead of the whole model to every rank: 'auto' = where the engines have tensor_parallel > 1 "
                "and the model's engine layout is known (not under DP attention), with every transport ('broadcast': "
                "per-rank groups, on gloo); 'on' = always, an error where it cannot; "
                "'off' = the whole model to every rank.")
    stage_senders: bool = doc(True, "With parallel.pipeline_parallel > 1, every pipeline stage sends its own layers: "
                                    "on the sharded route (weight_sync.sharded) with every transport, each stage's "
                                    "shards from its own buffers, segments or files; on the full route with the "
                                    "'broadcast' transport, over a group of its own (the stages take turns on the "
                                    "wire); false = the later stages send theirs through trainer rank 0.")
    master_port: int = doc(0, "TCP port of the store of the first trainer<->engines weight-update group, on "
                              "trainer rank 0's node address (loopback on a local Ray); 0 = a free one. Groups "
                              "rebuilt after an engine restart, and pipeline stage senders' groups, take free ports.")
    verify: bool = doc(True, "After every sync check that each engine reports the new weight version and holds, in "
                             "every parameter, the values the trainer sent (SGLang /weights_checker checksums); a "
                             "mismatch names the parameter and stops the job.")
    after_bucket_hook: str = doc("", "Dotted path of fn(version: str, bucket: int, engine_urls: list[str]) -> None, "
                                     "called on trainer rank 0 after each bucket (any stage's) but the last is on "
                                     "its way (tracing; fault-injection tests); '' = none.")
    in_flight_hook: str = doc("", "Dotted path of fn(version: str, bucket: int, engine_urls: list[str]) -> None, "
                                  "called on trainer rank 0 once the engines have been asked for one of its buckets "
                                  "and before the bucket is sent (the disk transport: before the engines load the "
                                  "model, bucket 0) (fault-injection tests); '' = none.")
    bucket_timeout_s: float = doc(60.0, "A bucket's deadline, with its size at weight_sync.min_bandwidth_mib_s: a "
                                        "bucket not on every engine by then fails the sync, which is done again to "
                                        "the engines that answer (a backstop: a dead or frozen engine releases the "
                                        "sync as soon as the watchdog sees it).")
    min_bandwidth_mib_s: float = doc(32.0, "The slowest rate, in MiB/s, a bucket may travel and load at before its "
                                           "deadline passes (see weight_sync.bucket_timeout_s; docs/weight-sync.md).")


@dataclass(kw_only=True)
class EvalConfig:
    every: int = doc(0, "Evaluate the policy after every this many RL steps' weight sync, and after the last step "
                        "(0 = never); on the job's engines, never trained on.")
    data_path: str = doc("", "Held-out prompts (any format data.path takes, same prompt_key and label_key); the "
                             "metrics are named after the file: eval/<stem>/pass@1, pass@k, reward_mean.")
    more_data_paths: list[str] = doc([], "More evaluation sets, each reported under its own name.")
    samples_per_prompt: int = doc(4, "k of pass@k: samples per held-out prompt.")
    max_prompts: int = doc(0, "Evaluate on the first this many prompts of each set (0 = all).")
    pass_threshold: float = doc(1.0, "A sample passes when its reward is at least this.")


@dataclass(kw_only=True)
class RlConfig:
    num_steps: int = doc(30, "RL steps (rollout -> train -> sync) to run.")
    mode: Literal["sync", "one_step_off", "async"] = doc(
        "sync", "sync: each step's samples are generated by the weights of the step before (rollout, train, sync in "
                "turn). one_step_off: step N+1's samples are generated while step N trains, by the weights step N "
                "started from; the sync follows (every token one version stale). async: generation never stops "
                "(needs rollout.partial.mode retract); each step trains the first prompts_per_step groups that are "
                "ready, and the weights sync every rl.sync_every steps; rollout.partial.max_staleness bounds how "
                "old a trained token may be.")
    sync_every: int = doc(1, "async: sync the weights after every this many steps (and after the last, and before "
                             "each evaluation).")


@dataclass(kw_only=True)
class CheckpointConfig:
    save_every: int = doc(0, "Save <run dir>/checkpoints/step_<N>/ every this many RL steps and after the last step "
                             "(0 = never).")
    resume: str = doc("auto", "'auto' = continue from the newest complete checkpoint of the run if any, 'never' = "
                              "start fresh, or the path of a step_<N> checkpoint directory.")
    keep_last: int = doc(2, "Checkpoints of this run kept in the run directory; its older ones are deleted (0 = keep "
                            "all). Another run's checkpoints are never counted or deleted by it.")
    other_runs: Literal["refuse", "archive", "delete"] = doc(
        "refuse", "What a job that starts a new run (resume 'never', or 'auto' with no checkpoint of the run the "
                  "directory continues) does with checkpoints of another run found in its run directory: 'refuse' "
                  "stops it in one line; 'archive' moves them, and the directory's metrics.jsonl, to "
                  "archive/<their run id>/; 'delete' deletes them.")
    async_save: bool = doc(False, "Write a checkpoint's files in the background while the next step runs: the "
                                  "trainer returns once its state is copied to host memory (each rank its own "
                                  "shard), and the checkpoint is committed (renamed to step_<N>, older ones pruned) "
                                  "after the next step, or before a stop. A crash before that leaves the previous "
                                  "checkpoint the newest. The last step's save is written at once.")
    save_on_signal: bool = doc(True, "SIGTERM or SIGUSR1 (scancel, a Slurm time limit with --signal, preemption) "
                                     "lets the step finish, saves it and stops with exit code 75, which "
                                     "launch/train.sbatch answers with a requeue; false = stop at once.")
    signal_grace_s: float = doc(240.0, "With save_on_signal: seconds to wait for the step to end; past them the job "
                                       "stops where it is (resuming from its last checkpoint). Keep it under the "
                                       "warning time of sbatch --signal (launch/train.sbatch asks for 300 s).")


@dataclass(kw_only=True)
class RayConfig:
    num_cpus: int = doc(0, "CPUs given to a local Ray (0 = all); ignored when RAY_ADDRESS joins a cluster.")
    placement_timeout_s: float = doc(120.0, "Seconds to wait for the GPUs (or slots) of trainer ranks and engines.")
    cpus_per_slot: float = doc(0.01, "CPUs Ray reserves for each trainer rank and engine on a cluster without GPUs "
                                     "(a sliver by default: on a small machine their CPU use is not Ray's to "
                                     "schedule; on a CPU cluster, the cores each should own, so Ray spreads them).")


@dataclass(kw_only=True)
class PlacementConfig:
    colocate: bool = doc(False, "Trainer ranks and engines share the GPUs: GPU i holds trainer rank i and one "
                                "engine's rank (rollout.engine.num_engines x tensor_parallel must equal "
                                "parallel.num_trainer_ranks). They take turns: the engines release their memory "
                                "while the trainer trains, the trainer offloads to host memory while they generate, "
                                "and every step ends with a full weight sync (transport 'tensor' or 'disk'; needs "
                                "rl.mode sync and rollout.partial.mode off or abort).")


@dataclass(kw_only=True)
class PlanConfig:
    """What `slimish plan` cannot know from the config: the cluster and the workload. Defaults: H100 SXM nodes."""
    gpu_memory_gb: float = doc(80.0, "Memory per GPU (GB, 1e9 bytes) a trainer rank or an engine rank may use.")
    gpu_tflops: float = doc(989.0, "Dense bf16 peak per GPU, TFLOP/s (H100 SXM: 989).")
    mfu: float = doc(0.35, "Fraction of gpu_tflops the trainer achieves (model FLOPs utilisation).")
    nic_gbit_s: float = doc(400.0, "Network bandwidth per GPU, Gbit/s (weight sync: one link carries the model).")
    fs_write_gbyte_s: float = doc(10.0, "Shared filesystem write bandwidth of one writer, GB/s (disk transport).")
    fs_read_gbyte_s: float = doc(10.0, "Shared filesystem read bandwidth of one engine, GB/s (disk transport).")
    decode_tokens_per_s: float = doc(2500.0, "Tokens one engine generates per second at the configured concurrency.")
    request_tokens_per_s: float = doc(40.0, "Tokens one request decodes per second (the longest response's pace).")
    prompt_tokens: int = doc(512, "Typical prompt length in tokens.")
    mean_response_tokens: int = doc(0, "Mean response length in tokens; 0 = half of rollout.max_new_tokens.")
    reward_s_per_sample: float = doc(0.01, "Seconds the reward function takes per sample.")
    reward_workers: int = doc(1, "Reward calls that run at once.")


@dataclass(kw_only=True)
class JobConfig:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    sft: SftConfig = field(default_factory=SftConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    data: DataConfig = field(default_factory=DataConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    weight_sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    rl: RlConfig = field(default_factory=RlConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)
