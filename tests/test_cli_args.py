"""One command line: every command's help shows defaults and choices, the model is the first positional,
an old flag name is refused naming its new one, and an on-the-fly conversion is not served unhealed."""

import argparse
import json
from dataclasses import fields

import pytest

from looplm.commands import all_commands, build_parser, main, parse
from looplm.commands.args import HelpFormatter, call_with, write_settings


def _parsers(parser, path=()):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, (*path, name))
    if path:
        yield " ".join(path), parser


def _leaves():
    parser = build_parser()
    return [
        (name, p)
        for name, p in _parsers(parser)
        if not any(isinstance(a, argparse._SubParsersAction) for a in p._actions)
    ]


def test_every_command_shows_defaults_and_every_flag_has_help():
    leaves = _leaves()
    assert len(leaves) >= 17
    for name, p in leaves:
        assert issubclass(p.formatter_class, HelpFormatter), name
        for a in p._actions:
            if a.help is not argparse.SUPPRESS and "-h" not in a.option_strings:
                assert a.help, f"{name}: {a.option_strings or a.dest} has no help"
        p.format_help()  # renders


def test_the_model_is_the_first_positional_everywhere():
    for name, p in _leaves():
        positionals = [a for a in p._actions if not a.option_strings]
        if any(a.dest == "model" for a in positionals):
            assert positionals[0].dest == "model", name
            assert "--model" in p._option_string_actions, name


def _parse(argv):
    return build_parser().parse_args(argv)


