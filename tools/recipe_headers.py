"""Regenerate the `slimish plan` figures quoted in the headers of configs/recipes/*.yaml.

Each recipe's header names its plan command, `#   slimish plan configs/recipes/NAME.yaml --model MODEL`, MODEL a
known model (`slimish.megatron_bridge.known_models`). The lines after it (up to `run:`) quote the plan's memory
sections. This script runs the plan and rewrites those lines: where the header's figures line up with the plan's
(the same names in the same order), only the numbers change and the shortened notes stay; otherwise (or where the
block is the marker `#PLAN`) the block is written afresh, one-line notes only. tests/planning/test_plan.py checks
that every header quotes what the plan prints.

    .venv/bin/python tools/recipe_headers.py [--check]
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
COMMAND = re.compile(r"^#   slimish plan (configs/recipes/\S+\.yaml) --model (\S+)\s*$")
FIGURE = re.compile(r"^(\s+)(weights|grads|optim|activ|logits|ref|critic|KV|total|generate|train|sync|host)(\s+)"
                    r"([\d.]+)\b")
WIDTH = 120


def plan_lines(recipe: Path, model: str) -> list[str]:
    from slimish.config import load_config
    from slimish.megatron_bridge.hf_config import read_hf_config
    from slimish.planning.report import plan_text

    cfg = load_config(recipe, [f"model.hf_path={model}"], files=False)
    text = plan_text(cfg, read_hf_config(model)).split("\nseconds per step:")[0]
    lines = text.split("\n\n", 1)[1].splitlines()  # the memory sections, without the model / layout / lr lines
    return [line for line in lines if not line.lstrip().startswith("(")]


def _fresh(lines: list[str]) -> list[str]:
    out = []
    for line in filter(str.strip, lines):
        line = f"#   {line}".rstrip()
        if len(line) > WIDTH and "(" in line:
            line = line[:line.index("(")].rstrip()
        out.append(line)
    return out


def _renumbered(header: list[str], lines: list[str]) -> list[str] | None:
    """The header's lines with the plan's figures, or None where the two do not line up."""
    printed = [m.groups() for m in map(FIGURE.match, lines) if m]
    quoted = [i for i, line in enumerate(header) if FIGURE.match(line[1:])]
    if len(printed) != len(quoted) or "#PLAN" in header:
        return None
    out = list(header)
    for i, (_, name, _, value) in zip(quoted, printed):
        match = FIGURE.match(header[i][1:])
        if match.group(2) != name:
            return None
        line, width = header[i][1:], len(match.group(3)) + len(match.group(4))  # the number ends in its column
        out[i] = "#" + line[:match.end(2)] + " " + value.rjust(width - 1) + line[match.end(4):]
    return out


def regenerate(recipe: Path) -> str | None:
    """The recipe's new text, or None where its header names no plan command."""
    text = recipe.read_text()
    head, sep, body = text.partition("\nrun:")
    header = head.splitlines()
    found = [(i, COMMAND.match(line)) for i, line in enumerate(header) if COMMAND.match(line)]
    if not found:
        return None
    index, match = found[0]
    lines = plan_lines(REPO / match.group(1), match.group(2))
    block = header[index + 1:]
    new_block = _renumbered(block, lines) or _fresh(lines)
    return "\n".join(header[:index + 1] + new_block) + sep + body


def main(argv: list[str]) -> int:
    check = "--check" in argv
    stale = []
    for recipe in sorted((REPO / "configs" / "recipes").glob("*.yaml")):
        new = regenerate(recipe)
        if new is None:
            print(f"{recipe.relative_to(REPO)}: no `slimish plan ... --model` line in its header")
            stale.append(recipe)
        elif new != recipe.read_text():
            stale.append(recipe)
            if not check:
                recipe.write_text(new)
            print(f"{recipe.relative_to(REPO)}: {'stale' if check else 'rewritten'}")
    return 1 if check and stale else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
