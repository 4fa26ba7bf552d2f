"""Every malformed /score field and body: a 4xx naming the problem, fast, and nothing sent upstream."""

from __future__ import annotations

import json

import pytest

from tests.bad_input.common import BASE, DROP, SMALL, expect


def _body(**changes) -> dict:
    body = dict(BASE)
    for key, value in changes.items():
        if value is DROP:
            body.pop(key, None)
        else:
            body[key] = value
    return body


# (changes to BASE, expected field); all are 422 invalid_request unless the id says otherwise
FIELD_CASES = {
    "task_text missing": ({"task_text": DROP}, "task_text"),
    "task_text null": ({"task_text": None}, "task_text"),
    "task_text empty": ({"task_text": ""}, "task_text"),
    "task_text int": ({"task_text": 5}, "task_text"),
    "task_text list": ({"task_text": ["t"]}, "task_text"),
    "task_text object": ({"task_text": {"en": "t"}}, "task_text"),
    "task_text bool": ({"task_text": True}, "task_text"),
    "task_text too long": ({"task_text": "x" * 4097}, "task_text"),
    "video_path int": ({"frames_npy": DROP, "video_path": 5}, "video_path"),
    "video_path list": ({"frames_npy": DROP, "video_path": ["/a.mp4"]}, "video_path"),
    "frames string": ({"frames_npy": DROP, "frames": "aGVsbG8="}, "frames"),
    "frames of ints": ({"frames_npy": DROP, "frames": [1, 2]}, "frames.0"),
    "frames with null": ({"frames_npy": DROP, "frames": [None]}, "frames.0"),
    "frames_npy int": ({"frames_npy": 5}, "frames_npy"),
    "frames_npy list": ({"frames_npy": [SMALL]}, "frames_npy"),
    "fps zero": ({"fps": 0}, "fps"),
    "fps negative": ({"fps": -4}, "fps"),
    "fps huge": ({"fps": 1001}, "fps"),
    "fps string": ({"fps": "fast"}, "fps"),
    "nframes zero": ({"nframes": 0}, "nframes"),
    "nframes negative": ({"nframes": -3}, "nframes"),
    "nframes fraction": ({"nframes": 1.5}, "nframes"),
    "nframes string": ({"nframes": "many"}, "nframes"),
    "nframes list": ({"nframes": [16]}, "nframes"),
    "nframes huge": ({"nframes": 1_000_000}, "nframes"),
    "nframes 2**64": ({"nframes": 2**64}, "nframes"),
    "nframes 10**30": ({"nframes": 10**30}, "nframes"),
    "nframes just over cap": ({"nframes": 129}, "nframes"),
    "max_pixels zero": ({"max_pixels": 0}, "max_pixels"),
    "max_pixels negative": ({"max_pixels": -5}, "max_pixels"),
    "max_pixels under one patch": ({"max_pixels": 783}, "max_pixels"),
    "max_pixels over limit": ({"max_pixels": 1_605_633}, "max_pixels"),
    "max_pixels 10**12": ({"max_pixels": 10**12}, "max_pixels"),
    "max_pixels 2**63": ({"max_pixels": 2**63}, "max_pixels"),
    "max_pixels fraction": ({"max_pixels": 200704.5}, "max_pixels"),
    "max_pixels string": ({"max_pixels": "big"}, "max_pixels"),
    "backend int": ({"backend": 5}, "backend"),
    "backend list": ({"backend": ["qwen2_5_vl_vllm"]}, "backend"),
    "backend_kwargs list": ({"backend_kwargs": ["temperature", 0]}, "backend_kwargs"),
    "backend_kwargs string": ({"backend_kwargs": "temperature=0"}, "backend_kwargs"),
    "temperature string": ({"backend_kwargs": {"temperature": "hot"}}, "backend_kwargs.temperature"),
    "temperature negative": ({"backend_kwargs": {"temperature": -1}}, "backend_kwargs.temperature"),
    "top_p zero": ({"backend_kwargs": {"top_p": 0}}, "backend_kwargs.top_p"),
    "top_k negative": ({"backend_kwargs": {"top_k": -1}}, "backend_kwargs.top_k"),
    "min_p over one": ({"backend_kwargs": {"min_p": 2}}, "backend_kwargs.min_p"),
    "repetition_penalty zero": ({"backend_kwargs": {"repetition_penalty": 0}}, "backend_kwargs.repetition_penalty"),
    "max_tokens zero": ({"backend_kwargs": {"max_tokens": 0}}, "backend_kwargs.max_tokens"),
    "max_tokens over cap": ({"backend_kwargs": {"max_tokens": 10**9}}, "backend_kwargs.max_tokens"),
    "seed string": ({"backend_kwargs": {"seed": "x"}}, "backend_kwargs.seed"),
    "score_mode unknown": ({"backend_kwargs": {"score_mode": "logit"}}, "backend_kwargs.score_mode"),
    "score_mode int": ({"backend_kwargs": {"score_mode": 5}}, "backend_kwargs.score_mode"),
    "kwarg n": ({"backend_kwargs": {"n": 5}}, "backend_kwargs.n"),
    "kwarg stream": ({"backend_kwargs": {"stream": True}}, "backend_kwargs.stream"),
    "kwarg model": ({"backend_kwargs": {"model": "other"}}, "backend_kwargs.model"),
    "kwarg messages": ({"backend_kwargs": {"messages": []}}, "backend_kwargs.messages"),
    "kwarg guided_json": ({"backend_kwargs": {"guided_json": {}}}, "backend_kwargs.guided_json"),
    "kwarg task_text": ({"backend_kwargs": {"task_text": "override"}}, "backend_kwargs.task_text"),
    "kwarg undeclared template variable": ({"backend_kwargs": {"scene": "a kitchen"}}, "backend_kwargs.scene"),
    "metadata list": ({"metadata": [1]}, "metadata"),
    "metadata env_success string": ({"metadata": {"env_success": "maybe"}}, "metadata.env_success"),
    "metadata step fraction": ({"metadata": {"step": 1.5}}, "metadata.step"),
    "metadata run too long": ({"metadata": {"run": "r" * 257}}, "metadata.run"),
    "metadata nested": ({"metadata": {"scene": {"room": "kitchen"}}}, "metadata"),
    "metadata too many keys": ({"metadata": {f"k{i}": i for i in range(33)}}, "metadata"),
    "metadata long key": ({"metadata": {"k" * 65: 1}}, "metadata"),
    "metadata long value": ({"metadata": {"note": "n" * 257}}, "metadata"),
    "extra field": ({"surprise": 1}, "surprise"),
    "extra field model": ({"model": "Qwen2.5-VL-7B-Instruct"}, "model"),
    "extra field prompt": ({"prompt": "ignore the video"}, "prompt"),
}


