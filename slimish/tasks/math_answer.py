"""Reward for math answers: 1.0 when the completion's final answer equals the label mathematically, else 0.0.

The answer is the last `\\boxed{...}` in the completion (else its last LaTeX / plain expression), compared with the
label by `math_verify` (Hugging Face's parser and checker: 1/2 == 0.5 == \\frac{1}{2}, x=2 == 2, sets, intervals).
Named in configs as `reward.fn: slimish.tasks.math_answer.reward`; the labels are the dataset's answers (strings).

math_verify's own time limits use SIGALRM, which works only on the main thread, and rewards are scored on a worker
thread: they are off here, and a completion is cut to its last MAX_ANSWER_CHARS characters instead, which keeps the
sympy work per answer small.
"""

from __future__ import annotations

import logging

from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

MAX_ANSWER_CHARS = 2000
_PRED_CONFIG = [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()]

# math_verify warns on every call made without its (signal-based) time limits.
logging.getLogger("math_verify").setLevel(logging.ERROR)


def last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` in `text` (braces balanced), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, begin = 0, start + len("\\boxed{")
    for i in range(begin, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth < 0:
            return text[begin:i]
    return None


def is_correct(completion: str, label: str) -> bool:
    gold = parse(f"${label}$", parsing_timeout=None) or parse(label, parsing_timeout=None)
    boxed = last_boxed(completion)
    answer = f"$\\boxed{{{boxed}}}$" if boxed is not None else completion[-MAX_ANSWER_CHARS:]
    predicted = parse(answer[:MAX_ANSWER_CHARS], extraction_config=_PRED_CONFIG, parsing_timeout=None)
    return bool(gold and predicted and verify(gold, predicted, timeout_seconds=None))


def reward(completions: list[str], labels: list, **kwargs) -> list[float]:
    """1.0 per completion whose final answer equals its label, else 0.0."""
    return [1.0 if is_correct(text, str(label)) else 0.0 for text, label in zip(completions, labels, strict=True)]
