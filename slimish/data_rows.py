"""Dataset rows as the job reads them: what a prompt row and an SFT row must hold. Shared by the job's dataset
readers (`slimish.rollout.data`) and `check-config` (`slimish.config.validate`), which reads a file's first rows."""

from __future__ import annotations

import json
from pathlib import Path

from slimish.errors import UserError


class DataError(UserError, ValueError):
    """A dataset file or row the job cannot read; the message names the file and the line."""


def check_prompt_row(row, where: str, prompt_key: str) -> None:
    """A prompt row: a JSON object whose `prompt_key` is text or a list of chat messages."""
    if not isinstance(row, dict):
        raise DataError(f"{where}: a row must be a JSON object, got {type(row).__name__}")
    if prompt_key not in row:
        raise DataError(f"{where}: the row has no key {prompt_key!r} (data.prompt_key); it has {sorted(row)[:8]}")
    if not isinstance(row[prompt_key], str) and not is_messages(row[prompt_key]):
        raise DataError(f"{where}: {prompt_key!r} is neither text nor a list of chat messages ({{'role', "
                        f"'content'}}), got {type(row[prompt_key]).__name__}")


def check_sft_row(row, where: str, prompt_key: str = "prompt") -> None:
    """An SFT row (`sft_samples`): a text "prompt" and a text "response", or "turns" [{"text", "env"}]."""
    if not isinstance(row, dict):
        raise DataError(f"{where}: a row must be a JSON object, got {type(row).__name__}")
    if not isinstance(row.get(prompt_key), str):
        raise DataError(f"{where}: an SFT row needs a text {prompt_key!r}")
    turns = row.get("turns")
    if turns is not None:
        if not (isinstance(turns, list) and all(isinstance(t, dict) and isinstance(t.get("text"), str)
                                                for t in turns)):
            raise DataError(f'{where}: "turns" must be a list of {{"text": ..., "env": bool}}')
    elif not isinstance(row.get("response"), str):
        raise DataError(f'{where}: an SFT row needs a text "response" (or "turns")')


def first_jsonl_rows(path: str | Path, limit: int | None = None) -> list[tuple[int, object]]:
    """(line number, parsed row) of the first `limit` (None: all) non-blank lines of a jsonl file; DataError on
    bad JSON."""
    rows = []
    with Path(path).open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rows.append((lineno, json.loads(line)))
            except json.JSONDecodeError as exc:
                raise DataError(f"{path}:{lineno}: not valid JSON: {exc}") from None
            if len(rows) == limit:
                break
    return rows


def is_messages(prompt) -> bool:
    return isinstance(prompt, list) and all(isinstance(m, dict) and "role" in m and "content" in m for m in prompt)
