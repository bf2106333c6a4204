"""`looplm bench serve`: request traces from real text, replayed against static, sequence-wise and
depth-wise batching on one engine, plus the paper's hypothetical (simulated) throughput
(hypothetical.py).

Figures per run: useful tokens/s (tokens delivered to finished requests / makespan), TTFT and TPOT
p50/p99, peak RSS, exits per loop, and agreement (fraction of generated tokens equal to the
full-depth greedy token of the same model given the same prefix, teacher-forced).
"""

from __future__ import annotations

import math
import random
import statistics
import time
from importlib import resources

import torch

from ..models.quantized import prepare, stored_format, stored_lora, weight_bytes
from ..serve import Engine, Request
from ..serve.exits import ExitPolicy
from ..serve.schedulers import make_scheduler, replay, rss_mb, scheduler_name, warm_up
from ..serve.speculative import figures
from .hypothetical import hypothetical


def heldout_text() -> str:
    return resources.files("looplm").joinpath("data", "heldout_sample.txt").read_text(encoding="utf-8")


def make_trace(
    token_ids: list[int],
    n: int,
    prompt_len=(16, 96),
    output_len=(8, 64),
    arrivals="all",
    rate: float = 4.0,
    seed: int = 0,
) -> list[dict]:
    """n requests cut from real text at random offsets: prompt and output lengths uniform in the
    given ranges; arrival 0 for all ("all") or a Poisson process of ``rate`` requests/s ("poisson")."""
    rnd = random.Random(seed)
    if len(token_ids) < prompt_len[1] + 2:
        raise ValueError("the trace text is shorter than the longest prompt")
    t, out = 0.0, []
    for _ in range(n):
        L, o = rnd.randint(*prompt_len), rnd.randint(*output_len)
        s = rnd.randint(0, len(token_ids) - L - 1)
        if arrivals == "poisson":
            t += rnd.expovariate(rate)
        elif arrivals != "all":
            raise ValueError(f"unknown arrival pattern {arrivals!r}; use all or poisson")
        out.append({"prompt": token_ids[s : s + L], "max_tokens": o, "arrival": t})
    return out


