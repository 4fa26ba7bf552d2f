"""The `vlm-reward-proxy` command line reads as one tool: docs/stack.md lists every subcommand the
parser has (and only options they take), placeholders are uppercase words, `--out` is a folder
wherever it appears, and `--version` answers."""

from __future__ import annotations

import argparse
import re

import pytest

from tests.helpers import REPO
from vlm_reward_cli import build_parser, main, version


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def _documented() -> list[str]:
    """The lines of docs/stack.md's command list (the code block under `## Commands`)."""
    text = (REPO / "docs" / "stack.md").read_text()
    block = re.search(r"^## Commands\n\n```\n(.*?)```", text, re.S | re.M)
    assert block, "docs/stack.md has no command list under '## Commands'"
    return [line for line in block.group(1).splitlines() if line.strip()]


def test_the_docs_command_list_matches_the_parsers_subcommands():
    documented = {line.split()[1] for line in _documented()}
    assert documented == set(_subcommands()), (
        f"docs/stack.md lacks {sorted(set(_subcommands()) - documented)}, "
        f"lists unknown {sorted(documented - set(_subcommands()))}")


def test_every_option_the_docs_list_exists():
    commands = _subcommands()
    for line in _documented():
        name = line.split()[1]
        options = {s for a in commands[name]._actions for s in a.option_strings}
        for option in re.findall(r"(?<![\w-])--[a-z][a-z-]*", line.split("#")[0]):
            assert option in options, f"docs/stack.md: `{name}` has no {option}"


def _value_options() -> list[tuple[str, argparse.Action]]:
    return [(name, action) for name, sub in sorted(_subcommands().items()) for action in sub._actions
            if action.nargs != 0 and not isinstance(action, argparse._HelpAction) and action.help != argparse.SUPPRESS]


@pytest.mark.parametrize(("command", "action"), _value_options(),
                         ids=lambda x: x if isinstance(x, str) else (x.option_strings or [x.dest])[0])
def test_placeholders_are_uppercase_words(command, action):
    """`--limit N`, `--from-backend NAME`, `--timeout S`: never argparse's default (the option's
    name in capitals, or a list of choices)."""
    assert action.metavar, f"{command} {action.option_strings or action.dest}: no metavar"
    assert re.fullmatch(r"[A-Z][A-Z_]*(\.[a-z]+|=[A-Z]+)?", action.metavar), (command, action.metavar)


def test_out_is_always_a_folder_and_a_single_file_is_out_file():
    for name, sub in _subcommands().items():
        for action in sub._actions:
            if "--out" in action.option_strings:
                assert action.metavar == "DIR", name
            if "--out-file" in action.option_strings:
                assert action.metavar != "DIR", name


def test_version(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == f"vlm-reward-proxy {version()}"


def test_evals_help_says_what_episodes_jsonl_holds_without_a_usage_line_or_a_source_path(capsys):
    with pytest.raises(SystemExit):
        main(["eval", "--help"])
    help_text = capsys.readouterr().out
    description = help_text.split("\n\n", 2)[1:]
    assert "episodes.jsonl" in help_text and '"success": true' in help_text
    assert not any(".py" in part or "vlm-reward-proxy eval EPISODES" in part for part in description)


def test_the_rlinf_config_merge_is_a_subcommand_and_still_a_module(tmp_path):
    """`vlm-reward-proxy rlinf-configs` writes what `python -m rlinf_client.rlinf_configs` writes
    (the module stays for RLinf's environment, where only the client is installed)."""
    from rlinf_client.rlinf_configs import CONFIG_DIR
    from rlinf_client.rlinf_configs import main as module_main
    from tests.client.test_rlinf_configs import BASE, OVERLAYS

    by_module, by_cli = tmp_path / "module", tmp_path / "cli"
    for checkout in (by_module, by_cli):
        (checkout / CONFIG_DIR).mkdir(parents=True)
        (checkout / CONFIG_DIR / "libero_10_grpo_openvlaoft.yaml").write_text(BASE)
    assert module_main(["--rlinf", str(by_module), *map(str, OVERLAYS)]) == 0
    assert main(["rlinf-configs", "--rlinf", str(by_cli), *map(str, OVERLAYS)]) == 0
    for overlay in OVERLAYS:
        assert (by_cli / CONFIG_DIR / overlay.name).read_text() == (by_module / CONFIG_DIR / overlay.name).read_text()
    assert main(["rlinf-configs", "--rlinf", str(by_cli), str(OVERLAYS[0])]) == 2  # no silent overwrite
