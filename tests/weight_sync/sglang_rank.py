"""SGLang's own model and loader, as one tensor-parallel rank of an engine holds them, built in this process
without an engine: what `/weights_checker` would report for that rank, from the weights of an HF checkpoint.

It takes the server's path (the same argument parsing, the rank placement `run_scheduler_process` publishes, the CPU
engine's `adjust_config_with_unaligned_cpu_tp`, the same model loader and so every parameter's `weight_loader`);
the stand-in is only at the process groups, which a weight load never communicates over: objects with a group's
placement (ranks, rank in group), laid out as `parallel_state.initialize_model_parallel` lays them out for one
pipeline stage (as SGLang's own tests do in sglang/test/parallel_groups.py).

Run as a script (SGLang leaves environment variables and logging set behind it; keep it out of the test process):
    python -m tests.weight_sync.sglang_rank CASES_JSON  ->  one JSON list on stdout, per case
        {"checksums": {name: checksum}, "server_info": the server's resolved arguments, as /server_info gives them}
where each case is {"model": path, "tp": size, "rank": r, "args": [extra server args], "cpu_padding": bool,
"direct": optional path}: `direct`, a `torch.save`d list of (engine parameter, tensor) that is then loaded into the
built rank as a sync with `load_format="direct"` does (`load_direct`), before the checksums are taken, or with
"loader": "by_name", as slimish's engine-side `load_by_name` does (the copy, then the model's post-processing); each
result also has "derived": the checksums of MLA's `w_kc` / `w_vc` buffers, which SGLang derives after loading;
`cpu_padding` False leaves out the CPU engine's padding, and answers the models' one question to the device while
they are built, whether shared experts may be fused, as an NVIDIA GPU of compute capability 9.0 (an H100) would
(`as_on_nvidia`): the sharding of GPU engines.
"""

from __future__ import annotations

import json
import os
import sys
from types import SimpleNamespace

os.environ["SGLANG_USE_CPU_ENGINE"] = "1"  # read when SGLang is imported
os.environ["HF_HUB_OFFLINE"] = "1"


def _group(name: str, ranks, rank: int) -> SimpleNamespace:
    ranks = list(ranks)
    i = ranks.index(rank)
    return SimpleNamespace(unique_name=name, ranks=ranks, rank=rank, rank_in_group=i, world_size=len(ranks),
                           local_rank=rank, first_rank=ranks[0], last_rank=ranks[-1], is_first_rank=i == 0,
                           is_last_rank=i == len(ranks) - 1, next_rank=ranks[(i + 1) % len(ranks)],
                           prev_rank=ranks[(i - 1) % len(ranks)], device_group=None, cpu_group=None,
                           use_pynccl=False, pynccl_comm=None, ca_comm=None)


