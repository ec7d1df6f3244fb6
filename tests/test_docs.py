"""The README and docs/ name only things that exist: every repository path, `make` target and config key they
mention, and every relative link; docs/config.md is the schema's reference as `make docs` writes it; and no page
denies what docs/gpu.md records as run on a GPU, or claims what has not run there."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from slimish.config import reference
from tests.conftest import REPO

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
TOP_LEVEL = ("slimish/", "tests/", "configs/", "launch/", "bench/", "docs/", "requirements/", ".ci/")
TOP_FILES = {"Makefile", "setup.py", "LICENSE", "pyproject.toml", "README.md"}
EXAMPLE = ("my_", "your_")  # a user's own file in an example (configs/my_run.yaml) need not exist
CONFIG_KEYS = {k.dotted for k in reference.keys()}
SECTIONS = set(reference.sections())
FILE_SUFFIXES = {"json", "jsonl", "yaml", "py", "md", "pt", "safetensors", "log", "txt", "html", "png"}


def _code_spans(text: str) -> list[str]:
    """Inline code of a page and each line of its fenced blocks."""
    spans = re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", text, flags=re.S))
    for block in re.findall(r"```[^\n]*\n(.*?)```", text, flags=re.S):
        spans += block.splitlines()
    return spans


def _words(span: str) -> list[str]:
    return re.split(r"[\s,;()\[\]'\"]+", span)


def _repo_paths(text: str) -> set[str]:
    paths = set()
    for span in _code_spans(text):
        for word in _words(span):
            word = word.split("::")[0].rstrip(".:")
            word = re.sub(r":\d+(-\d+)?$", "", word)  # file:line
            if (word.startswith(TOP_LEVEL) and not any(c in word for c in "*<>{}$")
                    and not any(e in word for e in EXAMPLE)) or word in TOP_FILES:
                paths.add(word)
    return paths


def _make_targets(text: str) -> set[str]:
    """`make X` in code (prose may say "make the")."""
    return {target for span in _code_spans(text) for target in re.findall(r"\bmake ([a-z][a-z0-9-]*)", span)}


def _config_keys(text: str) -> set[str]:
    """Dotted keys whose first part is a config section, e.g. `trainer.optimizer.lr` or `rl.mode=async`."""
    keys = set()
    for span in _code_spans(text):
        for word in _words(span):
            match = re.match(r"^([a-z_]+(?:\.[a-z_0-9]+)+)(?:=|$)", word)
            if not match or match.group(1).split(".")[0] not in SECTIONS or "/" in word:
                continue
            parts = match.group(1).split(".")
            if any(p.isdigit() for p in parts) or parts[-1] in FILE_SUFFIXES:  # a tensor's name, a file's
                continue
            keys.add(match.group(1))
    return keys


def _links(page: Path) -> set[str]:
    targets = re.findall(r"\]\(([^)\s]+)\)", page.read_text())
    return {t.split("#")[0] for t in targets if not re.match(r"^[a-z]+:", t) and t.split("#")[0]}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_named_paths_targets_keys_and_links_exist(page):
    text = page.read_text()
    missing = [p for p in sorted(_repo_paths(text)) if not (REPO / p).exists()]
    assert not missing, f"{page.name} names files that do not exist: {missing}"
    makefile = (REPO / "Makefile").read_text()
    targets = set(re.findall(r"^([a-z][a-z0-9-]*):", makefile, flags=re.M))
    unknown_targets = sorted(_make_targets(text) - targets)
    assert not unknown_targets, f"{page.name} names make targets the Makefile does not have: {unknown_targets}"
    prefixes = {key.rsplit(".", n)[0] for key in CONFIG_KEYS for n in range(key.count(".") + 1)}
    unknown = sorted(k for k in _config_keys(text) if k not in prefixes)
    assert not unknown, f"{page.name} names config keys the schema does not have: {unknown}"
    broken = [link for link in sorted(_links(page)) if not (page.parent / link).exists()]
    assert not broken, f"{page.name} links to files that do not exist: {broken}"


def test_the_config_reference_is_the_schemas():
    assert (REPO / "docs/config.md").read_text() == reference.markdown(), "run `make docs`"


def test_every_config_key_has_help():
    assert [k.dotted for k in reference.keys() if not k.help] == []


def test_the_checks_catch_what_they_are_for():
    text = "`slimish/no_such.py` `make no-such-target` `trainer.optimizer.no_such_key=1` [x](no_such.md)"
    assert _repo_paths(text) == {"slimish/no_such.py"}
    assert _make_targets(text) == {"no-such-target"}
    assert _config_keys(text) == {"trainer.optimizer.no_such_key"}


# What docs/gpu.md's "What has run" records as run on a GPU: the evidence that must be there, and the phrasings by
# which a page would deny it. And what has not run on a GPU, with the phrasings that would claim it. Every page is read
# lower-cased with its line breaks folded, so a phrase split over two lines is still found.
HAS_RUN = {
    "the trainer's one-rank steps have run on a GPU": (r"rl step.*?passed", [
        r"none of it has run on a gpu", r"none has run on a gpu",
        r"nothing (?:else )?has run on a gpu\b(?! engine| cluster| node)",
        r"trainer that is otherwise working is still missing", r"trainer does not work on (?:a )?gpus?"]),
    "MoE steps have run on a GPU without Transformer Engine": (r"moe: 2 passed", [r"every moe model crashes on a gpu"]),
    "SGLang's Triton hash has made the expected checksums on a GPU": (r"sglang's triton hash", [
        r"that code path has never run", r"sglang's triton hash for verification\.? (?:is|are) (?:written|never)",
        r"the gpu variants are written but have \*\*never run\*\*"]),
    "the weight-sync group has run on NCCL at one rank": (r"weight-sync group \(`new_weight_update_group`\) on nccl", [
        r"nothing has run over nccl", r"nccl on gpu \(never run\)"]),
    "the tensor transport's CUDA-IPC buckets have run": (r"cuda ipc \(`bench/tensor_buckets\.py --device cuda`\)", [
        r"a cuda ipc allocation on gpu \(never run\)"]),
    "Megatron-Core's optimizer is TE's FusedAdam under the GPU lock": (None, [
        r"transformer engine is not used", r"transformer engine is installed, not yet used",
        r"never uses transformer engine\.", r"transformer engine and apex, which slimish does not use"]),
    "engines span nodes (tested on CPU)": (None, [r"engine spanning several nodes is not supported"]),
}
NOT_RUN = {
    "a GPU SGLang engine": r"(?<!no )gpu engines? (?:has|have) run\b",
    "NCCL between two GPUs": r"(?<!no )nccl between (?:two )?gpus (?:has|have) run",
    "a colocated job on a GPU": r"(?<!no )colocated job (?:has|have) run on a gpu",
    # The sharded sync runs on CPU engines only.
    "a sharded sync on a GPU": r"sharded sync[^.|]*\| tested on (?:a |one )?(?:gpu|h100|h200)",
}


def _folded(page: Path) -> str:
    return re.sub(r"\s+", " ", page.read_text().replace("> ", " ")).lower()


def test_what_has_run_is_recorded_in_gpu_md():
    section = _folded(REPO / "docs/gpu.md").split("## what has run", 1)[1].split("## the gpu battery", 1)[0]
    for name, (evidence, _) in HAS_RUN.items():
        assert evidence is None or re.search(evidence, section), f"docs/gpu.md 'What has run' no longer says {name}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_no_page_denies_what_has_run_or_claims_what_has_not(page):
    text = _folded(page)
    for name, (_, denials) in HAS_RUN.items():
        for denial in denials:
            found = re.search(denial, text)
            assert not found, f"{page.name} says {found.group(0)!r}, but {name} (docs/gpu.md)"
    for name, claim in NOT_RUN.items():
        found = re.search(claim, text)
        assert not found, f"{page.name} says {found.group(0)!r}, but {name} has not run (docs/gpu.md)"
