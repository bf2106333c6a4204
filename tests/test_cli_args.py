"""One command line: every command's help shows defaults and choices, the model is the first positional,
old flag names still parse (with a note), and an on-the-fly conversion is not served unhealed."""

import argparse

import pytest

from looplm.cli import build_parser, main
from looplm.cli_args import HelpFormatter, resolve_model_alias


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
    parser = build_parser()
    args = parser.parse_args(argv)
    resolve_model_alias(args, parser)
    return args


def test_old_names_still_parse_and_say_so(capsys):
    args = _parse(["generate", "Hello", "there", "--model", "m", "--max-tokens", "5", "--exit", "softmax:0.9"])
    assert (args.model, args.prompt, args.max_new_tokens, args.exit_policy) == (
        "m",
        ["Hello", "there"],
        5,
        "softmax:0.9",
    )
    err = capsys.readouterr().err
    assert "--model is deprecated" in err and "use --max-new-tokens" in err and "use --exit-policy" in err
    args = _parse(["generate", "m", "Hello", "--max-new-tokens", "5"])
    assert (args.model, args.prompt, args.max_new_tokens) == ("m", ["Hello"], 5) and capsys.readouterr().err == ""
    args = _parse(["heal", "d", "--tokens", "100", "--base-weights", "float"])
    assert args.train_tokens == 100 and args.base_weights == "fp32"
    args = _parse(["quantize", "m", "--out", "o", "--calibrate", "c", "--calibration-rows", "4", "--dtype", "float32"])
    assert (args.calib_data, args.calib_rows, args.dtype) == ("c", 4, "fp32")
    args = _parse(["train", "--model", "m", "--data", "d", "--out", "o", "--max-tokens", "9", "--eval-seqs", "3"])
    assert (args.model, args.train_tokens, args.eval_rows) == ("m", 9, 3)
    args = _parse(["data", "build", "--out", "o"])
    assert args.model == "smollm2-135m"


def test_a_missing_model_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        _parse(["generate", "Hello"])
    assert e.value.code == 2 and "give the model as the first argument" in capsys.readouterr().err


def test_serving_an_on_the_fly_conversion_needs_consent(capsys):
    # refused before anything loads: the model name does not even exist
    assert main(["serve", "no-such-model", "--loops", "2"]) == 2
    err = capsys.readouterr().err
    assert "looplm heal" in err and "--allow-unhealed" in err and len(err.strip().splitlines()) == 1
