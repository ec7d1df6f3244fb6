"""`python -m slimish.engines.launch_router ROUTER_ARGS`: sglang_router's own launcher, taking the API key from the
environment (`SLIMISH_ROUTER_API_KEY`) instead of the command line, which every local user can read in /proc."""

from __future__ import annotations

import os
import sys

API_KEY_ENV = "SLIMISH_ROUTER_API_KEY"


def main() -> None:
    from sglang_router.launch_router import launch_router, parse_router_args

    argv = sys.argv[1:]
    api_key = os.environ.pop(API_KEY_ENV, None)
    launch_router(parse_router_args(argv + (["--api-key", api_key] if api_key else [])))


if __name__ == "__main__":
    main()
