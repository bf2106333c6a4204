"""`looplm bench speculate`: speculative decoding against plain decoding, side by side in one run.

Batch 1, greedy, a fixed number of new tokens (EOS ignored), three prompt kinds (code, prose continuation, a
question); per model and weight format every speculation mode runs each prompt in turn with plain decoding
(interleaved, so that a shared machine's drift falls on all of them alike). Reports tokens/s, the ratio to plain
decoding, acceptance rate, mean accepted length and whether the tokens equal plain decoding's; with a vanilla model
among the models, each row's ratio to it without speculation in the same weight format (``vs_vanilla``).

With a GGUF file (``llamacpp``) llama.cpp joins the same run on the same prompts and threads, through
llama-cpp-python (the optional `bench` extra): plain greedy decoding, and its prompt-lookup decoding
(``LlamaPromptLookupDecoding``: llama-cpp-python's draft model for `Llama.generate`) as mode ``context``; every
row then also gives its ratio to llama.cpp's plain decoding (``vs_llamacpp``).
"""

from __future__ import annotations

import time
from pathlib import Path

PROMPTS = {
    "code": (
        "import json\n\n\ndef load_config(path):\n"
        '    """Read a JSON config file and fill in defaults."""\n'
        "    with open(path) as f:\n        config = json.load(f)\n"
        '    config.setdefault("host", "127.0.0.1")\n    config.setdefault("port", 8000)\n'
        '    config.setdefault("workers", 4)\n    return config\n\n\ndef save_config(path, config):\n'
    ),
    "prose": (
        "The village sat at the edge of a wide valley, where the river slowed and spread into marshes before it "
        "reached the sea. In summer the fields were green with barley, and in winter the fog came up from the "
        "water and lay over the houses until noon. Most of the people who lived there"
    ),
    "question": "Question: Why do leaves change colour in autumn?\nAnswer:",
}


def _engine_run(model, ids, n, mode):
    from ..serve import Engine, Request
    from ..serve.schedulers import make_scheduler, replay, scheduler_name
    from ..serve.speculative import figures

    engine = Engine(model, max_batch=1, max_seq_len=len(ids) + n + 1)
    scheduler = scheduler_name("sequence", mode)
    replay(make_scheduler(scheduler, engine), [Request(ids[:8], 8)])  # warm-up, untimed
    req, sched = Request(ids, n), make_scheduler(scheduler, engine)
    t0 = time.perf_counter()
    replay(sched, [req])
    seconds = time.perf_counter() - t0
    spec = figures(sched.speculator.stats) if mode != "off" else {}
    return req.output, {
        "tokens": len(req.output),
        "seconds": round(seconds, 3),
        "tokens_per_s": round(len(req.output) / seconds, 2),
        "acceptance_rate": spec.get("acceptance_rate"),
        "mean_accepted_length": spec.get("mean_accepted_length"),
    }


class _CountingLookup:
    """llama-cpp-python's prompt-lookup draft model, counting its rounds and drafted tokens."""

    def __init__(self):
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        self.lookup, self.rounds, self.drafted = LlamaPromptLookupDecoding(), 0, 0

    def __call__(self, input_ids, **kw):
        draft = self.lookup(input_ids, **kw)
        self.rounds += 1
        self.drafted += len(draft)
        return draft


def _llama_run(llm, ids, n):
    """Greedy decoding of n tokens by a llama-cpp-python ``Llama`` (EOS ignored: ``generate`` does not stop)."""
    draft = llm.draft_model
    if draft is not None:
        draft.rounds = draft.drafted = 0
    out = []
    t0 = time.perf_counter()
    for tok in llm.generate(ids, temp=0.0, reset=True):
        out.append(int(tok))
        if len(out) >= n:
            break
    seconds = time.perf_counter() - t0
    fig = {"tokens": len(out), "seconds": round(seconds, 3), "tokens_per_s": round(len(out) / seconds, 2)}
    # each round yields its accepted drafts and the verifier's own token, so rounds = verifications
    rounds = draft.rounds if draft is not None else 0
    accepted = len(out) - rounds
    fig["acceptance_rate"] = round(accepted / draft.drafted, 4) if rounds and draft.drafted else None
    fig["mean_accepted_length"] = round(len(out) / rounds, 3) if rounds else None
    return out, fig


def _llama_models(gguf: str, threads: int | None, max_len: int) -> dict:
    """llama.cpp plain (``off``) and with prompt lookup (``context``), on the same file and threads."""
    import os

    from llama_cpp import Llama

    threads = threads or os.cpu_count()

    def load(draft):
        return Llama(
            model_path=gguf,
            n_ctx=max_len,
            n_threads=threads,
            n_threads_batch=threads,
            draft_model=draft,
            verbose=False,
        )

    return {"off": load(None), "context": load(_CountingLookup())}


