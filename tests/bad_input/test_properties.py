"""Hypothesis properties of the score parser, the frame sampler, and the /score request parser.

Stronger than tests/rules: a tagged score survives any surrounding text and <think> blocks full of
numbers and decoy tags; the parser raises nothing but ScoreParseError, never invents a 0, and never
reads a number found among words; the
sampler's indices are evenly spaced, mirror-symmetric and cover the episode; and no JSON body
makes the running proxy answer a 5xx or anything outside the documented error shape.
"""

from __future__ import annotations

import math
import re

import pytest
from hypothesis import HealthCheck, assume, event, example, given, settings
from hypothesis import strategies as st

from proxy.answers.parse import AnswerSpec, parse_score
from proxy.answers.scales import BINARY, PERCENTAGE, SCORE_MODES, Scale
from proxy.errors import ScoreParseError
from tests.fakes.episodes import episode_frames, npy_b64
from vlm_protocol.frames import sample_indices

# -- the score parser --------------------------------------------------------------------------------
SPEC = AnswerSpec(tags=("answer",), untagged=False, scale=PERCENTAGE)
SPECS = st.sampled_from([SPEC, AnswerSpec(tags=(), untagged=True, scale=Scale(1, 100)),
                         AnswerSpec(tags=("score",), untagged=True, scale=BINARY)])
_TAGGY = re.compile(r"</?\s*(think|answer)", re.I)
noise = st.text(max_size=120).filter(lambda t: not _TAGGY.search(t))
reasoning = st.lists(
    st.one_of(st.text(max_size=40), st.integers(-10**6, 10**6).map(str),
              st.floats(0, 1000, allow_nan=False).map(lambda f: f"{f:.3f}%"),
              st.integers(0, 100).map(lambda v: f"<answer>{v}</answer>"),
              st.integers(0, 100).map(lambda v: f"<score>{v}</score> [SCORE] {v}/10 [[{v}]]")),
    max_size=6).map(" ".join).filter(lambda t: "</think" not in t.lower())


@given(value=st.integers(0, 100), form=st.sampled_from(["{v}", " {v} ", "{v}%", "{v}/100", "\n{v}.\n"]),
       before=noise, thinking=reasoning, between=noise, after=noise,
       mode=st.sampled_from(["percentage", "auto"]))
def test_a_tagged_score_survives_any_surrounding_text(value, form, before, thinking, between, after, mode):
    text = f"{before}<think>{thinking}</think>{between}<answer>{form.format(v=value)}</answer>{after}"
    parsed = parse_score(text, SPEC, mode, finish_reason="stop")
    assert parsed.source == "answer_tag"
    assert parsed.score == pytest.approx(value / 100)


@given(text=st.text(max_size=400), spec=SPECS, mode=st.sampled_from(SCORE_MODES),
       finish=st.sampled_from([None, "stop", "length", "content_filter"]))
@example(text="<answer>" + "9" * 400 + "</answer>", spec=SPEC, mode="percentage", finish=None)
@example(text="<think>" * 50 + "</think>" * 3 + "<answer>5/0</answer>", spec=SPEC, mode="auto", finish="length")
@example(text="[SCORE] 7/0 [[", spec=SPEC, mode="unit", finish=None)
def test_the_parser_raises_only_score_parse_errors(text, spec, mode, finish):
    try:
        parsed = parse_score(text, spec, mode, finish_reason=finish)
    except ScoreParseError as err:
        assert err.message and err.output_text == text
        return
    assert finish != "length"  # a reply cut at max_tokens is never a score
    assert 0.0 <= parsed.score <= 1.0 and math.isfinite(parsed.raw_score)
    if mode == "binary":
        assert parsed.score in (0.0, 1.0)


@given(text=st.text(max_size=300), spec=SPECS, mode=st.sampled_from(SCORE_MODES))
def test_a_zero_is_only_ever_a_zero_the_model_wrote(text, spec, mode):
    """No silent 0: a 0.0 score comes from a written 0 or a negative verdict on a binary scale."""
    try:
        parsed = parse_score(text, spec, mode)
    except ScoreParseError:
        return
    if parsed.score == 0.0:
        assert parsed.raw_score == 0.0


@given(number=st.integers(0, 10**4), words_before=st.text(min_size=1, max_size=30).filter(str.strip))
def test_a_number_among_words_is_never_a_score(number, words_before):
    """The old parser's failure: "Task failed at frame 12." became 0.12."""
    text = f"{words_before} {number} frames"
    with pytest.raises(ScoreParseError):
        parse_score(text, SPEC, "percentage")
    with pytest.raises(ScoreParseError):
        parse_score(text, AnswerSpec(tags=(), untagged=True, scale=Scale(1, 100)))


def test_a_fraction_with_an_overflowing_denominator_is_not_zero():
    with pytest.raises(ScoreParseError):
        parse_score("<answer>1/" + "9" * 400 + "</answer>", SPEC, "percentage")


@pytest.mark.parametrize("text", ["No, I cannot see any video in this message.",
                                  "No: the frames did not load, so I can't tell."])
def test_a_refusal_starting_with_no_is_not_a_zero(text):
    with pytest.raises(ScoreParseError):
        parse_score(text, SPEC, "percentage")
    with pytest.raises(ScoreParseError):
        parse_score(text, AnswerSpec(tags=(), untagged=True, scale=BINARY))


