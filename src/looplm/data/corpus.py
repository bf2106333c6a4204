"""`looplm data build`: sources -> deterministic held-out split -> tokens -> packed fixed-length
sequences in memory-mapped files.

Layout of a corpus directory::

    meta.json              written last (atomically): the commit marker; tokenizer fingerprint,
                           seq_len, dtype, per-source and per-split counts and sha256 checksums
    train.bin, heldout.bin [num_seqs, seq_len] tokens, uint16 (vocab <= 65536) or uint32
    parts/<source>.<split>.bin  the per-source packed sequences the two files are made of

Held-out split: each document is cut into blocks of paragraphs (~``block_chars``); a block goes
to held-out when sha1("source/doc/block") falls under the held-out fraction (at least one block per
source), so the split does not depend on the tokenizer, the machine or the order of sources.
Idempotent: a re-run recomputes nothing whose inputs (source text sha256, tokenizer, seq_len,
split settings) and output checksums are unchanged.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path

import numpy as np

from ..errors import UsageError
from ..models.loading import tokenizer_fingerprint
from ..util import read_json, write_json_atomic
from .generated import read_manifest
from .sources import DEFAULT_SOURCES, resolve_sources, sha256_file

FORMAT = 1


def load_tokenizer(spec: str):
    """The tokenizer of a model spec (embedded name, looplm/HF directory, .gguf), without its weights
    where possible."""
    from transformers import AutoTokenizer

    from ..models import load_model
    from ..models.loading import EMBEDDED, embedded_copy

    p = embedded_copy(spec) if spec in EMBEDDED else Path(spec)
    if p.is_dir() and (p / "tokenizer_config.json").exists():
        return AutoTokenizer.from_pretrained(str(p))
    _, tok = load_model(spec)
    if tok is None:
        raise UsageError(f"model {spec!r} has no tokenizer files; save it with its tokenizer (looplm convert does)")
    return tok


def split_blocks(source: str, docs: list[tuple[str, str]], heldout: float, block_chars: int):
    """[(block_id, text, is_heldout, doc_end)] in document order."""
    blocks = []
    for doc_id, text in docs:
        paras, cur, size = [], [], 0
        for para in text.split("\n\n"):
            cur.append(para)
            size += len(para) + 2
            if size >= block_chars:
                paras.append("\n\n".join(cur))
                cur, size = [], 0
        if cur:
            paras.append("\n\n".join(cur))
        for j, block in enumerate(paras):
            bid = f"{source}/{doc_id}/{j}"
            blocks.append([bid, block, False, j == len(paras) - 1])
    if not blocks:
        return blocks
    scores = [int(hashlib.sha1(b[0].encode()).hexdigest()[:12], 16) / 16**12 for b in blocks]
    for b, s in zip(blocks, scores):
        b[2] = s < heldout
    if heldout > 0 and not any(b[2] for b in blocks):
        blocks[int(np.argmin(scores))][2] = True
    if len(blocks) > 1 and all(b[2] for b in blocks):
        blocks[int(np.argmax(scores))][2] = False
    return [tuple(b) for b in blocks]


def parse_cap(item: str) -> tuple[str, int | None]:
    """``SOURCE:N`` -> (SOURCE, N): at most N training rows of that source (a mix's weights); else (item, None)."""
    name, sep, rows = item.rpartition(":")
    if not sep or not rows.isdigit():
        return item, None
    if int(rows) < 1:
        raise UsageError(f"--sources {item}: a source's row cap must be at least 1")
    return name, int(rows)


def teacher_mix_sources(generated: str | Path, seq_len: int, real: tuple[str, ...] = DEFAULT_SOURCES) -> str:
    """``--sources`` of the healing recipe's corpus: the teacher's own text (a `looplm data generate` directory)
    and as many tokens of the ``real`` sources, split evenly among them. The real sources come first, so the
    first held-out rows, which healing's periodic evaluation scores, are real text."""
    tokens = read_manifest(generated)["tokens"]
    per_source = max(1, math.ceil(tokens / seq_len / len(real)))
    return ",".join([f"{name}:{per_source}" for name in real] + [str(generated)])


def pack(token_lists: list[list[int]], seq_len: int, bos: int | None) -> np.ndarray:
    """Concatenate token streams and cut into [n, seq_len] rows (the remainder is dropped); with
    ``bos`` every row starts with it."""
    body = seq_len - (1 if bos is not None else 0)
    stream = np.fromiter((t for ids in token_lists for t in ids), dtype=np.int64)
    n = len(stream) // body
    rows = stream[: n * body].reshape(n, body)
    if bos is not None:
        rows = np.concatenate([np.full((n, 1), bos, dtype=np.int64), rows], axis=1)
    return rows


def _write_atomic(path: Path, array: np.ndarray) -> str:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    array.tofile(tmp)
    os.replace(tmp, path)
    return sha256_file(path)


def build(
    out: str | Path,
    model: str = "smollm2-135m",
    sources: str = ",".join(("austen", "kjv", "shakespeare", "python-docs")),
    seq_len: int = 512,
    heldout: float = 0.02,
    block_chars: int = 16000,
    refresh: bool = False,
    log=print,
    progress: bool = True,
) -> dict:
    if seq_len < 8:
        raise UsageError(f"--seq-len {seq_len} is too short; use at least 8 (1024 or 2048 for real runs)")
    if not 0 <= heldout < 1:
        raise UsageError(f"--heldout {heldout} must be a fraction in [0, 1)")
    out = Path(out)
    tok = load_tokenizer(model)
    fp = tokenizer_fingerprint(tok)
    vocab = len(tok)
    probe = tok("a b").input_ids
    settings = {
        "format": FORMAT,
        "tokenizer": fp,
        "seq_len": seq_len,
        "heldout": heldout,
        "block_chars": block_chars,
        "dtype": "uint16" if vocab <= 1 << 16 else "uint32",
        # a BOS starts every row only for a tokenizer that puts one in front of its text
        "bos": tok.bos_token_id if tok.bos_token_id is not None and probe and probe[0] == tok.bos_token_id else None,
        "eos": tok.eos_token_id,
    }
    texts, caps = _read_sources(sources, refresh, log)
    out.mkdir(parents=True, exist_ok=True)
    (out / "parts").mkdir(exist_ok=True)
    old = json.loads((out / "meta.json").read_text()) if (out / "meta.json").exists() else {}
    meta = {**settings, "model": model, "vocab_size": vocab, "sources": {}, "splits": {}}
    changed = False
    for name, (docs, text_sha) in texts.items():
        prev = old.get("sources", {}).get(name)
        files = {s: out / "parts" / f"{name}.{s}.bin" for s in ("train", "heldout")}
        if _source_up_to_date(prev, text_sha, caps[name], settings, old, files):
            log(f"{name}: up to date ({prev['train']['seqs']} train / {prev['heldout']['seqs']} held-out sequences)")
            meta["sources"][name] = prev
            continue
        changed = True
        entry = _build_source(name, docs, text_sha, caps[name], tok, settings, files, progress)
        meta["sources"][name] = entry
        log(
            f"{name}: {entry['train']['seqs']} train / {entry['heldout']['seqs']} held-out sequences "
            f"of {seq_len} tokens"
        )
    for split in ("train", "heldout"):
        meta["splits"][split] = _join_split(out, split, meta, old, changed)
    if meta["splits"]["train"]["seqs"] == 0:
        raise UsageError(f"the corpus has no training sequences of {seq_len} tokens; add text or lower --seq-len")
    write_json_atomic(out / "meta.json", meta)
    return meta


def _read_sources(sources: str, refresh: bool, log) -> tuple[dict, dict]:
    """``--sources`` read: {source: (documents, text sha256)} and {source: its training row cap, or None}."""
    texts, caps = {}, {}
    items = [s.strip() for s in sources.split(",") if s.strip()]
    if not items:
        resolve_sources(sources)  # the one message for no sources
    for item in items:
        item, cap = parse_cap(item)
        resolved = resolve_sources(item, refresh=refresh, log=log)
        texts.update(resolved)
        caps.update({name: cap for name in resolved})
    return texts, caps


def _source_up_to_date(prev: dict | None, text_sha: str, cap: int | None, settings: dict, old: dict, files) -> bool:
    """Whether a source's parts of the previous build can stay: same text, cap and settings, files intact."""
    return bool(
        prev
        and prev.get("text_sha256") == text_sha
        and prev.get("max_train_rows") == cap
        and all(old.get(k) == v for k, v in settings.items())
        and all(files[s].exists() and sha256_file(files[s]) == prev[s]["sha256"] for s in files)
    )


def _build_source(name: str, docs, text_sha: str, cap: int | None, tok, settings: dict, files, progress: bool) -> dict:
    """Tokenise one source, split it into held-out and training blocks and write its packed parts; its meta entry."""
    from tqdm import tqdm

    eos = settings["eos"]
    blocks = split_blocks(name, docs, settings["heldout"], settings["block_chars"])
    streams = {"train": [], "heldout": []}
    bar = tqdm(blocks, desc=f"tokenising {name}", unit="block", disable=not progress)
    for _block, text, is_held, doc_end in bar:
        ids = tok(text, add_special_tokens=False).input_ids
        if doc_end and eos is not None:
            ids = ids + [eos]
        streams["heldout" if is_held else "train"].append(ids)
    entry = {
        "text_sha256": text_sha,
        "documents": len(docs),
        "chars": sum(len(t) for _, t in docs),
        "max_train_rows": cap,
    }
    for split, lists in streams.items():
        entry[split] = _write_part(name, lists, cap if split == "train" else None, settings, files[split])
    return entry


def _write_part(name: str, lists: list[list[int]], cap: int | None, settings: dict, path: Path) -> dict:
    """Pack one split of a source into ``path``, at most ``cap`` rows of it; its {"seqs", "tokens", "blocks",
    "sha256"}."""
    dtype = settings["dtype"]
    rows = pack(lists, settings["seq_len"], settings["bos"])
    if cap is not None and len(rows) > cap:
        # a seeded choice of rows, so that a mix weighs its sources as asked (held-out rows all stay)
        seed = int(hashlib.sha1(name.encode()).hexdigest()[:8], 16)
        rows = rows[np.sort(np.random.default_rng(seed).choice(len(rows), cap, replace=False))]
    if rows.size and rows.max() >= (1 << 16 if dtype == "uint16" else 1 << 32):
        raise UsageError(f"token id {rows.max()} does not fit {dtype}")
    digest = _write_atomic(path, rows.astype(dtype))
    return {
        "seqs": int(rows.shape[0]),
        "tokens": int(rows.size if cap is not None else sum(map(len, lists))),
        "blocks": len(lists),
        "sha256": digest,
    }


def _join_split(out: Path, split: str, meta: dict, old: dict, changed: bool) -> dict:
    """``split``.bin, the sources' parts one after another, kept from the previous build when nothing changed;
    its meta entry."""
    path = out / f"{split}.bin"
    parts = [out / "parts" / f"{n}.{split}.bin" for n in meta["sources"]]
    seqs = sum(meta["sources"][n][split]["seqs"] for n in meta["sources"])
    prev = old.get("splits", {}).get(split)
    if (
        not changed
        and prev
        and prev.get("sources") == list(meta["sources"])
        and path.exists()
        and sha256_file(path) == prev["sha256"]
    ):
        return prev
    dtype = meta["dtype"]
    arrays = [np.fromfile(p, dtype=dtype) for p in parts]
    data = np.concatenate(arrays) if arrays else np.zeros(0, dtype=dtype)
    return {
        "file": path.name,
        "seqs": seqs,
        "sha256": _write_atomic(path, data),
        "sources": list(meta["sources"]),
    }


class PackedCorpus:
    """A built corpus: memory-mapped [num_seqs, seq_len] token arrays per split."""

    def __init__(self, directory: str | Path, verify: bool = False):
        d = Path(directory)
        if not d.exists():
            raise UsageError(f"corpus directory {d} does not exist; build it with `looplm data build --out {d}`")
        self.meta = read_json(d / "meta.json", "finished corpus", f"run `looplm data build --out {d}`")
        self.dir, self.seq_len, self.dtype = d, int(self.meta["seq_len"]), np.dtype(self.meta["dtype"])
        self.splits = {}
        for split in ("train", "heldout"):
            info = self.meta["splits"].get(split, {"seqs": 0})
            path = d / f"{split}.bin"
            if info["seqs"] == 0:
                self.splits[split] = np.zeros((0, self.seq_len), dtype=self.dtype)
                continue
            expected = info["seqs"] * self.seq_len * self.dtype.itemsize
            if not path.exists() or path.stat().st_size != expected:
                raise UsageError(f"{path} is missing or truncated; re-run `looplm data build --out {d}`")
            if verify and sha256_file(path) != info["sha256"]:
                raise UsageError(f"{path} fails its checksum; re-run `looplm data build --out {d}`")
            self.splits[split] = np.memmap(path, dtype=self.dtype, mode="r", shape=(info["seqs"], self.seq_len))
        if len(self.splits["train"]) == 0:
            raise UsageError(
                f"corpus {d} is empty (no training sequences); rebuild it with more text or a smaller --seq-len"
            )

    @property
    def tokenizer(self) -> str:
        return self.meta["tokenizer"]

    def sources_of(self, split: str, rows: int) -> dict[str, int]:
        """{source: rows} of the first ``rows`` rows of ``split``: a split holds its sources one after another, so
        its first rows may all be one source's."""
        out, left = {}, rows
        for name in self.meta["splits"].get(split, {}).get("sources", []):
            n = min(left, self.meta["sources"][name][split]["seqs"])
            if n > 0:
                out[name] = n
            left -= n
        return out

    def training_text(self, rows) -> str:
        """Training rows ``rows`` (indices) decoded with the corpus's tokenizer, joined by blank lines: calibration
        text, never held out."""
        train, tok = self.splits["train"], load_tokenizer(self.meta["model"])
        return "\n\n".join(tok.decode(np.asarray(train[i]).tolist(), skip_special_tokens=True) for i in rows)

    def __len__(self) -> int:
        return len(self.splits["train"])
