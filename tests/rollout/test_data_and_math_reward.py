"""Prompt encoding (plain and chat-template) and the math-answer reward hook."""

from __future__ import annotations

import json
import threading

import pytest
from transformers import AutoTokenizer

from slimish.rollout.data import PromptDataset
from slimish.rollout.rewards import score
from slimish.sample import Status
from slimish.tasks import math_answer
from tests.kit.samples import group

TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture()
def prompts_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p, "label": "7"}) + "\n" for p in ["say 7", "echo 7"]))
    return str(path)


def test_chat_template_renders_one_user_message_with_the_assistant_turn_open(task_assets, prompts_file):
    tokenizer = AutoTokenizer.from_pretrained(task_assets["model"])
    plain = PromptDataset(prompts_file, tokenizer=tokenizer, prompt_key="prompt", label_key="label", shuffle=False,
                          seed=0)
    assert plain.prompts[0].ids == tokenizer("say 7")["input_ids"]
    with pytest.raises(ValueError, match="data.apply_chat_template"):  # this tokenizer has none
        PromptDataset(prompts_file, tokenizer=tokenizer, prompt_key="prompt", label_key="label", shuffle=False,
                      seed=0, chat_template=True)
    tokenizer.chat_template = TEMPLATE
    chat = PromptDataset(prompts_file, tokenizer=tokenizer, prompt_key="prompt", label_key="label", shuffle=False,
                         seed=0, chat_template=True)
    assert chat.prompts[0].ids == tokenizer("<|user|>say 7<|assistant|>")["input_ids"]
    assert chat.prompts[0].text == "say 7", "hooks see the prompt as written"


def test_sft_samples_train_the_response_and_not_the_environment_turns(task_assets, tmp_path):
    """The SFT warm-up's samples (`sft_samples`, built by the rollout manager with the job's tokenizer): the prompt
    with special tokens, each response turn on its own without, then EOS; an environment turn has loss_mask 0."""
    from slimish.rollout.data import sft_samples

    tokenizer = AutoTokenizer.from_pretrained(task_assets["model"])
    path = tmp_path / "sft.jsonl"
    path.write_text(json.dumps({"prompt": "say 7", "response": " 7"}) + "\n" + json.dumps(
        {"prompt": "add 1 2", "turns": [{"text": " calc"}, {"text": " 3", "env": True}, {"text": " 3"}]}) + "\n")
    plain, multi = sft_samples(path, tokenizer)

    def ids(text):
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    assert plain.prompt_ids == tokenizer("say 7")["input_ids"]
    assert plain.response_ids == ids(" 7") + [tokenizer.eos_token_id]
    assert plain.loss_mask == [1] * len(plain.response_ids)
    assert multi.response_ids == ids(" calc") + ids(" 3") + ids(" 3") + [tokenizer.eos_token_id]
    assert multi.loss_mask == [1] * len(ids(" calc")) + [0] * len(ids(" 3")) + [1] * (len(ids(" 3")) + 1)
    assert multi.response == " calc 3 3" and (plain.group_id, multi.group_id) == (0, 1)
    assert multi.status is Status.COMPLETED and multi.rollout_logprobs == [0.0] * len(multi.response_ids)


@pytest.mark.parametrize("completion,label,expected", [
    ("so the answer is \\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ("\\boxed{3}", "4", 0.0),
    ("first \\boxed{2}, no wait: \\boxed{5}", "5", 1.0),  # the last boxed answer counts
    ("\\boxed{x^{2}+1}", "1+x^2", 1.0),
    ("The answer is $x=2$", "2", 1.0),  # no box: the last expression
    ("no answer at all", "2", 0.0),
    ("\\boxed{", "1", 0.0),
])
def test_math_answer_reward(completion, label, expected):
    assert math_answer.reward([completion], [label]) == [expected]


def test_math_answer_reward_scores_on_a_worker_thread():
    """The scheduler scores on a worker thread, where signal-based time limits cannot run."""
    samples = group(["\\boxed{1/2}", "\\boxed{2}"], prompt="", label="0.5")
    failures = []
    thread = threading.Thread(target=lambda: failures.append(score(samples, math_answer.reward, failure_reward=-1)))
    thread.start()
    thread.join()
    assert failures == [0] and [s.reward for s in samples] == [1.0, 0.0]
