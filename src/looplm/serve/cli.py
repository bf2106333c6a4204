"""`looplm generate` and `looplm serve` (the HTTP server is in server.py)."""

from __future__ import annotations

import argparse

from ..cli_args import HelpFormatter, add_model, add_renamed, advanced
from ..convert.recursive import INITS
from ..errors import UsageError
from ..util import print_json

EXIT_POLICY_HELP = (
    "exit policy[:threshold][+copy[:BONUS]]: softmax, margin, entropy, cosine, probe or none; "
    "+copy (or copy alone) also exits where the loop's argmax continues a repeat of the context, "
    "BONUS nats added to that guess's logit first (e.g. margin:0.49+copy:8)"
)


def _data_subparsers(sub):
    """The `data` command's subparsers (data/cli.py registers `data` first: COMMAND_MODULES' order)."""
    parser = sub.choices["data"]
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))


def _register_generate(sub) -> None:
    from ..recipes.teacher_text import GenerateConfig

    d = GenerateConfig()
    g = _data_subparsers(sub).add_parser(
        "generate",
        help="sample a training corpus from a model with the serving engine (resumable); use the "
        "directory as a source of `looplm data build --sources ...,DIR`",
        formatter_class=HelpFormatter,
    )
    add_model(g, "the model to sample (the original, for healing)", default=d.model)
    g.add_argument("--out", required=True, help="corpus directory (re-running it resumes)")
    budget = g.add_mutually_exclusive_group(required=True)
    budget.add_argument(
        "--generated-tokens",
        dest="tokens",
        type=int,
        metavar="N",
        help="stop once this many generated tokens are kept (this or --budget-minutes is needed)",
    )
    budget.add_argument(
        "--budget-minutes", dest="minutes", type=float, metavar="M", help="stop after this many minutes of generation"
    )
    add_renamed(budget, "--tokens", "--generated-tokens")
    add_renamed(budget, "--minutes", "--budget-minutes")
    g.add_argument(
        "--prompt-mix",
        default=None,
        help="kind:weight list; start = a bare document start, corpus = a snippet of --corpus's training split "
        "(default: start:1,corpus:1 with --corpus, else start:1)",
    )
    g.add_argument(
        "--corpus",
        default=None,
        help="a `looplm data build` corpus for corpus prompts (needed when --prompt-mix has corpus prompts)",
    )
    g.add_argument("--prompt-tokens", type=int, default=d.prompt_tokens, help="tokens of each corpus prompt")
    g.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens, help="generated tokens per sample at most")
    g.add_argument("--temperature", type=float, default=d.temperature, help="sampling temperature")
    g.add_argument(
        "--top-p",
        type=float,
        default=d.top_p,
        help="nucleus sampling: the smallest set of tokens whose probabilities reach this sum",
    )
    g.add_argument(
        "--max-concurrency",
        dest="max_batch",
        type=int,
        default=d.max_batch,
        metavar="N",
        help="samples generated at once (KV cache rows)",
    )
    add_renamed(g, "--max-batch", "--max-concurrency")
    g.add_argument("--shard-size", type=int, default=d.shard_size, help="samples per shard (the unit of resuming)")
    g.add_argument(
        "--weights",
        default=None,
        choices=["fp32", "bf16", "int8", "int4"],
        help="weight format (default: bf16 where the hardware multiplies it natively, else fp32)",
    )
    g.add_argument("--seed", type=int, default=d.seed, help="seed of the prompts and of sampling")
    g.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    g.set_defaults(func=cmd_data_generate)


