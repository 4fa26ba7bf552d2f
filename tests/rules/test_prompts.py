"""Prompt templates: shipped ones render, variables are checked, edits apply without restart."""

import os
import threading
from pathlib import Path

import pytest

from proxy.errors import PromptTemplateError, TemplateVariableError
from proxy.prompting.templates import PromptStore, parse_template

REPO = Path(__file__).resolve().parents[2]
ANSWER = "answer: {tags: [answer], scale: {min: 0, max: 100}}\n"


def test_shipped_templates_render_the_task():
    store = PromptStore(REPO / "prompts")
    system, user = store.get("qwen_progress").render({"task_text": "open the drawer"})
    assert "open the drawer" in user and "<score>" in user and system
    primo = store.get("primo_r1")
    system, user = primo.render({"task_text": "open the drawer"})
    for tag in ("<think>", "<planning>", "<observation>", "<reasoning>", "<answer>"):
        assert tag in system
    assert "open the drawer" in user
    assert len(primo.sha256) == 64


def _write(path: Path, text: str) -> None:
    path.write_text(text)
    # mtime granularity can be coarse; make each write visibly newer
    stamp = path.stat().st_mtime_ns + 1_000_000_000
    os.utime(path, ns=(stamp, stamp))


def test_missing_variable_is_a_422_naming_it(tmp_path):
    _write(tmp_path / "t.yaml", "variables: {task_text: {}, scene: {}}\nuser: '${task_text} in ${scene}'\n" + ANSWER)
    template = PromptStore(tmp_path).get("t")
    with pytest.raises(TemplateVariableError) as err:
        template.render({"task_text": "x"})
    assert err.value.status_code == 422 and err.value.field == "backend_kwargs.scene"


def test_optional_variable_takes_its_default(tmp_path):
    _write(tmp_path / "t.yaml",
           "variables: {task_text: {}, hint: {default: none}}\nuser: '${task_text}/${hint}'\n" + ANSWER)
    assert PromptStore(tmp_path).get("t").render({"task_text": "a"})[1] == "a/none"


def test_undeclared_variable_is_refused_at_load(tmp_path):
    _write(tmp_path / "t.yaml", "variables: {task_text: {}}\nuser: '${task_text} ${oops}'\n" + ANSWER)
    with pytest.raises(PromptTemplateError, match="oops"):
        PromptStore(tmp_path).get("t")


def test_edit_applies_to_the_next_get_and_changes_the_hash(tmp_path):
    path = tmp_path / "t.yaml"
    _write(path, "variables: {task_text: {}}\nuser: 'v1 ${task_text}'\n" + ANSWER)
    store = PromptStore(tmp_path)
    first = store.get("t")
    assert store.get("t") is first  # cached while unchanged
    _write(path, "variables: {task_text: {}}\nuser: 'v2 ${task_text}'\n" + ANSWER)
    second = store.get("t")
    assert second.render({"task_text": "x"})[1] == "v2 x"
    assert second.sha256 != first.sha256


def test_names_cannot_escape_the_directory(tmp_path):
    with pytest.raises(PromptTemplateError):
        PromptStore(tmp_path).get("../secrets")


def test_a_template_must_declare_its_answer(tmp_path):
    _write(tmp_path / "t.yaml", "variables: {task_text: {}}\nuser: 'rate ${task_text}'\n")
    with pytest.raises(PromptTemplateError, match="answer must be declared"):
        PromptStore(tmp_path).get("t")
    _write(tmp_path / "t.yaml",
           "variables: {task_text: {}}\nuser: 'x'\nanswer: {tags: [answer], scale: {min: 5, max: 1}}\n")
    with pytest.raises(PromptTemplateError, match="scale"):
        PromptStore(tmp_path).get("t")


def test_a_duplicated_key_is_refused_naming_it_and_its_line(tmp_path):
    _write(tmp_path / "t.yaml", "variables: {task_text: {}}\nuser: 'a ${task_text}'\nuser: 'b'\n" + ANSWER)
    with pytest.raises(PromptTemplateError, match=r"duplicate key 'user' at line 3"):
        PromptStore(tmp_path).get("t")


def test_rendered_text_has_no_trailing_whitespace(tmp_path):
    _write(tmp_path / "t.yaml", "variables: {task_text: {}}\nsystem: |\n  judge\n\nuser: |\n  rate ${task_text}\n"
           + ANSWER)
    system, user = PromptStore(tmp_path).get("t").render({"task_text": "x"})
    assert (system, user) == ("judge", "rate x")


