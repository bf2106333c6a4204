"""Held-out perplexity and bits per byte, for the final exit and every loop exit in one pass.

The text is tokenised once and cut into non-overlapping windows of ``seq_len`` tokens (or the windows
are given, as the rows of a packed corpus's held-out split); every token after a window's first is
scored (a BOS is put in front of each text window for models that need one, such as Gemma). Loop i's exit is the
final norm and LM head applied after i loops: a static exit.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from tqdm import tqdm

from ..data.ood import token_windows
from ..errors import UsageError
from ..util import read_text_arg


@torch.no_grad()
def perplexity(
    model,
    tokenizer,
    text: str,
    seq_len: int = 512,
    batch_size: int = 4,
    exit_loop: int | None = None,
    max_tokens: int | None = None,
    progress: bool = False,
) -> dict:
    """{"perplexity", "bits_per_byte", "tokens", "per_loop": [{"loop", "perplexity", "bits_per_byte"}]}.

    ``perplexity`` is for exit_loop (default: the last loop); per_loop covers loops 1..exit_loop."""
    if not text.strip():
        raise ValueError("the evaluation text is empty; give a file with text in it")
    windows = token_windows(tokenizer, text, seq_len, bool(getattr(model.config, "add_bos_token", False)))
    return score_windows(model, tokenizer, windows, batch_size, exit_loop, max_tokens, progress)


@torch.no_grad()
def score_windows(
    model,
    tokenizer,
    windows: list[list[int]],
    batch_size: int = 4,
    exit_loop: int | None = None,
    max_tokens: int | None = None,
    progress: bool = False,
    final_only: bool = False,
    desc: str = "perplexity",
) -> dict:
    """``perplexity`` on token windows given directly (e.g. the rows of a packed corpus's held-out split), plus the
    final exit's mean token loss and scored tokens of each window (``window_losses``, ``window_tokens``).

    ``final_only``: score the exit after loop ``exit_loop`` alone (``per_loop`` then holds that loop only), for
    callers that report no earlier exit: each exit is an LM head over the whole vocabulary, the larger part of a
    small model's cost (Gemma's 262k-token head)."""
    if not windows:
        raise ValueError("nothing to score: no window holds two or more tokens")
    if max_tokens:
        windows = _first_tokens(windows, max_tokens)
    loops = model.model.check_loops(exit_loop)
    device = next(model.parameters()).device
    nll = torch.zeros(loops, dtype=torch.float64)
    count = 0
    window_nll, window_tokens = [], []  # the final exit's, per window: paired comparisons resample windows
    scored_text = []
    for start in tqdm(range(0, len(windows), batch_size), desc=desc, disable=not progress):
        batch = windows[start : start + batch_size]
        ids, mask = _padded(batch)
        w_nll, _, w_tokens = model.exit_losses(ids.to(device), mask.to(device), num_loops=loops, final_only=final_only)
        nll += w_nll.sum(1)
        window_nll.extend(w_nll[-1].tolist())
        window_tokens.extend(w_tokens.tolist())
        count += int(w_tokens.sum())
        scored_text.extend(w[1:] for w in batch)
    # Bytes of the scored tokens (the text they decode to), for a tokenizer-independent measure.
    n_bytes = sum(len(tokenizer.decode([t for t in w if t is not None]).encode("utf-8")) for w in scored_text)
    per_loop = _per_loop_figures(nll, count, n_bytes, range(loops - 1 if final_only else 0, loops))
    return {
        "perplexity": per_loop[-1]["perplexity"],
        "bits_per_byte": per_loop[-1]["bits_per_byte"],
        "tokens": count,
        "bytes": n_bytes,
        "exit_loop": loops,
        "per_loop": per_loop,
        "window_losses": [n / max(t, 1) for n, t in zip(window_nll, window_tokens)],
        "window_tokens": window_tokens,
    }


def _first_tokens(windows: list[list[int]], max_tokens: int) -> list[list[int]]:
    """The leading windows, the last one cut short, that hold ``max_tokens`` scored tokens (a window's first
    token is context, not scored)."""
    kept, total = [], 0
    for w in windows:
        if total >= max_tokens:
            break
        kept.append(w[: max_tokens - total + 1])
        total += len(kept[-1]) - 1
    return kept


def _padded(batch: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """[len(batch), longest] token ids right-padded with 0, and the mask of the real tokens."""
    width = max(len(w) for w in batch)
    ids = torch.full((len(batch), width), 0, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for i, w in enumerate(batch):
        ids[i, : len(w)] = torch.tensor(w)
        mask[i, : len(w)] = 1
    return ids, mask


def _per_loop_figures(nll: torch.Tensor, count: int, n_bytes: int, loops: range) -> list[dict]:
    """Perplexity and bits per byte of each exit in ``loops`` (0-based), from its summed token loss."""
    return [
        {
            "loop": i + 1,
            "perplexity": math.exp(nll[i] / count),
            "bits_per_byte": float(nll[i] / math.log(2) / max(n_bytes, 1)),
        }
        for i in loops
    ]


def heldout_sources(text: str | None, data: str | None) -> dict:
    """What `looplm eval ppl` scores: name -> a text, or a PackedCorpus whose held-out rows are scored. ``data``: a
    directory of held-out .txt files, a built corpus or "lambada"; ``text``: one file; neither: the packaged sample."""
    if text and data:
        raise UsageError("give either --text FILE or --data DIR, not both")
    if data == "lambada":
        from .task_data import lambada_passages

        return {"lambada": lambada_passages()}
    if data:
        d = Path(data)
        if not d.is_dir():
            raise UsageError(f"--data {d} is not a directory (or use --data lambada)")
        if (d / "meta.json").exists():  # a corpus from `looplm data build`: its held-out split, as tokens
            from ..data.corpus import PackedCorpus

            return {f"{d.name}-heldout": PackedCorpus(d)}
        files = sorted(d.glob("*.txt"))
        held = [f for f in files if any(k in f.name for k in ("heldout", "held_out", "test", "valid"))]
        files = held or files
        if not files:
            raise UsageError(f"{d} has no .txt files; give a directory of held-out text files")
        return {f.stem: read_text_arg(str(f)) for f in files}
    if text:
        return {Path(text).stem: read_text_arg(text)}
    from ..data import sample_text

    return {"heldout_sample": sample_text()}


def score_sources(model, tok, sources: dict, seq_len: int = 512, **kw) -> dict:
    """`looplm eval ppl`'s result: the perplexity of every source of ``heldout_sources`` (a text, or the held-out rows
    of a packed corpus, cut to ``seq_len``; ``kw``: ``perplexity``'s batch_size, exit_loop, max_tokens, progress),
    and over several their token-weighted perplexity, each one's under "files"."""
    results = {name: _score_source(model, tok, source, seq_len, kw) for name, source in sources.items()}
    if len(results) == 1:
        return {**next(iter(results.values())), "name": "+".join(results)}
    return {**combine(results), "name": "+".join(results), "files": results}


