"""`looplm data build` from local text: split, packing, idempotence, checksums, bad input."""

import json
import re

import numpy as np
import pytest
from test_train_fixtures import byte_tokenizer, write_texts

from looplm.data.corpus import PackedCorpus, build, pack, split_blocks
from looplm.errors import UsageError
from looplm.models import save_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from test_train_fixtures import tiny_vanilla

    return save_model(tiny_vanilla(), byte_tokenizer(), tmp_path_factory.mktemp("m") / "model")


def _build(tmp, model_dir, texts, **kw):
    logs = []
    kw = {"seq_len": 64, "heldout": 0.1, "block_chars": 1500, **kw}
    meta = build(tmp / "corpus", model=str(model_dir), sources=str(texts), log=logs.append, progress=False, **kw)
    return meta, logs


def test_build_packs_tokens_of_the_text_and_splits_per_source(tmp_path, model_dir):
    texts = write_texts(tmp_path / "texts", n_files=2, chars=20000)
    meta, _ = _build(tmp_path, model_dir, texts)
    corpus = PackedCorpus(tmp_path / "corpus", verify=True)
    assert corpus.seq_len == 64 and corpus.splits["train"].dtype == np.uint16
    assert set(meta["sources"]) == {"src0", "src1"}
    for info in meta["sources"].values():
        assert info["heldout"]["blocks"] >= 1 and info["train"]["blocks"] >= 1
    n_train = sum(s["train"]["seqs"] for s in meta["sources"].values())
    assert len(corpus) == n_train > 0 and len(corpus.splits["heldout"]) > 0
    # decoded rows are verbatim pieces of the source text, up to the blank lines between paragraphs (blocks
    # are cut at blank lines, so a row that spans two keeps one newline where the text may have several)
    tok = byte_tokenizer()
    lines = lambda text: re.sub(r"\n+", "\n", text)
    src = lines("".join((texts / f"src{i}.txt").read_text() for i in range(2)))
    for row in corpus.splits["train"][[0, 7, len(corpus) - 1]]:
        piece = tok.decode([int(t) for t in row if t != tok.eos_token_id])
        assert lines(piece[5:-5]) in src
    # no held-out block's text appears in training rows
    held_rows = corpus.splits["heldout"]
    held_text = tok.decode([int(t) for t in held_rows[0]])
    train_text = tok.decode([int(t) for t in corpus.splits["train"].reshape(-1)])
    assert held_text[:60] not in train_text
    # the held-out split holds its sources one after another: its first rows are all the first source's
    n0 = meta["sources"]["src0"]["heldout"]["seqs"]
    src0 = lines((texts / "src0.txt").read_text())
    assert lines(tok.decode([int(t) for t in held_rows[n0 - 1] if t != tok.eos_token_id])[5:-5]) in src0
    assert corpus.sources_of("heldout", n0) == {"src0": n0}
    assert corpus.sources_of("heldout", n0 + 1) == {"src0": n0, "src1": 1}
    assert corpus.sources_of("heldout", 10**6) == {n: s["heldout"]["seqs"] for n, s in meta["sources"].items()}


def test_split_is_deterministic_and_order_independent():
    docs = [(f"d{i}", "\n\n".join(f"para {i}.{j} " * 20 for j in range(30))) for i in range(5)]
    a = split_blocks("s", docs, 0.2, 500)
    b = split_blocks("s", list(reversed(docs)), 0.2, 500)
    held_a = {x[0] for x in a if x[2]}
    assert held_a == {x[0] for x in b if x[2]} and 0 < len(held_a) < len(a)


def test_pack_with_bos():
    rows = pack([[1, 2, 3], [4, 5, 6, 7]], 4, bos=9)
    assert rows.tolist() == [[9, 1, 2, 3], [9, 4, 5, 6]]
    assert pack([[1, 2, 3, 4, 5]], 2, None).tolist() == [[1, 2], [3, 4]]


