"""`looplm bench llamacpp`: our engine and llama.cpp side by side in one process, on the same requests (cut from
held-out text, greedy, fixed output lengths) and the same thread count, taking turns round by round so that a
shared machine's load swings hit both: tokens/s at batch 1 and on a trace served with continuous batching, each
output's greedy agreement with our float32 model, and (with a corpus) each format's held-out perplexity. A looped
model can join at batch 1, served depth-wise with exit policies, against llama.cpp running the vanilla model.

llama.cpp runs through llama-cpp-python's low-level API (the optional `bench` extra), over one ``llama_decode``
batch holding every running sequence's next token and new prompts, as its `parallel` example does. It serves the
embedded model's own GGUF file (Q4_1 for SmolLM2) and a Q8_0 file exported from the float32 model."""

from __future__ import annotations

import copy
import ctypes
import importlib.util
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import UsageError
from ..settings import setting
from ..util import machine
from .report import choice_list, int_list, str_list, token_range

MISSING = (
    "`looplm bench llamacpp` needs llama-cpp-python, the optional `bench` extra: pip install -e .[bench] "
    "(it builds llama.cpp from source)"
)
FORMATS = ("fp32", "bf16", "int8", "int4")


def check_available() -> None:
    if importlib.util.find_spec("llama_cpp") is None:
        raise UsageError(MISSING)


ROUNDING = "rounding (as `looplm quantize`)"
LOOPED = "a looped model at batch 1, against llama.cpp running the vanilla model"


@dataclass
class Settings:
    """`looplm bench llamacpp`'s settings."""

    model: str = setting("smollm2-135m", "the vanilla model (embedded name or directory)", positional=True)
    formats: list[str] = setting(
        ["fp32", "int8", "int4"],
        "our engine's weight formats, a comma list of fp32, bf16, int8, int4",
        flag="--weights",
        parse=choice_list(*FORMATS),
        metavar="LIST",
    )
    compile: bool = setting(False, "our engine compiled (its graphs are built before timing)")
    q4_gguf: str | None = setting(
        None, "a 4-bit llama.cpp file (default: an embedded model's own GGUF file)", metavar="FILE"
    )
    q8_gguf: str | None = setting(None, "a Q8_0 llama.cpp file (default: exported from MODEL)", metavar="FILE")
    b1_requests: int = setting(4, "requests served one at a time", minimum=1)
    b1_output: int = setting(64, "generated tokens of each batch-1 request", flag="--b1-new-tokens", minimum=1)
    requests: int = setting(64, "requests in the batched trace (0: batch 1 only)", minimum=0)
    prompt_len: tuple[int, int] = setting((16, 64), "prompt tokens", parse=token_range, metavar="LO:HI")
    output_len: tuple[int, int] = setting(
        (32, 32), "generated tokens of each trace request", parse=token_range, metavar="LO:HI"
    )
    max_concurrency: int = setting(64, "requests our engine serves at once on the trace", metavar="N", minimum=1)
    llama_concurrency: list[int] = setting(
        [16, 64],
        "llama.cpp's sequences at once on the trace, a comma list (its best is kept)",
        parse=int_list,
        metavar="LIST",
    )
    rounds: int = setting(2, "rounds, each running every configuration in turn", minimum=1)
    data: str | None = setting(None, "a corpus from `looplm data build`: each format's perplexity on its held-out rows")
    scored_tokens: int = setting(4088, "held-out tokens scored with --data")
    calib_data: str | None = setting(
        None,
        "round int8 and int4 by GPTQ on this corpus's first training rows (default: to nearest)",
        metavar="DATA",
        group=ROUNDING,
    )
    calib_rows: int = setting(16, "training rows GPTQ calibrates on", group=ROUNDING)
    equalize: bool = setting(False, "equalize input channels before GPTQ (needs --calib-data)", group=ROUNDING)
    looped: str | None = setting(
        None,
        "a looped model (converted from MODEL) served depth-wise at batch 1 with each exit policy",
        metavar="DIR",
        group=LOOPED,
    )
    looped_formats: list[str] = setting(
        ["int4"],
        "its weight formats, a comma list of fp32, bf16, int8, int4",
        flag="--looped-weights",
        parse=choice_list(*FORMATS),
        metavar="LIST",
        group=LOOPED,
    )
    lora: str = setting(
        "shared",
        "its LoRA: shared weights with the per-depth LoRA in float on top, or merged into one quantized weight per "
        "depth",
        choices=("shared", "merged"),
        group=LOOPED,
    )
    exit_policies: list[str] = setting(
        ["none"],
        "its exit policies, a comma list (policy[:threshold][+copy[:BONUS]], as `looplm serve --exit-policy`)",
        flag="--exit-policy",
        parse=str_list,
        metavar="LIST",
        group=LOOPED,
    )
    kv_mode: str = setting("copy", "KV of the loops an exit skips", choices=("copy", "later"), group=LOOPED)


