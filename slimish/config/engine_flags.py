"""The SGLang serving options a job sets by config key (`rollout.engine.*`), as `sglang.launch_server` arguments.

One table maps each key to its flags, so that the argv, the check that `extra_args` does not set a flag a key owns,
and the test that passes every recipe's argv through SGLang's own parser (tests/config/test_engine_flags.py) read
the same thing. A key at its default adds nothing: SGLang's own default then stands. (Here, in the config layer,
because validation reads the table too; `slimish.engines.server` puts `serving_args` on the command line.)
"""

from __future__ import annotations

from dataclasses import fields

from slimish.config.schema import EngineConfig

# key -> the flags it sets (SGLang 0.5.23's spelling); a bool key sets each of its flags to "disabled" when false.
FLAGS: dict[str, tuple[str, ...]] = {
    "expert_parallel": ("--ep-size",),
    "attention_data_parallel": ("--attn-dp-size",),
    "moe_a2a_backend": ("--moe-a2a-backend",),
    "mem_fraction_static": ("--mem-fraction-static",),
    "cuda_graphs": ("--cuda-graph-backend-decode", "--cuda-graph-backend-prefill"),
    "cuda_graph_max_bs": ("--cuda-graph-max-bs-decode",),
}
# Other flags of SGLang 0.5.23 for the same options (an `extra_args` entry may use any).
ALIASES: dict[str, tuple[str, ...]] = {
    "expert_parallel": ("--expert-parallel-size", "--ep"),
    "attention_data_parallel": ("--attention-data-parallel-size", "--enable-dp-attention"),
    "cuda_graphs": ("--disable-cuda-graph", "--disable-decode-cuda-graph", "--disable-prefill-cuda-graph"),
}
# --moe-a2a-backend's choices in SGLang 0.5.23 (pinned against its parser in tests/config/test_engine_flags.py).
A2A_BACKENDS = ("none", "deepep", "mooncake", "nixl", "mori", "ascend_fuseep", "flashinfer", "megamoe", "deepep_v2",
                "pplx", "ascend_tp", "flashinfer_megamoe")
_DEFAULTS = {f.name: f.default for f in fields(EngineConfig) if f.name in FLAGS}
# The weight loaders of the sharded syncs (slimish.weight_sync.engine_loader), registered in every
# engine the job starts: a request of `/update_weights_from_tensor` may name one as its load_format only if the engine
# lists it.
SHARD_LOADER = "slimish.weight_sync.engine_loader.load_shard_files"
SHARD_RECEIVER = "slimish.weight_sync.engine_loader.receive_shard"
SHARD_DIRECT = "slimish.weight_sync.engine_loader.load_by_name"  # the tensor transport's, for MLA


def loader_args() -> list[str]:
    """The flags that register slimish's weight loaders in an engine it starts."""
    return ["--custom-weight-loader", SHARD_LOADER, SHARD_RECEIVER, SHARD_DIRECT]


def serving_args(engine: EngineConfig) -> list[str]:
    """The flags of the keys not at their defaults, in FLAGS order."""
    argv: list[str] = []
    for key, flags in FLAGS.items():
        value = getattr(engine, key)
        if value == _DEFAULTS[key]:
            continue
        for flag in flags:
            argv += [flag, "disabled" if value is False else str(value)]
    return argv


def flags_set_twice(engine: EngineConfig) -> list[tuple[str, str]]:
    """(key, flag) for every flag in `extra_args` that a key owns (whatever the key's value)."""
    given = {str(arg).split("=", 1)[0] for arg in engine.extra_args if str(arg).startswith("-")}
    return [(key, flag) for key, flags in FLAGS.items() for flag in (*flags, *ALIASES.get(key, ())) if flag in given]


# Flags `extra_args` may not carry: the job sets the address and ports itself (and checks who listens there), and a
# key on the command line is readable by every local user in /proc (the job passes its key in a 0600 file).
JOB_OWNED = {
    "--host": "the job binds each engine to its node's address (a listener on all interfaces would open the engine "
              "to the network)",
    "--port": "the job picks each engine's port (rollout.engine.base_port)",
    "--api-key": "a key on the command line is readable by every local user; the job gives the engines its own key",
    "--admin-api-key": "a key on the command line is readable by every local user",
    "--dist-init-addr": "the job hosts each engine's rendezvous",
    "--nccl-port": "the job hosts each engine's rendezvous",
    "--model-path": "set model.hf_path",
    "--tp-size": "set rollout.engine.tensor_parallel",
    "--tensor-parallel-size": "set rollout.engine.tensor_parallel",
}


def extra_args_problem(extra_args: list) -> str | None:
    """What is wrong with `rollout.engine.extra_args`, as SGLang's own parser (`ServerArgs.add_cli_args`) and
    JOB_OWNED see it; None if nothing. Imports SGLang (seconds): call it only for a non-empty list."""
    import argparse

    from sglang.srt.server_args import ServerArgs

    args = [str(a) for a in extra_args]
    for arg in args:
        flag = arg.split("=", 1)[0]
        if flag in JOB_OWNED:
            return f"sets {flag}: {JOB_OWNED[flag]}"
    parser = argparse.ArgumentParser(exit_on_error=False, add_help=False)
    ServerArgs.add_cli_args(parser)
    try:
        _, unknown = parser.parse_known_args(["--model-path", "m", *args])
    except argparse.ArgumentError as exc:
        return f"SGLang's parser refuses them: {exc}"
    if unknown:
        return f"SGLang {_sglang_version()} has no option {unknown[0]!r}"
    return None


def _sglang_version() -> str:
    from importlib.metadata import version

    return version("sglang")
