"""`looplm data generate` (recipes/teacher_text.py, data/generated.py) on a tiny model: the corpus resumes to
what an uninterrupted run writes, drops duplicates and loops, refuses other settings or another teacher, and
is a source of `looplm data build`, whose SOURCE:N caps a source's training rows."""

import json

import numpy as np
import pytest
from test_train_fixtures import build_corpus, make_models, run_cli, tiny_vanilla, write_texts

from looplm.data.corpus import PackedCorpus, build, teacher_mix_sources
from looplm.data.generated import degenerate, read_manifest, read_samples, text_key
from looplm.errors import UsageError
from looplm.recipes.teacher_text import GenerateConfig, PromptSource, generate_corpus


@pytest.fixture(scope="module")
def setup(tmp_path_factory, one_torch_thread):
    tmp = tmp_path_factory.mktemp("gen")
    models = make_models(tmp)
    return tmp, models, build_corpus(tmp, models["teacher"], seq_len=32)


def config(models, corpus, out, **kw):
    base = dict(
        model=str(models["teacher"]),
        out=str(out),
        corpus=str(corpus),
        prompt_tokens=6,
        max_new_tokens=12,
        max_batch=3,
        shard_size=4,
        weights="fp32",
        progress=False,
    )
    return GenerateConfig(**{**base, **kw})


def quiet(*_):
    pass


def whole_corpus(setup):
    """The corpus of 60 generated tokens that the first test writes (written here when that test did not run)."""
    tmp, models, corpus = setup
    gen = tmp / "whole"
    if not (gen / "manifest.json").exists():
        generate_corpus(config(models, corpus, gen, tokens=60), log=quiet)
    return gen


def teacher_build(models, out, sources, **settings):
    """`looplm data build` of ``sources`` into ``out`` with the teacher's tokenizer, quietly."""
    return build(out, model=str(models["teacher"]), sources=str(sources), log=quiet, progress=False, **settings)


def test_a_resumed_corpus_equals_an_uninterrupted_one(setup):
    tmp, models, corpus = setup
    whole = generate_corpus(config(models, corpus, tmp / "whole", tokens=60), log=quiet)
    assert len(whole["shards"]) >= 2 and whole["tokens"] >= 60
    first = generate_corpus(config(models, corpus, tmp / "parts", tokens=1), log=quiet)
    assert len(first["shards"]) == 1
    resumed = generate_corpus(config(models, corpus, tmp / "parts", tokens=60), log=quiet)
    assert [s["sha256"] for s in resumed["shards"]] == [s["sha256"] for s in whole["shards"]]
    samples = read_samples(tmp / "whole")
    assert {s["prompt_kind"] for s in samples} == {"start", "corpus"}
    assert all(len(s["completion"]) <= 12 for s in samples)
    # corpus prompts are snippets of the training split, after the document start
    train = PackedCorpus(corpus).splits["train"]
    rows = {bytes(np.asarray(r, dtype=np.int64)) for r in train}
    for s in samples:
        if s["prompt_kind"] == "corpus":
            snippet = np.array(s["prompt"][1:], dtype=np.int64).tobytes()
            assert any(snippet in r for r in rows)
    assert whole["teacher"]["weights_sha256"] and whole["tokens_per_second"] > 0
    # killed before its first manifest: the shard directory and a half-written shard, and nothing else
    (tmp / "early" / "shards").mkdir(parents=True)
    (tmp / "early" / "shards" / ".shard-00000.jsonl.tmp-1").write_text("{cut")
    early = generate_corpus(config(models, corpus, tmp / "early", tokens=1), log=quiet)
    assert early["shards"][0]["sha256"] == whole["shards"][0]["sha256"]
    assert not list((tmp / "early" / "shards").glob(".*tmp*"))


def test_a_sample_holding_line_separators_reads_back_whole(setup):
    """The model writes any character; a shard line holds U+2028 and \\x1e verbatim (JSON without ASCII escapes)."""
    import hashlib

    tmp, models, corpus = setup
    out = tmp / "separators"
    generate_corpus(config(models, corpus, out, tokens=10), log=quiet)
    manifest = json.loads((out / "manifest.json").read_text())
    shard = out / manifest["shards"][0]["file"]
    first, *rest = shard.read_text(encoding="utf-8").split("\n")
    sample = json.loads(first)
    sample["text"] = "one\u2028two\x1ethree\x0bfour"
    body = "\n".join([json.dumps(sample, ensure_ascii=False), *rest])
    shard.write_text(body, encoding="utf-8")
    manifest["shards"][0]["sha256"] = hashlib.sha256(body.encode("utf-8")).hexdigest()
    (out / "manifest.json").write_text(json.dumps(manifest))
    assert read_samples(out)[0]["text"] == "one\u2028two\x1ethree\x0bfour"