class LlamaCpp:
    """One llama.cpp model and context serving up to ``parallel`` sequences at once."""

    def __init__(self, path: str, threads: int, parallel: int, max_len: int):
        import llama_cpp as L

        self.L = L
        # llama.cpp logs every tensor it loads; the ctypes callback must outlive the model
        self._quiet = L.llama_log_callback(lambda level, text, user_data: None)
        L.llama_log_set(self._quiet, ctypes.c_void_p(0))
        L.llama_backend_init()
        self.model = L.llama_model_load_from_file(path.encode(), L.llama_model_default_params())
        if not self.model:
            raise UsageError(f"llama.cpp could not load {path}")
        cp = L.llama_context_default_params()
        cp.n_ctx = parallel * max_len
        cp.n_batch = cp.n_ubatch = 512
        cp.n_seq_max = parallel
        cp.n_threads = cp.n_threads_batch = threads
        self.ctx = L.llama_init_from_model(self.model, cp)
        self.parallel, self.cap = parallel, 512
        self.batch = L.llama_batch_init(self.cap, 0, 1)
        self.n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(self.model))

    def close(self) -> None:
        self.L.llama_batch_free(self.batch)
        self.L.llama_free(self.ctx)
        self.L.llama_model_free(self.model)

    def _decode(self, entries) -> list[int]:
        """entries: (token, position, sequence, wants logits), decoded in chunks of the batch capacity; the argmax
        token of every entry that asked for logits, in order."""
        L, out = self.L, []
        for s in range(0, len(entries), self.cap):
            chunk, b = entries[s : s + self.cap], self.batch
            for i, (tok, pos, seq, want) in enumerate(chunk):
                b.token[i], b.pos[i], b.n_seq_id[i] = tok, pos, 1
                b.seq_id[i][0], b.logits[i] = seq, want
            b.n_tokens = len(chunk)
            if L.llama_decode(self.ctx, b) != 0:
                raise RuntimeError("llama_decode failed")
            n = sum(1 for e in chunk if e[3])
            if n:
                logits = np.ctypeslib.as_array(L.llama_get_logits(self.ctx), shape=(n, self.n_vocab))
                out += logits.argmax(1).tolist()
        return out

    def serve(self, trace: list[dict]) -> tuple[list[list[int]], float]:
        """Greedy continuous batching over the trace (every request arrives at once): (outputs, seconds)."""
        mem = self.L.llama_get_memory(self.ctx)
        self.L.llama_memory_clear(mem, True)
        queue, outputs = list(range(len(trace))), [[] for _ in trace]
        running: dict[int, int] = {}  # sequence slot -> request
        t0 = time.perf_counter()
        while queue or running:
            entries, owners = [], []
            for seq, r in running.items():
                entries.append((outputs[r][-1], len(trace[r]["prompt"]) + len(outputs[r]) - 1, seq, True))
                owners.append(r)
            for seq in range(self.parallel):
                if seq not in running and queue:
                    r = running[seq] = queue.pop(0)
                    p = trace[r]["prompt"]
                    entries += [(t, i, seq, i == len(p) - 1) for i, t in enumerate(p)]
                    owners.append(r)
            for r, tok in zip(owners, self._decode(entries)):
                outputs[r].append(tok)
            for seq, r in list(running.items()):
                if len(outputs[r]) >= trace[r]["max_tokens"]:
                    self.L.llama_memory_seq_rm(mem, seq, -1, -1)
                    del running[seq]
        return outputs, time.perf_counter() - t0


# --- our engine ---------------------------------------------------------------------------------


def calibration_moments(model, tok, s: Settings) -> dict | None:
    """GPTQ's input moments on the corpus's first training rows, as `looplm quantize --calib-data` computes them."""
    if not s.calib_data:
        return None
    import torch

    from ..data.corpus import PackedCorpus
    from ..models.gptq import input_moments
    from ..models.loading import tokenizer_fingerprint

    corpus = PackedCorpus(s.calib_data)
    if tok is None or tokenizer_fingerprint(tok) != corpus.tokenizer:
        raise UsageError(f"the corpus {s.calib_data} was tokenised with another tokenizer than {s.model}'s")
    rows = torch.from_numpy(np.array(corpus.splits["train"][: s.calib_rows], dtype=np.int64))
    return input_moments(model, rows)