def cmd_data_generate(args) -> int:
    from ..recipes.teacher_text import GenerateConfig, generate_corpus

    cfg = GenerateConfig(
        model=args.model,
        out=args.out,
        tokens=args.tokens,
        minutes=args.minutes,
        prompt_mix=args.prompt_mix,
        corpus=args.corpus,
        prompt_tokens=args.prompt_tokens,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        max_batch=args.max_batch,
        shard_size=args.shard_size,
        weights=args.weights,
        seed=args.seed,
        progress=not args.no_progress,
    )
    m = generate_corpus(cfg)
    print(
        f"wrote {args.out}: {m['kept']} samples kept of {m['samples']} ({m['duplicates']} duplicates, "
        f"{m['degenerate']} degenerate), {m['tokens']:,} tokens, {m['tokens_per_second']} tokens/s "
        f"({m['weights']}, {m['machine']['cpu']})"
    )
    return 0


def _engine_args(p, converts_at_load: bool = True) -> None:
    """Options of every command that builds an engine: weight format, compilation; and for one that can convert
    a model at load (serve, bench serve), the consent to serve it unhealed."""
    p.add_argument(
        "--weights",
        default=None,
        choices=["fp32", "bf16", "int8", "int4"],
        help="weight format: int8 (per-channel) or int4 (group-wise) quantized at load on CPU, with "
        "LoRA and norms in float on top; bf16: the whole model in bfloat16, where the hardware "
        "multiplies it natively (AMX, AVX-512 BF16, CUDA): the fastest batched steps on a CPU with "
        "AMX (default: as stored)",
    )
    p.add_argument(
        "--lora",
        default=None,
        choices=["shared", "merged"],
        help="with --weights int8|int4: keep each shared weight once with its per-depth LoRA in float on "
        "top (shared, the default), or quantize W + B_s A_s once per depth (merged: no LoRA "
        "matmuls)",
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="run each layer's work around attention as torch.compile regions (needs a C++ compiler on "
        "CPU; the graphs are built before serving starts, which takes a minute or more)",
    )
    if converts_at_load:
        add_allow_unhealed(p)


SPECULATE_HELP = (
    "speculative decoding, the same tokens as full depth only faster: drafts from the context (prompt lookup: "
    "the tokens that followed the last occurrence of the final n-gram; any model), from the model's own loop 1 "
    "(looped models), or both (the context's where it has one), verified at full depth; off by default; refuses "
    "an exit policy"
)


def add_speculate(p) -> None:
    """--speculate, spelled the same by generate, serve and bench serve."""
    p.add_argument("--speculate", default="off", choices=["off", "context", "loop1", "both"], help=SPECULATE_HELP)


def check_speculate_args(args) -> None:
    """Before the model loads: speculation and an exit policy together are a usage error."""
    policy = getattr(args, "exit_policy", "none")
    if getattr(args, "speculate", "off") != "off" and policy not in ("none", None):
        raise UsageError(
            f"--speculate {args.speculate} gives the full model's tokens and --exit-policy {policy} changes them; "
            "use one or the other"
        )


def check_engine_args(args, device: str = "cpu") -> None:
    """Before the model loads: a weight format this device cannot run, merging a LoRA into float weights, or
    compiling without a compiler is a one-line usage error."""
    if args.weights:
        from ..models.quantized import check_format

        check_format(args.weights, device)
    if args.lora == "merged" and args.weights in ("fp32", "bf16"):
        raise UsageError("--lora merged needs quantized weights (--weights int8 or int4)")
    if args.compile:
        from ..util import check_compile_available

        check_compile_available(device)


