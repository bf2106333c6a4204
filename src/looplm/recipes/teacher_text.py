"""`looplm data generate`: sample a corpus from a model with the serving engine (its format: data/generated.py).

Each sample starts from a prompt of one of two kinds, drawn per sample by ``prompt_mix``:

- ``start``: a bare beginning of a document (the token pretraining put between documents), so the model
  writes whatever it writes most: its own distribution, unconditioned;
- ``corpus``: ``prompt_tokens`` tokens from a random place in a built corpus's *training* split, so the
  model continues real text in its own words (never held-out rows).

Requests run through the depth-wise engine in batches of ``max_batch``, bfloat16 where the CPU multiplies it
natively. Sample i's prompt and sampling seed are functions of (seed, i) alone, so a killed run resumes at its
first unfinished shard and writes what an uninterrupted run would have.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch

from ..data.generated import FORMAT, KIND, degenerate, read_manifest, read_samples, text_key
from ..errors import UsageError
from ..settings import setting
from ..util import machine, write_json_atomic, write_text_atomic

PROMPT_KINDS = ("start", "corpus")


@dataclass
class GenerateConfig:
    """`looplm data generate`'s settings."""

    model: str = setting("smollm2-135m", "the model to sample (the original, for healing)", positional=True)
    out: str = setting("", "corpus directory (re-running it resumes)", required=True)
    tokens: int | None = setting(
        None,
        "stop once this many generated tokens are kept, across resumes (this or --budget-minutes is needed)",
        flag="--generated-tokens",
        metavar="N",
        exclusive="budget",
        renamed_from=("--tokens",),
    )
    minutes: float | None = setting(
        None,
        "stop after this many minutes of generation, across resumes",
        flag="--budget-minutes",
        metavar="M",
        exclusive="budget",
        renamed_from=("--minutes",),
    )
    prompt_mix: str | None = setting(
        None,
        "kind:weight list; start = a bare document start, corpus = a snippet of --corpus's training split "
        "(default: start:1,corpus:1 with --corpus, else start:1)",
    )
    corpus: str | None = setting(
        None, "a `looplm data build` corpus for corpus prompts (needed when --prompt-mix has corpus prompts)"
    )
    prompt_tokens: int = setting(32, "tokens of each corpus prompt")
    max_new_tokens: int = setting(448, "generated tokens per sample at most (with the prompt, within a 512-token row)")
    temperature: float = setting(1.0, "sampling temperature")
    top_p: float = setting(0.95, "nucleus sampling: the smallest set of tokens whose probabilities reach this sum")
    max_batch: int = setting(
        128,
        "samples generated at once (KV cache rows)",
        flag="--max-concurrency",
        metavar="N",
        renamed_from=("--max-batch",),
    )
    shard_size: int = setting(256, "samples per shard (the unit of resuming)")
    weights: str | None = setting(
        None,
        "weight format (default: bf16 where the hardware multiplies it natively, else fp32)",
        choices=("fp32", "bf16", "int8", "int4"),
    )
    seed: int = setting(0, "seed of the prompts and of sampling")
    progress: bool = setting(True, "a progress bar on stderr")

    # what a resumed run must share with the run it continues (the samples depend on them)
    FIXED = (
        "model",
        "prompt_mix",
        "corpus",
        "prompt_tokens",
        "max_new_tokens",
        "temperature",
        "top_p",
        "shard_size",
        "seed",
    )


def default_mix(corpus: str | None) -> str:
    """Half continuations of the corpus when one is given, else bare document starts only."""
    return "start:1,corpus:1" if corpus else "start:1"


