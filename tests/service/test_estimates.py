"""Scores beyond one reply, through the real proxy against the fake vLLM: a reply constrained to
the declared answer, k samples in one request reduced with their spread and quorum, and the
expectation over the answer token's probabilities."""

from __future__ import annotations

import math
import re
import shutil
import statistics

import httpx
import pytest

from proxy.config import settings_from_dict
from tests.conftest import PROMPTS_DIR, libero_settings_dict
from tests.fakes.episodes import episode_frames, npy_b64

FRAMES = npy_b64(episode_frames(8, 64, 64))
PERCENT = "(" + "|".join(str(v) for v in range(100, -1, -1)) + ")"  # every value of 0-100, spelled out


@pytest.fixture
def score(proxy_factory, fake_qwen, fake_primo, media_root, tmp_path):
    """POST /score with backend_kwargs on the qwen backend (or another prompt's backend)."""
    def post(prompt: str = "qwen_progress", backend: str = "qwen2_5_vl_vllm", **kwargs) -> httpx.Response:
        prompts = tmp_path / "prompts"
        if not prompts.exists():
            shutil.copytree(PROMPTS_DIR, prompts)
            (prompts / "scale_0_9.yaml").write_text(
                "variables: {task_text: {}}\nuser: 'Rate ${task_text} from 0 to 9 in <score></score>.'\n"
                "answer: {tags: [score], scale: {min: 0, max: 9}}\n")
        data = libero_settings_dict([fake_qwen.base_url], [fake_primo.base_url], media_root,
                                    prompts_dir=str(prompts))
        data["backends"]["qwen2_5_vl_vllm"]["prompt"] = prompt
        server = proxy_factory(settings_from_dict(data))
        with httpx.Client(base_url=server.url, timeout=30, trust_env=False) as http:
            return http.post("/score", json={"task_text": "put the bowl on the plate", "frames_npy": FRAMES,
                                             "backend": backend, "backend_kwargs": kwargs})
    return post


@pytest.mark.parametrize(("prompt", "backend", "regex"), [
    ("qwen_seed", "qwen2_5_vl_vllm", PERCENT),  # the shipped Qwen template constrains by default
    ("qwen_progress", "qwen2_5_vl_vllm", None),  # a template that does not declare it sends nothing
])
def test_the_constraint_follows_the_template(score, fake_qwen, prompt, backend, regex):
    fake_qwen.config.default_text = "75" if prompt == "qwen_seed" else "<score>75</score>"
    assert score(prompt, backend).json()["score"] == 0.75
    body = fake_qwen.chat_requests[-1]
    assert body.get("structured_outputs") == ({"regex": regex} if regex else None)
    assert "guided_regex" not in body  # vLLM 0.32 ignores it silently: never sent


def test_a_request_turns_the_constraint_on_for_a_tagged_reasoning_template(score, fake_primo):
    response = score("primo_r1_trained", "PRIMO-R1", constrain=True)
    assert response.status_code == 200 and response.json()["constrained"] is True
    regex = fake_primo.chat_requests[-1]["structured_outputs"]["regex"]
    assert regex == rf"<think>[\s\S]*</think>\s*<answer>{PERCENT}</answer>"
    assert re.fullmatch(regex, "<think>grasp, then place\n</think>\n<answer>60</answer>")
    assert not re.fullmatch(regex, "<think>x</think><answer>sixty</answer>")
    assert not re.fullmatch(regex, "<think>x</think><answer>613</answer>")  # off the scale: not even sampled


def test_k_samples_come_from_one_request_and_are_reduced_with_their_spread(score, fake_qwen):
    replies = ["<score>70</score>", "<score>80</score>", "I think 90", "<score>75</score>", "<score>95</score>"]
    fake_qwen.fake.script({"replies": replies})
    result = score(samples=5, reduce="median", temperature=0.7).json()
    assert len(fake_qwen.chat_requests) == 1 and fake_qwen.chat_requests[0]["n"] == 5
    parsed = [0.70, 0.80, 0.75, 0.95]
    assert result["score"] == pytest.approx(statistics.median(parsed)) and result["raw_score"] == pytest.approx(77.5)
    assert [s["ok"] for s in result["samples"]] == [True, True, False, True, True]
    assert "no answer tag" in result["samples"][2]["error"]
    spread = result["spread"]
    assert spread["std"] == pytest.approx(statistics.pstdev(parsed)) and (spread["min"], spread["max"]) == (0.7, 0.95)
    assert (spread["parsed"], spread["samples"]) == (4, 5)


@pytest.mark.parametrize(("reduce", "expected"), [("mean", statistics.fmean([0.7, 0.7, 0.9])), ("majority", 0.7)])
def test_other_reductions(score, fake_qwen, reduce, expected):
    fake_qwen.fake.script({"replies": ["<score>70</score>", "<score>90</score>", "<score>70</score>"]})
    assert score(samples=3, reduce=reduce, temperature=0.7).json()["score"] == pytest.approx(expected)


