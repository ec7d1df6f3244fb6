"""Rewards as TRL calls them (every dataset column by name), several weighted terms, a reward service over HTTP
(a real local server), and datasets from Parquet, `datasets`' save_to_disk and local json / csv files."""

from __future__ import annotations

import json
import threading

import httpx
import pytest

from slimish.rollout.data import PromptDataset
from slimish.rollout.remote_reward import RemoteReward
from slimish.rollout.rewards import build_reward_fn, score, weighted_sum
from tests.kit.engines import LoopbackServer
from tests.kit.samples import sample

ROWS = [{"prompt": "what is 3+4?", "label": "7", "solution": "7", "difficulty": 1},
        {"prompt": "what is 2+2?", "label": "4", "solution": "4", "difficulty": 2}]


def solution_reward(completions, solution, **kwargs):
    """A TRL reward function: it reads the dataset's `solution` column, which is not the label."""
    return [1.0 if completion.strip() == answer else 0.0 for completion, answer in zip(completions, solution)]


def length_reward(completions, **kwargs):
    return [float(len(c)) for c in completions]


def samples_for(rows, responses):
    return [sample(index=i, prompt=row["prompt"], label=row["label"], columns=row, response=text)
            for i, (row, text) in enumerate(zip(rows, responses))]


def test_a_trl_reward_function_reads_a_column_other_than_the_label():
    samples = samples_for(ROWS, ["7", "5"])
    assert score(samples, solution_reward, failure_reward=-1.0) == 0
    assert [s.reward for s in samples] == [1.0, 0.0]


def test_weighted_terms_sum_and_keep_each_value(tmp_path):
    samples = samples_for(ROWS, ["7", "22"])
    combined = weighted_sum([("solution", solution_reward, 2.0), ("length", length_reward, 0.5)])
    assert score(samples, combined, failure_reward=-1.0) == 0
    assert [s.reward for s in samples] == [2.0 + 0.5, 0.0 + 1.0]
    assert samples[1].meta["reward_terms"] == {"solution": 0.0, "length": 2.0}


