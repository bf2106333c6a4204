"""A corpus of text sampled from a model (`looplm data generate`): its on-disk form and its reader.

Healing distils the original model into the converted one. Text the original wrote itself carries the
original's own distribution, not one corpus's, so a student healed on it learns the teacher's behaviour
rather than the corpus (LLM-QAT, Liu et al. 2023; sequence-level KD, Kim and Rush 2016). A directory of it
is a corpus source like any other: `looplm data build --sources austen,...,DIR` splits and packs it.

Layout::

    manifest.json           written last after every shard (atomically): settings, the teacher's fingerprint,
                            counts, tokens/s, and each finished shard's file and sha256
    shards/shard-NNNNN.jsonl one sample a line: {"index", "prompt_kind", "prompt": ids, "completion": ids, "text"}

Samples are a pure function of (settings, index): a killed run resumes at the first unfinished shard and
writes what an uninterrupted run would have. Exact duplicates (by normalised text) and degenerate samples (a
loop of the same few words) are dropped when a shard is written, and counted in the manifest.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from ..errors import UsageError

KIND = "looplm-generated"
FORMAT = 1
MIN_DISTINCT_4GRAMS = 0.3  # below this share of distinct word 4-grams a sample is a repetition loop, not text


def is_generated(directory: Path) -> bool:
    manifest = directory / "manifest.json"
    if not manifest.exists():
        return False
    try:
        return json.loads(manifest.read_text()).get("kind") == KIND
    except json.JSONDecodeError:
        return False


def read_manifest(directory: str | Path) -> dict:
    d = Path(directory)
    path = d / "manifest.json"
    if not path.exists():
        raise UsageError(f"{d} is not a generated corpus (no manifest.json); make one with `looplm data generate`")
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise UsageError(f"{path} is corrupt ({e}); re-run `looplm data generate --out {d}` to rewrite it") from None
    if manifest.get("kind") != KIND:
        raise UsageError(f"{path} is not a generated corpus's manifest")
    return manifest


def text_key(text: str) -> str:
    """What makes two samples duplicates: their text with whitespace runs collapsed and case folded."""
    return hashlib.sha1(" ".join(text.split()).casefold().encode("utf-8")).hexdigest()


def degenerate(text: str) -> bool:
    """A sample stuck in a loop: few distinct word 4-grams among its words (short samples are kept)."""
    words = text.split()
    grams = [tuple(words[i : i + 4]) for i in range(len(words) - 3)]
    return len(grams) >= 20 and len(set(grams)) / len(grams) < MIN_DISTINCT_4GRAMS


def read_samples(directory: str | Path) -> list[dict]:
    """Every kept sample of the finished shards, in index order."""
    d = Path(directory)
    manifest = read_manifest(d)
    samples = []
    for shard in manifest["shards"]:
        path = d / shard["file"]
        if not path.exists():
            raise UsageError(f"{path} is missing; re-run `looplm data generate --out {d}` to write it again")
        if hashlib.sha256(path.read_bytes()).hexdigest() != shard["sha256"]:
            raise UsageError(f"{path} fails its checksum; delete it and re-run `looplm data generate --out {d}`")
        # split on newlines only: str.splitlines() also breaks at U+2028, \x1e and others, which the model's text
        # holds verbatim inside its JSON strings
        lines = path.read_text(encoding="utf-8").split("\n")
        samples += [json.loads(line) for line in lines if line.strip()]
    return samples


def generated_documents(directory: str | Path) -> tuple[list[tuple[str, str]], str]:
    """(documents, sha256) of a generated corpus as a `looplm data build` source: one document per sample, so
    that the held-out split and the end-of-text marks fall between samples. The digest covers every shard."""
    d = Path(directory)
    samples = read_samples(d)
    if not samples:
        raise UsageError(f"{d} holds no finished samples yet; let `looplm data generate --out {d}` run longer")
    digest = hashlib.sha256("".join(s["sha256"] for s in read_manifest(d)["shards"]).encode()).hexdigest()
    return [(f"sample-{s['index']}", s["text"]) for s in samples], digest