def test_fewer_parsed_samples_than_the_quorum_is_unparseable_and_re_asked(score, fake_qwen):
    bad = ["no idea", "<score>70</score>", "hmm"]
    fake_qwen.fake.script({"replies": bad}, {"replies": bad})
    response = score(samples=3, quorum=2, temperature=0.7)
    assert response.status_code == 502
    error = response.json()["error"]
    assert error["code"] == "unparseable_score"
    assert "1 of 3 samples" in error["message"] and "quorum of 2" in error["message"]
    assert len(fake_qwen.chat_requests) == 2  # parse_attempts: 2, each ask with n=3
    assert all(r["n"] == 3 for r in fake_qwen.chat_requests)


def test_the_logprob_score_is_the_expectation_over_the_scale(score, fake_qwen, tmp_path):
    fake_qwen.config.default_text = "<score>7</score>"
    fake_qwen.config.answer_top_logprobs = {"7": math.log(0.6), "8": math.log(0.2), "6": math.log(0.1),
                                            "the": math.log(0.05)}
    response = score("scale_0_9", logprob_score=True, score_mode="auto")  # the backend's own mode is percentage
    result = response.json()
    on_scale = 0.9
    expected_raw = (7 * 0.6 + 8 * 0.2 + 6 * 0.1) / on_scale
    assert result["raw_score"] == pytest.approx(expected_raw) and result["score"] == pytest.approx(expected_raw / 9)
    assert result["logprob"]["mass_outside"] == pytest.approx(0.1) and result["logprob"]["greedy_raw"] == 7
    assert result["parse"]["source"] == "score_tag+logprobs"
    body = fake_qwen.chat_requests[-1]
    assert (body["logprobs"], body["top_logprobs"], body["n"]) == (True, 20, 1)


def test_logprobs_that_do_not_line_up_with_the_reply_are_no_score(score, fake_qwen):
    # Chinese reasoning comes back as byte tokens: counting token lengths lands before the answer
    # (here on the "2" of the reasoning, which also carries the fake's top_logprobs)
    fake_qwen.config.default_text = "<think>数字2很好</think><score>8</score>"
    fake_qwen.config.answer_top_logprobs = {"2": math.log(0.9), "8": math.log(0.1)}
    response = score("scale_0_9", logprob_score=True, score_mode="auto")
    assert response.status_code == 502, response.text
    error = response.json()["error"]
    assert error["code"] == "unparseable_score" and "do not line up" in error["message"], error


def test_an_even_split_of_yes_and_no_is_no_verdict(score, fake_qwen):
    split = ["<score>yes</score>", "<score>no</score>", "<score>yes</score>", "<score>no</score>"]
    fake_qwen.fake.script({"replies": split}, {"replies": split})
    response = score(samples=4, temperature=0.7, score_mode="binary")
    assert response.status_code == 502, response.text
    error = response.json()["error"]
    assert error["code"] == "unparseable_score" and "split evenly" in error["message"], error


def test_a_server_that_ignores_n_is_a_bad_response_not_a_smaller_quorum(score, fake_qwen):
    fake_qwen.fake.state.reply_fn = lambda body: ["<score>70</score>"]  # one choice whatever n says
    response = score(samples=3, temperature=0.7)
    assert response.status_code == 502, response.text
    error = response.json()["error"]
    assert error["code"] == "upstream_bad_response" and "1 choices for n=3" in error["message"], error
    assert all(r["n"] == 3 for r in fake_qwen.chat_requests)


@pytest.mark.parametrize(("kwargs", "field", "mentions"), [
    ({"samples": 3}, "backend_kwargs.samples", "temperature > 0"),
    ({"samples": 17, "temperature": 0.5}, "backend_kwargs.samples", "from 1 to 16"),
    ({"samples": 3, "temperature": 0.5, "quorum": 4}, "backend_kwargs.quorum", "from 1 to samples"),
    ({"samples": 3, "temperature": 0.5, "reduce": "max"}, "backend_kwargs.reduce", "median, mean, majority"),
    ({"logprob_score": True}, "backend_kwargs.logprob_score", "single-token scale"),
    ({"logprob_score": True, "samples": 2, "temperature": 0.5}, "backend_kwargs.logprob_score", "choose one"),
    ({"constrain": "yes"}, "backend_kwargs.constrain", "true or false"),
])
def test_inconsistent_estimates_are_refused_before_anything_is_sent(score, fake_qwen, kwargs, field, mentions):
    response = score(**kwargs)
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["field"] == field and mentions in error["message"]
    assert fake_qwen.chat_requests == []
