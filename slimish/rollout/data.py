"""Prompt dataset: a jsonl file of {prompt, label}, tokenised once, served in seeded shuffled epochs.

With `chat_template`, each prompt becomes one user message rendered by the tokenizer's chat template with the
assistant's turn opened (what an instruct or reasoning model expects); otherwise its text is tokenised as is.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Prompt:
    text: str
    ids: list[int]
    label: object


def read_jsonl(path: str | Path) -> list[dict]:
    rows = []
    with Path(path).open() as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{lineno}: not valid JSON: {exc}") from None
    return rows


class PromptDataset:
    def __init__(self, path: str, *, tokenizer, prompt_key: str, label_key: str, shuffle: bool, seed: int,
                 chat_template: bool = False):
        rows = read_jsonl(path)
        if not rows:
            raise ValueError(f"{path}: no prompts")
        for lineno, row in enumerate(rows, 1):
            if prompt_key not in row:
                raise ValueError(f"{path}: row {lineno} has no key {prompt_key!r} (data.prompt_key)")
        if chat_template and not getattr(tokenizer, "chat_template", None):
            raise ValueError("data.apply_chat_template: the model's tokenizer has no chat template "
                             "(tokenizer_config.json / chat_template.jinja); set it to false")

        def encode(text: str) -> list[int]:
            if chat_template:
                return list(tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=True,
                                                          add_generation_prompt=True, return_dict=False))
            return tokenizer(text)["input_ids"]

        self.prompts = [Prompt(row[prompt_key], encode(row[prompt_key]), row.get(label_key)) for row in rows]
        self.shuffle, self.seed = shuffle, seed
        self.epoch, self.cursor = 0, 0
        self._order = self._make_order()

    def _make_order(self) -> list[int]:
        order = list(range(len(self.prompts)))
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(order)
        return order

    def next_batch(self, n: int) -> list[Prompt]:
        batch = []
        while len(batch) < n:
            if self.cursor == len(self._order):
                self.epoch, self.cursor = self.epoch + 1, 0
                self._order = self._make_order()
            batch.append(self.prompts[self._order[self.cursor]])
            self.cursor += 1
        return batch

    def state(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor}

    def load_state(self, state: dict) -> None:
        self.epoch, self.cursor = state["epoch"], state["cursor"]
        self._order = self._make_order()