words = st.text(alphabet=st.characters(whitelist_categories=("Ll", "Lu"), whitelist_characters=" "), max_size=30)


@given(first=st.integers(0, 10**4), second=st.integers(0, 10**4), a=words, b=words, c=words,
       spec=SPECS, mode=st.sampled_from(SCORE_MODES))
def test_untagged_numbers_among_words_are_never_a_score(first, second, a, b, c, spec, mode):
    assume((a + b + c).strip())
    with pytest.raises(ScoreParseError):
        parse_score(f"{a} {first} {b} {second} {c}", spec, mode)


@given(value=st.integers(101, 10**9), tag=st.sampled_from(["answer", "score"]))
def test_out_of_range_is_an_error_never_clamped(value, tag):
    spec = AnswerSpec(tags=(tag,), untagged=False, scale=PERCENTAGE)
    with pytest.raises(ScoreParseError, match="not one number on the 0-100 scale"):
        parse_score(f"<{tag}>{value}</{tag}>", spec, "percentage")


# -- the frame sampler ---------------------------------------------------------------------------------
@given(source=st.integers(1, 10**7), wanted=st.integers(1, 3000))
@example(source=4, wanted=3)
@example(source=10**7, wanted=2)
def test_sampled_indices_are_even_symmetric_and_cover_the_episode(source, wanted):
    indices = sample_indices(source, wanted)
    n = len(indices)
    assert n == min(source, wanted)
    assert all(b > a for a, b in zip(indices, indices[1:], strict=False))  # strictly increasing
    assert indices[-1] == source - 1 and indices[0] >= 0
    if n == 1:
        return
    assert indices[0] == 0
    step = (source - 1) / (n - 1)
    assert all(abs(i - k * step) <= 0.5 for k, i in enumerate(indices))  # within half a frame of ideal
    gaps = {b - a for a, b in zip(indices, indices[1:], strict=False)}
    assert gaps <= {math.floor(step), math.ceil(step)}  # as even as integers allow
    assert all(abs(indices[k] + indices[n - 1 - k] - (source - 1)) <= 1 for k in range(n))  # mirror
    assert max(gaps) <= math.ceil(step)  # no frame is further than half a gap from a sample


@given(source=st.integers(-10, 10**6), wanted=st.integers(-10, 10**4))
def test_sampler_refuses_empty_input_with_value_error_only(source, wanted):
    try:
        indices = sample_indices(source, wanted)
    except ValueError:
        assert source <= 0 or wanted <= 0
        return
    assert source > 0 and wanted > 0 and len(indices) == min(source, wanted)


@given(source=st.integers(1, 2000), a=st.integers(1, 200), b=st.integers(1, 200))
def test_sampling_is_monotone_in_the_frames_asked_for(source, a, b):
    """Asking for more frames never shrinks the span covered or the count sent."""
    small, large = sorted((a, b))
    assert len(sample_indices(source, small)) <= len(sample_indices(source, large))
    assert sample_indices(source, large)[-1] == sample_indices(source, small)[-1] == source - 1


# -- the /score request parser, through the running proxy ----------------------------------------------
SMALL = npy_b64(episode_frames(3, 32, 32))
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20).filter(lambda t: "\x00" not in t),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=6)
FIELDS = ["task_text", "video_path", "frames", "frames_npy", "fps", "nframes", "max_pixels", "backend",
          "backend_kwargs"]
# A valid body (the fakes answer 75 and 60, so score_mode stays percentage/auto) ...
valid_bodies = st.fixed_dictionaries(
    {"task_text": st.text(min_size=1, max_size=40), "frames_npy": st.just(SMALL)},
    optional={"nframes": st.integers(1, 128), "max_pixels": st.integers(3136, 1_605_632),
              "fps": st.floats(0.01, 1000), "backend": st.sampled_from(["PRIMO-R1", "qwen2_5_vl_vllm"]),
              "backend_kwargs": st.fixed_dictionaries({}, optional={
                  "temperature": st.floats(0, 2), "top_k": st.integers(0, 100), "seed": st.integers(0, 2**31),
                  "score_mode": st.sampled_from(["percentage", "auto"])})})
# ... then one to three fields replaced (or added) with arbitrary JSON or near-miss values.
near_miss = st.one_of(json_values, st.sampled_from(
    ["/etc/passwd", "relative.mp4", "/nonexistent/x.mp4", "", "nope", SMALL[:50], [SMALL], {"temperature": 3}]),
    st.integers(-3, 3 * 10**6))
mutations = st.dictionaries(st.sampled_from(FIELDS + ["extra"]), near_miss, min_size=1, max_size=3)
bodies = st.one_of(valid_bodies, st.tuples(valid_bodies, mutations).map(lambda p: {**p[0], **p[1]}),
                   st.dictionaries(st.sampled_from(FIELDS + ["extra"]), json_values, max_size=5))


@settings(max_examples=60, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=bodies)
def test_no_request_body_makes_the_proxy_fail(env, allow_upstream, body):
    response = env.post(json=body, label="hypothesis body")
    event(f"HTTP {response.status_code}")
    assert response.status_code < 500, (body, response.text)
    payload = response.json()
    if response.status_code == 200:
        assert 0.0 <= payload["score"] <= 1.0
    else:
        error = payload["error"]
        assert error["code"] and error["message"] and error["request_id"], payload
        assert response.status_code in (403, 404, 413, 422), payload