def parse_mix(spec: str) -> dict[str, float]:
    mix = {}
    for part in [p.strip() for p in spec.split(",") if p.strip()]:
        kind, _, weight = part.partition(":")
        if kind not in PROMPT_KINDS:
            raise UsageError(f"unknown prompt kind {kind!r} in --prompt-mix; use {', '.join(PROMPT_KINDS)}")
        try:
            w = float(weight or 1)
        except ValueError:
            raise UsageError(f"--prompt-mix weight {weight!r} of {kind} is not a number") from None
        if not w >= 0:
            raise UsageError(f"--prompt-mix weight of {kind} must be >= 0, got {weight}")
        mix[kind] = w
    if not mix or sum(mix.values()) <= 0:
        raise UsageError(f"--prompt-mix {spec!r} gives no prompt kind a positive weight")
    return mix


def document_start(tok) -> int:
    """The token that begins a document in pretraining: ``<|endoftext|>`` where the vocabulary has it (an
    instruct model's BOS is a chat marker, not a document start), else BOS, else EOS."""
    vocab = tok.get_vocab()
    for candidate in ("<|endoftext|>",):
        if candidate in vocab:
            return vocab[candidate]
    return tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id


def weights_fingerprint(model) -> str:
    """sha256 of every parameter and buffer as loaded (the teacher a corpus came from, exactly)."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def default_weights(device: torch.device) -> str:
    from ..models.quantized import has_bf16_matmuls

    return "bf16" if has_bf16_matmuls(device) else "fp32"


class PromptSource:
    """Sample i's prompt: (kind, token ids), a pure function of (seed, i)."""

    def __init__(self, cfg: GenerateConfig, tok):
        self.cfg, self.mix = cfg, parse_mix(cfg.prompt_mix or default_mix(cfg.corpus))
        self.kinds = [k for k in PROMPT_KINDS if self.mix.get(k, 0) > 0]
        w = np.array([self.mix[k] for k in self.kinds])
        self.cdf = np.cumsum(w / w.sum())
        self.start = document_start(tok)
        self.rows = None
        if "corpus" in self.kinds:
            from ..data.corpus import PackedCorpus
            from ..models.loading import tokenizer_fingerprint

            if not cfg.corpus:
                raise UsageError("--prompt-mix with corpus prompts needs --corpus DIR (a `looplm data build` corpus)")
            corpus = PackedCorpus(cfg.corpus)
            if corpus.tokenizer != tokenizer_fingerprint(tok):
                raise UsageError(
                    f"the corpus {cfg.corpus} was tokenised for another model than {cfg.model}; build "
                    f"one with `looplm data build {cfg.model} --out DIR`"
                )
            if corpus.seq_len <= cfg.prompt_tokens:
                raise UsageError(
                    f"--prompt-tokens {cfg.prompt_tokens} must be shorter than the corpus's {corpus.seq_len}-token rows"
                )
            self.rows = corpus.splits["train"]

    def __call__(self, i: int) -> tuple[str, list[int]]:
        rng = np.random.default_rng([self.cfg.seed, i])
        kind = self.kinds[int(np.searchsorted(self.cdf, rng.random(), side="right").clip(max=len(self.kinds) - 1))]
        if kind == "start":
            return kind, [self.start]
        row = int(rng.integers(len(self.rows)))
        at = int(rng.integers(self.rows.shape[1] - self.cfg.prompt_tokens))
        return kind, [self.start] + np.asarray(self.rows[row, at : at + self.cfg.prompt_tokens]).tolist()


def _checked(cfg: GenerateConfig) -> GenerateConfig:
    """The settings, refused with a usage error before anything loads; ``prompt_mix`` filled in with its default."""
    from ..serve import RequestError, SamplingParams

    if not cfg.out:
        raise UsageError("give the corpus directory with --out DIR")
    if (cfg.tokens is None) == (cfg.minutes is None):
        raise UsageError("give one budget: --generated-tokens N (generated tokens kept) or --budget-minutes M")
    if (cfg.tokens is not None and cfg.tokens <= 0) or (cfg.minutes is not None and cfg.minutes <= 0):
        raise UsageError("the budget must be positive")
    if cfg.max_new_tokens < 1 or cfg.prompt_tokens < 1 or cfg.max_batch < 1 or cfg.shard_size < 1:
        raise UsageError("--max-new-tokens, --prompt-tokens, --max-concurrency and --shard-size must be >= 1")
    try:
        SamplingParams(cfg.temperature, cfg.top_p).validate()
    except RequestError as e:
        raise UsageError(str(e).replace("temperature", "--temperature").replace("top_p", "--top-p")) from None
    if cfg.prompt_mix is None:
        cfg = replace(cfg, prompt_mix=default_mix(cfg.corpus))
    parse_mix(cfg.prompt_mix)
    return cfg


