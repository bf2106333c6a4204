"""`looplm data build` (fetch, split, tokenise, pack) and `looplm data text`; `looplm data generate` is in
commands/serve.py (it drives the engine)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..settings import setting
from ..util import write_text_atomic
from . import command
from .args import call_with, write_settings


def _default_sources() -> list[str]:
    from ..data.sources import DEFAULT_SOURCES

    return list(DEFAULT_SOURCES)


@dataclass
class Build:
    """Fetch sources, split held-out text, tokenise and pack into a corpus dir."""

    model: str = setting("smollm2-135m", "the model whose tokenizer packs the corpus", positional=True)
    out: str | None = setting(None, "corpus directory (re-running it skips finished work)", required=True)
    sources: str = setting(
        ",".join(_default_sources()),
        "comma list of source names and/or directories: of .txt files (one source per file) or from "
        "`looplm data generate`; SOURCE:N keeps at most N training rows of a source (a mix's weights)",
    )
    seq_len: int = setting(512, "tokens per packed sequence (the healing recipe reads 512)")
    refresh: bool = setting(False, "fetch sources again even if cached")
    progress: bool = setting(True, "progress bars on stderr")
    heldout: float = setting(0.02, "held-out fraction of each source (by block hash)", advanced=True)
    block_chars: int = setting(16000, "size of the blocks the split assigns", advanced=True)


@dataclass
class Text:
    """Decode rows of a built corpus's training split into a .txt file (calibration text for `looplm convert --calib-
    data`; never held-out rows)."""

    corpus: str | None = setting(None, "corpus dir from `looplm data build`", positional=True)
    out: str | None = setting(None, "directory to write train.txt into", required=True)
    rows: int = setting(32, "training rows to decode (x the corpus's seq-len tokens)")
    seed: int = setting(1234, "which rows: a seeded random choice")


def _sources_epilog() -> str:
    from ..data.sources import SOURCES

    return "sources:\n" + "\n".join(f"  {k:12s} {v}" for k, v in SOURCES.items())


@command("data", "build", epilog=_sources_epilog)
def cmd_build(s: Build) -> int:
    from ..data.corpus import build

    meta = call_with(build, s)
    write_settings(s.out, "looplm data build", s)
    splits = meta["splits"]
    print(
        f"wrote {s.out}: {splits['train']['seqs']} train / {splits['heldout']['seqs']} held-out sequences of "
        f"{meta['seq_len']} tokens ({len(meta['sources'])} sources, tokenizer {meta['tokenizer']})"
    )
    return 0


@command("data", "text")
def cmd_text(s: Text) -> int:
    import numpy as np

    from ..data.corpus import PackedCorpus
    from ..errors import UsageError

    corpus = PackedCorpus(s.corpus)
    train = corpus.splits["train"]
    if not 0 < s.rows <= len(train):
        raise UsageError(f"--rows {s.rows} must be between 1 and the corpus's {len(train)} training rows")
    picks = np.sort(np.random.default_rng(s.seed).choice(len(train), size=s.rows, replace=False))
    out = Path(s.out)
    out.mkdir(parents=True, exist_ok=True)
    text = corpus.training_text(picks)
    write_text_atomic(out / "train.txt", text)
    print(f"wrote {out / 'train.txt'}: {s.rows} training rows of {s.corpus} ({len(text):,} characters)")
    return 0
