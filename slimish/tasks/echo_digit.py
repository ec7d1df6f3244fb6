"""The quickstart task: answer with the digit the prompt asks for ("say 7" -> "7").

The tiny random model gets a deliberately *short* SFT warm-up in Megatron (20 steps; configs/quickstart_cpu.yaml)
that teaches the answer format and leaves it at ~0.1-0.3 reward; the RL phase then has to take it to ~0.8.
Measured alternatives that did not work: warming up on random digits (format only) collapses the model to an
input-independent uniform answer that GRPO does not undo within 30 steps.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

VERBS = ["say", "echo", "repeat", "copy", "write", "print"]


def make_prompt(rng: random.Random) -> tuple[str, str]:
    digit = str(rng.randrange(10))
    return f"{rng.choice(VERBS)} {digit}", digit


def reward(completions: list[str], labels: list, **kwargs) -> list[float]:
    """1.0 when the completion is exactly the label (then EOS), else 0.0: padding the answer earns nothing."""
    return [1.0 if text.strip() == str(label) else 0.0 for text, label in zip(completions, labels, strict=True)]


def contains_reward(completions: list[str], labels: list, **kwargs) -> list[float]:
    """A shaped variant: 1.0 when the label appears anywhere in the completion. An untrained model's long random
    completions earn it by chance, so its groups have reward variance from step 1 (long-response tests use it)."""
    return [1.0 if str(label) in text else 0.0 for text, label in zip(completions, labels, strict=True)]


def write_datasets(out_dir: Path, *, num_prompts: int = 512, num_sft: int = 2048, num_eval: int = 64, seed: int = 0,
                   sft_correct_fraction: float = 1.0) -> dict:
    """Write train.jsonl (prompt, label), sft.jsonl (prompt, response: right with prob. sft_correct_fraction) and
    held_out.jsonl (prompt, label: prompts for evaluation during training, drawn from a stream of their own; the
    task has only 60 distinct prompts, so these are another draw of the same distribution, not unseen ones)."""
    rng = random.Random(seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    train, sft, held_out = out_dir / "train.jsonl", out_dir / "sft.jsonl", out_dir / "held_out.jsonl"
    for path, count, stream in ((train, num_prompts, rng), (held_out, num_eval, random.Random(seed + 1))):
        with path.open("w") as f:
            for _ in range(count):
                prompt, label = make_prompt(stream)
                f.write(json.dumps({"prompt": prompt, "label": label}) + "\n")
    with sft.open("w") as f:
        for _ in range(num_sft):
            prompt, label = make_prompt(rng)
            response = label if rng.random() < sft_correct_fraction else str(rng.randrange(10))
            f.write(json.dumps({"prompt": prompt, "response": response}) + "\n")
    return {"train": str(train), "sft": str(sft), "eval": str(held_out)}


def corpus() -> list[str]:
    """Text the tiny tokenizer is trained on: every token the task can produce."""
    lines = [f"{verb} {d}" for verb in VERBS for d in range(10)]
    return lines + [" ".join(str(d) for d in range(10)), "0123456789"]
