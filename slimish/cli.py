"""`slimish` command line.

  slimish train CONFIG [key.sub=value ...]              run an RL job (`--config CONFIG` works too)
  slimish check-config CONFIG [key.sub=value ...]       validate a config without starting anything
  slimish plan CONFIG [--model PATH|NAME] [key=value ...]  memory per GPU, seconds per wall, the binding wall
  slimish check-gpu                                     whether this node can use CUDA, or why not (one line)
  slimish config [SECTION] [--markdown]                 every config key: type, default, meaning
  slimish report RUN_DIR                                a run's metrics as plots (report/report.html, PNGs)
  slimish make-tiny --out DIR [--family F] [--task T]   build the tiny CPU model, tokenizer and task data
  slimish convert hf-to-megatron --hf DIR --out DIR [--tp N --pp N --ep N --workers N]
  slimish convert megatron-to-hf --megatron DIR --hf-config DIR --out DIR [--max-shard-mb MB]
      (both: [--transformers-shape-check], transformers' model of config.json as the shapes' reference)
  slimish convert dequantize --hf DIR --out DIR [--max-shard-mb MB]   FP8 (DeepSeek-V3's release) -> bf16 HF

Bad input (a config key, a missing or corrupt file, an unwritable directory, a checkpoint of another model) is
reported as one line, `error: <what is wrong and what to do>`, with exit status 2: every such error is a
`slimish.errors.UserError`, raised here or wherever it is found (also inside a Ray actor).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

from slimish.errors import UserError, find_user_error


def _load(config: str | None, overrides: list[str]):
    """The config as `train` and `check-config` read it: the hooks imported in a process of their own."""
    from slimish.config import load_config

    try:
        return load_config(config, overrides, isolate_hooks=True)
    except FileNotFoundError as exc:
        raise UserError(f"config file not found: {exc.filename}") from None


def _config_argument(args) -> None:
    """`train` takes its config positionally like the other commands, or as --config (kept for old scripts)."""
    if args.config_flag and args.config:
        args.overrides.insert(0, args.config)  # with --config, every positional is an override
    args.config = args.config_flag or args.config
    if not args.config:
        raise UserError("no config file: pass it as the first argument, e.g. slimish train "
                        "configs/quickstart_cpu.yaml")
    if "=" in args.config:
        raise UserError(f"the first argument {args.config!r} looks like an override: pass the config file first, "
                        "e.g. slimish train configs/quickstart_cpu.yaml rollout.samples_per_prompt=8")


def _job_output(progress_bar: bool):
    """How a job's lines reach the terminal: printed, or, under a rollout progress bar, printed around it."""
    if progress_bar:
        from ray.experimental.tqdm_ray import safe_print

        return lambda line: safe_print(line, flush=True)
    return lambda line: print(line, flush=True)


def cmd_train(args) -> int:
    _config_argument(args)
    cfg = _load(args.config, args.overrides)
    from slimish import log
    from slimish.orchestration.driver import train
    from slimish.orchestration.graceful_stop import REQUEUE_EXIT, StoppedOnSignal, stopping_signal

    log.setup(cfg.run.log_level)
    # Everything the job writes (the run directory's checkpoints, rollouts, logs) is its user's only; the local Ray
    # that ray.init starts here, and so every actor, inherits this (under Slurm launch/ray_node.sh sets it too).
    os.umask(0o077)
    # One rollout bar on a terminal; none when the output goes to a file or a pipe (as under sbatch or tee), where
    # each redraw of a bar would be a line of its own among the step lines.
    progress_bar = sys.stdout.isatty()
    try:
        run_dir = train(cfg, report=_job_output(progress_bar), progress_bar=progress_bar)
    except StoppedOnSignal as exc:  # SIGTERM / SIGUSR1 at a safe point: saved; exit code 75 asks for a requeue
        print(str(exc), file=sys.stderr)
        return REQUEUE_EXIT
    except KeyboardInterrupt as exc:  # Ctrl-C or SIGTERM, after the job stopped everything it started
        signum = int(stopping_signal(exc))
        print(f"stopped by signal {signum}; everything the job started is stopped (checkpoint.resume continues it "
              "from its last checkpoint)", file=sys.stderr)
        return 128 + signum  # the shell's exit code for a death by that signal
    print(f"done: {run_dir}")
    return 0


def cmd_check_config(args) -> int:
    cfg = _load(args.config, args.overrides)
    print(f"ok: {args.config} (run.name={cfg.run.name}, {cfg.rl.num_steps} steps)")
    return 0


def cmd_plan(args) -> int:
    from slimish.config import load_config
    from slimish.megatron_bridge.hf_config import read_hf_config
    from slimish.planning.report import plan_text

    overrides = [*args.overrides, f"model.hf_path={args.model}"] if args.model else args.overrides
    try:
        cfg = load_config(args.config, overrides, files=False)
    except FileNotFoundError as exc:
        raise UserError(f"config file not found: {exc.filename}") from None
    print(plan_text(cfg, read_hf_config(cfg.model.hf_path)))
    return 0