def register(sub) -> None:
    _register_generate(sub)
    p = sub.add_parser(
        "fit-exit-probe",
        help="fit the learned exit probe (the `probe` exit policy) of a saved looped model on a corpus' training split",
        formatter_class=HelpFormatter,
    )
    add_model(p, "a saved looped model directory (the probe is written into it)")
    p.add_argument("--data", required=True, help="a corpus from `looplm data build` (its training split is used)")
    p.add_argument("--fit-rows", type=int, default=32, help="training-split rows to fit on")
    p.add_argument("--calib-rows", type=int, default=16, help="other training-split rows to calibrate the threshold on")
    p.add_argument(
        "--target-agreement",
        type=float,
        default=0.95,
        help="calibrate the threshold to this teacher-forced agreement with the final loop",
    )
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    a = advanced(p)
    a.add_argument("--l2", type=float, default=1e-3, help="L2 penalty on the standardised weights")
    a.add_argument(
        "--features",
        choices=["hidden", "confidence"],
        default="hidden",
        help="hidden: final-normed hidden state + cosine, decides without the LM head; confidence: "
        "top-5 probabilities, margin, entropy, logit gap, cosine, needs the head on every row "
        "but ranks tokens better",
    )
    p.set_defaults(func=cmd_fit_exit_probe)

    p = sub.add_parser("generate", help="generate text with the serving engine", formatter_class=HelpFormatter)
    add_model(p, "embedded name or saved model directory")
    p.add_argument("prompt", nargs="+", help="one or more prompts, generated as one batch")
    p.add_argument("--max-new-tokens", type=int, default=32, metavar="N", help="generated tokens per prompt at most")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0: greedy)")
    p.add_argument(
        "--top-p",
        type=float,
        default=1.0,
        help="nucleus sampling: the smallest set of tokens whose probabilities reach this sum",
    )
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0: all)")
    p.add_argument("--seed", type=int, default=None, help="seed of sampling (default: a random one)")
    p.add_argument("--exit-policy", default="none", help=EXIT_POLICY_HELP)
    add_speculate(p)
    _engine_args(p, converts_at_load=False)
    p.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object instead of text: per prompt the token ids and the loop each left at; tokens/s; "
        "with --speculate the acceptance rate and mean accepted length",
    )
    a = advanced(p)
    a.add_argument("--scheduler", default="depth", choices=["static", "sequence", "depth"], help=SCHEDULER_HELP)
    a.add_argument("--kv-mode", default="copy", choices=["copy", "later"], help=KV_MODE_HELP)
    add_renamed(p, "--max-tokens", "--max-new-tokens")
    add_renamed(p, "--exit", "--exit-policy")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser(
        "serve", help="OpenAI-compatible HTTP server on the depth-wise engine", formatter_class=HelpFormatter
    )
    add_model(p, "embedded model name or a saved model directory")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="port to listen on")
    p.add_argument("--max-concurrency", type=int, default=8, help="requests served at once (KV cache rows)")
    p.add_argument("--max-queue", type=int, default=64, help="requests waiting beyond the slots; more get 429")
    p.add_argument("--max-seq-len", type=int, default=1024, help="context per request (prompt + max_tokens - 1)")
    p.add_argument(
        "--exit-policy", default="none", help=EXIT_POLICY_HELP + "; for every request unless it asks for full depth"
    )
    p.add_argument("--device", default=None, help="torch device (default: where the model loads)")
    add_speculate(p)
    _engine_args(p)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    a = advanced(p)
    a.add_argument("--served-model-name", default=None, help="the id clients send as `model` (default: MODEL)")
    a.add_argument("--scheduler", default="depth", choices=["static", "sequence", "depth"], help=SCHEDULER_HELP)
    a.add_argument("--kv-mode", default="copy", choices=["copy", "later"], help=KV_MODE_HELP)
    a.add_argument(
        "--loops",
        type=int,
        default=0,
        help="convert MODEL to B loops at load (0: serve as saved); "
        "such a model was never healed, so this needs --allow-unhealed",
    )
    a.add_argument(
        "--init", default="stepwise", choices=[i for i in INITS if i != "aware"], help="init when converting at load"
    )
    a.add_argument("--lora-rank", default="64", help="LoRA rank when converting at load (0 = recursive)")
    a.add_argument(
        "--shutdown-timeout",
        type=float,
        default=10.0,
        help="seconds in-flight requests may finish after SIGINT/SIGTERM before they are failed",
    )
    a.add_argument(
        "--max-body-bytes",
        type=int,
        default=None,
        help="largest request body accepted, in bytes (default: 1 MiB); a larger one gets 413 (request_too_large)",
    )
    a.add_argument(
        "--log-level",
        default="warning",
        choices=["critical", "error", "warning", "info", "debug", "trace"],
        help="uvicorn's log level",
    )
    p.set_defaults(func=cmd_serve)


