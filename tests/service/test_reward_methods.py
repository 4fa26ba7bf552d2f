"""The field's reward methods through the real proxy against a fake vLLM whose answers depend on
what it is shown: TOPReward's P(done) read from the logprobs of one token (on /score, /score/batch
and /score/dense), and RoboReward's discrete 1-5 score after "ANSWER:". One proxy and one fake
serve the module (the fake is reset between tests).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import math
import re
import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from scipy.stats import spearmanr

from proxy.config import settings_from_dict
from reports.report import build_report
from tests.conftest import PROMPTS_DIR, QWEN_MODEL, libero_settings_dict
from tests.fakes.episodes import decode_jpeg_b64, episode_frames, frame_level, npy_b64
from tests.fakes.fake_vllm import FakeConfig, FakeVLLMThread
from tests.fakes.grader import last_video_frame
from tests.fakes.proxy_server import ProxyServerThread
from tests.helpers import HANG_S, release_when, wait_until

TASK = "put the black bowl on the plate"
FRAMES = npy_b64(episode_frames(24, 64, 64))
TRUE_ID, FALSE_ID = 2514, 4049  # the fake's vocabulary (FakeConfig.vocab)


@dataclasses.dataclass
class Stack:
    proxy: ProxyServerThread
    fake: FakeVLLMThread
    http: httpx.Client

    @property
    def audit_log(self) -> Path:
        self.proxy.flush_audit()
        return Path(self.proxy.settings.proxy.audit_log)

    def score(self, backend: str, path: str = "/score", **fields) -> httpx.Response:
        return self.http.post(path, json={"task_text": TASK, "frames_npy": FRAMES, "backend": backend, **fields})


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Iterator[Stack]:
    media, prompts = tmp_path_factory.mktemp("media"), tmp_path_factory.mktemp("prompts")
    for name in ("topreward", "roboreward", "gvl", "compare_rlvlmf"):
        (prompts / f"{name}.yaml").write_bytes((PROMPTS_DIR / f"{name}.yaml").read_bytes())
    (prompts / "two_token_words.yaml").write_text(
        "variables: {task_text: {}}\nuser: 'Is ${task_text} done?'\n"
        "answer: {probability: {affirmative: 'Definitely yes', negative: 'No'}}\n")
    fake = FakeVLLMThread(FakeConfig(served_model_name=QWEN_MODEL)).start()
    data = libero_settings_dict([fake.base_url], [], media, prompts_dir=str(prompts),
                                audit_log=str(tmp_path_factory.mktemp("runs") / "audit.jsonl"))
    qwen = data["backends"].pop("qwen2_5_vl_vllm")
    del data["backends"]["PRIMO-R1"]
    data["backends"] = {name: {**qwen, "prompt": prompt, "score_mode": "auto"} for name, prompt in (
        ("p_done", "topreward"), ("roboreward", "roboreward"), ("two_tokens", "two_token_words"))}
    data["backends"]["gvl"] = {**qwen, "prompt": "gvl", "score_mode": "auto", "layout": "shuffled_images",
                               "frames": {"nframes": 9, "max_pixels": 200704}, "sampling": {**qwen["sampling"],
                                                                                          "max_tokens": 512}}
    proxy = ProxyServerThread(settings_from_dict(data)).start()
    http = httpx.Client(base_url=proxy.url, timeout=30, trust_env=False)
    try:
        yield Stack(proxy, fake, http)
    finally:
        http.close()
        proxy.stop()
        fake.stop()


@pytest.fixture(autouse=True)
def _fresh_fake(stack: Stack) -> Iterator[None]:
    stack.fake.fake.reset()
    yield
    stack.fake.fake.state.label_fn = None
    stack.fake.fake.state.reply_fn = None
    stack.fake.config.label_logprobs = None
    stack.fake.config.default_text = "<answer>50</answer>"


def _tokenized(stack: Stack) -> list[str]:
    return [r.body["prompt"] for r in stack.fake.fake.state.requests if r.path == "/tokenize"]


def test_p_done_is_the_probability_the_model_put_on_true(stack):
    stack.fake.config.label_logprobs = {"True": math.log(0.7), "False": math.log(0.2)}
    answer = stack.score("p_done")
    assert answer.status_code == 200, answer.text
    result = answer.json()
    assert result["score"] == pytest.approx(0.7) and result["raw_score"] == pytest.approx(0.7)
    probability = result["probability"]
    assert probability["p_negative"] == pytest.approx(0.2) and probability["mass_other"] == pytest.approx(0.1)
    assert probability["normalised"] == pytest.approx(0.7 / 0.9)
    assert probability["token_ids"] == [TRUE_ID, FALSE_ID] and probability["first_token"] == "True"
    assert result["parse"]["source"] == "first_token_logprobs" and result["parse"]["scale"] == "probability"
    body = stack.fake.chat_requests[-1]
    # one token, its logprobs for exactly the two words' ids (whatever their rank), named by id
    assert (body["max_tokens"], body["logprobs"], body["logprob_token_ids"], body["return_tokens_as_token_ids"]) \
        == (1, True, [TRUE_ID, FALSE_ID], True)
    assert "top_logprobs" not in body and "structured_outputs" not in body
    assert result["sampling"]["max_tokens"] == 1  # the provenance says what was sent
    text = next(p["text"] for p in body["messages"][-1]["content"] if p["type"] == "text")
    assert text.endswith(f"task: {TASK} Decide whether the above statement is True or not. The answer is:")


def test_an_unlikely_true_is_priced_exactly_not_cut_at_the_top_20(stack):
    stack.fake.config.label_logprobs = {"True": math.log(3e-7), "False": math.log(0.9)}
    result = stack.score("p_done").json()
    assert result["score"] == pytest.approx(3e-7) and result["probability"]["first_token"] == "False"


def test_the_words_are_tokenized_once_per_endpoint(stack):
    stack.fake.config.label_logprobs = {"True": math.log(0.5), "False": math.log(0.5)}
    for _ in range(3):
        assert stack.score("p_done").status_code == 200
    # the module's first P(done) request tokenized the two words (here, or in an earlier test):
    # the later ones reuse the ids
    asked = Counter(_tokenized(stack))
    assert set(asked) <= {"True", "False"} and all(count == 1 for count in asked.values()), asked


def test_concurrent_first_requests_tokenize_each_word_once_and_stale_ids_are_no_score(stack):
    stack.proxy.app.state.services.answer_tokens.forget(stack.fake.base_url)  # as if this endpoint were new
    stack.fake.config.label_logprobs = {"True": math.log(0.6), "False": math.log(0.3)}
    items = [{"task_text": TASK, "frames_npy": FRAMES, "backend": "p_done"} for _ in range(6)]
    results = stack.http.post("/score/batch", json={"items": items}).json()["results"]
    assert all(r["ok"] for r in results)
    assert sorted(_tokenized(stack)) == ["False", "True"]  # six concurrent requests, one /tokenize per word
    # the replica now numbers its words otherwise (restarted with another tokenizer, the same name):
    # the old ids get vLLM's floor for both words, which is no P(done) of 0 but an error, and the
    # endpoint is asked for its ids again on the next request
    stack.fake.config.vocab = {**stack.fake.config.vocab, "True": 11, "False": 12}
    try:
        stale = stack.score("p_done")
        assert stale.status_code == 502 and "logprob floor" in stale.json()["error"]["message"], stale.text
        again = stack.score("p_done")
        assert again.status_code == 200 and again.json()["probability"]["token_ids"] == [11, 12], again.text
    finally:
        stack.fake.config.vocab = {**stack.fake.config.vocab, "True": TRUE_ID, "False": FALSE_ID}
        stack.proxy.app.state.services.answer_tokens.forget(stack.fake.base_url)


def test_a_slow_tokenize_ends_at_the_callers_budget_and_keeps_the_others_lookup(
        proxy_factory, fake_vllm_factory, media_root):
    # A proxy of its own: its token ids must not be known yet. A first request (no budget) starts
    # the endpoint's /tokenize, which the fake holds until a second request, with a 3 s budget and
    # waiting on that same lookup, has its answer: a 504 at its own budget (found by review: it
    # waited for the first caller's lookup, up to twice the call timeout). The first is scored.
    hold = threading.Event()
    fake = fake_vllm_factory(served_model_name=QWEN_MODEL, tokenize_hold=hold,
                             label_logprobs={"True": math.log(0.7), "False": math.log(0.2)})
    data = libero_settings_dict([fake.base_url], [], media_root)
    qwen = data["backends"].pop("qwen2_5_vl_vllm")
    data["backends"] = {"p_done": {**qwen, "prompt": "topreward", "score_mode": "auto"}}
    server = proxy_factory(settings_from_dict(data))
    episode = {"task_text": TASK, "frames_npy": FRAMES}
    answered = threading.Event()
    with (release_when(answered.is_set, hold, HANG_S, "the impatient request answered") as seen,
          httpx.Client(base_url=server.url, timeout=HANG_S * 2, trust_env=False) as http,
          concurrent.futures.ThreadPoolExecutor(1) as pool):
        patient = pool.submit(http.post, "/score", json=episode)
        wait_until(lambda: any(r.path == "/tokenize" for r in fake.fake.state.requests), HANG_S, "a lookup began")
        impatient = http.post("/score", json=episode, headers={"x-reward-budget-ms": "3000"})
        answered.set()
        patient = patient.result()
    assert seen["met"]
    assert impatient.status_code == 504 and impatient.json()["error"]["code"] == "upstream_timeout", impatient.text
    assert patient.status_code == 200 and patient.json()["score"] == pytest.approx(0.7), patient.text
    assert sorted(r.body["prompt"] for r in fake.fake.state.requests if r.path == "/tokenize") == ["False", "True"]
    assert len(fake.chat_requests) == 1  # the impatient request never reached the chat


def test_p_done_on_a_batch_each_item_its_own_probability(stack):
    def label(body: dict) -> dict[str, float]:
        level = frame_level(last_video_frame(body)) / 255
        return {"True": math.log(level), "False": math.log(1 - level)}
    stack.fake.fake.state.label_fn = label
    items = [{"task_text": TASK, "frames_npy": npy_b64(episode_frames(24, 64, 64)[: 4 + 6 * i]), "backend": "p_done"}
             for i in range(3)]
    results = stack.http.post("/score/batch", json={"items": items}).json()["results"]
    scores = [r["result"]["score"] for r in results]
    assert all(r["ok"] for r in results) and scores == sorted(scores) and len(set(scores)) == 3


def test_a_dense_p_done_curve_is_each_prefix_probability(stack):
    seen: list[tuple[float, float]] = []  # (the level of the last frame shown, P(True) the fake gave)

    def label(body: dict) -> dict[str, float]:
        level = frame_level(last_video_frame(body)) / 255
        seen.append((level, level * 0.9))
        return {"True": math.log(level * 0.9), "False": math.log(0.05)}
    stack.fake.fake.state.label_fn = label
    answer = stack.score("p_done", "/score/dense", points=6, nframes=8)
    assert answer.status_code == 200, answer.text
    curve = answer.json()["curve"]
    given = dict(seen)
    assert len(curve) == 6 and len(given) == 6
    # each point is what the fake put on "True" for the prefix ending at that frame
    ramp = episode_frames(24, 64, 64)
    for point in curve:
        level = frame_level(ramp[point["frame_index"]]) / 255
        nearest = min(given, key=lambda seen_level: abs(seen_level - level))
        assert abs(nearest - level) < 0.02  # the JPEG of that frame
        assert point["score"] == pytest.approx(given[nearest])
    assert [p["score"] for p in curve] == sorted(p["score"] for p in curve)


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"samples": 3, "temperature": 0.5}, "backend_kwargs.samples"),
    ({"logprob_score": True}, "backend_kwargs.logprob_score"),
    ({"constrain": True}, "backend_kwargs.constrain"),
    ({"score_mode": "percentage"}, "backend_kwargs.score_mode"),
])
def test_other_estimators_do_not_apply_to_a_probability(stack, kwargs, field):
    answer = stack.score("p_done", backend_kwargs=kwargs)
    assert answer.status_code == 422, answer.text
    error = answer.json()["error"]
    assert error["field"] == field and ("probability" in error["message"]), error
    assert not stack.fake.chat_requests  # refused before any call


def test_a_word_of_several_tokens_is_a_template_error_not_a_score(stack):
    answer = stack.score("two_tokens")
    assert answer.status_code == 500, answer.text
    error = answer.json()["error"]
    assert error["code"] == "prompt_template_invalid" and re.search(r"'Definitely yes' is \d+ tokens", error["message"])
    assert not stack.fake.chat_requests


def test_a_server_that_ignores_the_token_ids_is_a_bad_response_never_a_score(stack):
    # an older vLLM, or a server in front that drops logprob_token_ids: logprobs without the words
    stack.fake.fake.script({"reply": "True", "ignore_label_ids": True})
    answer = stack.score("p_done")
    assert answer.status_code == 502, answer.text
    error = answer.json()["error"]
    assert error["code"] == "upstream_bad_response" and "no logprob for 'True', 'False'" in error["message"]


@pytest.mark.parametrize(("reply", "score"), [("ANSWER: 1", 0.0), ("ANSWER: 3", 0.5), ("ANSWER: 5", 1.0),
                                              ("The bowl is on the plate.\nANSWER: 4", 0.75)])
def test_roboreward_maps_its_five_levels_to_zero_one(stack, reply, score):
    stack.fake.config.default_text = reply
    answer = stack.score("roboreward")
    assert answer.status_code == 200, answer.text
    assert answer.json()["score"] == score and answer.json()["parse"]["source"] == "label"
    regex = stack.fake.chat_requests[-1]["structured_outputs"]["regex"]
    assert regex == "ANSWER: (5|4|3|2|1)" and re.fullmatch(regex, "ANSWER: 4")


@pytest.mark.parametrize("reply", ["ANSWER: 6", "ANSWER: 4 because the bowl moved", "4", "ANSWER: 2\nANSWER: 4"])
def test_roboreward_replies_off_its_format_are_unparseable(stack, reply):
    stack.fake.config.default_text = reply
    answer = stack.score("roboreward")
    assert answer.status_code == 502 and answer.json()["error"]["code"] == "unparseable_score", answer.text


def test_the_report_gives_each_dense_curve_its_voc_by_outcome(stack, tmp_path):
    """Curves of successes rise (the ramp forward) and of failures fall (the ramp reversed): the
    report's VOC per outcome equals scipy's Spearman of each curve against its frame order."""
    def label(body: dict) -> dict[str, float]:
        level = frame_level(last_video_frame(body)) / 255
        return {"True": math.log(level * 0.9), "False": math.log(0.05)}
    stack.fake.fake.state.label_fn = label
    ramp = episode_frames(24, 64, 64)
    expected: dict[str, list[float]] = {"success": [], "failure": []}
    for episode, success in enumerate([True, False, True]):
        frames = ramp if success else ramp[::-1].copy()
        answer = stack.http.post("/score/dense", json={
            "task_text": TASK, "frames_npy": npy_b64(frames), "backend": "p_done", "points": 5, "nframes": 8,
            "metadata": {"run": "voc", "episode_id": episode, "task_id": 3, "env_success": success}})
        assert answer.status_code == 200, answer.text
        scores = [p["score"] for p in answer.json()["curve"]]
        expected["success" if success else "failure"].append(spearmanr(range(len(scores)), scores).statistic)
    stack.fake.fake.state.reply_fn = _gvl_grader({})  # and one curve from one call (GVL): its VOC too
    gvl = stack.http.post("/score/dense", json={
        "task_text": TASK, "frames_npy": npy_b64(ramp[::-1].copy()), "backend": "gvl", "points": 6,
        "metadata": {"run": "voc", "episode_id": 9, "task_id": 3, "env_success": False}}).json()
    gvl_scores = [p["score"] for p in gvl["curve"]]
    logs = build_report(stack.audit_log, out=tmp_path / "report")["logs"][0]["dense"]
    assert logs["gvl"]["failure"]["mean"] == pytest.approx(spearmanr(range(6), gvl_scores).statistic)
    dense = logs["p_done"]
    assert dense["success"]["curves"] == 2 and dense["failure"]["curves"] == 1
    assert dense["success"]["mean"] == pytest.approx(np.mean(expected["success"]))
    assert dense["failure"]["mean"] == pytest.approx(expected["failure"][0])
    assert dense["success"]["mean"] > 0.9 and dense["failure"]["mean"] < -0.9  # reversed: falls
    assert dense["tasks"]["3"]["all"]["curves"] == 3
    assert "Dense curves" in (tmp_path / "report" / "report.html").read_text()


# -- GVL: one call, the frames shown shuffled -------------------------------------------------------
def _images(body: dict) -> list[tuple[str | None, float]]:
    """(the text just before it, its grey level) of each image in the user turn, in order."""
    shown, before = [], None
    for part in body["messages"][-1]["content"]:
        if part["type"] == "text":
            before = part["text"]
        else:
            shown.append((before, frame_level(decode_jpeg_b64(part["image_url"]["url"].partition(",")[2]))))
            before = None
    return shown


def _gvl_grader(seen: dict[int, tuple[float, int]]):
    """Each shown frame's value = its grey level as a percentage (rounded), written in the shown
    numbering but listed in a scrambled order; `seen[n]` = (level, value) of frame n."""
    def reply(body: dict) -> str:
        seen.clear()
        for label, level in _images(body)[1:]:
            number = int(re.fullmatch(r"Frame (\d+):", label).group(1))
            seen[number] = (level, round(level / 255 * 100))
        lines = [f"Frame {n}: Task Completion Percentages:{value}%" for n, (_, value) in seen.items()]
        return "Here you go.\n" + "\n".join(reversed(lines))
    return reply


def test_gvl_shows_the_frames_shuffled_and_its_curve_is_their_values_in_time_order(stack):
    seen: dict[int, tuple[float, int]] = {}
    stack.fake.fake.state.reply_fn = _gvl_grader(seen)
    answer = stack.score("gvl", "/score/dense", points=6)
    assert answer.status_code == 200, answer.text
    dense = answer.json()
    assert dense["method"] == "shuffled" and dense["attempts"] == 1 and len(stack.fake.chat_requests) == 1
    (result,) = dense["points"]
    order = result["shuffle"]["order"]
    assert sorted(order) == list(range(6)) and order != list(range(6))
    body = stack.fake.chat_requests[0]
    images = _images(body)
    # the first frame is the 0% reference, then "Frame n:" before each shown frame
    assert images[0][0].endswith("Initial robot scene:") and images[0][1] == pytest.approx(20, abs=2)
    assert [label for label, _ in images[1:]] == [f"Frame {n}:" for n in range(1, 7)]
    ramp = episode_frames(24, 64, 64)
    indices = result["frames"]["indices"]
    assert indices == [0, *[p["frame_index"] for p in dense["curve"]]] and indices[-1] == 23
    for n, at in enumerate(order, start=1):  # shown number n is the frame `at` places after the reference
        assert seen[n][0] == pytest.approx(frame_level(ramp[indices[at + 1]]), abs=2)
    # the curve: each frame's value as the fake gave it for the image that showed it, in time order
    by_level = {level: value for level, value in seen.values()}
    for point in dense["curve"]:
        level = min(by_level, key=lambda lv: abs(lv - frame_level(ramp[point["frame_index"]])))
        assert point["raw_score"] == by_level[level] and point["score"] == by_level[level] / 100
    raw = [p["raw_score"] for p in dense["curve"]]
    assert raw == sorted(raw) and result["score"] == dense["curve"][-1]["score"]
    regex = body["structured_outputs"]["regex"]
    assert len(regex.split("\n")) == 6
    assert re.fullmatch(regex, "\n".join(f"Frame {n}: Task Completion Percentages:{n * 10}%" for n in range(1, 7)))
    assert not re.fullmatch(regex, "Frame 1: Task Completion Percentages:101%")


def test_gvl_the_seed_decides_the_order_and_is_in_the_provenance(stack):
    seen: dict[int, tuple[float, int]] = {}
    stack.fake.fake.state.reply_fn = _gvl_grader(seen)
    orders = []
    for seed in (7, 7, 8):
        result = stack.score("gvl", nframes=7, backend_kwargs={"shuffle_seed": seed}).json()
        assert result["shuffle"]["seed"] == seed
        orders.append(result["shuffle"]["order"])
    assert orders[0] == orders[1] != orders[2]
    default = [stack.score("gvl", nframes=7).json()["shuffle"] for _ in range(2)]
    assert default[0] == default[1]  # from the frames: the same episode is shown the same way


@pytest.mark.parametrize(("reply", "says"), [
    ("Frame 1: Task Completion Percentages:10%\nFrame 2: Task Completion Percentages:20%", "no value for frame 3"),
    ("\n".join(f"Frame {n}: Task Completion Percentages:{n}%" for n in (1, 2, 3, 3)), "two values for frame 3"),
    ("\n".join(f"Frame {n}: Task Completion Percentages:{n}%" for n in (1, 2, 3, 4)), "frame 4, which was not shown"),
    ("\n".join(f"Frame {n}: Task Completion Percentages:{v}%" for n, v in ((1, 5), (2, 150), (3, 9))),
     "not on the 0-100 scale"),
])
def test_gvl_a_reply_without_exactly_one_value_per_frame_is_no_curve(stack, reply, says):
    stack.fake.config.default_text = reply
    answer = stack.score("gvl", "/score/dense", points=3)
    assert answer.status_code == 502, answer.text
    error = answer.json()["error"]
    assert error["code"] == "unparseable_score" and says in error["message"], error


def test_gvl_pictures_go_only_where_the_template_places_them(stack):
    """The slots are the layout's: a caller can neither fill them (backend_kwargs) nor add one
    (its task text holds `${frames}` as text, never a second set of pictures)."""
    refused = stack.score("gvl", nframes=4, backend_kwargs={"frames": "x"})
    assert refused.status_code == 422 and refused.json()["error"]["field"] == "backend_kwargs.frames", refused.text
    stack.fake.fake.state.reply_fn = _gvl_grader({})
    answer = stack.http.post("/score", json={"task_text": "stack ${frames} then ${first_frame}", "nframes": 4,
                                             "frames_npy": FRAMES, "backend": "gvl"})
    assert answer.status_code == 200, answer.text
    body = stack.fake.chat_requests[-1]
    assert len(_images(body)) == 4  # the reference and 3 shown frames, once each
    texts = [p["text"] for p in body["messages"][-1]["content"] if p["type"] == "text"]
    assert any("stack ${frames} then ${first_frame}" in text for text in texts)


def test_gvl_on_an_episode_shorter_than_its_frames_constrains_the_frames_shown(stack):
    """5 frames, 9 asked: the reference and 4 shown; the constraint holds 4 lines, so the reply it
    allows is a score (not a re-ask for a fifth frame nobody saw)."""
    seen: dict[int, tuple[float, int]] = {}
    stack.fake.fake.state.reply_fn = _gvl_grader(seen)
    answer = stack.http.post("/score", json={"task_text": TASK, "frames_npy": npy_b64(episode_frames(5, 64, 64)),
                                             "backend": "gvl", "nframes": 9})
    assert answer.status_code == 200, answer.text
    regex = stack.fake.chat_requests[-1]["structured_outputs"]["regex"]
    assert len(regex.split("\n")) == 4 and len(answer.json()["per_frame"]) == 4 and len(seen) == 4


@pytest.mark.parametrize(("backend", "says"), [
    ("p_done", "probability"),  # its template answers one token: a label of -1 needs two
    ("gvl", "shuffled_images"),  # one value per shuffled frame: no place for two episodes
])
def test_compare_on_a_backend_that_cannot_write_a_label_is_a_422_before_any_call(stack, backend, says):
    # found by review: P(done) backends cut every label at max_tokens 1 (re-asked, then a 502),
    # and the GVL layout raised a ValueError (a 500)
    episodes = [{"frames_npy": FRAMES}, {"frames_npy": FRAMES}]
    response = stack.http.post("/compare", json={"task_text": TASK, "episodes": episodes, "backend": backend})
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["field"] == "backend" and says in error["message"], error
    assert stack.fake.chat_requests == []