def test_rebuild_is_idempotent_and_repairs_a_corrupt_file(tmp_path, model_dir):
    texts = write_texts(tmp_path / "texts", n_files=2, chars=15000)
    meta1, _ = _build(tmp_path, model_dir, texts)
    part = tmp_path / "corpus" / "parts" / "src1.train.bin"
    mtime = part.stat().st_mtime_ns
    meta2, logs = _build(tmp_path, model_dir, texts)
    assert meta1 == meta2 and part.stat().st_mtime_ns == mtime
    assert sum("up to date" in line for line in logs) == 2
    data = bytearray(part.read_bytes())
    data[10] ^= 0xFF
    part.write_bytes(bytes(data))
    meta3, logs = _build(tmp_path, model_dir, texts)
    assert meta3 == meta1 and sum("up to date" in line for line in logs) == 1
    # a changed source is re-tokenised
    (texts / "src0.txt").write_text((texts / "src0.txt").read_text() + "\nmore text " * 500)
    meta4, logs = _build(tmp_path, model_dir, texts)
    assert meta4["sources"]["src0"]["text_sha256"] != meta1["sources"]["src0"]["text_sha256"]
    assert meta4["sources"]["src1"] == meta1["sources"]["src1"]
    # a truncated split file is detected by the reader
    train = tmp_path / "corpus" / "train.bin"
    train.write_bytes(train.read_bytes()[:-10])
    with pytest.raises(UsageError, match="truncated; re-run `looplm data build"):
        PackedCorpus(tmp_path / "corpus")


def test_paradise_regained_is_refused(tmp_path, model_dir):
    from importlib import resources

    texts = tmp_path / "texts"
    texts.mkdir()
    sample = resources.files("looplm").joinpath("data", "heldout_sample.txt").read_text()
    (texts / "milton.txt").write_text("Some preface.\n\n" + sample[1000:6000])
    with pytest.raises(UsageError, match="held-out text"):
        _build(tmp_path, model_dir, texts)
    assert not (tmp_path / "corpus").exists()


def test_bad_sources(tmp_path, model_dir):
    with pytest.raises(UsageError, match="does not exist"):
        _build(tmp_path, model_dir, tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(UsageError, match="no .txt files"):
        _build(tmp_path, model_dir, tmp_path / "empty")
    (tmp_path / "tiny").mkdir()
    (tmp_path / "tiny" / "a.txt").write_text("too short")
    with pytest.raises(UsageError, match="no training sequences"):
        _build(tmp_path, model_dir, tmp_path / "tiny")
    assert not (tmp_path / "corpus" / "meta.json").exists()
    with pytest.raises(UsageError, match="unknown corpus source"):
        build(tmp_path / "c2", model=str(model_dir), sources="wikipedia", log=lambda *a: None)


def test_reader_errors(tmp_path):
    with pytest.raises(UsageError, match="looplm data build --out"):
        PackedCorpus(tmp_path / "missing")
    (tmp_path / "c").mkdir()
    with pytest.raises(UsageError, match="no meta.json"):
        PackedCorpus(tmp_path / "c")
    (tmp_path / "c" / "meta.json").write_text(
        json.dumps(
            {
                "seq_len": 8,
                "dtype": "uint16",
                "tokenizer": "x",
                "splits": {"train": {"seqs": 0}, "heldout": {"seqs": 0}},
            }
        )
    )
    with pytest.raises(UsageError, match="empty"):
        PackedCorpus(tmp_path / "c")


def test_eval_ppl_scores_the_heldout_split_of_a_corpus(tmp_path, model_dir, capsys):
    """`looplm eval ppl MODEL --data CORPUS` scores the corpus's held-out rows as tokens: the same
    number as a plain forward pass over those rows, cut to --seq-len."""
    import math

    import torch

    from looplm.commands import main
    from looplm.models import load_model

    _build(tmp_path, model_dir, write_texts(tmp_path / "texts", n_files=2, chars=20000))
    rows = PackedCorpus(tmp_path / "corpus").splits["heldout"]
    assert (
        main(
            [
                "eval",
                "ppl",
                str(model_dir),
                "--data",
                str(tmp_path / "corpus"),
                "--seq-len",
                "32",
                "--no-save",
                "--json",
            ]
        )
        == 0
    )
    got = json.loads(capsys.readouterr().out)
    model, _ = load_model(model_dir)
    ids = torch.tensor(np.asarray(rows, dtype=np.int64)).reshape(-1, 32)  # 64-token rows cut in two
    with torch.no_grad():
        logits = model(ids).logits[:, :-1]
    nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    assert got["tokens"] == ids[:, 1:].numel() and got["name"] == "corpus-heldout"
    assert got["perplexity"] == pytest.approx(math.exp(float(nll)), rel=1e-4)
    # a model with another tokenizer is refused, naming the fix
    other = save_model(load_model(model_dir)[0], byte_tokenizer(extra="<x>"), tmp_path / "other")
    assert main(["eval", "ppl", str(other), "--data", str(tmp_path / "corpus"), "--no-save"]) == 2
    assert "looplm data build " in capsys.readouterr().err