def _refused(argv, capsys) -> str:
    with pytest.raises(SystemExit) as e:
        _parse(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and len([ln for ln in err.splitlines() if "error:" in ln]) == 1, err
    return err.strip().splitlines()[-1]


@pytest.mark.parametrize(
    "argv, new",
    [
        (["generate", "--model", "m", "Hello"], "give the model as the first argument"),
        (["generate", "m", "Hello", "--max-tokens", "5"], "use --max-new-tokens"),
        (["generate", "m", "Hello", "--exit", "softmax:0.9"], "use --exit-policy"),
        (["heal", "d", "--tokens", "100"], "use --train-tokens"),
        (["heal", "d", "--base-weights", "float"], "choose from 'fp32', 'int4', 'int8'"),
        (["quantize", "m", "--out", "o", "--calibrate", "c"], "use --calib-data"),
        (["quantize", "m", "--out", "o", "--dtype", "float32"], "choose from 'fp32', 'bf16'"),
        (["train", "m", "--data", "d", "--out", "o", "--eval-seqs", "3"], "use --eval-rows"),
        (["convert", "--strategy", "cycle"], "use --sharing"),
    ],
)
def test_an_old_flag_name_is_refused_naming_its_replacement(argv, new, capsys):
    assert new in _refused(argv, capsys)


def test_the_current_names_parse_and_say_nothing(capsys):
    args = _parse(["generate", "m", "Hello", "there", "--max-new-tokens", "5", "--exit-policy", "softmax:0.9"])
    assert (args.model, args.prompt, args.max_new_tokens, args.exit_policy) == (
        "m",
        ["Hello", "there"],
        5,
        "softmax:0.9",
    )
    args = _parse(["heal", "d", "--train-tokens", "100", "--base-weights", "fp32"])
    assert args.train_tokens == 100 and args.base_weights == "fp32"
    args = _parse(["data", "build", "--out", "o"])
    assert args.model == "smollm2-135m" and capsys.readouterr().err == ""
    # old names are not listed in the help
    generate = dict(_leaves())["generate"].format_help()
    assert "--max-new-tokens" in generate and "--max-tokens" not in generate and "--model" not in generate


def test_a_missing_model_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        _parse(["quantize", "--out", "o"])
    assert e.value.code == 2 and "required: model" in capsys.readouterr().err


def test_serving_an_on_the_fly_conversion_needs_consent(capsys):
    # refused before anything loads: the model name does not even exist
    assert main(["serve", "no-such-model", "--loops", "2"]) == 2
    err = capsys.readouterr().err
    assert "looplm heal" in err and "--allow-unhealed" in err and len(err.strip().splitlines()) == 1


# ---------------------------------------------------------------------------------------------
# every command is one settings dataclass and one function


def test_every_flag_of_every_command_is_a_field_of_its_settings():
    """No flag is written by hand: each argument a command parses is a setting of its dataclass (old names, which
    are refused, and --config aside), and each setting is an argument."""
    parser = build_parser()
    leaves = dict(_leaves())
    commands = all_commands()
    assert sorted(" ".join(c.words) for c in commands) == sorted(leaves)
    for cmd in commands:
        p = leaves[" ".join(cmd.words)]
        dests = {a.dest for a in p._actions if a.dest not in ("help", "config") and not a.dest.startswith("_renamed_")}
        settings = {f.name for f in fields(cmd.settings) if "help" in f.metadata}
        assert dests == settings, cmd.name
        assert p.get_default("_command") is cmd
    assert parser.parse_args(["info", "m"])._command.settings.__name__ == "Info"


def test_settings_from_a_config_file_and_flags_beside_it_win(tmp_path, capsys):
    config = tmp_path / "suite.json"
    config.write_text(json.dumps({"windows": 3, "tasks": "none", "compare": ["a,b"]}))
    cmd, s = parse(["eval", "suite", "orig", "a=x", "b=y", "--config", str(config)])
    assert cmd.words == ("eval", "suite") and (s.windows, s.tasks, s.compare, s.models) == (
        3,
        "none",
        ["a,b"],
        ["orig", "a=x", "b=y"],
    )
    _, s = parse(["eval", "suite", "orig", "--config", str(config), "--windows", "5"])
    assert (s.windows, s.tasks) == (5, "none")
    config.write_text(json.dumps({"windows": 3, "window": 4}))
    assert main(["eval", "suite", "orig", "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert "window are not settings of `looplm eval suite`" in err and len(err.strip().splitlines()) == 1


def test_the_settings_a_run_writes_repeat_it(tmp_path):
    """command.json holds every setting; --config reads it back to the same settings."""
    argv = ["heal", "student", "--train-tokens", "100", "--base-weights", "fp32", "--no-progress", "--out", "o"]
    cmd, s = parse(argv)
    assert s.base_weights == "fp32"
    write_settings(tmp_path, cmd.name, s)
    record = json.loads((tmp_path / "command.json").read_text())
    assert record["command"] == "looplm heal" and record["settings"]["base_weights"] == "fp32"
    _, again = parse(["heal", "--config", str(tmp_path / "command.json")])  # the model, too, from the file
    assert again == s


def test_call_with_passes_the_settings_a_function_takes_by_name_and_given_values_first():
    from dataclasses import dataclass

    @dataclass
    class Settings:
        model: str = "m"
        windows: int = 4
        json: bool = True  # a command's own: the function takes no such parameter

    def score(model, windows=16, limit=None, tasks=None):
        return model, windows, limit, tasks

    assert call_with(score, Settings()) == ("m", 4, None, None)
    assert call_with(score, Settings(), model="loaded", tasks=["a"]) == ("loaded", 4, None, ["a"])


def test_a_value_below_a_settings_minimum_is_refused_from_flags_and_config_files(tmp_path, capsys):
    """``setting(minimum=...)``: the bound is the field's, so the flag and a --config file meet the same check."""
    from looplm.commands import main

    assert main(["eval", "suite", "smollm2-135m", "--windows", "0"]) == 2
    assert "--windows must be >= 1, got 0" in capsys.readouterr().err
    config = tmp_path / "c.json"
    config.write_text('{"resamples": 1}')
    assert main(["eval", "claims", "r.json", "--out", "x.md", "--config", str(config)]) == 2
    assert "--resamples must be >= 2, got 1" in capsys.readouterr().err