def _stamp_groups(rank: int) -> None:
    """The groups of `rank` with initialize_model_parallel's layout and aliasing (one pipeline stage)."""
    from sglang.srt.runtime_context import get_parallel

    p = get_parallel()
    n = p.tp_size
    a_tp, a_cp, m_ep, m_dp, m_tp = p.attn_tp_size, p.attn_cp_size, p.moe_ep_size, p.moe_dp_size, p.moe_tp_size

    def strided(size: int, stride: int, start: int) -> range:
        return range(start, start + size * stride, stride)

    tp = _group("tp", range(n), rank)
    attn_tp = tp if a_tp == n else _group("attention_tp", strided(a_tp, 1, rank - rank % a_tp), rank)
    attn_cp = tp if a_cp == n else _group(
        "attn_cp", strided(a_cp, a_tp, rank // (a_tp * a_cp) * (a_tp * a_cp) + rank % a_tp), rank)
    moe_dp = attn_cp if a_cp > m_dp else tp if m_dp == n else _group(
        "moe_dp", strided(m_dp, m_tp * m_ep, rank % (m_tp * m_ep)), rank)
    moe_ep = tp if m_ep == n else _group(
        "moe_ep", strided(m_ep, m_tp, rank // (m_ep * m_tp) * (m_ep * m_tp) + rank % m_tp), rank)
    moe_tp = tp if m_tp == n else _group("moe_tp", strided(m_tp, 1, rank - rank % m_tp), rank)
    p.override_permanently(world_group=_group("world", range(n), rank), tp_group=tp, attn_tp_group=attn_tp,
                           attn_cp_group=attn_cp, moe_dp_group=moe_dp, moe_ep_group=moe_ep, moe_tp_group=moe_tp,
                           pp_group=_group("pp", [rank], rank))


def as_on_nvidia(capability: tuple[int, int] = (9, 0)) -> None:
    """The stand-in at the device boundary for GPU rules: DeepSeek-V3's and GLM-4.5's shared-experts fusion decision
    (`shared_experts_fusion_disable_reason`, asked once before the model is built) sees an NVIDIA GPU of
    `capability`; everything else still runs on the CPU."""
    import torch
    from sglang.srt.models import deepseek_v2, glm4_moe

    for module, model_class in ((deepseek_v2, deepseek_v2.DeepseekV2ForCausalLM),
                                (glm4_moe, glm4_moe.Glm4MoeForCausalLM)):
        decide = model_class.shared_experts_fusion_disable_reason.__func__

        def on_nvidia(cls, hf_config, quant_config, decide=decide, module=module):
            saved = module._is_cuda, torch.cuda.get_device_capability
            module._is_cuda, torch.cuda.get_device_capability = True, lambda *_: capability
            try:
                return decide(cls, hf_config, quant_config)
            finally:
                module._is_cuda, torch.cuda.get_device_capability = saved

        model_class.shared_experts_fusion_disable_reason = classmethod(on_nvidia)


def build_rank(model: str, *, tp: int, rank: int, args=(), cpu_padding: bool = True):
    """(The model as rank `rank` of an engine of `tp` ranks holds it once loaded from `model`, the server's resolved
    arguments: what its /server_info reports of them)."""
    from sglang.srt.configs.device_config import DeviceConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.configs.update_config import adjust_config_with_unaligned_cpu_tp
    from sglang.srt.model_executor.model_runner_components.load_model_utils import build_load_config
    from sglang.srt.model_loader import get_model_loader
    from sglang.srt.runtime_context import SpawnRanks, get_model, publish, reset_context
    from sglang.srt.server_args import prepare_server_args

    from slimish.compat.sglang_cpu import server_args as cpu_args

    reset_context()  # the previous build's ranks and groups
    server_args = prepare_server_args(["--model-path", model, "--tp-size", str(tp), "--max-total-tokens", "4096",
                                       *cpu_args(device="cpu", dtype="float32", tp=tp), *args])
    publish(server_args, role="scheduler", ranks=SpawnRanks(world_rank=rank, dp_rank=None, gpu_id=0))
    _stamp_groups(rank)
    model_config = ModelConfig.from_server_args(server_args)
    load_config = build_load_config(
        server_args=server_args, tp_rank=rank, remote_instance_weight_transporter_engine=None,
        remote_instance_weight_transporter_session_id="", draft_model_idx=None,
        weight_cache_mode=get_model().weight_cache_mode, weight_cache_socket=None)
    if cpu_padding:  # what ModelRunner.load_model does on a CPU engine
        model_config = adjust_config_with_unaligned_cpu_tp(model_config, load_config, tp)
    loader = get_model_loader(load_config=load_config, model_config=model_config)
    model = loader.load_model(model_config=model_config, device_config=DeviceConfig("cpu", 0))
    return model, server_args.resolved_dict()


def load_direct(model, named_tensors, loader: str = "direct") -> None:
    """What one engine rank does with a weight update of `load_format="direct"` inside /begin_weight_update ...
    /end_weight_update (SGLang's WeightUpdater: restore packed weights, copy each tensor into the parameter of its
    name, shape checked, then re-process the weights; no post_load_weights, since weights were loaded)."""
    import torch
    from sglang.srt.model_executor.model_runner_components.weight_updater import _model_load_weights_direct
    from sglang.srt.model_loader.loader import DefaultModelLoader

    from slimish.weight_sync.engine_loader import load_by_name

    DefaultModelLoader.restore_weights_before_loading(model, torch.device("cpu"))
    (load_by_name if loader == "by_name" else _model_load_weights_direct)(model, named_tensors)
    DefaultModelLoader.postprocess_weights(model, torch.device("cpu"))


def derived(model) -> dict[str, str]:
    """The checksums of every MLA layer's `w_kc` / `w_vc` (buffers SGLang derives from kv_b_proj, not parameters)."""
    import torch

    from slimish.weight_sync.checksums import tensor_checksum

    return {f"{name}.{attr}": tensor_checksum(getattr(module, attr))
            for name, module in model.named_modules() for attr in ("w_kc", "w_vc")
            if isinstance(getattr(module, attr, None), torch.Tensor)}


def checksums(model) -> dict[str, str]:
    """What `/weights_checker` {"action": "checksum"} reports for this rank."""
    from sglang.srt.utils.weight_checker import WeightChecker

    return WeightChecker(get_model=lambda: model).handle("checksum", role="target")["checksums"]


def main(cases: list[dict]) -> list[dict]:
    from slimish.compat.cuda_driver_stub import preload_if_needed

    preload_if_needed()  # the CUDA sgl_kernel wheel links libcuda
    # CPU cases first: the stand-in, once set, stays for the rest of the process.
    order = sorted(range(len(cases)), key=lambda i: not cases[i].get("cpu_padding", True))
    result: list[dict] = [{} for _ in cases]
    on_nvidia = False
    for i in order:
        case = cases[i]
        if not case.get("cpu_padding", True) and not on_nvidia:
            as_on_nvidia()
            on_nvidia = True
        model, info = build_rank(case["model"], tp=case["tp"], rank=case["rank"], args=case.get("args", ()),
                                 cpu_padding=case.get("cpu_padding", True))
        if case.get("direct"):
            import torch

            load_direct(model, torch.load(case["direct"]), case.get("loader", "direct"))
        result[i] = {"checksums": checksums(model), "derived": derived(model),
                     "server_info": json.loads(json.dumps(info, default=str))}
    return result


if __name__ == "__main__":
    result = main(json.loads(sys.argv[1]))
    sys.stdout.flush()
    print("\n" + json.dumps(result))