def served(model, fmt: str, moments: dict | None, s: Settings, lora: str = "shared"):
    """A copy of the float ``model`` with weights ``fmt``, rounded as `looplm quantize` would (GPTQ when
    ``moments`` are given, input channels equalized first with ``s.equalize``)."""
    from ..models.quantized import DEFAULT_GROUP, prepare, quantize_model

    if fmt == "fp32":
        return model
    m = copy.deepcopy(model)
    if fmt == "bf16":
        return prepare(m, fmt)
    if moments is None:
        return prepare(m, fmt, lora=lora)
    if s.equalize:
        from ..models.equalize import equalize

        moments, _ = equalize(m, moments, fmt, DEFAULT_GROUP)
    return quantize_model(m, fmt, lora=lora, moments=moments)


def _engine(model, trace, max_concurrency, compile, scheduler="sequence", policy=None, kv_mode="copy"):
    from .serving import run_trace

    max_len = max(len(r["prompt"]) + r["max_tokens"] for r in trace)
    fig, reqs, _ = run_trace(model, trace, scheduler, max_concurrency, max_len, policy, kv_mode, compile)
    return fig["tokens_per_s"], [r.output for r in reqs]


def _llama(ll: LlamaCpp, trace):
    out, seconds = ll.serve(trace)
    return sum(map(len, out)) / seconds, out


class _Served:  # the fields serving.agreement reads
    def __init__(self, prompt, output):
        self.prompt, self.output = prompt, output


def _agreement(reference, trace, outputs) -> float:
    from .serving import agreement

    return round(agreement(reference, [_Served(t["prompt"], o) for t, o in zip(trace, outputs)]), 4)


def _perplexity(model, tok, s: Settings) -> float | None:
    if not s.data:
        return None
    from ..data.corpus import PackedCorpus
    from ..eval.perplexity import score_windows

    windows = [row.tolist() for row in PackedCorpus(s.data).splits["heldout"]]
    return round(score_windows(model, tok, windows, batch_size=1, max_tokens=s.scored_tokens)["perplexity"], 3)


def ggufs(s: Settings, vanilla, tok, tmp: Path) -> dict[str, str]:
    """The llama.cpp files: the embedded model's own (Q4_1 for SmolLM2) and a Q8_0 export of the float model."""
    from ..convert.gguf_export import export_gguf, source_pre
    from ..models.loading import EMBEDDED, embedded_gguf

    q4 = s.q4_gguf or (str(embedded_gguf(s.model)) if s.model in EMBEDDED else None)
    q8 = s.q8_gguf
    if q8 is None:
        q8 = str(tmp / "q8_0.gguf")
        export_gguf(vanilla, tok, q8, "q8_0", pre=source_pre(vanilla.config))
    return {k: v for k, v in (("llama.cpp q4", q4), ("llama.cpp q8_0", q8)) if v}


# --- the run ------------------------------------------------------------------------------------


def _looped_configs(s: Settings, tok) -> tuple[dict, dict, object]:
    """With ``--looped``: each format x exit policy's model and bound policy by config name, and the float looped
    model their outputs are compared with; else nothing."""
    from ..models import load_model
    from ..serve.exits import parse_policy

    looped, policies, base = {}, {}, None
    if s.looped:
        base, _ = load_model(s.looped)
        base.eval()
        base_moments = calibration_moments(base, tok, s)
        for f in s.looped_formats:
            model = served(base, f, base_moments, s, lora=s.lora)
            for e in s.exit_policies:
                looped[f"looped {f} {e}"] = model
                policies[f"looped {f} {e}"] = parse_policy(e).bind(model)  # a missing probe fails here
    return looped, policies, base


def _round_runs(s: Settings, ours, looped, policies, files, llamas, b1, trace) -> list[tuple]:
    """One round's runs, in order: (part, config name, runner, its arguments)."""
    runs = [("batch1", name, _engine, (m, b1, 1, s.compile)) for name, m in ours.items()]
    runs += [("batch1", k, _llama, (llamas[(k, 1)], b1)) for k in files]
    runs += [
        ("batch1", name, _engine, (m, b1, 1, s.compile, "depth", policies[name], s.kv_mode))
        for name, m in looped.items()
    ]
    if s.requests:
        runs += [("trace", name, _engine, (m, trace, s.max_concurrency, s.compile)) for name, m in ours.items()]
        runs += [("trace", f"{k} x{n}", _llama, (llamas[(k, n)], trace)) for k in files for n in s.llama_concurrency]
    return runs