def _resumed_manifest(out: Path, settings: dict) -> dict:
    """The manifest of the run this one resumes ({} for a new corpus): a resumed run must share its settings, and
    a directory holding anything else is not written into."""
    if (out / "manifest.json").exists():
        done = read_manifest(out)
        changed = [k for k in GenerateConfig.FIXED if done["settings"].get(k) != settings[k]]
        if changed:
            raise UsageError(
                f"{out} was generated with other settings ("
                + ", ".join(f"{k}: {done['settings'].get(k)!r} -> {settings[k]!r}" for k in changed)
                + "); resume with the same settings or choose a new --out"
            )
        return done
    if out.exists() and any(p.name != "shards" for p in out.iterdir()):  # shards/ alone: killed before its first
        raise UsageError(f"{out} exists and is not a generated corpus; choose an empty or new --out")
    return {}


def _load_teacher(cfg: GenerateConfig, done: dict, out: Path, log):
    """(model, tokenizer, fingerprint) of the teacher; a resumed corpus must come from the very same weights."""
    from ..models import load_model
    from ..models.loading import tokenizer_fingerprint

    model, tok = load_model(cfg.model)
    if tok is None:
        raise UsageError(f"{cfg.model} has no tokenizer files")
    if model.config.num_loops != 1:
        log(f"note: {cfg.model} is a looped model; the corpus is its own text (heal from the original's)")
    fingerprint = {
        "model": cfg.model,
        "tokenizer": tokenizer_fingerprint(tok),
        "weights_sha256": weights_fingerprint(model),
    }
    if done and done["teacher"] != fingerprint:
        raise UsageError(
            f"{out} was generated by another model ({done['teacher']['weights_sha256'][:12]}) than "
            f"{cfg.model} ({fingerprint['weights_sha256'][:12]}); choose a new --out"
        )
    return model, tok, fingerprint


def _new_manifest(settings: dict, fingerprint: dict, weights: str) -> dict:
    return {
        "kind": KIND,
        "format": FORMAT,
        "settings": settings,
        "teacher": fingerprint,
        "weights": weights,
        "shards": [],
        "samples": 0,
        "kept": 0,
        "duplicates": 0,
        "degenerate": 0,
        "tokens": 0,
        "seconds": 0.0,
    }


def _budget_left(manifest: dict, budget_tokens: int | None, budget_seconds: float | None) -> bool:
    if budget_tokens is not None:
        return manifest["tokens"] < budget_tokens
    return manifest["seconds"] < budget_seconds


def _progress_bar(manifest: dict, budget_tokens: int | None, budget_seconds: float | None, progress: bool):
    """A bar over the budget (kept tokens or seconds), starting where a resumed run left off."""
    from tqdm import tqdm

    return tqdm(
        total=budget_tokens or int(budget_seconds),
        initial=min(manifest["tokens"], budget_tokens or 0) if budget_tokens else int(manifest["seconds"]),
        unit="tok" if budget_tokens else "s",
        desc="generating",
        disable=not progress,
    )