def cmd_check_gpu(args) -> int:
    """Whether this node can run the GPU stack, in one line (exit status 1 if not)."""
    from slimish import cuda_facts

    facts = cuda_facts.collect()
    if facts.device_count:
        print(f"cuda ok on {facts.node}: {facts.device_count} GPU(s), torch {facts.torch_version} (CUDA "
              f"{facts.torch_cuda}), NVIDIA driver {facts.driver_version} (CUDA up to {facts.driver_cuda})")
        return 0
    print(f"cuda unusable on {facts.node}: {cuda_facts.cause(facts)}")
    return 1


def cmd_config(args) -> int:
    from slimish.config import reference

    if args.section is not None and args.section not in reference.sections():
        raise UserError(f"no config section {args.section!r}; sections: {', '.join(reference.sections())}")
    print(reference.markdown() if args.markdown else reference.text(args.section), end="\n" * (not args.markdown))
    return 0


def cmd_report(args) -> int:
    from slimish.reporting.page import write_report

    try:
        page = write_report(args.run_dir)
    except (FileNotFoundError, ValueError) as exc:
        raise UserError(str(exc)) from None
    print(f"report: {page}")
    return 0


def cmd_make_tiny(args) -> int:
    import importlib

    from slimish.tasks.tiny_model import SIZES, build_tiny_model

    _output_dir(args.out, "--out")
    task = importlib.import_module(f"slimish.tasks.{args.task}")
    out = Path(args.out)
    model_dir = build_tiny_model(out / "model", corpus=task.corpus(), family=args.family, seed=args.seed,
                                 **SIZES[args.size])
    paths = task.write_datasets(out, seed=args.seed)
    print(f"model: {model_dir}\ntrain prompts: {paths['train']}\nsft data: {paths['sft']}\n"
          f"held-out prompts: {paths['eval']}")
    return 0


def _input_dir(path: str, flag: str, *, holds: str, what: str) -> None:
    if not (Path(path) / holds).is_file():
        where = "does not exist" if not Path(path).exists() else f"has no {holds}"
        raise UserError(f"{flag} {path}: {where}; pass {what}")


def _output_dir(path: str, flag: str) -> None:
    """Prove now, before any work is done, that `path` can be written: the directory itself or, if it does not exist
    yet, its nearest existing parent (nothing is created; root ignores permission bits, so a file is written and
    removed rather than os.access asked)."""
    existing = Path(path).absolute()
    while not existing.exists():
        existing = existing.parent
    try:
        if not existing.is_dir():
            raise NotADirectoryError(20, f"{existing} is a file")
        tempfile.TemporaryFile(dir=existing).close()
    except OSError as exc:
        raise UserError(f"{flag} {path}: cannot write there ({exc.strerror or exc}); choose a writable "
                        "directory") from None


