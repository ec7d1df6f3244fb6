"""Prompt dataset: rows with a prompt, a label and any other columns, tokenised once, served in seeded shuffled
epochs.

Rows come from a jsonl file, a Parquet file, a Hugging Face `datasets` dataset saved with `save_to_disk` (a
directory; a DatasetDict gives its `split`), or a local .json / .csv file read by `datasets.load_dataset` (nothing is
downloaded). A prompt is text, or a list of chat messages ({"role", "content"}) rendered by the tokenizer's chat
template with the assistant's turn opened; with `chat_template`, a text prompt becomes one user message first.
Every column of a row travels with its samples to the reward hook (`Sample.columns`).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from slimish.data_rows import DataError, check_prompt_row, first_jsonl_rows, is_messages
from slimish.sample import Sample, Status


@dataclass(frozen=True)
class Prompt:
    text: str
    ids: list[int]
    label: object
    columns: dict  # the whole row


def read_rows(path: str | Path, *, split: str = "train") -> list[dict]:
    """The rows of the dataset at `path` (see the module docstring), as JSON values (they are checkpointed with
    the samples: a timestamp or bytes column becomes its string)."""
    path = Path(path)
    if path.suffix == ".jsonl":
        return read_jsonl(path)
    return json.loads(json.dumps(_read_table(path, split), default=str))


def _read_table(path: Path, split: str) -> list[dict]:
    if path.is_dir():
        import datasets

        data = datasets.load_from_disk(str(path))
        if isinstance(data, datasets.DatasetDict):
            if split not in data:
                raise DataError(f"{path}: no split {split!r} (data.split); it has {sorted(data)}")
            data = data[split]
        return data.to_list()
    if path.suffix == ".parquet":
        import pyarrow.parquet

        return pyarrow.parquet.read_table(path).to_pylist()
    if path.suffix in (".json", ".csv"):
        import datasets

        return datasets.load_dataset(path.suffix[1:], data_files=str(path), split="train").to_list()
    return read_jsonl(path)


def sft_samples(path: str | Path, tokenizer) -> list[Sample]:
    """The SFT warm-up's samples, one per row of the jsonl at `path`: its "prompt" (text, tokenised with the
    tokenizer's special tokens) and its response, either "response" (text) or "turns" ([{"text", "env": bool}],
    whose environment turns are not trained on: loss_mask 0), each turn tokenised on its own without special
    tokens, then the tokenizer's EOS (trained)."""
    samples = []
    for i, row in enumerate(read_jsonl(path)):
        prompt_ids = tokenizer(row["prompt"])["input_ids"]
        turns = row["turns"] if "turns" in row else [{"text": row["response"]}]
        response_ids, loss_mask = [], []
        for turn in turns:
            ids = tokenizer(turn["text"], add_special_tokens=False)["input_ids"]
            response_ids += ids
            loss_mask += [0 if turn.get("env") else 1] * len(ids)
        response_ids.append(tokenizer.eos_token_id)
        loss_mask.append(1)
        samples.append(Sample(group_id=i, index=0, prompt=row["prompt"], prompt_ids=prompt_ids,
                              status=Status.COMPLETED, response="".join(t["text"] for t in turns),
                              response_ids=response_ids, rollout_logprobs=[0.0] * len(response_ids),
                              weight_versions=[0] * len(response_ids), loss_mask=loss_mask))
    return samples


def read_jsonl(path: str | Path) -> list[dict]:
    return [row for _, row in first_jsonl_rows(path)]


class PromptDataset:
    def __init__(self, path: str, *, tokenizer, prompt_key: str, label_key: str, shuffle: bool, seed: int,
                 chat_template: bool = False, split: str = "train"):
        rows = read_rows(path, split=split)
        if not rows:
            raise DataError(f"{path}: no prompts")
        for lineno, row in enumerate(rows, 1):
            check_prompt_row(row, f"{path}: row {lineno}", prompt_key)
        needs_template = chat_template or any(is_messages(row[prompt_key]) for row in rows)
        if needs_template and not getattr(tokenizer, "chat_template", None):
            raise DataError("the model's tokenizer has no chat template (tokenizer_config.json / chat_template.jinja):"
                             " set data.apply_chat_template to false and give prompts as text")

        def encode(prompt) -> tuple[str, list[int]]:
            if is_messages(prompt) or chat_template:
                messages = prompt if is_messages(prompt) else [{"role": "user", "content": prompt}]
                ids = list(tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                                         return_dict=False))
                return (prompt if isinstance(prompt, str) else tokenizer.decode(ids)), ids
            return prompt, tokenizer(prompt)["input_ids"]

        self.prompts = [Prompt(*encode(row[prompt_key]), row.get(label_key), row) for row in rows]
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