@pytest.mark.parametrize(("changes", "field"), list(FIELD_CASES.values()), ids=list(FIELD_CASES))
def test_bad_field_is_422_naming_it(env, changes, field):
    error = expect(env.post(json=_body(**changes), label=f"field {field}"), 422, "invalid_request", field)
    assert field.split(".")[-1] in error["message"], error  # the message names it too


@pytest.mark.parametrize(("changes", "mentions"), [
    ({"frames_npy": DROP}, "exactly one"),
    ({"video_path": "/x.mp4"}, "exactly one"),
    ({"frames": ["aGVsbG8="]}, "exactly one"),
    ({"frames_npy": None}, "exactly one"),
])
def test_zero_or_two_frame_sources(env, changes, mentions):
    expect(env.post(json=_body(**changes)), 422, "invalid_request", mentions=mentions)


def test_a_body_without_a_frame_source_says_the_source_is_missing(env):
    error = expect(env.post(json=_body(frames_npy=DROP)), 422, "invalid_request", "body", mentions="no frame source")
    assert "not a JSON object" not in error["message"] and "video_path, frames, frames_npy" in error["message"]


@pytest.mark.parametrize("path", ["/score", "/score/batch", "/score/dense", "/compare"])
@pytest.mark.parametrize("content_type", ["application/x-www-form-urlencoded", "text/plain", None])
def test_a_json_body_sent_under_another_content_type_names_the_one_expected(env, path, content_type):
    """curl -d without -H 'content-type: application/json' sends a form type: the answer says so."""
    headers = {"content-type": content_type} if content_type else {}
    error = expect(env.post(path=path, content=json.dumps(BASE).encode(), headers=headers, label=str(content_type)),
                   422, "invalid_request", "content-type", mentions="content-type: application/json")
    assert (content_type or "without a content-type") in error["message"]
    assert "not a JSON object" not in error["message"]


def test_a_json_content_type_with_parameters_or_a_suffix_is_json(env):
    for content_type in ("application/json; charset=utf-8", "application/vnd.api+json"):
        expect(env.post(content=json.dumps(_body(frames_npy=DROP)).encode(), headers={"content-type": content_type},
                        label=content_type), 422, "invalid_request", "body", mentions="no frame source")


@pytest.mark.parametrize("backend", ["gpt-9", "", "qwen2_5_vl_vllm ", "QWEN2_5_VL_VLLM", "../PRIMO-R1", "模型"])
def test_unknown_backend_is_404_listing_the_known_ones(env, backend):
    error = expect(env.post(json=_body(backend=backend)), 404, "unknown_backend", "backend")
    assert "qwen2_5_vl_vllm" in error["message"] and "PRIMO-R1" in error["message"]


@pytest.mark.parametrize(("content", "content_type"), [
    (b"", "application/json"),
    (b"{not json", "application/json"),
    (b"[]", "application/json"),
    (b"null", "application/json"),
    (b'"put the bowl on the plate"', "application/json"),
    (b"42", "application/json"),
    (b'{"task_text": "t", "frames_npy": "AAAA"', "application/json"),  # cut short
    (json.dumps(BASE).encode(), "text/plain"),
    (b"task_text=t&frames_npy=AAAA", "application/x-www-form-urlencoded"),
    (json.dumps({**BASE, "fps": float("nan")}).encode(), "application/json"),  # NaN is not JSON
    (json.dumps({**BASE, "nframes": float("inf")}).encode(), "application/json"),
])
def test_malformed_bodies_are_422(env, content, content_type):
    expect(env.post(content=content, headers={"content-type": content_type}, label=repr(content[:40])),
           422, "invalid_request")


@pytest.mark.parametrize("content", [
    b'{"task_text": "\xff\xfe", "frames_npy": "AAAA"}',
    ('{"task_text": "t", "frames_npy": "AAAA", "backend_kwargs": {"x": ' + "[" * 100_000 + "]" * 100_000
     + "}}").encode(),
], ids=["not utf-8", "nested 100k deep"])
def test_unparseable_bodies_are_422_in_the_error_shape(env, content):
    expect(env.post(content=content, headers={"content-type": "application/json"}, label="parse bug"),
           422, "invalid_request")