async def test_on_the_event_loop_an_edit_is_read_by_a_worker_thread_never_by_the_loop(tmp_path):
    """On the loop `get` answers from the cache; the file is stat'ed and re-read off the loop
    (issue 24: no file I/O on the event loop's hot path), and the edit applies once that is done."""
    path = tmp_path / "t.yaml"
    _write(path, "variables: {task_text: {}}\nuser: 'v1 ${task_text}'\n" + ANSWER)
    readers: list[threading.Thread] = []

    def parse(name: str, raw: bytes):
        readers.append(threading.current_thread())
        return parse_template(name, raw)

    store = PromptStore(tmp_path, parser=parse, recheck_s=0)
    first = store.get("t")  # its first use: read at once (start-up reads every configured one)
    _write(path, "variables: {task_text: {}}\nuser: 'v2 ${task_text}'\n" + ANSWER)
    assert store.get("t") is first  # the loop did not look at the disk; a check went off the loop
    await store.settled()
    second = store.get("t")
    assert second.render({"task_text": "x"})[1] == "v2 x"
    assert readers[1] is not threading.main_thread() and readers[1] is not readers[0]
    await store.settled()  # the check `second` started (nothing changed) is over
    path.write_text("user: [broken")
    os.utime(path, ns=(path.stat().st_mtime_ns + 2_000_000_000,) * 2)
    store.get("t")
    await store.settled()
    with pytest.raises(PromptTemplateError, match="not valid YAML"):  # a broken edit is still a clear error
        store.get("t")


@pytest.mark.parametrize(("answer", "says"), [
    ("{probability: {affirmative: True, negative: False}}", "two different words"),  # YAML booleans, not words
    ("{probability: {affirmative: 'True', negative: 'True'}}", "two different words"),
    ("{probability: {affirmative: 'True'}}", "two different words"),
    ("{probability: {affirmative: 'True', negative: 'False'}, tags: [answer]}", "tags mean nothing"),
    ("{probability: {affirmative: 'True', negative: 'False'}, constrain: true}", "constrain mean nothing"),
    ("{probability: {affirmative: 'True', negative: 'False'}, scale: binary}", "scale mean nothing"),
    ("{label: 'ANSWER:', tags: [answer], scale: {min: 1, max: 5}}", "label must be"),
    ("{label: '', scale: {min: 1, max: 5}}", "label must be"),
])
def test_a_probability_or_labelled_answer_is_declared_whole(tmp_path, answer, says):
    _write(tmp_path / "t.yaml", f"variables: {{task_text: {{}}}}\nuser: 'is ${{task_text}} done?'\nanswer: {answer}\n")
    with pytest.raises(PromptTemplateError, match=says):
        PromptStore(tmp_path).get("t")


def test_the_shipped_field_methods_declare_their_answers():
    store = PromptStore(REPO / "prompts")
    assert store.get("topreward").answer.probability == ("True", "False")
    robo = store.get("roboreward").answer
    assert robo.label == "ANSWER:" and (robo.scale.min, robo.scale.max, robo.scale.zero) == (1, 5, 1) and robo.constrain


GVL_ANSWER = "answer: {per_frame: {label: 'F{i}:', reply: 'F{i}: {value}%'}, scale: {min: 0, max: 100}}\n"


@pytest.mark.parametrize(("user", "answer", "says"), [
    ("'${frames} then ${first_frame}'", GVL_ANSWER, "before it"),  # the reference after the shown frames
    ("'${frames} and ${frames}'", GVL_ANSWER, "once"),
    ("'no pictures here'", GVL_ANSWER, "once"),
    ("'${first_frame} ${frames}'",
     "answer: {per_frame: {label: 'F{i}:', reply: 'F{i}: {value}%'}, scale: {min: 0, max: 100}, reasoning: true}\n",
     "no tags, label, reasoning"),
])
def test_a_per_frame_template_places_its_pictures_once_in_order(tmp_path, user, answer, says):
    _write(tmp_path / "t.yaml", f"variables: {{task_text: {{}}}}\nuser: {user}\n{answer}")
    with pytest.raises(PromptTemplateError, match=says):
        PromptStore(tmp_path).get("t")
    placed = "user: 'a ${first_frame} b ${frames}'\n"
    _write(tmp_path / "t.yaml", f"variables: {{task_text: {{}}}}\n{placed}{GVL_ANSWER}")
    assert PromptStore(tmp_path).get("t").slots == {"first_frame", "frames"}


def test_a_per_frame_prompt_on_another_layout_is_refused_at_start_up(tmp_path):
    from proxy.config import settings_from_dict
    from proxy.errors import ConfigError
    from proxy.http.app import create_app

    backend = {"model": "m", "endpoints": ["http://127.0.0.1:9/v1"], "layout": "qwen_video", "prompt": "gvl"}
    settings = settings_from_dict({"proxy": {"prompts_dir": str(REPO / "prompts")}, "backends": {"b": backend}})
    with pytest.raises(ConfigError, match="do not fit"):
        create_app(settings)