def cmd_convert(args) -> int:
    from slimish.megatron_bridge import convert

    if args.direction == "hf-to-megatron":
        _input_dir(args.hf, "--hf", holds="config.json", what="a Hugging Face model directory (config.json + "
                   "safetensors)")
        _output_dir(args.out, "--out")
        if args.workers is not None and args.workers < 1:
            raise UserError(f"--workers {args.workers}: give at least 1 (the writer threads)")
        out = convert.hf_to_megatron(hf_dir=args.hf, out_dir=args.out, tensor_parallel=args.tp,
                                     pipeline_parallel=args.pp, expert_parallel=args.ep, workers=args.workers,
                                     transformers_shape_check=args.transformers_shape_check)
    elif args.direction == "dequantize":
        _input_dir(args.hf, "--hf", holds="config.json", what="a block-scaled FP8 Hugging Face model directory")
        _output_dir(args.out, "--out")
        convert.dequantize_hf(hf_dir=args.hf, out_dir=args.out, max_shard_bytes=args.max_shard_mb << 20)
        out = args.out
    else:
        _input_dir(args.megatron, "--megatron", holds="metadata.json", what="a Megatron distributed checkpoint "
                   "(from `slimish convert hf-to-megatron`)")
        _input_dir(args.hf_config, "--hf-config", holds="config.json", what="the Hugging Face directory of the "
                   "converted model (config.json + tokenizer files)")
        _output_dir(args.out, "--out")
        convert.megatron_to_hf(megatron_dir=args.megatron, hf_config_dir=args.hf_config, out_dir=args.out,
                               max_shard_bytes=args.max_shard_mb << 20,
                               transformers_shape_check=args.transformers_shape_check)
        out = args.out
    print(f"wrote {out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="slimish", description="RL post-training on Megatron-Core + SGLang")
    parser.add_argument("--version", action="version", version=f"slimish {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("train", help="run an RL job")
    p.add_argument("config", nargs="?", help="YAML config file")
    p.add_argument("--config", dest="config_flag", metavar="CONFIG", help="the same, as an option")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. rollout.samples_per_prompt=8")
    p.set_defaults(fn=cmd_train)
    p = sub.add_parser("config", help="list the config keys with their types, defaults and meaning")
    p.add_argument("section", nargs="?", help="one top-level section (run, model, trainer, rollout, ...)")
    p.add_argument("--markdown", action="store_true", help="the whole reference as Markdown (docs/config.md)")
    p.set_defaults(fn=cmd_config)
    p = sub.add_parser("check-config", help="validate a config and exit (0 when valid)")
    p.add_argument("config", help="YAML config file")
    p.add_argument("overrides", nargs="*", help="dotted overrides")
    p.set_defaults(fn=cmd_check_config)
    p = sub.add_parser("check-gpu", help="whether this node can use CUDA, or why not, in one line (exit 1 if not)")
    p.set_defaults(fn=cmd_check_gpu)
    p = sub.add_parser("plan", help="memory per GPU, weight-sync time and the binding wall of a config "
                                     "(config.json of the model only: no GPU, no weights)")
    p.add_argument("config", help="YAML config file")
    p.add_argument("overrides", nargs="*", help="dotted overrides (plan.* states the cluster and workload)")
    p.add_argument("--model", metavar="PATH|NAME", help="the model to plan for instead of model.hf_path: its "
                   "directory, its config.json alone, or a known model by name (planned before the download): "
                   "llama-3.1-405b, qwen3-8b, qwen3-30b-a3b, qwen3-235b-a22b, deepseek-v3, glm-4.5")
    p.set_defaults(fn=cmd_plan)
    p = sub.add_parser("report", help="a run's metrics as plots: RUN_DIR/report/report.html (self-contained) and PNGs")
    p.add_argument("run_dir", help="the run directory (runs/<run.name>)")
    p.set_defaults(fn=cmd_report)
    p = sub.add_parser("make-tiny", help="build the tiny CPU model + task data (nothing is downloaded)")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--family", default="qwen3", choices=["qwen3", "qwen2", "llama", "qwen3_moe", "glm4_moe",
                                                         "deepseek_v3"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--task", default="echo_digit", choices=["echo_digit", "calculator"],
                   help="the task's tokenizer corpus and data: the quickstart's, or the tool-use one")
    p.add_argument("--size", default="tiny", choices=["tiny", "100m"],
                   help="tiny: 115k parameters (CPU jobs); 100m: a 105M-parameter Qwen3-shaped model (dense families)")
    p.set_defaults(fn=cmd_make_tiny)
    p = sub.add_parser("convert", help="convert checkpoints between HF safetensors and Megatron-Core (torch_dist)")
    directions = p.add_subparsers(dest="direction", required=True)
    d = directions.add_parser("hf-to-megatron", help="HF safetensors -> Megatron-Core distributed checkpoint")
    d.add_argument("--hf", required=True, help="HF model directory (config.json + safetensors)")
    d.add_argument("--out", required=True, help="output directory for the distributed checkpoint")
    d.add_argument("--tp", type=int, default=1, help="check the model splits over this tensor-parallel size, and "
                   "cut the stored chunks at its slices: a job at this TP (or a divisor of it) reads only its slices")
    d.add_argument("--pp", type=int, default=1, help="check the model splits over this pipeline-parallel size")
    d.add_argument("--ep", type=int, default=1, help="check the experts split over this expert-parallel size")
    d.add_argument("--workers", type=int, help="threads reading, converting and writing in parallel, each to a file "
                   "of its own (default: the usable cores, at most 8)")
    d.add_argument("--transformers-shape-check", action="store_true",
                   help="check the weights' shapes against transformers' model of config.json (seconds: it imports "
                   "transformers) instead of the shapes slimish works out from config.json for the families it knows")
    d = directions.add_parser("megatron-to-hf", help="Megatron-Core distributed checkpoint -> HF safetensors")
    d.add_argument("--megatron", required=True, help="distributed checkpoint directory")
    d.add_argument("--hf-config", required=True, help="HF directory with config.json and tokenizer files")
    d.add_argument("--out", required=True, help="output HF directory")
    d.add_argument("--max-shard-mb", type=int, default=2048, help="largest safetensors shard (MiB)")
    d.add_argument("--transformers-shape-check", action="store_true",
                   help="check the weights' shapes against transformers' model of config.json (seconds: it imports "
                   "transformers) instead of the shapes slimish works out from config.json for the families it knows")
    d = directions.add_parser("dequantize", help="block-scaled FP8 HF checkpoint (DeepSeek-V3's release) -> bf16 HF")
    d.add_argument("--hf", required=True, help="FP8 HF model directory (config.json + safetensors)")
    d.add_argument("--out", required=True, help="output HF directory (bf16)")
    d.add_argument("--max-shard-mb", type=int, default=4096, help="largest safetensors shard (MiB)")
    p.set_defaults(fn=cmd_convert)
    return parser


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("slimish")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and not (args.command == "plan" and all("=" in e and not e.startswith("-") for e in extra)):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if extra:  # overrides after `plan ... --model X`: argparse ends the positionals at the option
        args.overrides += extra
    try:
        return args.fn(args)
    except Exception as exc:
        error = find_user_error(exc)
        if error is None:
            raise  # a bug in slimish: keep the traceback
        print(f"error: {' '.join(str(error).split())}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