def test_duplicates_and_loops_are_dropped_and_counted(setup):
    tmp, models, corpus = setup
    # greedy from a bare document start: every sample is the same text
    m = generate_corpus(
        config(models, corpus, tmp / "greedy", tokens=1, temperature=0.0, prompt_mix="start:1", shard_size=5), log=quiet
    )
    assert m["samples"] == 5 and m["kept"] + m["duplicates"] + m["degenerate"] == 5
    assert m["kept"] <= 1 and m["duplicates"] + m["degenerate"] >= 4
    assert text_key("The  cat\nsat.") == text_key("the cat sat.") != text_key("the cat sat")
    assert degenerate("one two three four " * 10) and not degenerate(" ".join(f"w{i}" for i in range(40)))
    assert not degenerate("short text short text")


def test_other_settings_another_teacher_and_bad_input_are_refused(setup):
    tmp, models, corpus = setup
    out = tmp / "strict"
    generate_corpus(config(models, corpus, out, tokens=1), log=quiet)
    with pytest.raises(UsageError, match="other settings.*temperature"):
        generate_corpus(config(models, corpus, out, tokens=2, temperature=0.7), log=quiet)
    # the same path, other weights: the teacher's fingerprint tells them apart
    from looplm.models import load_model, save_model

    swapped = tmp / "swapped-teacher"
    save_model(tiny_vanilla(seed=0), load_model(models["teacher"])[1], swapped)
    generate_corpus(config(models, corpus, tmp / "swap", tokens=1, model=str(swapped)), log=quiet)
    save_model(tiny_vanilla(seed=1), load_model(models["teacher"])[1], swapped)
    with pytest.raises(UsageError, match="another model"):
        generate_corpus(config(models, corpus, tmp / "swap", tokens=2, model=str(swapped)), log=quiet)
    (tmp / "full").mkdir()
    (tmp / "full" / "notes.txt").write_text("x")
    with pytest.raises(UsageError, match="not a generated corpus"):
        generate_corpus(config(models, corpus, tmp / "full", tokens=1), log=quiet)
    for kw, msg in [
        ({"prompt_mix": "web:1"}, "unknown prompt kind"),
        ({"prompt_mix": "start:0"}, "positive weight"),
        ({"top_p": 0.0}, "--top-p"),
        ({"tokens": None}, "one budget"),
        ({"tokens": 0}, "positive"),
    ]:
        with pytest.raises(UsageError, match=msg):
            generate_corpus(config(models, corpus, tmp / "never", **{"tokens": 1, **kw}), log=quiet)
    assert not (tmp / "never").exists()
    r = run_cli(
        "data", "generate", models["teacher"], "--out", tmp / "cli", "--generated-tokens", 1, "--prompt-mix", "corpus:1"
    )
    assert r.returncode == 2 and "needs --corpus" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    # without --corpus the default prompts are bare document starts (half are corpus snippets with one)
    r = run_cli(
        "data", "generate", models["teacher"], "--out", tmp / "starts", "--generated-tokens", 1, "--no-progress"
    )
    assert r.returncode == 0, r.stderr
    assert json.loads((tmp / "starts" / "manifest.json").read_text())["settings"]["prompt_mix"] == "start:1"
    assert {s["prompt_kind"] for s in read_samples(tmp / "starts")} == {"start"}


def test_prompts_are_a_function_of_the_seed_and_index(setup):
    tmp, models, corpus = setup
    from looplm.models import load_model

    tok = load_model(models["teacher"])[1]
    a = PromptSource(config(models, corpus, tmp / "p"), tok)
    b = PromptSource(config(models, corpus, tmp / "p"), tok)
    assert [a(i) for i in range(20)] == [b(i) for i in range(20)]
    assert [a(i) for i in range(20)] != [
        PromptSource(config(models, corpus, tmp / "p", seed=1), tok)(i) for i in range(20)
    ]
    assert a(0)[1][0] == tok.get_vocab()["<|endoftext|>"]


