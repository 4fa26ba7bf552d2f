"""The score parser: every accepted form, the mode rules, and what must be an error."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from proxy.errors import ScoreParseError
from proxy.parse import parse_score

TABLE = [
    # text, mode, score, raw, source
    ("<answer>85</answer>", "percentage", 0.85, 85, "answer_tag"),
    ("<answer> 85% </answer>", "auto", 0.85, 85, "answer_tag"),
    ("<answer>7/10</answer>", "auto", 0.7, 7, "answer_tag"),
    ("<answer>yes</answer>", "binary", 1.0, 1, "answer_tag"),
    ("<score>0.7</score>", "unit", 0.7, 0.7, "score_tag"),
    ("<score>40</score>", "auto", 0.4, 40, "score_tag"),
    ("Progress so far. [SCORE] 8/10", "auto", 0.8, 8, "score_marker"),
    ("SCORE: 65", "percentage", 0.65, 65, "score_marker"),
    ("Score: 7 out of 10", "percentage", 0.7, 7, "score_marker"),
    ("My rating: [[0.9]]", "unit", 0.9, 0.9, "double_bracket"),
    ("About 30% done.", "auto", 0.3, 30, "percent"),
    ("3 out of 4 steps", "auto", 0.75, 3, "fraction"),
    ("42", "percentage", 0.42, 42, "bare_number"),
    ("0.25", "auto", 0.25, 0.25, "bare_number"),
    ("1", "binary", 1.0, 1, "bare_number"),
    ("Yes, the bowl is on the plate.", "binary", 1.0, 1, "yes_no"),
    ("Failure.", "binary", 0.0, 0, "yes_no"),
    ("No, the bowl fell off.", "binary", 0.0, 0, "yes_no"),
]


@pytest.mark.parametrize(("text", "mode", "score", "raw", "source"), TABLE)
def test_table(text, mode, score, raw, source):
    parsed = parse_score(text, mode)
    assert parsed.score == pytest.approx(score)
    assert parsed.raw_score == pytest.approx(raw)
    assert parsed.source == source


def test_numbers_in_reasoning_never_win():
    text = ("<think><planning>3 steps, 100 cm</planning><observation>moved 12 cm</observation>"
            "<reasoning>2 of 3 done: 66</reasoning></think><answer>60</answer>")
    assert parse_score(text, "percentage").score == pytest.approx(0.6)
    # no tag after the reasoning: the reasoning's numbers are not a fallback
    with pytest.raises(ScoreParseError):
        parse_score("<think>it is 80 percent done</think> hmm", "percentage")


def test_reply_that_starts_inside_the_reasoning_ignores_it():
    # templates that open <think> in the prompt: the reply holds only the closing tag
    assert parse_score("reasoning: 50% done</think> Final: 80", "percentage").score == pytest.approx(0.8)


def test_truncated_reasoning_is_a_parse_failure_that_says_why():
    text = "<think><planning>1. grasp the bowl 2. place it at 45 degrees"
    with pytest.raises(ScoreParseError, match="finish_reason=length") as err:
        parse_score(text, "percentage", finish_reason="length")
    assert err.value.output_text == text


@pytest.mark.parametrize("text", [
    "", "I cannot tell.", "maybe 30 or 40", "<answer>unclear</answer>",
    "<answer>150</answer>",  # out of range is not clamped
    "no idea", "Not sure.", "The robot did not succeed or fail clearly",
    "No, I cannot see any video.",  # a refusal is not a verdict outside binary mode
])
def test_unparseable_is_an_error_never_zero(text):
    with pytest.raises(ScoreParseError):
        parse_score(text, "percentage")


def test_binary_mode_refuses_a_fraction():
    with pytest.raises(ScoreParseError, match="binary"):
        parse_score("<answer>0.4</answer>", "binary")


@given(st.integers(0, 100))
def test_any_percentage_in_answer_tag_round_trips(value):
    parsed = parse_score(f"<think>stuff 999</think><answer>{value}</answer>", "percentage")
    assert parsed.score == pytest.approx(value / 100)


@given(st.text(max_size=300))
def test_never_returns_out_of_range(text):
    try:
        parsed = parse_score(text, "auto")
    except ScoreParseError:
        return
    assert 0.0 <= parsed.score <= 1.0
