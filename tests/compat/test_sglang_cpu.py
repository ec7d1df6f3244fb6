"""The environment of a CPU engine (`slimish.compat.sglang_cpu.server_env`)."""

from __future__ import annotations

import pytest

from slimish.compat import sglang_cpu


@pytest.mark.skipif(sglang_cpu.cuda_available(), reason="a CUDA machine: engines keep SGLang's crash diagnostics")
def test_a_cpu_engine_skips_the_crash_diagnostics_a_stop_would_wait_for():
    """SGLang sleeps 5 s before its crash diagnostics, which a stop triggers (the group's SIGTERM ends the scheduler
    first): on a CPU engine there is nothing to dump, so they are off, unless the user set them."""
    env = sglang_cpu.server_env({})
    assert env["SGLANG_PYSPY_DUMP_BEFORE_CRASH"] == "0" and env["SGLANG_CUDA_COREDUMP_BEFORE_CRASH"] == "0"
    assert sglang_cpu.server_env({"SGLANG_PYSPY_DUMP_BEFORE_CRASH": "1"})["SGLANG_PYSPY_DUMP_BEFORE_CRASH"] == "1"


def test_the_plugin_is_registered_where_sglang_looks_for_plugins():
    from importlib.metadata import entry_points

    assert "slimish.compat.sglang_plugin:register" in [ep.value for ep in entry_points(group="sglang.srt.plugins")]