def _row(model, loops, fmt, kind, mode, fig, base, same) -> dict:
    return {
        "model": model,
        "loops": loops,
        "weights": fmt,
        "prompt": kind,
        "speculate": mode,
        **fig,
        "vs_off": round(fig["tokens_per_s"] / base, 3),
        "same_tokens_as_off": same,
    }


def _compare(runs: list[dict]) -> None:
    """Each row's ratio to the vanilla model without speculation in its weight format, and to llama.cpp's plain
    decoding, on the same prompt (where those ran)."""
    ours = [r for r in runs if r["weights"] != "gguf"]
    vanilla = next((r["model"] for r in ours if r["loops"] == 1), None)
    plain = {(r["model"], r["weights"], r["prompt"]): r["tokens_per_s"] for r in ours if r["speculate"] == "off"}
    llama = {r["prompt"]: r["tokens_per_s"] for r in runs if r["weights"] == "gguf" and r["speculate"] == "off"}
    for r in runs:
        v = plain.get((vanilla, r["weights"], r["prompt"]))
        if v:
            r["vs_vanilla"] = round(r["tokens_per_s"] / v, 3)
        if r["prompt"] in llama:
            r["vs_llamacpp"] = round(r["tokens_per_s"] / llama[r["prompt"]], 3)


def bench_speculate(
    models,
    weights,
    modes,
    new_tokens: int = 256,
    rounds: int = 1,
    log=print,
    llamacpp: str | None = None,
    threads: int | None = None,
) -> dict:
    from ..models import load_model
    from ..models.quantized import load_dtype, prepare

    runs, prompt_ids = [], {}
    for path in models:
        for fmt in weights:
            model, tok = load_model(path, dtype=load_dtype(fmt))
            model = prepare(model, fmt).eval()
            B = model.config.num_loops
            usable = [m for m in modes if m != "loop1" or B > 1]
            for kind, text in PROMPTS.items():
                ids = prompt_ids[kind] = tok(text, add_special_tokens=bool(model.config.add_bos_token))["input_ids"]
                figs: dict[str, list] = {m: [] for m in ["off", *usable]}
                outputs = {}
                for _ in range(rounds):
                    for mode in figs:
                        outputs[mode], fig = _engine_run(model, ids, new_tokens, mode)
                        figs[mode].append(fig)
                best = {m: max(f, key=lambda x: x["tokens_per_s"]) for m, f in figs.items()}
                base = best["off"]["tokens_per_s"]
                for mode, fig in best.items():
                    runs.append(_row(str(path), B, fmt, kind, mode, fig, base, outputs[mode] == outputs["off"]))
                    _say(log, runs[-1])
            del model
    if llamacpp:  # the prompts as the last model's tokenizer gave them (llama.cpp adds no BOS to token ids)
        llms = _llama_models(llamacpp, threads, 64 + max(len(t) for t in PROMPTS.values()) + new_tokens)
        label = f"llama.cpp {Path(llamacpp).name}"
        for kind, ids in prompt_ids.items():
            for llm in llms.values():  # warm-up, untimed
                _llama_run(llm, ids[:8], 8)
            figs: dict[str, list] = {m: [] for m in llms}
            outputs = {}
            for _ in range(rounds):
                for mode, llm in llms.items():
                    outputs[mode], fig = _llama_run(llm, ids, new_tokens)
                    figs[mode].append(fig)
            best = {m: max(f, key=lambda x: x["tokens_per_s"]) for m, f in figs.items()}
            for mode, fig in best.items():
                same = outputs[mode] == outputs["off"]
                runs.append(_row(label, 1, "gguf", kind, mode, fig, best["off"]["tokens_per_s"], same))
                _say(log, runs[-1])
    _compare(runs)
    return {"new_tokens": new_tokens, "rounds": rounds, "llamacpp": llamacpp, "runs": runs}


def _say(log, row: dict) -> None:
    log(
        f"{row['model']} {row['weights']} {row['prompt']:<9} {row['speculate']:<8} {row['tokens_per_s']:>7.1f} tok/s"
        f"  x{row['vs_off']:.2f}  acceptance {row['acceptance_rate']}  accepted length {row['mean_accepted_length']}"
        f"  same tokens {row['same_tokens_as_off']}"
    )


def speculate_table(result: dict) -> tuple[list[str], list[list]]:
    """The benchmark's table: a row per model, weight format, prompt and speculation mode."""
    header = ["model", "weights", "prompt", "speculate", "tokens/s", "x off", "acceptance", "accepted length", "same"]
    header += ["x vanilla off", "x llama.cpp off"]
    keys = ["model", "weights", "prompt", "speculate", "tokens_per_s", "vs_off", "acceptance_rate"]
    keys += ["mean_accepted_length", "same_tokens_as_off"]
    rows = [[r[k] for k in keys] + [r.get("vs_vanilla", ""), r.get("vs_llamacpp", "")] for r in result["runs"]]
    return header, rows
