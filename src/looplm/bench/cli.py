"""`looplm bench`: the maintained benchmarks. Each prints a short table naming the machine and writes its result
as JSON with ``--out FILE``."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..cli_args import HelpFormatter, add_model, add_renamed, advanced
from ..errors import UsageError


def token_range(text: str) -> tuple[int, int]:
    """LO:HI (or N for N:N) token counts."""
    try:
        lo, _, hi = text.partition(":")
        lo, hi = int(lo), int(hi or lo)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LO:HI, got {text!r}") from None
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"need 1 <= LO <= HI, got {text!r}")
    return lo, hi


def weight_formats(text: str) -> list[str]:
    from .llamacpp import FORMATS

    formats = [f.strip() for f in text.split(",") if f.strip()]
    bad = [f for f in formats if f not in FORMATS]
    if not formats or bad:
        raise argparse.ArgumentTypeError(f"expected a comma list of {', '.join(FORMATS)}, got {text!r}")
    return formats


def _common(p) -> None:
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own choice)")
    p.add_argument("--out", default=None, metavar="FILE", help="also write the result as JSON to FILE")


def register(sub) -> None:
    parser = sub.add_parser(
        "bench",
        help="benchmarks: serving, llama.cpp side by side, a heal step, a train step",
        formatter_class=HelpFormatter,
    )
    bench = parser.add_subparsers(dest="bench_command", required=True)
    _register_serve(bench)
    _register_llamacpp(bench)
    _register_heal_step(bench)
    _register_train_step(bench)
    _register_speculate(bench)


# --- speculative decoding -----------------------------------------------------------------------


def _register_speculate(bench) -> None:
    p = bench.add_parser(
        "speculate",
        help="speculative decoding (--speculate) against plain decoding at batch 1, greedy, side by side",
        formatter_class=HelpFormatter,
    )
    p.add_argument("models", nargs="+", metavar="MODEL", help="embedded names or model directories")
    p.add_argument("--weights", default="fp32", help="comma list of weight formats (fp32, bf16, int8, int4)")
    p.add_argument("--modes", default="context,loop1,both", help="comma list of speculation modes to time")
    p.add_argument("--new-tokens", type=int, default=256, help="generated tokens per prompt (EOS ignored)")
    p.add_argument("--rounds", type=int, default=1, help="times each run repeats, interleaved (the best is kept)")
    p.add_argument(
        "--llamacpp",
        default=None,
        metavar="GGUF",
        help="also time llama.cpp on this GGUF file (or an embedded model's own, by name), plain and with its "
        "prompt-lookup decoding, on the same prompts and threads (needs the `bench` extra)",
    )
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    _common(p)
    p.set_defaults(func=cmd_speculate)


def cmd_speculate(args) -> int:
    import functools
    import sys

    import torch

    from ..util import machine, print_json
    from .report import finish
    from .speculate import bench_speculate

    if args.threads:
        torch.set_num_threads(args.threads)
    weights = [w.strip() for w in args.weights.split(",") if w.strip()]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in ("context", "loop1", "both")]
    if bad or not modes or args.new_tokens < 1 or args.rounds < 1:
        raise UsageError("need --modes from context, loop1, both, --new-tokens >= 1 and --rounds >= 1")
    gguf = args.llamacpp
    if gguf:  # before anything loads
        from ..models.loading import EMBEDDED, embedded_gguf
        from .llamacpp import check_available

        check_available()
        gguf = str(embedded_gguf(gguf)) if gguf in EMBEDDED else gguf
        if not Path(gguf).is_file():
            raise UsageError(f"--llamacpp {gguf}: no such GGUF file; give a file or an embedded model's name")
    say = functools.partial(print, file=sys.stderr, flush=True) if args.json else print
    result = bench_speculate(
        args.models, weights, modes, args.new_tokens, args.rounds, log=say, llamacpp=gguf, threads=args.threads
    )
    result["machine"] = machine()
    if args.json:
        print_json(result)
    rows = [
        [
            r["model"],
            r["weights"],
            r["prompt"],
            r["speculate"],
            r["tokens_per_s"],
            r["vs_off"],
            r["acceptance_rate"],
            r["mean_accepted_length"],
            r["same_tokens_as_off"],
            r.get("vs_vanilla", ""),
            r.get("vs_llamacpp", ""),
        ]
        for r in result["runs"]
    ]
    header = ["model", "weights", "prompt", "speculate", "tokens/s", "x off", "acceptance", "accepted length", "same"]
    header += ["x vanilla off", "x llama.cpp off"]
    finish(result, header, rows, args.out, say)
    return 0


# --- serve --------------------------------------------------------------------------------------


def _register_serve(bench) -> None:
    from ..convert.recursive import INITS
    from ..serve.cli import _engine_args, add_speculate

    p = bench.add_parser(
        "serve",
        help="static vs sequence-wise vs depth-wise batching on real-text traces",
        formatter_class=HelpFormatter,
    )
    add_model(p, "the vanilla model (embedded name or directory)", default="smollm2-135m")
    p.add_argument("--looped", default=None, help="a saved looped model (default: convert MODEL on the fly)")
    p.add_argument("--loops", type=int, default=2, help="B when converting on the fly")
    # not "aware": that init needs calibration text
    p.add_argument(
        "--init", default="stepwise", choices=[i for i in INITS if i != "aware"], help="init when converting on the fly"
    )
    p.add_argument(
        "--lora-rank", default="64", help="LoRA rank when converting on the fly (0: recursive; full: full rank)"
    )
    p.add_argument("--requests", type=int, default=24, help="requests in the trace")
    p.add_argument("--prompt-len", type=token_range, default="16:96", metavar="LO:HI", help="prompt tokens")
    p.add_argument("--output-len", type=token_range, default="8:64", metavar="LO:HI", help="generated tokens")
    p.add_argument("--arrivals", default="all,poisson", help="comma list of all (at once), poisson")
    p.add_argument(
        "--rate",
        type=float,
        default=None,
        help="Poisson requests/s (default: about 80%% of the sequence-wise capacity measured on the all-at-once trace)",
    )
    p.add_argument(
        "--max-concurrency",
        dest="max_batch",
        type=int,
        default=8,
        metavar="N",
        help="requests served at once (KV cache rows)",
    )
    add_renamed(p, "--max-batch", "--max-concurrency")
    p.add_argument(
        "--exit-policy",
        dest="exit",
        default="softmax:0.9",
        metavar="POLICY",
        help="exit policy[:threshold][+copy[:BONUS]] of the depth-wise run (softmax, margin, entropy, "
        "cosine, probe, oracle, none; +copy: also exit where the loop's argmax continues a repeat "
        "of the context, BONUS nats added to that guess's logit first)",
    )
    add_renamed(p, "--exit", "--exit-policy")
    p.add_argument("--kv-mode", default="copy", choices=["copy", "later"], help="KV of the loops an exit skips")
    add_speculate(p)
    p.add_argument(
        "--extra",
        action="store_true",
        help="also: the other KV mode, and the looped model under sequence-wise batching without exits",
    )
    hf = advanced(p, "the transformers comparison")
    hf.add_argument(
        "--hf",
        type=int,
        default=0,
        help="also time transformers generate (batch 1) and "
        "generate_batch on the first N requests against our engine (vanilla, sequence-wise)",
    )
    hf.add_argument(
        "--hf-b1",
        type=int,
        default=0,
        help="time generate at batch 1 on only the first N of the --hf requests (0: all of them)",
    )
    hf.add_argument(
        "--hf-rounds",
        type=int,
        default=1,
        help="run generate_batch and our engine in turn this many "
        "times (medians and the median of per-round ratios are reported)",
    )
    hf.add_argument("--hf-batch-tokens", type=int, default=512, help="generate_batch's max_batch_tokens")
    hf.add_argument("--hf-only", action="store_true", help="only the transformers comparison (with --hf N)")
    t = advanced(p, "the exit-policy table and the paper's simulated throughput")
    t.add_argument(
        "--tradeoff-tokens", type=int, default=1024, help="held-out tokens for the exit-policy table (0: skip it)"
    )
    t.add_argument(
        "--sim-samples",
        type=int,
        default=8,
        help="held-out windows for the paper's hypothetical throughput (0: skip it)",
    )
    t.add_argument("--sim-prefix", type=int, default=64, help="prefix tokens of each simulated request")
    t.add_argument("--sim-decode", type=int, default=256, help="decoded tokens of each simulated request")
    t.add_argument(
        "--sim-memory-mb",
        type=float,
        default=1024,
        help="memory limit that sets each model's largest batch (weights + KV caches)",
    )
    t.add_argument("--sim-max-batch", type=int, default=64, help="cap on the simulated batch")
    p.add_argument("--seed", type=int, default=0, help="seed of the traces and of an on-the-fly conversion")
    _engine_args(p)
    p.add_argument("--json", action="store_true", help="print the result as one JSON object (progress goes to stderr)")
    _common(p)
    p.set_defaults(func=cmd_serve)


def cmd_serve(args) -> int:
    import functools
    import sys

    import torch

    from ..serve.cli import check_engine_args
    from ..util import machine, print_json
    from .report import finish
    from .serving import bench_serve

    if args.threads:
        torch.set_num_threads(args.threads)
    arrivals = [a.strip() for a in args.arrivals.split(",") if a.strip()]
    if not arrivals or any(a not in ("all", "poisson") for a in arrivals):
        raise UsageError(f"--arrivals takes a comma list of all, poisson; got {args.arrivals!r}")
    if args.requests < 1 or args.max_batch < 1:
        raise UsageError("--requests and --max-concurrency must be >= 1")
    check_engine_args(args)
    if not args.looped and not args.hf_only:  # before anything loads
        from ..serve.on_the_fly import check_unhealed

        check_unhealed(args.model, args.loops, args.allow_unhealed)
    say = functools.partial(print, file=sys.stderr, flush=True) if args.json else print
    result = bench_serve(args, arrivals, log=say)
    result["machine"] = {**machine(), **result.get("machine", {})}
    if args.json:
        print_json(result)
    rows = [
        [name, fig["model"], fig["tokens_per_s"], fig["ttft_p50"], fig["tpot_p50"], fig.get("agreement", "")]
        for name, fig in result.get("runs", {}).items()
    ]
    finish(result, ["run", "model", "tokens/s", "TTFT p50 s", "TPOT p50 s", "agreement"], rows, args.out, say)
    return 0


# --- llama.cpp ----------------------------------------------------------------------------------


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected a comma list of positive integers, got {text!r}")
    return values


def _register_llamacpp(bench) -> None:
    from .llamacpp import Settings

    d = Settings()
    p = bench.add_parser(
        "llamacpp",
        help="our engine and llama.cpp side by side (needs the `bench` extra)",
        formatter_class=HelpFormatter,
    )
    add_model(p, "the vanilla model (embedded name or directory)", default=d.model)
    p.add_argument(
        "--weights",
        type=weight_formats,
        default=",".join(d.formats),
        metavar="LIST",
        help="our engine's weight formats, a comma list of fp32, bf16, int8, int4",
    )
    p.add_argument("--compile", action="store_true", help="our engine compiled (its graphs are built before timing)")
    p.add_argument(
        "--q4-gguf",
        default=None,
        metavar="FILE",
        help="a 4-bit llama.cpp file (default: an embedded model's own GGUF file)",
    )
    p.add_argument(
        "--q8-gguf", default=None, metavar="FILE", help="a Q8_0 llama.cpp file (default: exported from MODEL)"
    )
    p.add_argument("--b1-requests", type=int, default=d.b1_requests, help="requests served one at a time")
    p.add_argument("--b1-new-tokens", type=int, default=d.b1_output, help="generated tokens of each batch-1 request")
    p.add_argument("--requests", type=int, default=d.requests, help="requests in the batched trace (0: batch 1 only)")
    p.add_argument(
        "--prompt-len", type=token_range, default="{}:{}".format(*d.prompt_len), metavar="LO:HI", help="prompt tokens"
    )
    p.add_argument(
        "--output-len",
        type=token_range,
        default="{}:{}".format(*d.output_len),
        metavar="LO:HI",
        help="generated tokens of each trace request",
    )
    p.add_argument(
        "--max-concurrency",
        type=int,
        default=d.max_concurrency,
        metavar="N",
        help="requests our engine serves at once on the trace",
    )
    p.add_argument(
        "--llama-concurrency",
        type=_int_list,
        default=",".join(map(str, d.llama_concurrency)),
        metavar="LIST",
        help="llama.cpp's sequences at once on the trace, a comma list (its best is kept)",
    )
    p.add_argument("--rounds", type=int, default=d.rounds, help="rounds, each running every configuration in turn")
    p.add_argument(
        "--data", default=None, help="a corpus from `looplm data build`: each format's perplexity on its held-out rows"
    )
    p.add_argument("--scored-tokens", type=int, default=d.scored_tokens, help="held-out tokens scored with --data")
    q = p.add_argument_group("rounding (as `looplm quantize`)")
    q.add_argument(
        "--calib-data",
        default=None,
        metavar="DATA",
        help="round int8 and int4 by GPTQ on this corpus's first training rows (default: to nearest)",
    )
    q.add_argument("--calib-rows", type=int, default=d.calib_rows, help="training rows GPTQ calibrates on")
    q.add_argument("--equalize", action="store_true", help="equalize input channels before GPTQ (needs --calib-data)")
    lp = p.add_argument_group("a looped model at batch 1, against llama.cpp running the vanilla model")
    lp.add_argument(
        "--looped",
        default=None,
        metavar="DIR",
        help="a looped model (converted from MODEL) served depth-wise at batch 1 with each exit policy",
    )
    lp.add_argument(
        "--looped-weights",
        type=weight_formats,
        default=",".join(d.looped_formats),
        metavar="LIST",
        help="its weight formats, a comma list of fp32, bf16, int8, int4",
    )
    lp.add_argument(
        "--lora",
        default=d.lora,
        choices=["shared", "merged"],
        help="its LoRA: shared weights with the "
        "per-depth LoRA in float on top, or merged into one quantized weight per depth",
    )
    lp.add_argument(
        "--exit-policy",
        default="none",
        metavar="LIST",
        help="its exit policies, a comma list (policy[:threshold][+copy[:BONUS]], as `looplm serve --exit-policy`)",
    )
    lp.add_argument("--kv-mode", default=d.kv_mode, choices=["copy", "later"], help="KV of the loops an exit skips")
    _common(p)
    p.set_defaults(func=cmd_llamacpp)


def cmd_llamacpp(args) -> int:
    import torch

    from .llamacpp import Settings, bench_llamacpp, check_available
    from .report import finish

    check_available()  # before any model loads
    if args.equalize and not args.calib_data:
        raise UsageError("--equalize chooses its scales on calibration rows: add --calib-data DATA")
    if min(args.b1_requests, args.b1_new_tokens, args.rounds, args.max_concurrency) < 1 or args.requests < 0:
        raise UsageError("--b1-requests, --b1-new-tokens, --rounds and --max-concurrency must be >= 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    s = Settings(
        model=args.model,
        formats=args.weights,
        compile=args.compile,
        calib_data=args.calib_data,
        calib_rows=args.calib_rows,
        equalize=args.equalize,
        lora=args.lora,
        looped=args.looped,
        looped_formats=args.looped_weights,
        exit_policies=[e.strip() for e in args.exit_policy.split(",") if e.strip()],
        kv_mode=args.kv_mode,
        q4_gguf=args.q4_gguf,
        q8_gguf=args.q8_gguf,
        b1_requests=args.b1_requests,
        b1_output=args.b1_new_tokens,
        requests=args.requests,
        prompt_len=args.prompt_len,
        output_len=args.output_len,
        max_concurrency=args.max_concurrency,
        llama_concurrency=args.llama_concurrency,
        rounds=args.rounds,
        data=args.data,
        scored_tokens=args.scored_tokens,
    )
    r = bench_llamacpp(s)
    trace = [f"tokens/s {args.requests} requests"] if args.requests else []
    rows = [
        [
            name,
            c.get("batch1_tokens_per_s", ""),
            *([c.get("trace_tokens_per_s", "")] if trace else []),
            c.get("agreement_with_fp32", c.get("agreement_full_depth", "")),
            c.get("perplexity") or "",
        ]
        for name, c in r["configs"].items()
    ]
    finish(r, ["configuration", "tokens/s batch 1", *trace, "agreement", "perplexity"], rows, args.out)
    for part, ratios in r["ratios"].items():
        if ratios:
            print(f"{part}: " + ", ".join(f"{k} {v}x" for k, v in ratios.items()))
    return 0


# --- heal step ----------------------------------------------------------------------------------


def _register_heal_step(bench) -> None:
    from ..train.heal import E2E_ROWS, HealConfig

    d = HealConfig()
    p = bench.add_parser(
        "heal-step",
        help="seconds of a layer-local, an end-to-end and an exit-adapter step of `looplm heal`",
        formatter_class=HelpFormatter,
    )
    add_model(p, "the converted student (a looplm directory)")
    p.add_argument("--teacher", required=True, help="the original model the student was converted from")
    p.add_argument("--data", required=True, help="a corpus from `looplm data build`")
    p.add_argument("--seq-len", type=int, default=d.seq_len, help="tokens per row")
    p.add_argument("--local-batch", type=int, default=d.local_batch, help="rows per tied depth of a local step")
    p.add_argument("--e2e-batch", type=int, default=d.e2e_batch, help="rows of an end-to-end step")
    p.add_argument(
        "--e2e-rows",
        default=d.e2e_rows,
        choices=list(E2E_ROWS),
        help="where the end-to-end rows come from: the teacher cache, or any training row with the "
        "original run on it each step",
    )
    p.add_argument(
        "--exit-adapter", default=d.exit_adapter, help="the exit stage's adapter: affine, head-lora:R, or none"
    )
    p.add_argument("--cache-rows", type=int, default=8, help="training rows in the teacher cache")
    p.add_argument(
        "--cache", default=None, metavar="DIR", help="keep the teacher cache in DIR (default: a temporary directory)"
    )
    p.add_argument(
        "--precision",
        default=d.precision,
        choices=["auto", "bf16", "fp32"],
        help="auto: bf16 autocast where the hardware has bf16 matmuls",
    )
    p.add_argument("--compile", action="store_true", help="time the steps with each layer through torch.compile")
    p.add_argument(
        "--rounds", type=int, default=2, help="timings, each on a fresh copy of the student (the median is reported)"
    )
    _common(p)
    p.set_defaults(func=cmd_heal_step)


def cmd_heal_step(args) -> int:
    import torch

    from ..train.heal import HealConfig
    from .heal_step import heal_step
    from .report import finish

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.rounds < 1:
        raise UsageError("--rounds must be >= 1")
    cfg = HealConfig(
        model=args.model,
        teacher=args.teacher,
        data=args.data,
        seq_len=args.seq_len,
        local_batch=args.local_batch,
        e2e_batch=args.e2e_batch,
        e2e_rows=args.e2e_rows,
        exit_adapter=args.exit_adapter,
        cache_rows=args.cache_rows,
        cache=args.cache,
        precision=args.precision,
        compile=args.compile,
        progress=False,
    )
    r = heal_step(cfg, args.rounds)
    rows = [[name, s["seconds"], s["tokens_per_s"], s["note"]] for name, s in r["steps"].items()]
    finish(r, ["step", "seconds", "tokens/s", "what it runs"], rows, args.out)
    return 0


# --- train step ---------------------------------------------------------------------------------


def _register_train_step(bench) -> None:
    from ..train.loop import TrainConfig

    d = TrainConfig()
    p = bench.add_parser("train-step", help="seconds of a `looplm train` step", formatter_class=HelpFormatter)
    add_model(p, "the model to train (embedded name, HF or looplm directory)")
    p.add_argument("--data", required=True, help="a corpus from `looplm data build`")
    p.add_argument("--teacher", default=None, help="distil from this model too (as `looplm train --teacher`)")
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="sequences per step")
    p.add_argument("--seq-len", type=int, default=None, help="crop the corpus's rows (default: their full length)")
    p.add_argument("--steps", type=int, default=6, help="steps to run")
    p.add_argument("--warmup", type=int, default=2, help="first steps left out of the figures")
    p.add_argument(
        "--precision",
        default=d.precision,
        choices=["auto", "bf16", "fp32"],
        help="auto: bf16 autocast where the hardware has bf16 matmuls",
    )
    _common(p)
    p.set_defaults(func=cmd_train_step)


def cmd_train_step(args) -> int:
    import torch

    from ..train.loop import TrainConfig
    from .report import finish
    from .train_step import train_step

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.steps < 1 or args.warmup < 0:
        raise UsageError("--steps must be >= 1 and --warmup >= 0")
    cfg = TrainConfig(
        model=args.model,
        data=args.data,
        teacher=args.teacher,
        max_steps=args.steps,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        precision=args.precision,
        progress=False,
    )
    r = train_step(cfg, args.warmup)
    rows = [
        [
            f"{r['global_batch']} x {r['seq_len']} tokens, {r['precision']}",
            r["seconds_per_step"],
            r["tokens_per_s"],
            r["steps"] - r["warmup"],
        ]
    ]
    finish(r, ["step", "seconds", "tokens/s", "steps timed"], rows, args.out)
    return 0
