"""Corpus subcommands: `looplm data build` (fetch, split, tokenise, pack) and `looplm data text`."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from ..cli_args import HelpFormatter, add_model, advanced


class _Formatter(argparse.RawDescriptionHelpFormatter, HelpFormatter):
    """Defaults shown, and the epilog's list of sources kept as written."""


def register(sub) -> None:
    from .sources import DEFAULT_SOURCES, SOURCES

    p = sub.add_parser("data", help="training corpora")
    dsub = p.add_subparsers(dest="data_command", required=True)
    b = dsub.add_parser(
        "build",
        help="fetch sources, split held-out text, tokenise and pack into a corpus dir",
        formatter_class=_Formatter,
        epilog="sources:\n" + "\n".join(f"  {k:12s} {v}" for k, v in SOURCES.items()),
    )
    add_model(b, "the model whose tokenizer packs the corpus", default="smollm2-135m")
    b.add_argument("--out", required=True, help="corpus directory (re-running it skips finished work)")
    b.add_argument(
        "--sources",
        default=",".join(DEFAULT_SOURCES),
        help="comma list of source names and/or directories: of .txt files (one source per file) or from "
        "`looplm data generate`; SOURCE:N keeps at most N training rows of a source (a mix's weights)",
    )
    b.add_argument("--seq-len", type=int, default=512, help="tokens per packed sequence (the healing recipe reads 512)")
    b.add_argument("--refresh", action="store_true", help="fetch sources again even if cached")
    b.add_argument("--no-progress", action="store_true", help="no progress bars on stderr")
    a = advanced(b)
    a.add_argument("--heldout", type=float, default=0.02, help="held-out fraction of each source (by block hash)")
    a.add_argument("--block-chars", type=int, default=16000, help="size of the blocks the split assigns")
    b.set_defaults(func=cmd_data_build)

    x = dsub.add_parser(
        "text",
        help="decode rows of a built corpus's training split into a .txt file (calibration "
        "text for `looplm convert --calib-data`; never held-out rows)",
        formatter_class=HelpFormatter,
    )
    x.add_argument("corpus", help="corpus dir from `looplm data build`")
    x.add_argument("--out", required=True, help="directory to write train.txt into")
    x.add_argument("--rows", type=int, default=32, help="training rows to decode (x the corpus's seq-len tokens)")
    x.add_argument("--seed", type=int, default=1234, help="which rows: a seeded random choice")
    x.set_defaults(func=cmd_data_text)


def cmd_data_build(args) -> int:
    from .corpus import build

    meta = build(
        args.out,
        model=args.model,
        sources=args.sources,
        seq_len=args.seq_len,
        heldout=args.heldout,
        block_chars=args.block_chars,
        refresh=args.refresh,
        progress=not args.no_progress,
    )
    s = meta["splits"]
    print(
        f"wrote {args.out}: {s['train']['seqs']} train / {s['heldout']['seqs']} held-out sequences of "
        f"{meta['seq_len']} tokens ({len(meta['sources'])} sources, tokenizer {meta['tokenizer']})"
    )
    return 0


def cmd_data_text(args) -> int:
    import numpy as np

    from ..errors import UsageError
    from .corpus import PackedCorpus, load_tokenizer

    corpus = PackedCorpus(args.corpus)
    train = corpus.splits["train"]
    if not 0 < args.rows <= len(train):
        raise UsageError(f"--rows {args.rows} must be between 1 and the corpus's {len(train)} training rows")
    tok = load_tokenizer(corpus.meta["model"])
    picks = np.sort(np.random.default_rng(args.seed).choice(len(train), size=args.rows, replace=False))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    text = "\n\n".join(tok.decode(np.asarray(train[i]).tolist(), skip_special_tokens=True) for i in picks)
    tmp = out / ".train.txt.tmp"
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, out / "train.txt")
    print(f"wrote {out / 'train.txt'}: {args.rows} training rows of {args.corpus} ({len(text):,} characters)")
    return 0