class RewardServer:
    """A real HTTP reward service on 127.0.0.1 (tests/kit/engines.py's `LoopbackServer`): reward = 1 when the
    completion equals the row's solution. It fails the first `fail_first` requests with 503, or every one with
    `always`; it records the most requests in flight."""

    def __init__(self, *, fail_first: int = 0, always: int | None = None):
        self.fail_first, self.always, self.requests, self.in_flight, self.most = fail_first, always, 0, 0, 0
        self.lock = threading.Lock()
        self.release = threading.Event()
        self.server = LoopbackServer(self.answer)
        self.url = f"{self.server.url}/reward"

    def answer(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        with self.lock:
            self.requests += 1
            self.in_flight += 1
            self.most = max(self.most, self.in_flight)
            failing = self.always or (self.requests <= self.fail_first and 503)
        payload = b""
        if not failing:
            rewards = [float(c == s) for c, s in zip(body["completions"], body["solution"])]
            payload = json.dumps({"rewards": rewards}).encode()
        with self.lock:  # done before the client can read the answer and send its next request
            self.in_flight -= 1
        return httpx.Response(failing or 200, content=payload)

    def close(self):
        self.server.close()


@pytest.fixture()
def server_factory():
    servers = []

    def make(**kwargs):
        servers.append(RewardServer(**kwargs))
        return servers[-1]

    yield make
    for server in servers:
        server.close()


def test_remote_rewards_in_batches_within_the_concurrency_limit(server_factory, monkeypatch):
    server = server_factory()
    remote = RemoteReward(server.url, max_concurrency=2, retries=0, timeout_s=10, batch_size=3)
    rows = [ROWS[i % 2] for i in range(20)]
    samples = samples_for(rows, ["7" if i % 4 == 0 else "4" for i in range(20)])
    assert score(samples, remote, failure_reward=-1.0) == 0
    assert [s.reward for s in samples] == [float(i % 4 == 0) if i % 2 == 0 else 1.0 for i in range(20)]
    assert server.requests == 7 and server.most <= 2  # ceil(20 / 3) requests, never more than 2 at once
    remote.close()


def test_remote_failures_are_retried_then_counted_like_local_ones(server_factory, monkeypatch):
    monkeypatch.setattr("slimish.rollout.remote_reward.BACKOFF_S", 0.0)
    flaky = server_factory(fail_first=2)
    remote = RemoteReward(flaky.url, max_concurrency=1, retries=2, timeout_s=10, batch_size=8)
    samples = samples_for(ROWS, ["7", "4"])
    assert score(samples, remote, failure_reward=-1.0) == 0 and [s.reward for s in samples] == [1.0, 1.0]
    assert flaky.requests == 3
    down = server_factory(always=500)
    remote = RemoteReward(down.url, max_concurrency=1, retries=1, timeout_s=10, batch_size=8)
    samples = samples_for(ROWS, ["7", "4"])
    assert score(samples, remote, failure_reward=-1.0) == 2  # the batch, then each sample alone: all fail
    assert all(s.reward == -1.0 and "HTTP 500 after 2 attempts" in s.error for s in samples)


def test_reward_config_builds_hooks_and_the_service_as_weighted_terms(server_factory):
    from slimish.config.schema import RewardConfig

    server = server_factory()
    config = RewardConfig(fn="tests.rollout.test_reward_terms.solution_reward",
                          fns=["tests.rollout.test_reward_terms.length_reward"], url=server.url,
                          weights=[1.0, 0.1, 2.0])
    samples = samples_for(ROWS, ["7", "12"])
    assert score(samples, build_reward_fn(config), failure_reward=-1.0) == 0
    assert [s.reward for s in samples] == [pytest.approx(1.0 + 0.1 + 2.0), pytest.approx(0.0 + 0.2 + 0.0)]


class Tokenizer:
    chat_template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<assistant>"

    def __call__(self, text):
        return {"input_ids": [ord(c) for c in text]}

    def apply_chat_template(self, messages, **kwargs):
        return [ord(c) for c in "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"]

    def decode(self, ids):
        return "".join(chr(i) for i in ids)


def _dataset(path, **kwargs):
    return PromptDataset(str(path), tokenizer=Tokenizer(), prompt_key="prompt", label_key="label", shuffle=False,
                         seed=0, **kwargs)


def test_parquet_saved_datasets_and_local_files_give_the_same_rows(tmp_path):
    import datasets
    import pyarrow
    import pyarrow.parquet

    pyarrow.parquet.write_table(pyarrow.Table.from_pylist(ROWS), tmp_path / "train.parquet")
    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS[:1]),
                          "test": datasets.Dataset.from_list(ROWS[1:])}).save_to_disk(str(tmp_path / "splits"))
    (tmp_path / "train.json").write_text("\n".join(json.dumps(r) for r in ROWS))
    (tmp_path / "train.csv").write_text("prompt,label,solution,difficulty\n" +
                                        "".join(f"{r['prompt']},{r['label']},{r['solution']},{r['difficulty']}\n"
                                                for r in ROWS))
    for name in ("train.parquet", "saved", "train.json", "train.csv"):
        got = _dataset(tmp_path / name)
        assert [p.text for p in got.prompts] == [r["prompt"] for r in ROWS], name
        assert [str(p.label) for p in got.prompts] == ["7", "4"], name
        assert [p.columns["difficulty"] for p in got.prompts] == [1, 2], name
    assert [p.label for p in _dataset(tmp_path / "splits", split="test").prompts] == ["4"]
    with pytest.raises(ValueError, match="no split 'validation'"):
        _dataset(tmp_path / "splits", split="validation")


def test_a_prompt_given_as_chat_messages_is_rendered_by_the_template(tmp_path):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "3+4?"}]
    (tmp_path / "chat.jsonl").write_text(json.dumps({"prompt": messages, "label": "7"}) + "\n")
    prompt = _dataset(tmp_path / "chat.jsonl").prompts[0]
    assert prompt.text == "<system>be brief<user>3+4?<assistant>" and prompt.columns["prompt"] == messages
    (tmp_path / "bad.jsonl").write_text(json.dumps({"prompt": 5, "label": "7"}) + "\n")
    with pytest.raises(ValueError, match="neither text nor a list of chat messages"):
        _dataset(tmp_path / "bad.jsonl")
