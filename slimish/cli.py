"""`slimish` command line.

  slimish train --config CONFIG [key.sub=value ...]     run an RL job
  slimish check-config CONFIG [key.sub=value ...]       validate a config without starting anything
  slimish make-tiny --out DIR [--family qwen3]          build the tiny CPU model, tokenizer and task data
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _load(config: str | None, overrides: list[str]):
    from slimish.config import ConfigError, load_config

    try:
        return load_config(config, overrides)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    except FileNotFoundError as exc:
        print(f"error: config file not found: {exc.filename}", file=sys.stderr)
        raise SystemExit(2) from None


def cmd_train(args) -> int:
    cfg = _load(args.config, args.overrides)
    from slimish.orchestration.driver import train

    run_dir = train(cfg)
    print(f"done: {run_dir}")
    return 0


def cmd_check_config(args) -> int:
    cfg = _load(args.config, args.overrides)
    print(f"ok: {args.config} (run.name={cfg.run.name}, {cfg.rl.num_steps} steps)")
    return 0


def cmd_make_tiny(args) -> int:
    from slimish.tasks import echo_digit
    from slimish.tasks.tiny_model import build_tiny_model

    out = Path(args.out)
    model_dir = build_tiny_model(out / "model", corpus=echo_digit.corpus(), family=args.family, seed=args.seed)
    paths = echo_digit.write_datasets(out, seed=args.seed)
    print(f"model: {model_dir}\ntrain prompts: {paths['train']}\nsft data: {paths['sft']}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="slimish", description="RL post-training on Megatron-Core + SGLang")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("train", help="run an RL job")
    p.add_argument("--config", required=True, help="YAML config file")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. rollout.samples_per_prompt=8")
    p.set_defaults(fn=cmd_train)
    p = sub.add_parser("check-config", help="validate a config and exit (0 when valid)")
    p.add_argument("config", help="YAML config file")
    p.add_argument("overrides", nargs="*", help="dotted overrides")
    p.set_defaults(fn=cmd_check_config)
    p = sub.add_parser("make-tiny", help="build the tiny CPU model + task data (nothing is downloaded)")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--family", default="qwen3", choices=["qwen3", "qwen2", "llama"])
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(fn=cmd_make_tiny)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
