"""The quickstart task: answer with the digit the prompt asks for ("say 7" -> "7").

A tiny random model is first warmed up (SFT, in Megatron) on the answer *format* only: a digit and EOS, with the
digit drawn at random, so it starts RL at chance (~0.1 reward) and must learn the task itself from the reward.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

VERBS = ["say", "echo", "repeat", "copy", "write", "print"]
_FIRST_DIGIT = re.compile(r"\d")


def make_prompt(rng: random.Random) -> tuple[str, str]:
    digit = str(rng.randrange(10))
    return f"{rng.choice(VERBS)} {digit}", digit


def reward(completions: list[str], labels: list, **kwargs) -> list[float]:
    """1.0 when the first digit of the completion equals the label, else 0.0."""
    scores = []
    for text, label in zip(completions, labels, strict=True):
        match = _FIRST_DIGIT.search(text)
        scores.append(1.0 if match is not None and match.group(0) == str(label) else 0.0)
    return scores


def write_datasets(out_dir: Path, *, num_prompts: int = 512, num_sft: int = 2048, seed: int = 0) -> dict:
    """Write train.jsonl (prompt, label) and sft.jsonl (prompt, response with a *random* digit)."""
    rng = random.Random(seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    train, sft = out_dir / "train.jsonl", out_dir / "sft.jsonl"
    with train.open("w") as f:
        for _ in range(num_prompts):
            prompt, label = make_prompt(rng)
            f.write(json.dumps({"prompt": prompt, "label": label}) + "\n")
    with sft.open("w") as f:
        for _ in range(num_sft):
            prompt, _ = make_prompt(rng)
            f.write(json.dumps({"prompt": prompt, "response": str(rng.randrange(10))}) + "\n")
    return {"train": str(train), "sft": str(sft)}


def corpus() -> list[str]:
    """Text the tiny tokenizer is trained on: every token the task can produce."""
    lines = [f"{verb} {d}" for verb in VERBS for d in range(10)]
    return lines + [" ".join(str(d) for d in range(10)), "0123456789"]
