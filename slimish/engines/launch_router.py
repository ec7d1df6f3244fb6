"""`python -m slimish.engines.launch_router ROUTER_ARGS`: sglang_router's Rust router, started as its own launcher
starts it (`sglang_router.launch_router`: the same arguments, parsed by `RouterArgs`, validated, then
`Router.from_args(...).start()`), with two differences:

- the API key comes from the environment (`SLIMISH_ROUTER_API_KEY`) instead of the command line, which every local
  user can read in /proc;
- sglang_router's launcher module is not imported: it imports its Python debugging load balancer (`mini_lb`,
  which slimish never selects), and that imports all of SGLang, torch and transformers: 9-11 s of a router's start
  on a busy 2-core machine, against 0.1 s for the router and its arguments alone. A job waits for its router
  before its first step.
"""

from __future__ import annotations

import argparse
import os
import sys

API_KEY_ENV = "SLIMISH_ROUTER_API_KEY"


def parse_args(argv: list[str]):
    """`argv` as sglang_router's launcher parses it (`RouterArgs`' own options, without the "router-" prefix)."""
    from sglang_router.router_args import RouterArgs

    parser = argparse.ArgumentParser(prog="slimish.engines.launch_router")
    RouterArgs.add_cli_args(parser, use_router_prefix=False)
    return RouterArgs.from_cli_args(parser.parse_args(argv), use_router_prefix=False)


def main() -> None:
    import setproctitle
    from sglang_router.router import Router

    api_key = os.environ.pop(API_KEY_ENV, None)
    args = parse_args(sys.argv[1:] + (["--api-key", api_key] if api_key else []))
    if args.mini_lb:
        raise SystemExit("slimish.engines.launch_router starts the Rust router only; drop --mini-lb")
    setproctitle.setproctitle("sglang::router")
    args._validate_router_args()  # what sglang_router's launcher checks before it starts the Rust router
    Router.from_args(args).start()


if __name__ == "__main__":
    main()