def _score_source(model, tok, source, seq_len: int, kw: dict) -> dict:
    if isinstance(source, str):
        return perplexity(model, tok, source, seq_len=seq_len, **kw)
    from ..models.loading import tokenizer_fingerprint

    if tokenizer_fingerprint(tok) != source.tokenizer:
        raise UsageError(
            f"the corpus {source.dir} was tokenised with {source.meta['model']}'s tokenizer, not the model's; build "
            "one for this model with `looplm data build MODEL --out DIR`"
        )
    rows = source.splits["heldout"]
    if len(rows) == 0:
        raise UsageError(f"the corpus {source.dir} has no held-out split; rebuild it with a held-out fraction")
    windows = [row[i : i + seq_len].tolist() for row in rows for i in range(0, len(row), seq_len)]
    return score_windows(model, tok, [w for w in windows if len(w) > 1], **kw)


def combine(results: dict) -> dict:
    """Token-weighted perplexity (and byte-weighted bits per byte) over several texts."""
    first = next(iter(results.values()))
    tokens = sum(r["tokens"] for r in results.values())
    n_bytes = sum(r["bytes"] for r in results.values())
    per_loop = []
    for i, row in enumerate(first["per_loop"]):
        nll = sum(math.log(r["per_loop"][i]["perplexity"]) * r["tokens"] for r in results.values())
        bits = sum(r["per_loop"][i]["bits_per_byte"] * r["bytes"] for r in results.values())
        per_loop.append({"loop": row["loop"], "perplexity": math.exp(nll / tokens), "bits_per_byte": bits / n_bytes})
    return {
        "perplexity": per_loop[-1]["perplexity"],
        "bits_per_byte": per_loop[-1]["bits_per_byte"],
        "tokens": tokens,
        "bytes": n_bytes,
        "exit_loop": first["exit_loop"],
        "per_loop": per_loop,
    }
