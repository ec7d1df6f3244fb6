"""slimish's router launcher (slimish/engines/launch_router.py): the router's arguments as sglang_router parses them,
and a start that does not import SGLang."""

from __future__ import annotations

import subprocess
import sys

from slimish.engines.launch_router import parse_args
from slimish.engines.servers import HEALTH_CHECK_ENDPOINT, router_argv
from tests.conftest import REPO


def test_the_router_gets_the_choices_rl_needs():
    """What `router_argv` asks for, as sglang_router's own argument parsing (`RouterArgs`) reads it: a renamed or
    dropped option fails here, not in a job."""
    argv = router_argv(worker_urls=["http://127.0.0.1:1", "http://127.0.0.1:2"], port=5, prometheus_port=6,
                       policy="round_robin")
    assert argv[1:3] == ["-m", "slimish.engines.launch_router"]
    args = parse_args(argv[3:])
    assert args.worker_urls == ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    assert (args.host, args.port, args.prometheus_host, args.prometheus_port) == ("127.0.0.1", 5, "127.0.0.1", 6)
    assert args.policy == "round_robin" and args.disable_retries and args.disable_circuit_breaker
    assert args.health_check_endpoint == HEALTH_CHECK_ENDPOINT and not args.mini_lb
    assert args.api_key is None, "the key comes from the environment, never the command line"


def test_the_launcher_imports_neither_sglang_nor_torch():
    """sglang_router's own launcher module imports its Python debugging load balancer, and with it all of SGLang
    (9-11 s of a router's start on a busy 2-core machine); slimish's launcher starts the Rust router without it."""
    code = ("import sys; from slimish.engines import launch_router; import sglang_router.router; "
            "launch_router.parse_args(['--worker-urls', 'http://127.0.0.1:1']); "
            "print(sorted(m for m in ('sglang', 'torch', 'transformers') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "[]"