def _shard_requests(cfg: GenerateConfig, prompts: PromptSource, first: int, eos: int):
    """The shard's requests from sample ``first`` on, and each one's prompt kind; sampling seeded per sample."""
    from ..serve import Request, SamplingParams

    reqs, kinds = [], []
    for i in range(first, first + cfg.shard_size):
        kind, ids = prompts(i)
        kinds.append(kind)
        reqs.append(
            Request(
                ids,
                cfg.max_new_tokens,
                SamplingParams(cfg.temperature, cfg.top_p, 0, cfg.seed * 1_000_003 + i),
                eos_token_id=eos,
            )
        )
    return reqs, kinds


def _generate_shard(engine, reqs: list, bar, budget_tokens: int | None) -> float:
    """Serve the shard's requests depth-wise, moving the bar as they go; the seconds it took."""
    from ..serve import make_scheduler, replay

    t0 = time.perf_counter()
    at = bar.n

    def moved():  # every engine step, not once a shard: the shard's tokens (or seconds) so far
        so_far = sum(len(r.output) for r in reqs) if budget_tokens else time.perf_counter() - t0
        bar.update(at + so_far - bar.n)

    replay(make_scheduler("depth", engine), reqs, on_step=moved)
    seconds = time.perf_counter() - t0
    failed = [r for r in reqs if r.status != "done"]
    if failed:
        raise RuntimeError(f"generation failed for sample {failed[0].id}: {failed[0].error}")
    return seconds


def _kept_samples(reqs: list, kinds: list[str], first: int, tok, eos: int, seen: set):
    """The shard's JSON lines, its kept tokens and what it dropped: empty or degenerate text, and text already
    kept (``seen``, updated)."""
    lines, kept_tokens = [], 0
    counts = {"duplicates": 0, "degenerate": 0}
    for i, (req, kind) in enumerate(zip(reqs, kinds), start=first):
        completion = req.output[:-1] if req.output and req.output[-1] == eos else req.output
        text = tok.decode(req.prompt[1:] + completion, skip_special_tokens=True).strip()
        if not text or degenerate(text):
            counts["degenerate"] += 1
            continue
        key = text_key(text)
        if key in seen:
            counts["duplicates"] += 1
            continue
        seen.add(key)
        kept_tokens += len(completion)
        lines.append(
            json.dumps(
                {"index": i, "prompt_kind": kind, "prompt": req.prompt, "completion": completion, "text": text},
                ensure_ascii=False,
            )
        )
    return lines, kept_tokens, counts


def _commit_shard(
    out: Path, manifest: dict, shard: int, reqs: list, lines: list[str], kept_tokens: int, counts: dict, seconds: float
) -> None:
    """Write the shard, then the manifest counting it: the manifest is the shard's commit marker."""
    name = f"shards/shard-{shard:05d}.jsonl"
    body = "".join(line + "\n" for line in lines)
    write_text_atomic(out / name, body)
    generated = sum(len(r.output) for r in reqs)
    manifest["shards"].append(
        {
            "file": name,
            "sha256": hashlib.sha256(body.encode("utf-8")).hexdigest(),
            "samples": len(reqs),
            "kept": len(lines),
            "tokens": kept_tokens,
            "generated_tokens": generated,
            "seconds": round(seconds, 2),
        }
    )
    manifest["samples"] += len(reqs)
    manifest["kept"] += len(lines)
    manifest["tokens"] += kept_tokens
    manifest["seconds"] = round(manifest["seconds"] + seconds, 2)
    for k, v in counts.items():
        manifest[k] += v
    gen_total = sum(s["generated_tokens"] for s in manifest["shards"])
    manifest["tokens_per_second"] = round(gen_total / max(manifest["seconds"], 1e-9), 1)
    manifest["machine"] = machine()
    write_json_atomic(out / "manifest.json", manifest)  # the commit marker of this shard