def _timed_rounds(s: Settings, files, max_len, ours, looped, policies, b1, trace, log) -> tuple[dict, dict]:
    """Every configuration in turn, ``s.rounds`` times: tokens/s per round and the first round's outputs, by part
    (batch1, trace) and config name."""
    times: dict[str, dict[str, list[float]]] = {"batch1": {}, "trace": {}}
    outputs: dict[str, dict[str, list]] = {"batch1": {}, "trace": {}}
    threads = machine()["torch_threads"]
    sizes = {1, *s.llama_concurrency} if s.requests else {1}
    llamas = {(k, n): LlamaCpp(v, threads, n, max_len) for k, v in files.items() for n in sizes}
    try:
        for rnd in range(s.rounds):
            log(f"round {rnd + 1} of {s.rounds}")
            for part, name, fn, fn_args in _round_runs(s, ours, looped, policies, files, llamas, b1, trace):
                tps, out = fn(*fn_args)
                times[part].setdefault(name, []).append(tps)
                outputs[part].setdefault(name, out)
                log(f"  {part:<7} {name:<28} {tps:8.1f} tokens/s")
    finally:
        for ll in llamas.values():
            ll.close()
    return times, outputs


def _config_figures(s: Settings, times, outputs, b1, trace, vanilla, base, ours, tok) -> dict:
    """Per config: the median and every round's tokens/s, greedy agreement and (with --data) perplexity."""
    configs: dict[str, dict] = {}
    for part, ref_trace in (("batch1", b1), ("trace", trace)):
        for name, xs in times[part].items():
            c = configs.setdefault(name, {})
            c[f"{part}_tokens_per_s"] = round(statistics.median(xs), 2)
            c[f"{part}_rounds"] = [round(x, 2) for x in xs]
            if name.startswith("looped "):  # exits and weights against the float looped model at full depth
                c["agreement_full_depth"] = _agreement(base, ref_trace, outputs[part][name])
            elif part == "trace" or not s.requests:
                c["agreement_with_fp32"] = _agreement(vanilla, ref_trace, outputs[part][name])
    for name, m in ours.items():
        configs[name]["perplexity"] = _perplexity(m, tok, s)
    return configs


def bench_llamacpp(s: Settings, log=print) -> dict:
    check_available()
    from ..models import load_model
    from .serving import heldout_text, make_trace

    vanilla, tok = load_model(s.model)
    vanilla.eval()
    moments = calibration_moments(vanilla, tok, s)
    ours = {f"looplm {f}": served(vanilla, f, moments, s) for f in s.formats}
    looped, policies, base = _looped_configs(s, tok)
    ids = tok(heldout_text(), add_special_tokens=False)["input_ids"]
    b1 = make_trace(ids, s.b1_requests, s.prompt_len, (s.b1_output, s.b1_output), "all", seed=1)
    trace = make_trace(ids, s.requests, s.prompt_len, s.output_len, "all", seed=0)
    max_len = s.prompt_len[1] + max(s.output_len[1], s.b1_output) + 1
    with tempfile.TemporaryDirectory(prefix="looplm-bench-llamacpp-") as tmp:
        files = ggufs(s, vanilla, tok, Path(tmp))
        times, outputs = _timed_rounds(s, files, max_len, ours, looped, policies, b1, trace, log)
    result = {
        "benchmark": "llamacpp",
        "settings": {k: v for k, v in vars(s).items()},
        "gguf": files,
        "configs": {},
        "machine": machine(),  # stamped before the agreement and perplexity runs
    }
    result["configs"] = _config_figures(s, times, outputs, b1, trace, vanilla, base, ours, tok)
    result["ratios"] = ratios(times)
    return result


def ratios(times: dict) -> dict:
    """Each of our configurations against each llama.cpp file (on the trace: its best concurrency), the median of
    per-round ratios: each round's pair ran under the same load."""
    out = {}
    for part, runs in times.items():
        theirs: dict[str, list[float]] = {}
        for name, xs in runs.items():
            if name.startswith("llama.cpp"):
                f = " ".join(name.split()[:2])
                if f not in theirs or statistics.median(xs) > statistics.median(theirs[f]):
                    theirs[f] = xs
        out[part] = {
            f"{o} / {t}": round(statistics.median(a / b for a, b in zip(ov, tv)), 3)
            for o, ov in runs.items()
            if not o.startswith("llama.cpp")
            for t, tv in theirs.items()
        }
    return out


def llamacpp_table(result: dict) -> tuple[list[str], list[list]]:
    """The benchmark's table: a row per configuration, ours and llama.cpp's."""
    s = result["settings"]
    trace = [f"tokens/s {s['requests']} requests"] if s["requests"] else []
    rows = [
        [
            name,
            c.get("batch1_tokens_per_s", ""),
            *([c.get("trace_tokens_per_s", "")] if trace else []),
            c.get("agreement_with_fp32", c.get("agreement_full_depth", "")),
            c.get("perplexity") or "",
        ]
        for name, c in result["configs"].items()
    ]
    return ["configuration", "tokens/s batch 1", *trace, "agreement", "perplexity"], rows