SCHEDULER_HELP = (
    "static (a batch runs to its end), sequence (continuous batching of whole tokens) or depth "
    "(continuous batching of (token, loop) items: exits free their slot at once)"
)
KV_MODE_HELP = (
    "KV of the loops an exited token skips: copy (its exit state projected through the skipped depths) "
    "or later (it runs them beside its successor: exact, slower at small batches)"
)


def add_allow_unhealed(p) -> None:
    """The flag that lets a command serve a model converted at load (see on_the_fly.convert_unhealed)."""
    p.add_argument(
        "--allow-unhealed",
        action="store_true",
        help="serve a model converted at load although no "
        "healing has touched it (its output is poor: for tests and timing only)",
    )


def cmd_serve(args) -> int:
    from .exits import parse_policy

    body_ok = args.max_body_bytes is None or args.max_body_bytes >= 1
    if args.max_concurrency < 1 or args.max_queue < 0 or args.max_seq_len < 2 or not body_ok:
        raise UsageError("need --max-concurrency >= 1, --max-queue >= 0, --max-seq-len >= 2 and --max-body-bytes >= 1")
    policy = parse_policy(args.exit_policy)  # a bad policy is a usage error before the model loads
    if policy.kind == "oracle":
        raise UsageError(
            "the oracle policy is for analysis (it never exits); use softmax, margin, entropy, cosine, probe or none"
        )
    check_engine_args(args, args.device or "cpu")
    check_speculate_args(args)
    if args.speculate != "off":  # speculative rounds are the serving schedule (schedulers.SpeculativeScheduler)
        args.scheduler = f"speculative:{args.speculate}"
    from .on_the_fly import check_unhealed

    check_unhealed(args.model, args.loops, args.allow_unhealed)
    from .server import main

    return main(args)


def cmd_fit_exit_probe(args) -> int:
    import json
    import sys
    from pathlib import Path

    import numpy as np
    import torch

    from ..data.corpus import PackedCorpus
    from ..models import load_model
    from ..models.loading import is_looplm_dir, tokenizer_fingerprint
    from .probe import fit_probe

    if args.threads:
        torch.set_num_threads(args.threads)
    d = Path(args.model)
    if not (d.is_dir() and is_looplm_dir(d)):
        raise UsageError(
            f"{d} is not a saved looplm model directory; the probe is written beside its weights "
            f"(save one with `looplm convert` or `looplm train`)"
        )
    if args.fit_rows < 1 or args.calib_rows < 1 or not 0 < args.target_agreement <= 1:
        raise UsageError("need --fit-rows >= 1, --calib-rows >= 1 and 0 < --target-agreement <= 1")
    corpus = PackedCorpus(args.data)
    model, tok = load_model(d)
    if model.config.num_loops < 2:
        raise UsageError(f"{d} has B = 1 loop: there is no early exit to fit a probe for")
    if tok is not None and tokenizer_fingerprint(tok) != corpus.tokenizer:
        raise UsageError(
            f"corpus {args.data} was tokenised with another tokenizer than {d}; build one with "
            f"`looplm data build {d} --out DIR`"
        )
    train = corpus.splits["train"]
    n = args.fit_rows + args.calib_rows
    if len(train) < n:
        raise UsageError(f"the corpus has {len(train)} training rows; lower --fit-rows/--calib-rows to at most that")
    picks = np.linspace(0, len(train) - 1, n).round().astype(int)  # spread over every source
    rows = [train[i].astype(np.int64).tolist() for i in picks]
    calib_at = set(np.linspace(0, n - 1, args.calib_rows).round().astype(int).tolist())  # interleaved with fit rows
    fit_rows = [r for i, r in enumerate(rows) if i not in calib_at]
    calib_rows = [r for i, r in enumerate(rows) if i in calib_at]
    log = (lambda *a: print(*a, file=sys.stderr, flush=True)) if args.json else print
    probe, report = fit_probe(
        model, fit_rows, calib_rows, args.target_agreement, args.l2, log=log, features=args.features
    )
    path = probe.save(d)
    report = {"model": str(d), "data": args.data, "probe": str(path), **report}
    (d / "eval").mkdir(exist_ok=True)
    (d / "eval" / "exit_probe.json").write_text(json.dumps(report, indent=2))
    if args.json:
        print_json(report)
    else:
        at = report["calib_at_threshold"]
        print(
            f"wrote {path}: threshold {probe.threshold} (calibration rows: {at['early_exit_fraction']:.1%} of "
            f"tokens leave early at {at['agreement']:.3f} agreement with the final loop); use it with "
            f"--exit-policy probe (or probe:THRESHOLD)"
        )
    return 0