def test_a_generated_corpus_is_a_build_source_and_caps_weigh_a_mix(setup):
    tmp, models, _ = setup
    gen = whole_corpus(setup)
    samples = read_samples(gen)
    meta = teacher_build(models, tmp / "from-gen", gen, seq_len=16, heldout=0.2)
    assert meta["sources"]["whole"]["documents"] == len(samples)
    texts = write_texts(tmp / "mix-texts")
    mix = dict(seq_len=32, heldout=0.1, block_chars=2000)
    full = teacher_build(models, tmp / "uncapped", texts, **mix)
    capped = teacher_build(models, tmp / "capped", f"{texts}:3", **mix)
    for name in full["sources"]:
        assert capped["sources"][name]["train"]["seqs"] == 3 < full["sources"][name]["train"]["seqs"]
        assert capped["sources"][name]["heldout"] == full["sources"][name]["heldout"]
    whole_rows = {bytes(r) for r in np.asarray(PackedCorpus(tmp / "uncapped").splits["train"])}
    assert all(bytes(r) in whole_rows for r in np.asarray(PackedCorpus(tmp / "capped").splits["train"]))
    again = teacher_build(models, tmp / "capped", f"{texts}:4", **mix)
    assert all(again["sources"][n]["train"]["seqs"] == 4 for n in full["sources"])
    assert json.loads((tmp / "capped" / "meta.json").read_text())["sources"][name]["max_train_rows"] == 4
    with pytest.raises(UsageError, match="at least 1"):
        teacher_build(models, tmp / "bad", f"{texts}:0", seq_len=32)


def test_the_recipe_mix_holds_as_many_real_tokens_as_generated_ones(setup):
    gen = whole_corpus(setup)
    tokens = read_manifest(gen)["tokens"]
    real = ("one", "two", "three")
    spec = teacher_mix_sources(gen, 8, real=real)
    assert spec.split(",")[-1] == str(gen)  # the real sources first
    caps = [int(item.rpartition(":")[2]) for item in spec.split(",")[:-1]]
    assert len(caps) == len(real) and len(set(caps)) == 1
    assert tokens / 8 <= sum(caps) < tokens / 8 + len(real)  # rows of real text: as many as of generated text


def test_heal_makes_its_corpus_once_from_the_teachers_text_and_real_text(setup, tmp_path, monkeypatch):
    """`looplm heal` without --data: the teacher writes its text, the corpus mixes it with real text, and a
    second run reuses both; several processes are refused before any of them starts making it."""
    from dataclasses import replace

    import looplm.data.corpus as corpus_module
    import looplm.recipes.teacher_text as teacher_text

    tmp, models, _ = setup
    texts = write_texts(tmp_path / "real")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(teacher_text, "TEACHER_TOKENS", 20)
    small = dict(max_new_tokens=8, shard_size=4, max_batch=4, weights="fp32")
    generate = teacher_text.generate_corpus
    monkeypatch.setattr(teacher_text, "generate_corpus", lambda cfg, **kw: generate(replace(cfg, **small), **kw))
    monkeypatch.setattr(corpus_module, "teacher_mix_sources", lambda gen, seq_len: f"{texts}:2,{gen}")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(UsageError, match="run `looplm heal` on one process first"):
        teacher_text.recipe_corpus(str(models["teacher"]), 16, progress=False)
    assert not (tmp_path / "out").exists()
    monkeypatch.delenv("WORLD_SIZE")
    made = teacher_text.recipe_corpus(str(models["teacher"]), 16, progress=False)
    assert made == f"out/corpus-{models['teacher'].name}-mix-16"
    generated = tmp_path / "out" / f"gen-{models['teacher'].name}"
    assert read_manifest(generated)["tokens"] >= 20
    meta = json.loads((tmp_path / made / "meta.json").read_text())
    assert set(meta["sources"]) == {"src0", "src1", generated.name}
    assert all(meta["sources"][f"src{i}"]["train"]["seqs"] == 2 for i in (0, 1))
    monkeypatch.setattr(teacher_text, "generate_corpus", None)  # a second run makes nothing
    assert teacher_text.recipe_corpus(str(models["teacher"]), 16, progress=False) == made