def percentile(xs, q):
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return None
    k = (len(xs) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def run_trace(
    model,
    trace,
    scheduler: str,
    max_batch: int,
    max_seq_len: int,
    policy: ExitPolicy | None = None,
    kv_mode: str = "copy",
    compile: bool = False,
    speculate: str = "off",
) -> tuple[dict, list[Request], Engine]:
    engine = Engine(
        model,
        max_batch=max_batch,
        max_seq_len=max_seq_len,
        exit_policy=policy,
        kv_mode=kv_mode,
        compile=compile,
    )
    compile_s = warm_up(engine)  # compiled graphs are built before the clock starts
    reqs = [Request(r["prompt"], r["max_tokens"], arrival=r["arrival"]) for r in trace]
    rss0 = rss_mb()
    sched = make_scheduler(scheduler_name(scheduler, speculate), engine)
    res = replay(sched, reqs)
    fig = _trace_figures(model, engine, reqs, res["peak_rss_mb"], rss0)
    if speculate != "off":
        spec = figures(sched.speculator.stats)
        fig.update(speculate=speculate, **{k: spec[k] for k in ("acceptance_rate", "mean_accepted_length")})
    if compile:
        fig["compile_seconds"] = round(compile_s, 1)
    return fig, reqs, engine


def _trace_figures(model, engine: Engine, reqs: list[Request], peak_rss_mb: float, rss0: float) -> dict:
    """One replayed trace's throughput, latency percentiles, memory and the engine's step counters."""
    ok = [r for r in reqs if r.status == "done"]
    tokens = sum(len(r.output) for r in ok)
    first = min(r.arrival for r in reqs)
    span = max(r.finish_time for r in ok) - first if ok else float("nan")
    ttft = [r.ttft for r in ok]
    tpot = [r.tpot for r in ok]
    stats = engine.stats
    return {
        "tokens": tokens,
        "seconds": round(span, 3),
        "tokens_per_s": round(tokens / span, 2),
        "ttft_p50": _r(percentile(ttft, 0.5)),
        "ttft_p99": _r(percentile(ttft, 0.99)),
        "tpot_p50": _r(percentile(tpot, 0.5)),
        "tpot_p99": _r(percentile(tpot, 0.99)),
        "peak_rss_mb": round(peak_rss_mb, 1),
        "rss_growth_mb": round(peak_rss_mb - rss0, 1),
        "kv_cache_mb": round(engine.cache.nbytes / 2**20, 1),
        "packed_weights_mb": round(engine.packed_bytes / 2**20, 1),
        "cpu_products": engine.cpu_plan.summary() if engine.cpu_plan else None,  # the ways measured fastest here
        "weights_mb": round(weight_bytes(model) / 2**20, 1),  # every weight tensor held, packed copies included
        "exits_per_loop": list(stats["exits_per_loop"]),
        "steps": stats["stages"],
        "mixed_steps": stats["mixed_stages"],
        "mean_items_per_step": round(stats["stage_items"] / max(1, stats["stages"]), 2),
        "kv_copy_tokens": stats["kv_copy_tokens"],
        "kv_later_items": stats["kv_later_items"],
        "failed": sum(r.status == "error" for r in reqs),
        # where the steps' time went, in ms per generated token (Engine.stats["seconds"]); the rest of the
        # span is scheduling, prefill bookkeeping and waiting
        "step_ms_per_token": {k: round(1e3 * v / max(1, tokens), 3) for k, v in stats["seconds"].items()},
    }


def _r(x, n=4):
    return None if x is None else round(x, n)


@torch.no_grad()
def agreement(model, reqs) -> float:
    """Fraction of generated tokens equal to the full-depth greedy choice given the same prefix."""
    same = total = 0
    for r in reqs:
        if not r.output:
            continue
        ids = torch.tensor([r.prompt + r.output[:-1]], device=next(model.parameters()).device)
        want = model(ids).logits[0, len(r.prompt) - 1 :].argmax(-1).tolist()
        same += sum(a == b for a, b in zip(want, r.output))
        total += len(r.output)
    return same / total if total else float("nan")


# --- machine limits ------------------------------------------------------------------------------


def machine_limits(size: int = 1024, reps: int = 5) -> dict:
    """Measured float32 matmul GFLOP/s and memory copy GB/s on this process's threads."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    a @ b
    t = time.perf_counter()
    for _ in range(reps):
        a @ b
    gflops = 2 * size**3 * reps / (time.perf_counter() - t) / 1e9
    x = torch.empty(32 * 2**20)  # 128 MB
    y = torch.empty_like(x)
    y.copy_(x)
    t = time.perf_counter()
    for _ in range(reps):
        y.copy_(x)
    gbs = 2 * x.numel() * 4 * reps / (time.perf_counter() - t) / 1e9  # read + write
    return {"matmul_gflops": round(gflops, 1), "copy_gb_s": round(gbs, 1), "matmul_size": size}


def utilisation(model, fig: dict, limits: dict) -> dict:
    """Achieved FLOP/s (2 x weights used per token x tokens/s) and weight bytes read per step x
    steps/s, as fractions of the measured matmul and copy limits (decode-dominated estimate)."""
    c = model.config
    body = sum(p.numel() for n, p in model.named_parameters() if "embed_tokens" not in n and "lm_head" not in n)
    head = c.vocab_size * c.hidden_size
    per_token = 2 * (body * c.num_loops + head)  # every depth runs once per token at full depth
    flops = per_token * fig["tokens_per_s"]
    step_bytes = (body + head) * next(model.parameters()).element_size()
    bw = step_bytes * fig["steps"] / fig["seconds"]
    return {
        "gflops": round(flops / 1e9, 2),
        "matmul_fraction": round(flops / 1e9 / limits["matmul_gflops"], 3),
        "weight_gb_s": round(bw / 1e9, 2),
        "bandwidth_fraction": round(bw / 1e9 / limits["copy_gb_s"], 3),
    }


# --- the whole benchmark -------------------------------------------------------------------------

HEADLINE_KEYS = ("tokens_per_s", "ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99", "peak_rss_mb")


def _looped_model(args, vanilla):
    from ..models import load_model

    if args.looped:
        model, _ = load_model(args.looped)
        return model, f"{args.looped}"
    from ..serve.on_the_fly import convert_unhealed

    model = convert_unhealed(
        vanilla,
        args.model,
        args.loops,
        args.init,
        args.lora_rank,
        getattr(args, "allow_unhealed", False),
        seed=args.seed,
    )
    return model.eval(), (
        f"{args.model} converted: B={args.loops}, init {args.init}, LoRA rank {args.lora_rank}, "
        f"per-depth norms (not uptrained)"
    )


def hf_cache_config(requests: list[dict], max_new_tokens: int, page_size: int = 256, batch_tokens: int = 512):
    """A ContinuousBatchingConfig sized for these requests: every request's pages fit at once (left to
    itself, transformers sizes the cache from free memory, which on a shared CPU machine got the process
    killed). batch_tokens bounds a step's tokens (prefill chunks; `bench serve --hf-batch-tokens`)."""
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    pages = sum(-(-(len(r["prompt"]) + max_new_tokens) // page_size) for r in requests)
    return ContinuousBatchingConfig(page_size=page_size, num_blocks=pages + 4, max_batch_tokens=batch_tokens)


def _hf_generate_b1(hf, requests: list[dict], cfg) -> float:
    """transformers generate, one request after another: tokens/s."""
    t, toks = time.perf_counter(), 0
    with torch.no_grad():
        for r in requests:
            g = hf.generate(torch.tensor([r["prompt"]]), generation_config=cfg)
            toks += g.shape[1] - len(r["prompt"])
    return round(toks / (time.perf_counter() - t), 2)


def _hf_generate_batch(hf, requests: list[dict], n_new: int, cfg, batch_tokens: int) -> tuple[float, dict]:
    """transformers generate_batch (continuous batching) on every request: tokens/s and the cache it was given."""
    cb = hf_cache_config(requests, n_new, batch_tokens=batch_tokens)
    t = time.perf_counter()
    res = hf.generate_batch(
        [r["prompt"] for r in requests], generation_config=cfg, continuous_batching_config=cb, progress_bar=False
    )
    toks = sum(len(v.generated_tokens) for v in res.values())
    tps = toks / (time.perf_counter() - t)
    return tps, {"page_size": cb.page_size, "num_blocks": cb.num_blocks, "max_batch_tokens": cb.max_batch_tokens}


def _paired_rounds(args, hf, sub, n_new, cfg, vanilla, max_seq_len, out, log) -> tuple[list, list, dict]:
    """generate_batch and our engine in turn, --hf-rounds times: the host's speed drifts, so the ratio is taken
    round by round (a generate_batch failure is recorded in ``out``). (theirs, ours, our last run's figures)."""
    theirs, ours = [], []
    for rnd in range(max(1, getattr(args, "hf_rounds", 1))):
        try:
            tps, cache = _hf_generate_batch(hf, sub, n_new, cfg, getattr(args, "hf_batch_tokens", 512))
            theirs.append(tps)
            out["hf_generate_batch_config"] = cache
        except Exception as e:  # noqa: BLE001 (reported rather than abort the benchmark)
            out["hf_generate_batch_error"] = f"{type(e).__name__}: {e}"
        fig, _, _ = run_trace(vanilla, sub, "sequence", args.max_batch, max_seq_len)
        ours.append(fig["tokens_per_s"])
        if log:
            log(
                f"  round {rnd + 1}: transformers generate_batch, {len(sub)} requests: "
                f"{round(theirs[-1], 2) if len(theirs) > rnd else out.get('hf_generate_batch_error')} tok/s; "
                f"our engine {ours[-1]} tok/s"
            )
    return theirs, ours, fig


def hf_comparison(args, trace, vanilla, max_seq_len, log) -> dict:
    """transformers generate (batch 1) and generate_batch against our engine (vanilla model,
    sequence-wise, ``--max-concurrency`` rows) on the same requests, all with one output length
    (generate_batch takes one): generate_batch on the first ``--hf`` requests, generate at batch 1 on
    the first ``--hf-b1`` of them (default: all; requests one after another take long), each set
    against our engine's run on that same set."""
    from transformers import GenerationConfig

    from ..models import load_hf_reference

    hf, _ = load_hf_reference(args.model)
    sub = trace[: args.hf]
    n_new = max(r["max_tokens"] for r in sub)
    sub = [{**r, "max_tokens": n_new, "arrival": 0.0} for r in sub]
    sub_b1 = sub[: getattr(args, "hf_b1", 0) or len(sub)]
    out = {"requests": len(sub), "requests_b1": len(sub_b1), "max_new_tokens": n_new, "engine_rows": args.max_batch}
    cfg = GenerationConfig(
        max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    out["hf_generate_b1_tokens_per_s"] = _hf_generate_b1(hf, sub_b1, cfg)
    if log:
        log(f"  transformers generate, batch 1, {len(sub_b1)} requests: {out['hf_generate_b1_tokens_per_s']} tok/s")
    theirs, ours, fig = _paired_rounds(args, hf, sub, n_new, cfg, vanilla, max_seq_len, out, log)
    # the median of the per-round ratios beside the ratio of the medians
    if theirs:
        out["hf_generate_batch_tokens_per_s"] = round(statistics.median(theirs), 2)
        out["hf_generate_batch_rounds"] = [round(x, 2) for x in theirs]
    out["engine_sequence_tokens_per_s"] = round(statistics.median(ours), 2)
    out["engine_sequence_rounds"] = ours
    if len(theirs) == len(ours) > 1:
        out["vs_generate_batch_paired"] = round(statistics.median(o / h for o, h in zip(ours, theirs)), 2)
    fig_b1 = fig if len(sub_b1) == len(sub) else run_trace(vanilla, sub_b1, "sequence", args.max_batch, max_seq_len)[0]
    out["engine_sequence_b1_set_tokens_per_s"] = fig_b1["tokens_per_s"]
    out["vs_generate_b1"] = round(fig_b1["tokens_per_s"] / out["hf_generate_b1_tokens_per_s"], 2)
    if "hf_generate_batch_tokens_per_s" in out:
        out["vs_generate_batch"] = round(out["engine_sequence_tokens_per_s"] / out["hf_generate_batch_tokens_per_s"], 2)
    if log:
        log(
            f"  our engine (vanilla, sequence-wise, {args.max_batch} rows): {out['engine_sequence_tokens_per_s']} "
            f"tok/s on {len(sub)} requests, {fig_b1['tokens_per_s']} on {len(sub_b1)}"
        )
    del hf
    return out


def _hf_only(args, base, vanilla, max_seq_len, log) -> dict:
    """`--hf-only`: the transformers comparison alone, without a looped model."""
    if not args.hf:
        raise ValueError("--hf-only needs --hf N")
    return {
        "model": args.model,
        "torch_threads": torch.get_num_threads(),
        "machine": machine_limits(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "transformers": hf_comparison(args, base, vanilla, max_seq_len, log),
    }


def _arrival_trace(args, arrival: str, ids: list[int], base: list[dict], result: dict, say) -> list[dict]:
    """The trace of one arrival pattern: ``base`` (all at once), or Poisson arrivals at ``--rate``."""
    if arrival != "poisson":
        say(f"\nall {len(base)} requests at once; prompts {args.prompt_len}, outputs {args.output_len}")
        return base
    rate = args.rate
    if rate is None:  # ~80% of what sequence-wise batching sustained on the all-at-once trace
        seq = result.get("schedulers", {}).get("sequence", {}).get("tokens_per_s")
        mean_out = sum(r["max_tokens"] for r in base) / len(base)
        rate = 0.8 * seq / mean_out if seq else 1.0
    trace = make_trace(ids, args.requests, args.prompt_len, args.output_len, "poisson", rate, args.seed)
    say(f"\nPoisson arrivals, {rate:.2f} requests/s")
    return trace


def _run_plan(args, arrival: str, vanilla, looped, policy) -> list[tuple]:
    """The runs on one trace: (name, model, scheduler, exit policy, kv mode[, speculation])."""
    from ..serve.exits import parse_policy

    other_kv = "later" if args.kv_mode == "copy" else "copy"
    plan = [
        ("static", vanilla, "static", None, "copy"),
        ("sequence", vanilla, "sequence", None, "copy"),
        ("depth", looped, "depth", policy, args.kv_mode),
    ]
    spec = getattr(args, "speculate", "off")
    if spec != "off":  # the same trace, the same tokens as full depth, in speculative rounds
        plan.append(
            ("sequence_speculative", vanilla, "sequence", None, "copy", "context" if spec != "loop1" else "off")
        )
        plan.append(("looped_speculative", looped, "sequence", None, "copy", spec))
        plan.append(("looped_sequence_full_depth", looped, "sequence", None, "copy"))
        plan = [pl for pl in plan if pl[-1] != "off"]
    if arrival == "all":
        plan.append(("depth_oracle", looped, "depth", parse_policy("oracle"), "copy"))
        if args.extra:
            plan += [
                (f"depth_kv_{other_kv}", looped, "depth", policy, other_kv),
                ("looped_sequence_full_depth", looped, "sequence", None, "copy"),
                ("looped_depth_full_depth", looped, "depth", None, "copy"),
            ]
    return list({pl[0]: pl for pl in plan}.values())  # a run named twice runs once


def _run_line(name: str, fig: dict) -> str:
    """One run's figures on one line of the log."""
    return (
        f"  {name:<28} {fig['tokens_per_s']:>8.1f} tok/s  ttft p50 {fig['ttft_p50']:.3f}s p99 "
        f"{fig['ttft_p99']:.3f}s  tpot p50 {fig['tpot_p50']:.4f}s p99 {fig['tpot_p99']:.4f}s  "
        f"rss {fig['peak_rss_mb']:.0f} MB  weights {fig['weights_mb']:.0f} MB  "
        f"exits/loop {fig['exits_per_loop']}"
        + (f"  agreement {fig['agreement']:.3f}" if "agreement" in fig else "")
        + (
            f"  acceptance {fig['acceptance_rate']}, {fig['mean_accepted_length']} tokens/verification"
            if "speculate" in fig
            else ""
        )
    )


def _run_all(args, plan: list[tuple], trace: list[dict], max_seq_len: int, vanilla, looped, say) -> dict:
    """Every planned run on the trace, by name; the looped model's runs with their agreement."""
    runs = {}
    for name, model, sched, pol, kv, *sp in plan:
        fig, reqs, _ = run_trace(
            model,
            trace,
            sched,
            args.max_batch,
            max_seq_len,
            pol,
            kv,
            getattr(args, "compile", False),
            sp[0] if sp else "off",
        )
        if model is looped:
            fig["agreement"] = round(agreement(looped, reqs), 4)
        fig["model"] = "vanilla" if model is vanilla else "looped"
        fig["scheduler"] = sched
        runs[name] = fig
        say(_run_line(name, fig))
    return runs


def _arrival_block(runs: dict, vanilla, looped, limits: dict, weights: dict) -> dict:
    """One arrival pattern's figures: the three schedulers' headlines, depth-wise speedups, every run."""
    return {
        "schedulers": {
            k: {**{h: runs[k][h] for h in HEADLINE_KEYS}, "model": runs[k]["model"]}
            for k in ("static", "sequence", "depth")
        },
        "agreement": runs["depth"]["agreement"],
        "speedup": {
            "depth_vs_static": round(runs["depth"]["tokens_per_s"] / runs["static"]["tokens_per_s"], 3),
            "depth_vs_sequence": round(runs["depth"]["tokens_per_s"] / runs["sequence"]["tokens_per_s"], 3),
        },
        "runs": runs,
        # float weights only: the estimate counts parameters and their bytes
        "utilisation": {
            k: utilisation(vanilla if runs[k]["model"] == "vanilla" else looped, runs[k], limits)
            for k in ("static", "sequence", "depth")
        }
        if weights == {"vanilla": "fp32", "looped": "fp32"}
        else None,
    }


def _hypothetical_section(args, vanilla, looped, ids: list[int], say) -> dict:
    """The paper's hypothetical (simulated) throughput, hypothetical.py, logged."""
    say(
        f"\nhypothetical throughput, the paper's protocol (appendix J): {args.sim_samples} held-out windows "
        f"of {args.sim_prefix} + {args.sim_decode} tokens, oracle exits, block times per model"
    )
    sim = hypothetical(
        vanilla,
        looped,
        ids,
        args.sim_prefix,
        args.sim_decode,
        args.sim_samples,
        args.sim_memory_mb,
        args.sim_max_batch,
        say,
    )
    say(
        f"  Delta_V {sim['delta_v']}x, Delta_Seq {sim['delta_seq']}x; oracle exits per loop "
        f"{sim['oracle_exits_per_loop']}"
    )
    return sim


def _exit_tradeoff_section(args, looped, ids: list[int], say) -> dict:
    """Every exit policy's trade of early exits against agreement, on the held-out text's second half, logged."""
    say("\nexit policies, teacher-forced on held-out text (full-depth KV; an upper bound for the engine)")
    trade = exit_tradeoff(looped, ids[len(ids) // 2 :], n_tokens=args.tradeoff_tokens)
    say(f"  per-loop perplexity {trade['per_loop_perplexity']}, oracle exit fraction {trade['oracle_exit_fraction']}")
    for row in trade["policies"]:
        say(
            f"  {row['policy']:<14} early exits {row['early_exit_fraction']:.3f}  "
            f"agreement {row['agreement']:.4f}  perplexity {row['perplexity']}"
        )
    return trade


def bench_serve(args, arrivals: list[str], log=print) -> dict:
    from ..models import load_model
    from ..serve.exits import parse_policy

    say = log or (lambda *a: None)
    vanilla, tok = load_model(args.model)
    vanilla.eval()
    ids = tok(heldout_text(), add_special_tokens=False)["input_ids"]
    max_seq_len = args.prompt_len[1] + args.output_len[1]
    base = make_trace(ids, args.requests, args.prompt_len, args.output_len, "all", seed=args.seed)
    if getattr(args, "hf_only", False):
        return _hf_only(args, base, vanilla, max_seq_len, log)
    looped, looped_desc = _looped_model(args, vanilla)
    weights = getattr(args, "weights", None)
    vanilla, looped = prepare(vanilla, weights), prepare(looped, weights, lora=getattr(args, "lora", None))
    policy = parse_policy(args.exit).bind(looped)  # the probe policy: the looped model's fitted probe
    limits = machine_limits()
    result = {
        "model": args.model,
        "looped": looped_desc,
        "exit_policy": policy.label,
        "weights": {"vanilla": stored_format(vanilla), "looped": stored_format(looped)},
        "looped_lora": stored_lora(looped),  # shared, or merged per depth (--lora)
        "kv_mode": args.kv_mode,
        "max_batch": args.max_batch,
        "torch_threads": torch.get_num_threads(),
        "machine": limits,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    say(f"vanilla {args.model}; looped: {looped_desc}; exit {result['exit_policy']}, kv {args.kv_mode}")
    for arrival in arrivals:
        trace = _arrival_trace(args, arrival, ids, base, result, say)
        plan = _run_plan(args, arrival, vanilla, looped, policy)
        runs = _run_all(args, plan, trace, max_seq_len, vanilla, looped, say)
        block = _arrival_block(runs, vanilla, looped, limits, result["weights"])
        say(
            f"  measured: depth/static {block['speedup']['depth_vs_static']}x, depth/sequence "
            f"{block['speedup']['depth_vs_sequence']}x at agreement {block['agreement']:.3f}"
        )
        if arrival == "all":
            result.update(block)
        else:
            result[arrival] = block
    if args.sim_samples > 0:
        result["hypothetical"] = _hypothetical_section(args, vanilla, looped, ids, say)
    if args.tradeoff_tokens > 0:
        result["exit_tradeoff"] = _exit_tradeoff_section(args, looped, ids, say)
    if args.hf:
        say("\ntransformers comparison")
        result["transformers"] = hf_comparison(args, base, vanilla, max_seq_len, log)
    return result


@torch.no_grad()
def _teacher_forced_loops(model, ids: list[int], seq_len: int, probe):
    """Over ``ids`` in windows of ``seq_len`` (full-depth KV): every loop's log-probabilities [B, t, V], each
    loop's cosine to the state before it [B, t], the probe's exit probabilities [B - 1, t] (None without a
    probe) and the targets [t]."""
    B = model.config.num_loops
    dev = next(model.parameters()).device
    per_loop_logp, cos_prev, probe_p = [], [], []
    targets = []
    for s in range(0, len(ids) - 1, seq_len):
        w = ids[s : s + seq_len + 1]
        if len(w) < 2:
            break
        x = torch.tensor([w[:-1]], device=dev)
        h0 = model.model.embed(x)
        _, states, _ = model.model(x, output_loop_states=True)
        lp = [model.exit_logits(h, loop=i)[0].float().log_softmax(-1) for i, h in enumerate(states)]
        per_loop_logp.append(torch.stack(lp))  # [B, t, V]
        prev = [h0] + states[:-1]
        cos_prev.append(
            torch.stack(
                [
                    torch.nn.functional.cosine_similarity(a[0].float(), b[0].float(), dim=-1)
                    for a, b in zip(states, prev)
                ]
            )
        )  # [B, t]
        if probe is not None:
            probe_p.append(
                torch.stack(
                    [
                        probe.prob(
                            probe.featurize(model, states[i][0], prev[i][0], lp[i]),
                            torch.full((x.shape[1],), i, device=dev),
                        )
                        for i in range(B - 1)
                    ]
                )
            )
        targets.append(torch.tensor(w[1:], device=dev))
    logp, cosv, tgt = torch.cat(per_loop_logp, 1), torch.cat(cos_prev, 1), torch.cat(targets)
    probe_pv = torch.cat(probe_p, 1) if probe is not None else None
    return logp, cosv, probe_pv, tgt


def _exit_loops(kind: str, thr: float, tgt, logp, probs, cosv, probe_pv):
    """The loop each token leaves at under one policy and threshold: the earliest whose signal clears it, else
    the last."""
    B = logp.shape[0]
    exit_loop = torch.full_like(tgt, B - 1)
    for i in range(B - 2, -1, -1):
        if kind == "softmax":
            ok = probs[i].max(-1).values >= thr
        elif kind == "margin":
            t2 = probs[i].topk(2, -1).values
            ok = (t2[:, 0] - t2[:, 1]) >= thr
        elif kind == "entropy":
            ok = -(probs[i] * logp[i].clamp_min(-1e30)).nan_to_num().sum(-1) <= thr
        elif kind == "probe":
            ok = probe_pv[i] >= thr
        else:
            ok = cosv[i] >= thr
        exit_loop = torch.where(ok, torch.full_like(exit_loop, i), exit_loop)
    return exit_loop


def _policy_row(policy: str, exit_loop, arg, nll_loop) -> dict:
    """One policy's early exits, loops run, agreement with the final loop and perplexity of the logits used."""
    B = arg.shape[0]
    chosen = arg.gather(0, exit_loop[None])[0]
    nll = nll_loop.gather(0, exit_loop[None])[0]
    return {
        "policy": policy,
        "early_exit_fraction": round(float((exit_loop < B - 1).float().mean()), 3),
        "mean_loops": round(float(exit_loop.float().mean() + 1), 3),
        "agreement": round(float((chosen == arg[-1]).float().mean()), 4),
        "perplexity": round(float(nll.mean().exp()), 2),
    }


@torch.no_grad()
def exit_tradeoff(
    model,
    token_ids: list[int],
    n_tokens: int = 1024,
    seq_len: int = 256,
    policies=(
        ("softmax", (0.5, 0.7, 0.9, 0.95)),
        ("margin", (0.3, 0.6, 0.9)),
        ("entropy", (2.0, 1.0, 0.5)),
        ("cosine", (0.9, 0.95, 0.99)),
    ),
) -> dict:
    """Teacher-forced on held-out text (full-depth KV, so an upper bound for the engine): per policy and
    threshold, the fraction of tokens leaving before the last loop, agreement of their argmax with the
    final loop's, and the perplexity of the logits actually used (exit logits where a token exits).
    A model with a fitted exit probe also gets the probe policy's rows (its calibrated threshold too)."""
    from ..serve.probe import ProbeError, load_probe

    B = model.config.num_loops
    ids = token_ids[: n_tokens + 1]
    try:
        probe = load_probe(model)
        policies = tuple(policies) + (("probe", tuple(sorted({0.5, 0.7, 0.9, probe.threshold}))),)
    except ProbeError:
        probe = None
    logp, cosv, probe_pv, tgt = _teacher_forced_loops(model, ids, seq_len, probe)
    arg = logp.argmax(-1)
    nll_loop = -logp.gather(-1, tgt[None, :, None].expand(B, -1, 1))[..., 0]  # [B, t]
    out = {
        "tokens": int(tgt.numel()),
        "per_loop_perplexity": [round(float(nll_loop[i].mean().exp()), 2) for i in range(B)],
        "oracle_exit_fraction": [round(float((arg[i] == arg[-1]).float().mean()), 3) for i in range(B - 1)],
        "policies": [],
    }
    probs = logp.exp()
    for kind, thresholds in policies:
        for thr in thresholds:
            exit_loop = _exit_loops(kind, thr, tgt, logp, probs, cosv, probe_pv)
            out["policies"].append(_policy_row(f"{kind}:{thr}", exit_loop, arg, nll_loop))
    return out


def serve_table(result: dict) -> tuple[list[str], list[list]]:
    """The benchmark's table: a row per run (scheduler and model on a trace)."""
    rows = [
        [name, fig["model"], fig["tokens_per_s"], fig["ttft_p50"], fig["tpot_p50"], fig.get("agreement", "")]
        for name, fig in result.get("runs", {}).items()
    ]
    return ["run", "model", "tokens/s", "TTFT p50 s", "TPOT p50 s", "agreement"], rows
