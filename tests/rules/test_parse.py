"""The score parser: only the answer the template declares is a score; everything else is an error
that carries the reply. Never a number found elsewhere in the text."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from proxy.answers.parse import AnswerSpec, parse_score
from proxy.answers.scales import BINARY, PERCENTAGE, Scale
from proxy.errors import ScoreParseError

ANSWER_0_100 = AnswerSpec(tags=("answer",), untagged=False, scale=PERCENTAGE)  # PRIMO-R1
BARE_1_100 = AnswerSpec(tags=(), untagged=True, scale=Scale(1, 100))  # the seed's Qwen prompt
SCORE_0_10 = AnswerSpec(tags=("score",), untagged=False, scale=Scale(0, 10))
STARS_1_5 = AnswerSpec(tags=("answer",), untagged=False, scale=Scale(1, 5, zero=1))
VERDICT = AnswerSpec(tags=("answer",), untagged=True, scale=BINARY)
ROBOREWARD = AnswerSpec(tags=(), untagged=False, scale=Scale(1, 5, zero=1), label="ANSWER:")
REASONING = ("<think><planning>3 steps, 100 cm</planning><observation>moved 12 cm, frame 7"
             "</observation><reasoning>2 of 3 done: 66</reasoning></think>")

SCORES = [
    # reply, spec, score_mode, score, source
    ("<answer>85</answer>", ANSWER_0_100, "auto", 0.85, "answer_tag"),
    ("<answer> 85% </answer>", ANSWER_0_100, "auto", 0.85, "answer_tag"),
    ("<answer>\n60\n</answer>", ANSWER_0_100, "auto", 0.60, "answer_tag"),
    ("<ANSWER>42.5</ANSWER>", ANSWER_0_100, "auto", 0.425, "answer_tag"),
    (REASONING + "<answer>60</answer>", ANSWER_0_100, "auto", 0.60, "answer_tag"),
    ("half done</think><answer>50</answer>", ANSWER_0_100, "auto", 0.50, "answer_tag"),  # orphan </think>
    ("<answer>0</answer>", ANSWER_0_100, "auto", 0.0, "answer_tag"),
    ("<answer>100</answer>", ANSWER_0_100, "auto", 1.0, "answer_tag"),
    ("<answer>0.7</answer>", ANSWER_0_100, "unit", 0.7, "answer_tag"),  # score_mode picks the scale
    ("<answer>1</answer>", ANSWER_0_100, "percentage", 0.01, "answer_tag"),
    ("<answer>2</answer>", ANSWER_0_100, "percentage", 0.02, "answer_tag"),
    ("75", BARE_1_100, "auto", 0.75, "untagged"),
    ("75.", BARE_1_100, "auto", 0.75, "untagged"),
    ("  1\n", BARE_1_100, "auto", 0.01, "untagged"),  # "1" and "2" on the same scale
    ("2", BARE_1_100, "auto", 0.02, "untagged"),
    ("<score>7</score>", SCORE_0_10, "auto", 0.7, "score_tag"),
    ("<score>7/10</score>", SCORE_0_10, "auto", 0.7, "score_tag"),
    ("<answer>1</answer>", STARS_1_5, "auto", 0.0, "answer_tag"),
    ("<answer>4</answer>", STARS_1_5, "auto", 0.75, "answer_tag"),
    ("<answer>yes</answer>", VERDICT, "auto", 1.0, "answer_tag"),
    ("No.", VERDICT, "auto", 0.0, "untagged"),
    ("<answer>1</answer>", VERDICT, "auto", 1.0, "answer_tag"),
    ("ANSWER: 4", ROBOREWARD, "auto", 0.75, "label"),
    ("ANSWER:1", ROBOREWARD, "auto", 0.0, "label"),
    ("The bowl is on the plate, the gripper open.\nANSWER: 5\n", ROBOREWARD, "auto", 1.0, "label"),
    ("<think>ANSWER: 1 at first</think>ANSWER: 3", ROBOREWARD, "auto", 0.5, "label"),  # reasoning is not the answer
]

ERRORS = [
    # reply, spec, score_mode, what the message says
    ("Task failed at frame 12.", ANSWER_0_100, "percentage", "no answer tag"),
    ("The robot is at step 2 of the task.", ANSWER_0_100, "percentage", "no answer tag"),
    ("Before I give a score: 16 frames were shown. Final: 90%", ANSWER_0_100, "percentage", "no answer tag"),
    ("Only 1/4 subgoals done, yet I estimate 75%", ANSWER_0_100, "percentage", "no answer tag"),
    ("<answer>60</answer> wait, actually <answer>20</answer>", ANSWER_0_100, "percentage", "2 answer tags"),
    ("", ANSWER_0_100, "auto", "empty"),
    ("<answer></answer>", ANSWER_0_100, "auto", "not one number"),
    ("<answer>unclear</answer>", ANSWER_0_100, "auto", "not one number"),
    ("<answer>60 (most steps done)</answer>", ANSWER_0_100, "auto", "not one number"),
    ("<answer>30 or 40</answer>", ANSWER_0_100, "auto", "not one number"),
    ("<answer>150</answer>", ANSWER_0_100, "auto", "not one number"),  # out of range: never clamped
    ("<answer>-5</answer>", ANSWER_0_100, "auto", "not one number"),
    ("<answer>60", ANSWER_0_100, "auto", "never closed"),
    ("<answer>85</answer> <answer>", ANSWER_0_100, "auto", "never closed"),  # a second answer begun, cut
    ("<answer> <answer>85</answer>", ANSWER_0_100, "auto", "never closed"),
    (REASONING, ANSWER_0_100, "auto", "reasoning and no answer"),  # numbers in reasoning are never a fallback
    ("<think>it is 80 percent done", ANSWER_0_100, "auto", "reasoning and no answer"),  # cut inside the reasoning
    ("<answer>yes</answer>", ANSWER_0_100, "auto", "not one number"),  # a verdict on a numeric scale
    ("<answer>1.5</answer>", ANSWER_0_100, "unit", "not one number"),
    ("9ormalDistw", BARE_1_100, "auto", "not one number"),  # random weights, cut at max_tokens
    ("Score: 75", BARE_1_100, "auto", "not one number"),
    ("75 percent", BARE_1_100, "auto", "not one number"),
    ("0", BARE_1_100, "auto", "not one number"),  # below the 1-100 scale
    ("<score>7/5</score>", SCORE_0_10, "auto", "not one number"),
    ("<score>70%</score>", SCORE_0_10, "auto", "not one number"),  # % only on 0-100 scales
    ("<answer>0</answer>", STARS_1_5, "auto", "not one number"),
    ("No, I cannot see the video.", VERDICT, "auto", "not one number"),
    ("<answer>0.4</answer>", VERDICT, "auto", "not one number"),
    ("4", ROBOREWARD, "auto", "no 'ANSWER:'"),
    ("ANSWER: 6", ROBOREWARD, "auto", "not one number"),
    ("ANSWER: 0", ROBOREWARD, "auto", "not one number"),
    ("ANSWER: 4 (the bowl moved)", ROBOREWARD, "auto", "not one number"),
    ("ANSWER: 2\nOn second thought, ANSWER: 4", ROBOREWARD, "auto", "2 lines hold 'ANSWER:'"),
]


@pytest.mark.parametrize(("text", "spec", "mode", "score", "source"), SCORES)
def test_declared_answers_are_scores(text, spec, mode, score, source):
    parsed = parse_score(text, spec, mode)
    assert parsed.score == pytest.approx(score)
    assert parsed.source == source


@pytest.mark.parametrize(("text", "spec", "mode", "says"), ERRORS)
def test_everything_else_is_an_error_carrying_the_reply(text, spec, mode, says):
    with pytest.raises(ScoreParseError, match=says) as err:
        parse_score(text, spec, mode)
    assert err.value.output_text == text
    assert err.value.code == "unparseable_score"


def test_the_table_is_half_errors():
    assert len(SCORES) + len(ERRORS) >= 40 and len(ERRORS) >= len(SCORES)


def test_a_reply_cut_at_max_tokens_is_an_error_even_with_an_answer():
    with pytest.raises(ScoreParseError, match="finish_reason=length") as err:
        parse_score("<answer>60</answer> and then it kept go", ANSWER_0_100, finish_reason="length")
    assert err.value.finish_reason == "length"


def test_the_error_names_what_the_template_asked_for():
    with pytest.raises(ScoreParseError, match=r"one number on the 0-100 scale in <answer>…</answer>"):
        parse_score("hmm", ANSWER_0_100)


def test_no_mode_reads_one_and_two_on_different_scales():
    for mode in ("auto", "percentage", "unit"):
        try:
            one = parse_score("<answer>1</answer>", ANSWER_0_100, mode).score
            two = parse_score("<answer>2</answer>", ANSWER_0_100, mode).score
        except ScoreParseError:
            continue  # "2" is off the 0-1 scale: an error, not another scale
        assert two == pytest.approx(2 * one)


@given(st.integers(0, 100))
def test_any_percentage_in_the_answer_tag_round_trips(value):
    parsed = parse_score(f"{REASONING}<answer>{value}</answer>", ANSWER_0_100)
    assert parsed.score == pytest.approx(value / 100)


@given(st.text(max_size=300))
def test_never_returns_out_of_range(text):
    try:
        parsed = parse_score(text, ANSWER_0_100)
    except ScoreParseError:
        return
    assert 0.0 <= parsed.score <= 1.0


@pytest.mark.parametrize(("logprobs", "says"), [
    ({2514: float("inf"), 4049: -1.0}, "numeric logprob"),  # never P = 1 from a broken number
    ({2514: float("nan"), 4049: -1.0}, "numeric logprob"),
    ({2514: -9999.0, 4049: -9999.0}, "logprob floor"),  # ids that do not name this server's words
    ({2514: -0.1, 4049: -0.2}, "> 1"),  # not one token's distribution
    ({2514: -0.1}, "no logprob for 'False'"),  # a server that ignored logprob_token_ids
])
def test_a_probability_is_read_from_sound_logprobs_only(logprobs, says):
    from proxy.answers.probability import AnswerTokens, read_probability
    from proxy.answers.reply import Choice
    from proxy.errors import UpstreamProtocolError

    top = [{"token": f"token_id:{token}", "logprob": lp} for token, lp in logprobs.items()]
    choice = Choice("True", "length", [{"token": "token_id:2514", "logprob": -0.1, "top_logprobs": top}])
    with pytest.raises(UpstreamProtocolError, match=says):
        read_probability(choice, AnswerTokens("True", "False", 2514, 4049), "auto", "http://x/v1")
