"""A constrained reply is always a score: every string vLLM may sample under `answer_regex` parses,
on the scale of every score_mode, for every shipped template (hypothesis draws from the regex)."""

from dataclasses import replace

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.answers.constraints import answer_regex
from proxy.answers.parse import AnswerSpec, parse_score
from proxy.answers.per_frame import parse_per_frame, shuffle_order
from proxy.answers.scales import SCORE_MODES, Scale, scale_for_mode
from proxy.errors import ScoreParseError
from proxy.prompting.templates import PromptStore
from tests.helpers import PROMPTS_DIR

STORE = PromptStore(PROMPTS_DIR)
# the score templates (a comparison template has queries, not a user message)
# (a probability answer is read from the logprobs, never constrained: tests/rules/test_prompts.py;
# a per-frame answer's constraint depends on the frames shown: below)
SHIPPED = sorted(p.stem for p in PROMPTS_DIR.glob("*.yaml")
                 if "user" in (doc := yaml.safe_load(p.read_text()))
                 and not {"probability", "per_frame"} & set(doc["answer"]))
EXTRA_SCALES = [Scale(0, 9), Scale(1, 10), Scale(0, 999)]


def _answers() -> list[tuple[str, AnswerSpec]]:
    cases = []
    for name in SHIPPED:
        declared = STORE.get(name).answer
        for mode in SCORE_MODES:
            cases.append((f"{name}/{mode}", replace(declared, scale=scale_for_mode(mode, declared.scale))))
    untagged = AnswerSpec(tags=(), untagged=True, scale=Scale(0, 1))
    cases += [(f"untagged/{s.name}", replace(untagged, scale=s)) for s in EXTRA_SCALES]
    return cases


@pytest.mark.parametrize(("label", "spec"), _answers(), ids=[label for label, _ in _answers()])
def test_every_reply_the_constraint_allows_parses_to_a_score_on_the_scale(label, spec):
    @given(reply=st.from_regex(answer_regex(spec), fullmatch=True))
    @settings(max_examples=60, database=None)
    def check(reply):
        parsed = parse_score(reply, spec, "auto", finish_reason="stop")
        assert 0.0 <= parsed.score <= 1.0, (label, reply, parsed)

    check()


def test_an_integer_scale_is_spelled_out_so_off_scale_numbers_cannot_be_sampled():
    regex = answer_regex(AnswerSpec(tags=(), untagged=True, scale=Scale(0, 100)))
    assert regex == "(" + "|".join(str(v) for v in range(100, -1, -1)) + ")"


def test_wider_and_fractional_scales_bound_the_digits_and_leave_the_range_to_the_parser():
    wide = AnswerSpec(tags=(), untagged=True, scale=Scale(0, 5000))
    assert answer_regex(wide) == r"\d{1,4}(\.\d{1,3})?"
    with pytest.raises(ScoreParseError, match="not one number on the 0-5000 scale"):
        parse_score("9999", wide, "auto", finish_reason="stop")  # allowed by the regex, refused, then re-asked


@pytest.mark.parametrize("shown", [1, 3, 8])
def test_every_reply_the_per_frame_constraint_allows_is_one_value_per_shown_frame(shown):
    spec = STORE.get("gvl").answer
    shuffle = shuffle_order(shown, seed=shown)

    @given(reply=st.from_regex(answer_regex(spec, shown), fullmatch=True))
    @settings(max_examples=40, database=None)
    def check(reply):
        in_time, by_number = parse_per_frame(reply, spec, shuffle, finish_reason="stop")
        assert sorted(by_number) == list(range(1, shown + 1)) and all(0 <= p.score <= 1 for p in in_time)
        # un-shuffled: the value written for shown number n lands at the time place order[n - 1]
        assert all(in_time[shuffle.order[n - 1]].raw_score == by_number[n] for n in by_number)

    check()
