"""Preference labels (RL-VLM-F: 0 first better, 1 second, -1 none) and comparison templates, on their own."""

from __future__ import annotations

import pytest

from proxy.answers.preference import combine_orders, parse_compare_template, parse_label, read_description, swap_label
from proxy.errors import LabelParseError, PromptTemplateError
from tests.conftest import PROMPTS_DIR

SHIPPED = parse_compare_template("compare_rlvlmf", (PROMPTS_DIR / "compare_rlvlmf.yaml").read_bytes())
TAGGED = parse_compare_template("compare_tagged", b"""
variables: {task_text: {}}
episode_label: "Video ${number}"
query: "Which? ${task_text} <answer>0, 1 or -1</answer>"
describe: "Describe."
label: "${description} -> label?"
answer: {tags: [answer]}
""")


@pytest.mark.parametrize(("text", "label"), [("0", 0), ("1", 1), ("-1", -1), (" -1 ", -1), ("-1.", -1), ("1\n", 1),
                                             ("<think>maybe 1</think>-1", -1)])
def test_a_label_is_the_whole_reply(text, label):
    assert parse_label(text, SHIPPED) == (label, "untagged")


@pytest.mark.parametrize("text", ["", "2", "10", "-1 or 1", "Episode 1", "0.5", "- 1", "label: 1", "+1", "-0"])
def test_anything_else_is_unparseable_never_a_label(text):
    with pytest.raises(LabelParseError) as err:
        parse_label(text, SHIPPED)
    assert err.value.code == "unparseable_label" and err.value.status_code == 502


def test_a_cut_reply_is_unparseable_even_when_it_reads_as_a_label():
    with pytest.raises(LabelParseError, match="max_tokens"):
        parse_label("1", SHIPPED, finish_reason="length")


def test_a_tagged_template_reads_its_one_tag():
    assert parse_label("<think>x</think>So <answer>-1</answer>", TAGGED) == (-1, "answer_tag")
    for text in ("-1", "<answer>0</answer><answer>1</answer>", "<answer>yes</answer>"):
        with pytest.raises(LabelParseError):
            parse_label(text, TAGGED)


def test_swapped_orders_agree_or_give_no_preference():
    assert [swap_label(x) for x in (0, 1, -1)] == [1, 0, -1]
    assert combine_orders(0, 1) == (0, True) and combine_orders(1, 0) == (1, True)
    assert combine_orders(-1, -1) == (-1, True)
    assert combine_orders(0, 0) == (-1, False) and combine_orders(1, -1) == (-1, False)


def test_rendering_fills_the_number_and_the_description():
    assert SHIPPED.render("episode_label", {"task_text": "t", "number": 2}) == "Episode 2:"
    text = SHIPPED.render("label", {"task_text": "stack", "description": "D1"})
    assert "The goal is stack." in text and "\nD1\n" in text
    assert read_description("<think>hm</think> Both alike. ") == "Both alike."
    with pytest.raises(LabelParseError):
        read_description("  ")


@pytest.mark.parametrize(("yaml", "mentions"), [
    (b"variables: {task_text: {}}\nquery: q\ndescribe: d\nlabel: '${description}'\n", "episode_label"),
    (b"episode_label: E\nquery: q\ndescribe: d\nlabel: no description\n", "${description}"),
    (b"episode_label: E\nquery: '${oops}'\ndescribe: d\nlabel: '${description}'\n", "undeclared"),
    (b"variables: {number: {}}\nepisode_label: E\nquery: q\ndescribe: d\nlabel: '${description}'\n", "filled by"),
    (b"episode_label: E\nquery: q\ndescribe: d\nlabel: '${description}'\nanswer: {scale: binary}\n", "answer"),
    (b"episode_label: E\nuser: u\nquery: q\ndescribe: d\nlabel: '${description}'\n", "unknown keys"),
])
def test_a_broken_comparison_template_is_refused_with_the_reason(yaml, mentions):
    with pytest.raises(PromptTemplateError, match=mentions.replace("$", r"\$")):
        parse_compare_template("compare_x", yaml)
