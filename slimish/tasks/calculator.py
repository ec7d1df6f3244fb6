"""A tool-use task a tiny model learns on CPU: add two digits, with a calculator it may call.

Prompt "add 3 4", label "7". A transcript that uses the tool:

    calc 3 4;        the model's call (generation stops at ";")
     = 7;            the calculator's answer: environment tokens, loss_mask 0
     answer 7<EOS>   the model's answer

The reward is 1.0 when the last `answer N` equals the label. The SFT warm-up (sft.jsonl, `turns` with the
calculator's turn marked `env`, so it is not trained on either) calls the tool in only `tool_fraction` of its
transcripts and guesses the rest, so the warmed-up model guesses most of the time; RL has to learn that calling the
tool and copying its answer pays.

Config: configs/calculator_cpu.yaml (`rollout.generate_fn: slimish.tasks.calculator.program`).
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

from slimish.rollout.programs import RolloutClient
from slimish.sample import Sample, Status

CALL = re.compile(r"calc (\d+) (\d+);$")  # an unanswered call ends the transcript
ANSWER = re.compile(r"answer (\d+)")
MAX_CALLS = 2  # a model that keeps calling gets its transcript ended


def make_prompt(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randrange(10), rng.randrange(10)
    return f"add {a} {b}", str(a + b)


def calculator(call: re.Match) -> str:
    """The environment: the calculator's reply to a call."""
    return f" = {int(call.group(1)) + int(call.group(2))};"


async def program(sample: Sample, client: RolloutClient) -> Sample:
    """`rollout.generate_fn`: the model speaks until it stops; a transcript ending in a call gets the calculator's
    answer, and the model goes on. Resumable: what to do next is read off the sample (who spoke last, whether the
    model finished its turn, whether that ended in an unanswered call), so an interrupted sample continues where it
    stopped: it comes back pending, cut off in the middle of a model turn."""
    while True:
        if sample.response_ids and sample.loss_mask[-1] == 1 and sample.status is not Status.PENDING:
            # the model spoke last, and finished its turn
            call = CALL.search(client.detokenize(sample.response_ids))
            calls = sum(1 for prev, cur in zip(sample.loss_mask, sample.loss_mask[1:]) if prev == 1 and cur == 0)
            if call is None or calls >= MAX_CALLS or sample.status is Status.TRUNCATED:
                return sample  # its answer (or it stopped otherwise)
            client.append_environment(sample, calculator(call))
            if sample.status is Status.TRUNCATED:
                return sample
        await client.generate(sample, stop=[";"])
        if sample.status is Status.TRUNCATED:
            return sample


def reward(completions: list[str], labels: list, **kwargs) -> list[float]:
    """1.0 when the transcript's last `answer N` is the label."""
    out = []
    for text, label in zip(completions, labels, strict=True):
        answers = ANSWER.findall(text)
        out.append(1.0 if answers and answers[-1] == str(label) else 0.0)
    return out


def corpus() -> list[str]:
    """Text the tiny tokenizer is trained on: every piece of a transcript."""
    lines = [f"add {a} {b}" for a in range(10) for b in range(10)]
    lines += [f"calc {a} {b}; = {a + b}; answer {a + b}" for a in range(10) for b in range(10)]
    return lines + [" ".join(str(d) for d in range(19))]


def write_datasets(out_dir: Path, *, num_prompts: int = 512, num_sft: int = 2048, num_eval: int = 64, seed: int = 0,
                   tool_fraction: float = 0.3) -> dict:
    """train.jsonl and held_out.jsonl (prompt, label) and sft.jsonl (prompt, turns)."""
    rng = random.Random(seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"train": out_dir / "train.jsonl", "eval": out_dir / "held_out.jsonl", "sft": out_dir / "sft.jsonl"}
    for key, count, stream in (("train", num_prompts, rng), ("eval", num_eval, random.Random(seed + 1))):
        with paths[key].open("w") as f:
            for _ in range(count):
                prompt, label = make_prompt(stream)
                f.write(json.dumps({"prompt": prompt, "label": label}) + "\n")
    with paths["sft"].open("w") as f:
        for _ in range(num_sft):
            prompt, label = make_prompt(rng)
            if rng.random() < tool_fraction:
                a, b = prompt.split()[1:]
                turns = [{"text": f"calc {a} {b};"}, {"text": f" = {label};", "env": True},
                         {"text": f" answer {label}"}]
            else:
                turns = [{"text": f"answer {rng.randrange(19)}"}]
            f.write(json.dumps({"prompt": prompt, "turns": turns}) + "\n")
    return {key: str(path) for key, path in paths.items()}
