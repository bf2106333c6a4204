"""One vocabulary of run settings (train/settings.py): flags made from dataclass fields, each default written once;
`looplm train` and `looplm heal` name the settings they share alike; a run saved under former names resumes."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, fields, replace

import pytest

from looplm.commands import build_parser
from looplm.commands.args import HelpFormatter, add_flags, flag_fields, flag_name, from_args
from looplm.errors import UsageError
from looplm.settings import refine, setting
from looplm.train.heal import HealConfig
from looplm.train.loop import TrainConfig
from looplm.train.run_dir import FORMER_NAMES, RunDir, changed_settings, check_resume_settings, current_names
from looplm.train.settings import RunSettings

# ---------------------------------------------------------------------------------------------
# the generator, on a settings class of its own


@dataclass
class Base(RunSettings):
    rate: float = setting(0.25, "how fast", metavar="R")


@dataclass
class Toy(Base):
    model: str = ""  # not a flag
    hidden: int = 7  # not a flag either
    count: int = setting(3, "how many", renamed_from=("--number",))
    mode: str = setting("fast", "how", choices=("fast", "slow"), advanced=True)
    loud: bool = setting(False, "say more")
    fancy: bool | None = setting(None, "the recipe chooses when absent (default: when it pays)")
    steps: int | None = setting(None, "instead: steps", exclusive="budget", metavar="N")
    rate: float = refine(Base, "rate", help="how fast, refined")
    train_tokens: int | None = refine(RunSettings, "train_tokens", renamed_from=("--old-tokens",))


def _toy_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="toy", formatter_class=HelpFormatter)
    add_flags(p, Toy, first=("count",))
    return p


def test_a_default_written_once_reaches_the_help_and_the_parsed_arguments():
    p = _toy_parser()
    args = p.parse_args([])
    toy = from_args(Toy, args)
    assert toy == Toy()  # every default came from the dataclass
    assert (args.count, args.mode, args.rate, args.eval_rows, args.seed) == (3, "fast", 0.25, 16, 0)
    help_text = " ".join(p.format_help().split())
    assert "--count COUNT how many (default: 3)" in help_text
    assert "--rate R how fast, refined (default: 0.25)" in help_text  # refined help, the base's default
    assert "--eval-rows N held-out rows scored at each evaluation (default: 16)" in help_text
    assert "--mode {fast,slow} how (default: fast)" in help_text
    assert "(default: when it pays)" in help_text and "(default: None)" not in help_text
    # fields made without setting() are not flags
    assert "--hidden" not in help_text and "--model" not in help_text
    assert [f.name for f in flag_fields(Toy)][:1] == ["out"] and "hidden" not in {f.name for f in flag_fields(Toy)}
    # values given on the command line reach the settings, typed by the field
    toy = from_args(Toy, p.parse_args(["--count", "5", "--rate", "0.5", "--train-tokens", "100", "--out", "o"]))
    assert (toy.count, toy.rate, toy.train_tokens, toy.out) == (5, 0.5, 100, "o")


def test_the_help_lists_first_then_own_then_shared_and_advanced_apart():
    p = _toy_parser()
    main = next(g for g in p._action_groups if g.title == "options")
    names = [a.option_strings[0] for a in main._group_actions if a.option_strings and a.dest != "help"]
    assert names[0] == "--count"  # first
    assert names.index("--loud") < names.index("--out")  # Toy's own before those every run has
    research = next(g for g in p._action_groups if g.title.startswith("advanced"))
    assert {a.dest for a in research._group_actions} == {"mode", "seed", "precision"}


def test_an_old_name_is_refused_naming_the_new_one(capsys):
    p = _toy_parser()
    for old, new in (("--number", "--count"), ("--old-tokens", "--train-tokens")):
        with pytest.raises(SystemExit):
            p.parse_args([old, "9"])
        assert f"{old} was removed; use {new}" in capsys.readouterr().err
    assert "--number" not in p.format_help()


def test_switches_and_spelled_values():
    p = _toy_parser()
    assert from_args(Toy, p.parse_args([])).loud is False
    assert from_args(Toy, p.parse_args(["--loud"])).loud is True
    assert from_args(Toy, p.parse_args(["--no-progress"])).progress is False  # default True: --x/--no-x
    assert from_args(Toy, p.parse_args(["--progress"])).progress is True
    # default None: --x/--no-x, absent left to the recipe
    assert [from_args(Toy, p.parse_args(a)).fancy for a in ([], ["--fancy"], ["--no-fancy"])] == [None, True, False]


# ---------------------------------------------------------------------------------------------
# the two commands


def _command(name: str) -> argparse.ArgumentParser:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def _flags(p: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """The flags of ``p`` by setting, old names left out."""
    return {a.dest: a for a in p._actions if a.option_strings and a.help is not argparse.SUPPRESS}


@pytest.mark.parametrize("name, cls", [("train", TrainConfig), ("heal", HealConfig)])
def test_every_flag_default_is_the_dataclass_default(name, cls):
    actions = _flags(_command(name))
    for f in flag_fields(cls):
        a = actions[f.name]
        assert flag_name(f) in a.option_strings, f.name
        if not a.required:
            spelled = f.metadata.get("spelled", {})
            assert a.default == spelled.get(f.default, f.default), f.name
    # and parsing no flag (but the required ones) gives the dataclass (heal's recipe fills its Nones later:
    # recipes/heal.py fill_recipe_defaults)
    required = {a.dest: a.option_strings[0] for a in actions.values() if a.required}
    parsed = from_args(cls, _command(name).parse_args(["m"] + [x for flag in required.values() for x in (flag, "x")]))
    assert replace(parsed, model=cls().model) == cls(**dict.fromkeys(required, "x"))


def test_train_and_heal_name_the_settings_they_share_alike():
    train, heal = _flags(_command("train")), _flags(_command("heal"))
    shared = [f.name for f in flag_fields(RunSettings)]
    assert set(shared) == {
        "out",
        "budget_minutes",
        "train_tokens",
        "eval_rows",
        "resume",
        "progress",
        "seed",
        "precision",
    }
    for dest in shared:
        assert train[dest].option_strings == heal[dest].option_strings, dest
        assert type(train[dest]) is type(heal[dest]) and train[dest].type == heal[dest].type, dest
    # the same names in the help text
    for p in (_command("train"), _command("heal")):
        text = p.format_help()
        for flag in ("--out", "--budget-minutes", "--train-tokens", "--eval-rows", "--resume", "--no-progress"):
            assert flag in text
    # the intervals say their unit
    assert "eval_every_steps" in train and "save_every_steps" in train
    assert "eval_every_seconds" in heal and "save_every_seconds" in heal


def test_the_former_flag_names_are_refused(capsys):
    for command, old, new in (
        ("train", "--max-tokens", "--train-tokens"),
        ("train", "--eval-seqs", "--eval-rows"),
        ("train", "--eval-every", "--eval-every-steps"),
        ("train", "--save-every", "--save-every-steps"),
        ("heal", "--tokens", "--train-tokens"),
    ):
        with pytest.raises(SystemExit):
            _command(command).parse_args(["m", "--data", "d", "--out", "o", old, "9"])
        assert f"{old} was removed; use {new}" in capsys.readouterr().err, (command, old)
    args = _command("heal").parse_args(["m", "--train-tokens", "100", "--base-weights", "fp32", "--no-progress"])
    cfg = from_args(HealConfig, args)
    assert (cfg.train_tokens, cfg.base_weights, cfg.progress, cfg.compile, cfg.teacher) == (
        100,
        "fp32",
        False,
        None,
        None,
    )


# ---------------------------------------------------------------------------------------------
# a run saved under the former names


OLD_HEAL = {  # the config a heal run.json held before the rename: `tokens`
    **{f.name: getattr(HealConfig(), f.name) for f in fields(HealConfig) if f.name != "train_tokens"},
    "tokens": 640,
    "base_weights": "float",
}
OLD_TRAIN = {"max_tokens": 9, "eval_seqs": 3, "eval_every": 4, "save_every": 5, "data_rows": "all"}


def test_a_saved_config_of_the_old_shape_is_read_under_the_new_names():
    assert current_names(OLD_TRAIN) == {
        "train_tokens": 9,
        "eval_rows": 3,
        "eval_every_steps": 4,
        "save_every_steps": 5,
        "data_rows": "all",
    }
    assert set(FORMER_NAMES.values()) <= {f.name for f in fields(TrainConfig)} | {f.name for f in fields(HealConfig)}
    # the former "float" of base_weights reads as its name now
    now = HealConfig(
        **{**{k: v for k, v in OLD_HEAL.items() if k != "tokens"}, "train_tokens": 640, "base_weights": "fp32"}
    )
    assert changed_settings(OLD_HEAL, now, HealConfig.FIXED, HealConfig.FORMER_DEFAULTS) == []
    check_resume_settings(OLD_HEAL, now, HealConfig.FIXED, HealConfig.FORMER_DEFAULTS)
    now.train_tokens = 1280
    assert changed_settings(OLD_HEAL, now, HealConfig.FIXED, HealConfig.FORMER_DEFAULTS) == [
        "train_tokens: 640 -> 1280"
    ]
    with pytest.raises(UsageError, match="train_tokens: 640 -> 1280"):
        check_resume_settings(OLD_HEAL, now, HealConfig.FIXED, HealConfig.FORMER_DEFAULTS)


def test_an_old_run_json_reads_under_the_new_names(tmp_path):
    run = RunDir(tmp_path)
    run.out.mkdir(exist_ok=True)
    run.run_json.write_text(json.dumps({"config": OLD_HEAL, "rows": 4, "tokens": 12}))
    settings = run.settings()
    assert settings["config"]["train_tokens"] == 640 and "tokens" not in settings["config"]
    assert settings["config"]["base_weights"] == "fp32"  # its former value "float"
    assert settings["tokens"] == 12  # only the config's settings are renamed
    assert list(settings["config"]).index("train_tokens") == list(OLD_HEAL).index("tokens")  # in its place


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from test_train_fixtures import build_corpus, make_models

    tmp = tmp_path_factory.mktemp("settings")
    models = make_models(tmp)
    return models, build_corpus(tmp, models["student"], seq_len=32)


def test_a_heal_run_saved_under_the_old_names_resumes(tiny, tmp_path):
    from looplm.train.heal import prepare

    models, corpus = tiny
    cfg = HealConfig(
        model=str(models["student"]),
        teacher=str(models["teacher"]),
        data=str(corpus),
        out=str(tmp_path / "run"),
        train_tokens=640,
        seq_len=32,
        cache_rows=4,
        local_batch=2,
        resume=True,
    )
    saved = {f.name: getattr(cfg, f.name) for f in fields(cfg)}
    saved = {("tokens" if k == "train_tokens" else k): v for k, v in saved.items()}  # the former name
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "run.json").write_text(json.dumps({"config": saved, "cache": "", "rows": 4}))
    assert prepare(cfg, log=lambda *a: None).settings["config"]["train_tokens"] == 640
    with pytest.raises(UsageError, match="train_tokens: 640 -> 1280"):
        prepare(replace(cfg, train_tokens=1280), log=lambda *a: None)
    # a run healed with every hidden channel alike, recorded or by the default of its time, cannot resume: the
    # setting is gone, and the error says so
    for recorded in ({"hidden_channels": "uniform"}, {}):
        config = {k: v for k, v in saved.items() if k != "hidden_channels"} | recorded
        (tmp_path / "run" / "run.json").write_text(json.dumps({"config": config, "cache": "", "rows": 4}))
        with pytest.raises(UsageError, match="hidden_channels: 'uniform' -> 'read' \\(no longer a setting"):
            prepare(cfg, log=lambda *a: None)


def test_a_train_run_saved_under_the_old_names_resumes(tiny, tmp_path):
    from looplm.train.loop import train

    models, corpus = tiny
    cfg = dict(
        model=str(models["student"]),
        data=str(corpus),
        out=str(tmp_path / "run"),
        precision="fp32",
        progress=False,
        save_every_steps=1,
        eval_rows=2,
    )
    quiet = lambda *a: None  # noqa: E731
    assert train(TrainConfig(max_steps=1, **cfg), quiet)["steps"] == 1
    # the run.json a run wrote before the rename
    path = tmp_path / "run" / "run.json"
    saved = json.loads(path.read_text())
    renamed = {new: old for old, new in FORMER_NAMES.items() if old != "tokens"}
    saved["config"] = {renamed.get(k, k): v for k, v in saved["config"].items()}
    assert {"max_tokens", "eval_seqs", "eval_every", "save_every"} <= set(saved["config"])
    path.write_text(json.dumps(saved))
    assert train(TrainConfig(max_steps=2, resume=True, **cfg), quiet)["steps"] == 2
    assert RunDir(tmp_path / "run").settings()["config"]["save_every_steps"] == 1
    with pytest.raises(UsageError, match="--resume with different settings"):
        train(TrainConfig(max_steps=3, resume=True, **{**cfg, "seed": 1}), quiet)