@pytest.mark.skipif(sglang_cpu.cuda_available(), reason="a CUDA machine: the plugin changes nothing there")
@pytest.mark.parametrize("cpu_engine", [True, False])
def test_the_plugin_makes_a_cpu_engines_device_synchronisation_a_no_op(cpu_engine):
    """SGLang's /release_memory_occupation synchronises torch.cuda on a CPU engine, which raised there and took the
    server down; in a CPU engine's processes the plugin makes that call do nothing, elsewhere it changes nothing.
    (In a process of its own: the plugin changes torch where it runs.)"""
    import subprocess
    import sys

    code = ("import torch; from slimish.compat.sglang_plugin import register; register()\n"
            "try:\n    torch.cuda.synchronize(); print('no-op')\nexcept RuntimeError as exc:\n    print('raised')")
    env = sglang_cpu.server_env() if cpu_engine else {k: v for k, v in sglang_cpu.server_env().items()
                                                       if k != "SGLANG_USE_CPU_ENGINE"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == ("no-op" if cpu_engine else "raised"), out.stderr[-2000:]


@pytest.mark.skipif(sglang_cpu.cuda_available(), reason="a CUDA machine: the plugin changes nothing there")
def test_a_cpu_engines_server_forks_its_processes_and_skips_what_it_never_uses(tiny_models):
    """SGLang's server forces "spawn" for the processes it starts (`_set_envs_and_config`); in a CPU engine's server,
    which loads slimish's plugin, the processes it starts after that are forked instead (a spawned child imports
    SGLang again: an engine took twice as long to start here). Run as the server runs it, in a process of its own
    with an engine's environment (it changes SGLang and multiprocessing where it runs); fails loudly if SGLang moves
    that choice elsewhere. With SGLang's model registry imported as at every start, that process has imported
    neither FlashInfer, W&B nor Megatron-Core (hidden from engines: slimish/engines/engine_path,
    slimish/compat/cpu_engine_path), and the registry still has the models slimish serves. (One test: each of
    these facts needs SGLang imported in a fresh process, ~20 s.)"""
    import subprocess
    import sys

    from slimish.engines.server import engine_env

    code = ("import multiprocessing as mp, sys\n"
            "from sglang.srt.plugins import load_plugins\n"
            "load_plugins()\n"
            "import sglang.srt.entrypoints.engine as engine\n"
            "from sglang.srt.models.registry import ModelRegistry\n"
            "from sglang.srt.server_args import prepare_server_args\n"
            "args = prepare_server_args(['--model-path', sys.argv[1], '--device', 'cpu'])\n"
            "args.resolve_once()\n"
            "engine._set_envs_and_config(args)\n"
            "print(sorted(m for m in ('flashinfer', 'wandb', 'megatron') if m in sys.modules))\n"
            "print(all(a in ModelRegistry.models for a in ('Qwen3ForCausalLM', 'Qwen3MoeForCausalLM', "
            "'DeepseekV3ForCausalLM', 'Glm4MoeForCausalLM')))\n"
            "print(mp.get_start_method())")
    out = subprocess.run([sys.executable, "-c", code, str(tiny_models["qwen3"])], env=engine_env(),
                         capture_output=True, text=True, timeout=300)
    assert out.stdout.strip().splitlines()[-3:] == ["[]", "True", "fork"], out.stdout[-500:] + out.stderr[-2000:]


def test_a_colocated_gpu_engine_asks_for_sglangs_memory_saver():
    """Colocated on a GPU, the engine's release frees memory only with SGLang's memory saver: the flag, as SGLang's
    own parser reads it; on the CPU (where the saver cannot start) it is left out."""
    import argparse

    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    gpu = sglang_cpu.server_args(device="cuda", dtype="bfloat16", colocated=True)
    assert parser.parse_args(["--model-path", "m", *gpu]).enable_memory_saver
    assert not parser.parse_args(["--model-path", "m", *sglang_cpu.server_args(device="cuda", dtype="bfloat16")]
                                 ).enable_memory_saver
    assert "--enable-memory-saver" not in sglang_cpu.server_args(device="cpu", dtype="float32", colocated=True)


@pytest.mark.skipif(sglang_cpu.cuda_available(), reason="a CUDA machine: tensor-parallel engines need none of it")
def test_a_tensor_parallel_cpu_engine_gets_what_sglang_needs_to_start():
    """One core group per rank (SGLang otherwise asserts a NUMA node per rank), PyNccl pointed at no library (it
    would build a CUDA communicator on the CPU group), threads per rank no more than its cores, and no custom
    all-reduce, as SGLang's own parser reads the flags; none of it for one rank, and a user's own choice stands."""
    import argparse

    from sglang.srt.server_args import ServerArgs

    env = sglang_cpu.server_env({}, tp=2)
    groups = env["SGLANG_CPU_OMP_THREADS_BIND"].split("|")
    assert len(groups) == 2 and all(groups)
    assert env["SGLANG_NCCL_SO_PATH"].startswith("/nonexistent/") and int(env["OMP_NUM_THREADS"]) >= 1
    assert "SGLANG_CPU_OMP_THREADS_BIND" not in sglang_cpu.server_env({}, tp=1)
    # One node part of a TP2 engine over two nodes runs one rank (SGLang indexes the groups by the node's own ranks),
    # yet its group of two still must not build PyNccl.
    part = sglang_cpu.server_env({}, tp=2, nnodes=2)
    assert "|" not in part["SGLANG_CPU_OMP_THREADS_BIND"] and part["SGLANG_NCCL_SO_PATH"].startswith("/nonexistent/")
    assert sglang_cpu.server_env({"SGLANG_CPU_OMP_THREADS_BIND": "0-3|4-7"}, tp=2)["SGLANG_CPU_OMP_THREADS_BIND"] \
        == "0-3|4-7"
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = parser.parse_args(["--model-path", "m", *sglang_cpu.server_args(device="cpu", dtype="float32", tp=2)])
    assert args.disable_custom_all_reduce
    assert "--disable-custom-all-reduce" not in sglang_cpu.server_args(device="cpu", dtype="float32")


@pytest.mark.parametrize(("cores", "ranks", "groups"), [
    ([0, 1], 2, [[0], [1]]), ([0, 1, 2, 3, 4], 2, [[0, 1, 2], [3, 4]]), ([0, 1], 4, [[0], [1], [0], [1]])])
def test_cores_are_dealt_to_the_ranks_in_consecutive_groups(cores, ranks, groups):
    assert sglang_cpu.core_groups(cores, ranks) == groups
