"""Our engine with float32, int8 and int4 weights against llama.cpp (llama-cpp-python) in one run: the same
prompts (cut from held-out text, greedy, fixed output lengths), the same thread count, configurations
alternating round by round; tokens/s at batch 1 and on a 64-request trace, peak memory, and quality
(greedy agreement with the float32 model over the trace, held-out perplexity).

    PYTHONPATH=src .venv/bin/python benchmarks/bench_llamacpp.py --rounds 2 --json > benchmarks/results/llamacpp-smollm2.json

llama.cpp runs the embedded SmolLM2 Q4_1 GGUF file itself (the file our float32 weights are dequantized
from) and a Q8_0 file exported from our float32 model (`looplm export-gguf --type q8_0`), through its own
continuous batching (`llama_decode` over one batch holding every running sequence's next token and new
prompts, as llama.cpp's `parallel` example), greedy by argmax over its logits, as our engine.

Engine configurations are named FORMAT[-bf16][-gN][-h4][-f32act][-m][-gptq|-eq][-c], FORMAT fp32, int8, int4 or bf16
(`--weights bf16`: the whole model in bfloat16, rotary frequencies float32); then: the whole model in bfloat16
(default: float32 outside the quantized matmuls), int4 group size N (default 32), int4 LM head (default int8),
float32 activations into the quantized matmuls (default bfloat16), a looped model's LoRA merged into one
quantized weight per depth (`--lora merged`; default: shared weights with the float LoRA on top), rounding by
GPTQ or input channels equalized and then GPTQ (`looplm quantize --calibrate DATA [--equalize]`, on the first 16
training rows of `--data`; default: rounded to nearest), the compiled engine (`--compile`,
serve/compiled.py; its graphs are built before timing starts). Agreement: the fraction of a configuration's generated
tokens equal to the float32 model's greedy choice given the same prefix (teacher-forced); for a looped model
with exits (`--looped`), against the float32 looped model at full depth. Memory: each
format served in a fresh process (`--child`), from a `looplm quantize` directory and quantized at load.

llama-cpp-python is the optional `bench` extra (pip install -e .[bench]); CI does not install it.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from looplm.models import load_model
from looplm.models import quantized as Q
from looplm.models.loading import EMBEDDED, embedded_gguf, save_quantized
from looplm.serve.bench import agreement, heldout_text, make_trace, run_trace
from looplm.serve.exits import parse_policy


# --- llama.cpp, through llama-cpp-python's low-level API ---------------------------------------------

def _quiet():
    try:
        import llama_cpp
        return llama_cpp.llama_log_callback(lambda level, text, user_data: None)
    except ImportError:
        return None


_QUIET = _quiet()  # llama.cpp logs every tensor it loads; kept alive here (a ctypes callback)


class LlamaCpp:
    """One llama.cpp model and context serving up to ``parallel`` sequences at once."""

    def __init__(self, path: str, threads: int, parallel: int, max_len: int):
        import llama_cpp as L
        self.L = L
        L.llama_log_set(_QUIET, ctypes.c_void_p(0))
        L.llama_backend_init()
        mp = L.llama_model_default_params()
        self.model = L.llama_model_load_from_file(path.encode(), mp)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        cp = L.llama_context_default_params()
        cp.n_ctx = parallel * max_len
        cp.n_batch = cp.n_ubatch = 512
        cp.n_seq_max = parallel
        cp.n_threads = cp.n_threads_batch = threads
        self.ctx = L.llama_init_from_model(self.model, cp)
        self.parallel, self.cap = parallel, 512
        self.batch = L.llama_batch_init(self.cap, 0, 1)
        self.vocab = L.llama_model_get_vocab(self.model)
        self.n_vocab = L.llama_vocab_n_tokens(self.vocab)

    def close(self):
        L = self.L
        L.llama_batch_free(self.batch)
        L.llama_free(self.ctx)
        L.llama_model_free(self.model)

    def _decode(self, entries):
        """entries: (token, pos, seq, wants_logits); decoded in chunks of the batch capacity. Returns the
        argmax token of every entry that asked for logits, in order."""
        L, out = self.L, []
        for s in range(0, len(entries), self.cap):
            chunk, b = entries[s:s + self.cap], self.batch
            for i, (tok, pos, seq, want) in enumerate(chunk):
                b.token[i], b.pos[i], b.n_seq_id[i] = tok, pos, 1
                b.seq_id[i][0], b.logits[i] = seq, want
            b.n_tokens = len(chunk)
            if L.llama_decode(self.ctx, b) != 0:
                raise RuntimeError("llama_decode failed")
            n = sum(1 for e in chunk if e[3])
            if n:  # the logits of the entries that asked for them, in batch order: one argmax over all rows
                logits = np.ctypeslib.as_array(L.llama_get_logits(self.ctx), shape=(n, self.n_vocab))
                out += logits.argmax(1).tolist()
        return out

    def serve(self, trace):
        """Greedy continuous batching over the trace (all arrivals at 0): (outputs, seconds)."""
        mem = self.L.llama_get_memory(self.ctx)
        self.L.llama_memory_clear(mem, True)
        queue, outputs = list(range(len(trace))), [[] for _ in trace]
        running: dict[int, int] = {}  # seq slot -> request index
        t0 = time.perf_counter()
        while queue or running:
            entries, owners = [], []
            for seq in range(self.parallel):
                if seq in running:
                    r = running[seq]
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

def parse_spec(spec: str) -> dict:
    parts = spec.split("-")
    out = {"format": parts[0], "dtype": torch.float32, "group": Q.DEFAULT_GROUP, "head": "int8",
           "act_dtype": Q.DEFAULT_ACT, "compile": False, "lora": "shared", "rounding": "nearest"}
    for p in parts[1:]:
        if p == "c":
            out["compile"] = True
        elif p == "bf16":
            out["dtype"] = torch.bfloat16
        elif p == "f32act":
            out["act_dtype"] = torch.float32
        elif p in ("gptq", "eq"):
            out["rounding"] = p
        elif p.startswith("g"):
            out["group"] = int(p[1:])
        elif p == "h4":
            out["head"] = "int4"
        elif p == "m":
            out["lora"] = "merged"
        else:
            raise SystemExit(f"unknown configuration part {p!r} in {spec!r}")
    return out


def compiled(spec: str) -> bool:
    return parse_spec(spec)["compile"]


CALIBRATION_ROWS = 16  # `looplm quantize --calibrate`'s default


@functools.cache
def calibration_moments(model, data: str | None) -> dict:
    """GPTQ's input moments of ``model`` on the first training rows of corpus ``data``, as `looplm quantize
    --calibrate DATA` computes them (never held-out rows)."""
    if data is None:
        raise SystemExit("the -gptq and -eq configurations calibrate on --data: give a built corpus")
    from looplm.data.corpus import PackedCorpus
    from looplm.models.gptq import input_moments
    rows = np.array(PackedCorpus(data).splits["train"][:CALIBRATION_ROWS], dtype=np.int64)
    return input_moments(model, torch.from_numpy(rows))


def engine_model(vanilla, spec: str, data: str | None = None):
    import copy
    s = parse_spec(spec)
    if s["format"] == "fp32":
        return vanilla if s["dtype"] == torch.float32 else copy.deepcopy(vanilla).to(s["dtype"])
    if s["format"] == "bf16":  # `--weights bf16`: the whole model in bfloat16
        return Q.to_bf16(copy.deepcopy(vanilla))
    model, moments = copy.deepcopy(vanilla), None
    if s["rounding"] != "nearest":
        moments = calibration_moments(vanilla, data)
        if s["rounding"] == "eq":
            from looplm.models.equalize import equalize
            moments, _ = equalize(model, moments, s["format"], s["group"])
    return Q.quantize_model(model, s["format"], s["group"], s["dtype"], s["head"], s["act_dtype"], lora=s["lora"],
                            moments=moments)


def engine_serve(model, trace, max_batch, scheduler="sequence", policy=None, compile=False, kv_mode="copy"):
    """(tokens/s from first arrival to last finish, outputs)."""
    max_len = max(len(r["prompt"]) + r["max_tokens"] for r in trace)
    fig, reqs, _ = run_trace(model, trace, scheduler, max_batch, max_len, policy, kv_mode, compile)
    return fig["tokens_per_s"], [r.output for r in reqs]


def llama_serve(ll, trace):
    out, seconds = ll.serve(trace)
    return sum(map(len, out)) / seconds, out


def outputs_agreement(fp32, trace, outputs) -> float:
    """Teacher-forced agreement of outputs with the float32 model's greedy choices."""
    class R:  # the fields `agreement` reads
        def __init__(self, prompt, output):
            self.prompt, self.output = prompt, output
    return agreement(fp32, [R(t["prompt"], o) for t, o in zip(trace, outputs)])


# --- quality and memory -------------------------------------------------------------------------

def heldout_perplexity(model, tok, data: str, max_tokens: int) -> float | None:
    from looplm.data.corpus import PackedCorpus
    from looplm.eval.perplexity import score_windows
    if not data or not Path(data).exists():
        return None
    rows = PackedCorpus(data).splits["heldout"]
    windows = [row.tolist() for row in rows]
    return round(score_windows(model, tok, windows, batch_size=1, max_tokens=max_tokens)["perplexity"], 3)


CHILD_PROMPTS = 4


def child(args) -> int:
    """Serve a few requests with one weight format in this fresh process; print its peak RSS."""
    torch.set_num_threads(args.threads)
    kind, _, target = args.child.partition(":")
    prompts = [list(range(100 + 7 * i, 140 + 7 * i)) for i in range(CHILD_PROMPTS)]
    if kind == "llama":
        ll = LlamaCpp(target, args.threads, CHILD_PROMPTS, 64)
        ll.serve([{"prompt": p, "max_tokens": 16} for p in prompts])
        weights = None
    else:
        spec, _, path = target.partition("@")
        s = parse_spec(spec)
        model, _ = load_model(path, dtype=Q.load_dtype(s["format"]))  # bf16 read as bf16: no float32 copy
        if s["format"] != "fp32":
            model = Q.prepare(model, s["format"], group=s["group"], dtype=s["dtype"], head=s["head"],
                              act_dtype=s["act_dtype"])
        engine_serve(model, [{"prompt": p, "max_tokens": 16, "arrival": 0.0} for p in prompts], CHILD_PROMPTS,
                     compile=s["compile"])
        weights = round(Q.weight_bytes(model) / 2 ** 20, 1)
    print(json.dumps({**_rss(), "weights_mb": weights}))
    return 0


def _rss() -> dict:
    """Peak and current resident set size of this process (VmHWM / VmRSS: per address space, so a child
    started from a big parent is not charged the parent's pages, as ru_maxrss would be after fork)."""
    status = dict(line.split(":", 1) for line in open("/proc/self/status") if ":" in line)
    mb = lambda k: round(int(status[k].split()[0]) / 1024, 1)  # noqa: E731
    return {"peak_rss_mb": mb("VmHWM"), "rss_serving_mb": mb("VmRSS")}


def measure_memory(cases: dict[str, str], threads: int, log) -> dict:
    out = {}
    for name, target in cases.items():
        proc = subprocess.run([sys.executable, __file__, "--child", target, "--threads", str(threads)],
                              capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": str(threads)})
        if proc.returncode != 0:
            out[name] = {"error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "failed"}
        else:
            out[name] = json.loads(proc.stdout.strip().splitlines()[-1])
        log(f"  memory {name:<24} {out[name]}")
    return out


def profile_b1(model, trace, log, compile=False) -> dict:
    """Where a batch-1 decode token's time goes: wall time per token (no profiler), and under the profiler
    the operators' own time per token, split into the weight matmuls (quantized ops, mm/addmm/linear)
    and everything else (aten operators, and compiled regions' own time: their fused kernels); the rest of
    the wall time is Python and dispatch between operators. One engine, warmed up once, serves the trace
    twice: timed, then profiled."""
    from torch.profiler import ProfilerActivity, profile
    from looplm.serve import Engine, Request, make_scheduler, warm_up
    from looplm.serve.schedulers import replay
    max_len = max(len(r["prompt"]) + r["max_tokens"] for r in trace)
    engine = Engine(model, max_batch=1, max_seq_len=max_len, compile=compile)
    warm_up(engine)

    def serve():
        reqs = [Request(r["prompt"], r["max_tokens"]) for r in trace]
        replay(make_scheduler("sequence", engine), reqs)
        return sum(len(r.output) for r in reqs)

    serve()  # first use of each cache length
    t = time.perf_counter()
    tokens = serve()
    wall = (time.perf_counter() - t) / tokens
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        serve()
    mm_names = ("_weight_int8pack_mm", "_weight_int4pack_mm_for_cpu", "aten::mm", "aten::addmm", "mkl_linear")
    mm = other = 0.0
    for e in prof.key_averages():
        if any(n in e.key for n in mm_names):
            mm += e.self_cpu_time_total
        elif (e.key.startswith("aten::") or "CompiledFxGraph" in e.key or e.key.startswith("cpp_fused")
              or "inductor_entry" in e.key):
            other += e.self_cpu_time_total
    out = {"wall_ms_per_token": round(wall * 1e3, 3), "matmul_ms_per_token": round(mm / 1e3 / tokens, 3),
           "other_ops_ms_per_token": round(other / 1e3 / tokens, 3)}
    out["python_dispatch_ms_per_token"] = round(out["wall_ms_per_token"] - out["matmul_ms_per_token"]
                                                - out["other_ops_ms_per_token"], 3)
    log(f"  profile   {out}")
    return out


# --- the run ------------------------------------------------------------------------------------

def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--configs", default="fp32,int8,int4,int8-bf16,int4-bf16",
                   help="engine configurations: FORMAT[-bf16][-gN][-h4][-f32act][-m][-c] (see the top)")
    p.add_argument("--q4-gguf", default=None, help="llama.cpp Q4_1 file (default: the embedded model's own)")
    p.add_argument("--q8-gguf", default=None, help="llama.cpp Q8_0 file (default: exported from --model)")
    p.add_argument("--looped", default=None, help="a looped model served at batch 1 with --exit (depth-wise); "
                   "'convert': --model converted on the fly (B=2, stepwise, LoRA rank 64, not uptrained)")
    p.add_argument("--looped-configs", default="fp32,int4")
    p.add_argument("--exit", default="margin:0.6", help="the looped model's exit policies, comma separated "
                   "(margin:0.6: 95%% teacher-forced agreement for the healed B=2 rank-64 model, docs/FINDINGS.md; "
                   "probe: the probe fitted into the model directory, `looplm fit-exit-probe`)")
    p.add_argument("--kv-mode", default="copy", choices=["copy", "later"],
                   help="the looped model's KV of skipped loops (as `looplm serve --kv-mode`)")
    p.add_argument("--b1-requests", type=int, default=4)
    p.add_argument("--b1-output", type=int, default=64)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--prompt-len", default="16:64")
    p.add_argument("--output-len", default="32:32")
    p.add_argument("--max-batch", type=int, default=64, help="our engine's KV rows on the trace")
    p.add_argument("--llama-parallel", default="16,64", help="llama.cpp sequences at once on the trace (best kept)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--data", default=None, help="a built corpus (`looplm data build`) whose held-out rows give "
                   "the perplexity (skipped without one)")
    p.add_argument("--ppl-tokens", type=int, default=8176)
    p.add_argument("--memory-configs", default="fp32,int8,int4", help="configurations measured in a fresh process")
    p.add_argument("--profile", default="", help="comma list of configurations to profile at batch 1")
    p.add_argument("--skip", default="", help="comma list of parts to skip: b1, trace, looped, quality, memory")
    p.add_argument("--json", action="store_true")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--table", default=None, help="print markdown tables from a result file and stop")
    args = p.parse_args()
    if args.child:
        return child(args)
    if args.table:
        print(table(args.table))
        return 0
    import importlib.util
    if importlib.util.find_spec("llama_cpp") is None:
        raise SystemExit("needs llama-cpp-python: pip install -e .[bench] (builds llama.cpp, ~12 min on 2 cores)")
    torch.set_num_threads(args.threads)
    log = (lambda *a: print(*a, file=sys.stderr, flush=True)) if args.json else print
    rng = lambda s: tuple(int(x) for x in s.split(":"))  # noqa: E731
    skip = set(args.skip.split(","))
    vanilla, tok = load_model(args.model)
    tmp = Path(tempfile.mkdtemp(prefix="bench-llamacpp-"))
    q4 = args.q4_gguf or (str(embedded_gguf(args.model)) if args.model in EMBEDDED else None)
    q8 = args.q8_gguf
    if q8 is None:
        from looplm.convert.gguf_export import export_gguf, source_pre
        q8 = str(tmp / "q8_0.gguf")
        export_gguf(vanilla, tok, q8, "q8_0", pre=source_pre(vanilla.config))
    ggufs = {"llama.cpp q4_1": q4, "llama.cpp q8_0": q8}
    ggufs = {k: v for k, v in ggufs.items() if v}
    specs = [s for s in args.configs.split(",") if s]
    models = {s: engine_model(vanilla, s, args.data) for s in specs}
    ids = tok(heldout_text(), add_special_tokens=False)["input_ids"]
    b1 = make_trace(ids, args.b1_requests, rng(args.prompt_len), (args.b1_output, args.b1_output), "all", seed=1)
    trace = make_trace(ids, args.requests, rng(args.prompt_len), rng(args.output_len), "all", seed=0)
    max_len = rng(args.prompt_len)[1] + max(rng(args.output_len)[1], args.b1_output) + 1
    result = {"model": args.model, "threads": args.threads, "configs": specs, "gguf": ggufs, "requests": args.requests,
              "command": " ".join(sys.argv[1:]),
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "torch": torch.__version__,
              "cpu": _cpu(), "batch1": {}, "trace": {}, "quality": {}, "memory": {}}
    llamas_b1 = {k: LlamaCpp(v, args.threads, 1, max_len) for k, v in ggufs.items()}
    par = [int(x) for x in args.llama_parallel.split(",")]
    llamas_tr = {(k, n): LlamaCpp(v, args.threads, n, max_len) for k, v in ggufs.items() for n in par}
    looped = None
    if args.looped and "looped" not in skip:
        if args.looped == "convert":  # as `bench serve` without --looped: not uptrained
            from looplm.convert import convert
            base = convert(vanilla, loops=2, init="stepwise", lora_ranks=64, norms="per-depth").eval()
        else:
            base, _ = load_model(args.looped)
        looped = {s: engine_model(base, s, args.data) for s in args.looped_configs.split(",")}
        result["looped_weights_mb"] = {s: round(Q.weight_bytes(m) / 2 ** 20, 1) for s, m in looped.items()}
        exits = args.exit.split(",")
        result["looped_exit"] = {"policies": exits, "kv_mode": args.kv_mode}
        policies = {(s, e): parse_policy(e).bind(looped[s]) for s in looped for e in exits}  # a missing probe fails here
    outputs, looped_outputs = {}, {}
    times: dict[str, dict[str, list]] = {"batch1": {}, "trace": {}}
    for rnd in range(args.rounds):
        log(f"round {rnd + 1}")
        if "b1" not in skip:
            runs = [(s, lambda s=s: engine_serve(models[s], b1, 1, compile=compiled(s))) for s in specs]
            runs += [(k, lambda k=k: llama_serve(llamas_b1[k], b1)) for k in llamas_b1]
            if looped:
                runs += [(f"looped {s} {e}", lambda s=s, e=e: engine_serve(
                    looped[s], b1, 1, "depth", policies[(s, e)], compiled(s), args.kv_mode))
                         for s in looped for e in exits]
            for name, fn in runs:
                tps, out = fn()
                if name.startswith("looped "):
                    looped_outputs.setdefault(name, out)
                times["batch1"].setdefault(name, []).append(tps)
                log(f"  batch 1   {name:<28} {tps:7.1f} tok/s")
        if "trace" not in skip:
            runs = [(s, lambda s=s: engine_serve(models[s], trace, args.max_batch, compile=compiled(s)))
                    for s in specs]
            runs += [(f"{k} x{n}", lambda k=k, n=n: llama_serve(llamas_tr[(k, n)], trace)) for k, n in llamas_tr]
            for name, fn in runs:
                tps, out = fn()
                times["trace"].setdefault(name, []).append(tps)
                outputs.setdefault(name, out)
                log(f"  trace     {name:<28} {tps:7.1f} tok/s")
    for part in ("batch1", "trace"):
        for name, xs in times[part].items():
            result[part][name] = {"tokens_per_s": round(statistics.median(xs), 2), "rounds": [round(x, 2) for x in xs]}
        result[part]["ratios"] = _ratios(times[part], part)
    for spec in [x for x in args.profile.split(",") if x]:
        log(f"profile {spec}")
        result.setdefault("profile", {})[spec] = profile_b1(models[spec], b1, log, compiled(spec))
    if "quality" not in skip:
        fp32 = models.get("fp32") or vanilla
        for name, out in outputs.items():
            result["quality"].setdefault(name, {})["agreement"] = round(outputs_agreement(fp32, trace, out), 4)
        for s in specs:
            result["quality"].setdefault(s, {})["perplexity"] = heldout_perplexity(models[s], tok, args.data,
                                                                                  args.ppl_tokens)
            log(f"  quality   {s:<28} {result['quality'][s]}")
        for s in looped or {}:  # the final exit's perplexity: what merging each depth's LoRA before quantizing costs
            result["quality"][f"looped {s}"] = {"perplexity": heldout_perplexity(looped[s], tok, args.data,
                                                                                 args.ppl_tokens)}
            log(f"  quality   looped {s:<21} {result['quality'][f'looped {s}']}")
        for name, out in looped_outputs.items():  # exits and weights against the float model at full depth
            result["quality"][name] = {"agreement_full_depth": round(outputs_agreement(base, b1, out), 4)}
            log(f"  quality   {name:<28} {result['quality'][name]}")
    if "memory" not in skip:
        cases = {}
        src = str(tmp / "fp32")
        from looplm.models import save_model
        save_model(vanilla, tok, src)
        for s in [x for x in args.memory_configs.split(",") if x]:
            sp = parse_spec(s)
            if sp["format"] in ("fp32", "bf16"):  # bf16: cast at load (`looplm quantize` stores int formats only)
                cases[s] = f"engine:{s}@{src}"
                continue
            d = tmp / s
            save_quantized(vanilla, tok, d, sp["format"], sp["group"], sp["dtype"], sp["head"], sp["act_dtype"])
            cases[f"{s} (stored)"] = f"engine:{s}@{d}"
            cases[f"{s} (at load)"] = f"engine:{s}@{src}"
        cases.update({k: f"llama:{v}" for k, v in ggufs.items()})
        result["memory"] = measure_memory(cases, args.threads, log)
    for ll in list(llamas_b1.values()) + list(llamas_tr.values()):
        ll.close()
    if args.json:
        print(json.dumps(result, indent=2))
    return 0


def _ratios(times: dict, part: str) -> dict:
    """Each engine configuration against each llama.cpp file (its best parallel setting on the trace):
    the median of per-round ratios."""
    ours = {k: v for k, v in times.items() if not k.startswith("llama.cpp")}
    theirs: dict[str, list] = {}
    for k, v in times.items():
        if k.startswith("llama.cpp"):
            f = " ".join(k.split()[:2])
            if f not in theirs or statistics.median(v) > statistics.median(theirs[f]):
                theirs[f] = v
    return {f"{o} / {t}": round(statistics.median(a / b for a, b in zip(ov, tv)), 3)
            for o, ov in ours.items() for t, tv in theirs.items()}


def table(path: str) -> str:
    """Markdown tables from a result file (`--table FILE`): tokens/s with the median per-round ratio to
    llama.cpp, then quality and memory."""
    r = json.load(open(path))
    lines = []
    for part, title in (("batch1", "batch 1"), ("trace", f"the {r.get('requests', 64)}-request trace")):
        if len(r[part]) <= 1:  # only the (empty) ratios: the part was skipped
            continue
        lib = sorted({k.split(" / ")[1] for k in r[part]["ratios"]})
        lines += [f"\n{title}:\n", "| configuration | tokens/s (median) | rounds | " + " | ".join(f"/ {x}" for x in lib) + " |",
                  "|---|---:|---|" + "---:|" * len(lib)]
        for name, v in r[part].items():
            if name == "ratios":
                continue
            ratios = [r[part]["ratios"].get(f"{name} / {x}") for x in lib]
            lines.append(f"| {name} | {v['tokens_per_s']} | {', '.join(map(str, v['rounds']))} | "
                         + " | ".join("" if x is None else f"{x}x" for x in ratios) + " |")
    if r.get("quality"):
        lines += ["\nquality:\n", "| configuration | agreement with float32 (trace; looped with exits: batch-1 "
                  "requests, against full depth) | held-out perplexity |", "|---|---:|---:|"]
        for name, q in r["quality"].items():
            agree = q.get("agreement", q.get("agreement_full_depth", ""))
            lines.append(f"| {name} | {agree} | {q.get('perplexity', '')} |")
    if r.get("looped_weights_mb"):
        lines += ["\nlooped model, weight tensors held (MB):\n", "| configuration | MB |", "|---|---:|"]
        lines += [f"| looped {name} | {mb} |" for name, mb in r["looped_weights_mb"].items()]
    if r.get("memory"):
        lines += ["\nmemory (one process each):\n", "| configuration | weight tensors MB | RSS serving MB | peak RSS MB |",
                  "|---|---:|---:|---:|"]
        for name, m in r["memory"].items():
            lines.append(f"| {name} | {m.get('weights_mb') or ''} | {m.get('rss_serving_mb', m.get('error'))} | "
                         f"{m.get('peak_rss_mb', '')} |")
    if r.get("profile"):
        lines += ["\nbatch-1 profile, ms per token:\n", "| configuration | wall | weight matmuls | other operators | "
                  "Python and dispatch |", "|---|---:|---:|---:|---:|"]
        for name, p in r["profile"].items():
            lines.append(f"| {name} | {p['wall_ms_per_token']} | {p['matmul_ms_per_token']} | "
                         f"{p['other_ops_ms_per_token']} | {p['python_dispatch_ms_per_token']} |")
    return "\n".join(lines)


def _cpu() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip() + f", {os.cpu_count()} cores"
    except OSError:
        pass
    return "unknown"


if __name__ == "__main__":
    sys.exit(main())
