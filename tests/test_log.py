"""The job's log (slimish/log.py): one handler, one format, the configured level, whatever stderr is now; and no
`print` in library code but the CLI's."""

from __future__ import annotations

import ast
import logging
import re

from slimish import log
from tests.conftest import REPO


def test_setup_logs_slimish_records_in_one_format_at_its_level(capsys):
    logger = logging.getLogger("slimish")
    before = list(logger.handlers)
    try:
        log.setup("warning")
        log.setup("warning")  # idempotent: still one handler
        assert len(logger.handlers) == len(before) + 1
        logging.getLogger("slimish.rollout.scheduler").info("not shown")
        logging.getLogger("slimish.rollout.scheduler").warning("request %s failed", "r-1")
        [line] = capsys.readouterr().err.splitlines()  # the stderr of this moment, not the one at setup
        assert re.fullmatch(r"\d\d:\d\d:\d\d WARNING slimish.rollout.scheduler: request r-1 failed", line), line
    finally:
        logger.handlers[:] = before
        logger.setLevel(logging.NOTSET)


def test_only_the_cli_prints():
    printing = []
    for path in sorted((REPO / "slimish").rglob("*.py")):
        if path.name == "cli.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "print":
                printing.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not printing, f"print in library code (log through logging.getLogger(__name__)): {printing}"


def test_third_party_noise_is_dropped_and_the_rest_kept(recwarn):
    import warnings

    log.quiet_third_party()
    for message in ("Transformer Engine and Apex are not installed. Falling back to Torch optimizers.",
                    "Apex is not installed. Falling back to Torch Norm", "something a user should read"):
        warnings.warn(message, UserWarning, stacklevel=1)
    assert [str(w.message) for w in recwarn] == ["something a user should read"]
    auth = logging.getLogger("ray._private.authentication.authentication_token_setup")
    assert not auth.filter(logging.makeLogRecord({"msg": "Token authentication is enabled for this Ray cluster."}))
    assert auth.filter(logging.makeLogRecord({"msg": "Token authentication is disabled for this Ray cluster."}))