def generate_corpus(cfg: GenerateConfig, log=print) -> dict:
    """Generate (or resume generating) ``cfg.out``; returns the manifest."""
    from ..models.quantized import check_format, load_dtype, prepare
    from ..serve import Engine

    cfg = _checked(cfg)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    weights = cfg.weights or default_weights(device)
    check_format(weights, device)
    out = Path(cfg.out)
    settings = {k: v for k, v in asdict(cfg).items() if k in GenerateConfig.FIXED}
    done = _resumed_manifest(out, settings)
    model, tok, fingerprint = _load_teacher(cfg, done, out, log)
    prompts = PromptSource(cfg, tok)
    model = prepare(model.to(device=device, dtype=load_dtype(weights)), weights)
    max_prompt = 1 + (cfg.prompt_tokens if "corpus" in prompts.kinds else 0)
    engine = Engine(model, max_batch=cfg.max_batch, max_seq_len=max_prompt + cfg.max_new_tokens)

    manifest = done or _new_manifest(settings, fingerprint, weights)
    seen = {text_key(s["text"]) for s in read_samples(out)} if done else set()
    (out / "shards").mkdir(parents=True, exist_ok=True)
    for stale in (out / "shards").glob(".*tmp*"):
        stale.unlink()
    budget_tokens = cfg.tokens
    budget_seconds = cfg.minutes * 60 if cfg.minutes is not None else None
    bar = _progress_bar(manifest, budget_tokens, budget_seconds, cfg.progress)
    eos = tok.eos_token_id
    while _budget_left(manifest, budget_tokens, budget_seconds):
        shard = len(manifest["shards"])
        first = shard * cfg.shard_size
        reqs, kinds = _shard_requests(cfg, prompts, first, eos)
        seconds = _generate_shard(engine, reqs, bar, budget_tokens)
        lines, kept_tokens, counts = _kept_samples(reqs, kinds, first, tok, eos, seen)
        _commit_shard(out, manifest, shard, reqs, lines, kept_tokens, counts, seconds)
        bar.n = min(manifest["tokens"], budget_tokens) if budget_tokens else manifest["seconds"]  # what was kept
        bar.set_postfix(tok_s=manifest["tokens_per_second"], kept=manifest["kept"])
    bar.close()
    return manifest


# the teacher's own text in the recipe's corpus: more than an hour of healing reads (about 1,200 rows of 512 tokens
# with as many real ones), so no row is read twice
TEACHER_TOKENS = 300_000


def recipe_corpus(teacher: str, seq_len: int, progress: bool) -> str:
    """The recipe's corpus, made once per teacher and reused: text the teacher writes itself beside as many tokens
    of the real sources. Healed on it, a model stays closer to the original on text neither holds than healed on
    the real sources alone (docs/RESULTS.md, "Healed quality off the corpus")."""
    from ..data.corpus import build, teacher_mix_sources

    name = Path(teacher).name
    corpus, generated = Path("out") / f"corpus-{name}-mix-{seq_len}", Path("out") / f"gen-{name}"
    if (corpus / "meta.json").exists():
        return str(corpus)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise UsageError(
            f"the recipe's corpus {corpus} is not made yet and {os.environ['WORLD_SIZE']} processes would each make "
            f"it: run `looplm heal` on one process first, or give --data"
        )
    print(
        f"looplm heal: the teacher writes {TEACHER_TOKENS:,} tokens of its own text into {generated} (once per "
        "teacher, resumable; docs/guides/heal.md gives its time)",
        file=sys.stderr,
    )
    m = generate_corpus(GenerateConfig(model=teacher, out=str(generated), tokens=TEACHER_TOKENS, progress=progress))
    print(
        f"looplm heal: {m['tokens']:,} tokens of the teacher's text in {m['seconds'] / 60:.0f} min "
        f"({m['tokens_per_second']} tokens/s, {m['weights']}); building the corpus {corpus} (a few minutes, once)",
        file=sys.stderr,
    )
    build(corpus, model=teacher, sources=teacher_mix_sources(generated, seq_len), seq_len=seq_len, progress=progress)
    return str(corpus)