def speculation_figures(counts) -> dict:
    """Acceptance rate (accepted / drafted tokens) and mean accepted length (tokens committed per verification,
    the verifier's own token included) from an engine's stats or a request's speculation state."""
    get = counts.get if isinstance(counts, dict) else lambda k: getattr(counts, k.removeprefix("spec_"))
    drafted, accepted, rounds, tokens = (get(f"spec_{k}") for k in ("drafted", "accepted", "rounds", "tokens"))
    return {
        "drafted": drafted,
        "accepted": accepted,
        "verifications": rounds,
        "acceptance_rate": round(accepted / drafted, 4) if drafted else None,
        "mean_accepted_length": round(tokens / rounds, 3) if rounds else None,
    }


def cmd_generate(args) -> int:
    from ..models import load_model
    from ..models.quantized import load_dtype, prepare
    from .engine import Engine, Request
    from .exits import parse_policy
    from .sampling import SamplingParams
    from .schedulers import make_scheduler, replay, warm_up

    check_engine_args(args)
    check_speculate_args(args)
    model, tok = load_model(args.model, dtype=load_dtype(args.weights))
    model = prepare(model, args.weights, lora=args.lora)
    sp = SamplingParams(args.temperature, args.top_p, args.top_k, args.seed)
    reqs = [
        Request(
            tok(p, add_special_tokens=bool(model.config.add_bos_token))["input_ids"],
            args.max_new_tokens,
            sp,
            eos_token_id=tok.eos_token_id,
        )
        for p in args.prompt
    ]
    need = max(len(r.prompt) for r in reqs) + args.max_new_tokens
    engine = Engine(
        model,
        max_batch=max(1, min(len(reqs), 16)),
        max_seq_len=max(need, 64),
        exit_policy=parse_policy(args.exit_policy),
        kv_mode=args.kv_mode,
        compile=args.compile,
        speculate=args.speculate,
    )
    warm_up(engine)
    res = replay(make_scheduler(args.scheduler, engine), reqs)
    out = [
        {
            "prompt": p,
            "status": r.status,
            "error": r.error,
            "text": tok.decode(r.output),
            "tokens": len(r.output),
            "token_ids": r.output,
            "exit_loops": r.exit_loops,
            **({"speculation": speculation_figures(r.spec)} if r.spec is not None else {}),
        }
        for p, r in zip(args.prompt, reqs)
    ]
    if args.json:
        total = sum(len(r.output) for r in reqs)
        summary = {"results": out, "seconds": round(res["seconds"], 3)}
        summary["tokens_per_second"] = round(total / res["seconds"], 2) if res["seconds"] > 0 else None
        if args.speculate != "off":
            summary["speculation"] = {"mode": args.speculate, **speculation_figures(engine.stats)}
        print_json(summary)
    else:
        for o in out:
            print(o["prompt"] + (o["text"] if o["status"] == "done" else f"  [error: {o['error']}]"))
    return 0 if all(r.status == "done" for r in reqs) else 1
