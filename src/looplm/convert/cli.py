"""Conversion subcommands: convert, unroll, info, quantize, export-gguf."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..cli_args import HelpFormatter, add_model, add_renamed, advanced, renamed_choices
from ..data import sample_text
from ..errors import UsageError
from ..models.plan import SHARING_STRATEGIES
from ..util import Timer, print_json, read_text_arg
from .recursive import INITS, LORA_INITS, NORMS


def register(sub) -> None:
    p = sub.add_parser(
        "convert",
        help="convert a pretrained model into a (Relaxed) Recursive Transformer",
        formatter_class=HelpFormatter,
    )
    add_model(p, "embedded name, HF/looplm directory or .gguf file", default="smollm2-135m")
    p.add_argument("--loops", type=int, default=2, help="B, the number of loops of the core")
    p.add_argument(
        "--lora-rank",
        default=None,
        help="rank of every per-depth LoRA (0 = plain recursive, 'full'; default: the largest rank that keeps N-emb "
        "at most the paper's cycle plan's at rank 64, 56 for SmolLM2-135M middle-cycle; 0 with --relax prefix)",
    )
    p.add_argument(
        "--out",
        default=None,
        help="output directory (default: out/<model>-b<loops>[-<sharing>]-r<rank>, the default plan unnamed)",
    )
    p.add_argument(
        "--calib-data",
        action="append",
        default=[],
        metavar="DIR",
        help="calibration data for the data-aware init: a corpus from `looplm data build` (its first "
        "training rows) or a directory of training-split .txt files (repeatable; default: a text "
        "the package ships, rows of the default corpus's training split)",
    )
    p.add_argument(
        "--calib-text",
        action="append",
        default=[],
        metavar="FILE",
        help="a training-split text file to calibrate on (repeatable; never held-out text; default: none)",
    )
    p.add_argument("--calib-tokens", type=int, default=8192, help="calibration tokens run through the original model")
    p.add_argument(
        "--scored-tokens",
        dest="ppl_tokens",
        type=int,
        default=2048,
        metavar="N",
        help="tokens of held-out text scored before and after (0 = skip)",
    )
    p.add_argument("--text", default=None, help="held-out text for that perplexity (default: a Milton sample)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    add_renamed(p, "--ppl-tokens", "--scored-tokens")
    add_renamed(p, "--strategy", "--sharing")
    a = advanced(p, "the defaults are the conversion that heals best")
    a.add_argument(
        "--sharing",
        dest="strategy",
        default=None,
        choices=list(SHARING_STRATEGIES),
        help="the core's pattern: depth d runs shared layer d mod K (cycle), d div B (sequence) or cycle with the "
        "last loop reversed (cycle-rev); middle-cycle and middle-sequence keep the first and the last layer unique "
        "(default: middle-cycle, or cycle where the model's attention pattern leaves no middle-cycle plan)",
    )
    a.add_argument(
        "--prelude",
        type=int,
        default=0,
        metavar="P",
        help="the original's first P layers run once, unique and exact, before the looped core",
    )
    a.add_argument(
        "--coda",
        type=int,
        default=0,
        metavar="C",
        help="the original's last C layers run once, unique and exact, after the looped core (and after every "
        "exit); a remainder of core layers that B does not divide joins them",
    )
    a.add_argument(
        "--init",
        default="average",
        choices=list(INITS),
        help="shared weights from the layers they replace (average, aware: needs calibration) or "
        "from one of them (stepwise, stepwise-start, lower, upper: the core's last K), or random",
    )
    a.add_argument(
        "--lora-init",
        default="aware-svd",
        choices=list(LORA_INITS),
        help="per-depth LoRA: SVD of each depth's residual, weighted by the original's inputs on the "
        "calibration text (aware-svd), unweighted (svd), or zero",
    )
    a.add_argument(
        "--norms",
        default=None,
        choices=list(NORMS),
        help="per-depth norm vectors, or tied ones (default: per-depth with a data-aware init; else "
        "tied-choice for stepwise/lower, which copy one layer, tied-avg for average)",
    )
    a.add_argument(
        "--relax",
        default="lora",
        choices=["lora", "prefix"],
        help="per-depth relaxation: LoRA (section 2.3) or learned prefixes (appendix G)",
    )
    a.add_argument("--lora-ranks", default=None, help="per-group ranks, e.g. q=128,kv=64,out=128,ffn=256")
    a.add_argument(
        "--prefix-length",
        type=int,
        default=None,
        help="with --relax prefix: learned prefix vectors per depth (default 64)",
    )
    a.add_argument("--calib-seq-len", type=int, default=512, help="calibration window length in tokens")
    a.add_argument(
        "--calib-damp",
        type=float,
        default=0.01,
        help="damping of the input statistics, relative to their mean diagonal",
    )
    a.add_argument(
        "--calib-no-fold-norms",
        action="store_true",
        help="do not account for tied norm weights in the data-aware objective",
    )
    a.add_argument("--seed", type=int, default=0, help="seed of the random init and of random LoRA factors")
    p.set_defaults(func=cmd_convert)

    p = sub.add_parser(
        "unroll",
        help="export the equivalent vanilla model: each depth's LoRA merged into dense weights",
        formatter_class=HelpFormatter,
    )
    add_model(p, "a looped model: embedded name or looplm directory")
    p.add_argument("--out", required=True, help="directory of the unrolled model")
    p.set_defaults(func=cmd_unroll)

    p = sub.add_parser(
        "quantize", help="store a model with int8 or int4 weights for CPU serving", formatter_class=HelpFormatter
    )
    add_model(p, "a float model: embedded name or looplm directory")
    p.add_argument("--out", required=True, help="directory of the quantized model")
    p.add_argument(
        "--weights",
        default="int4",
        choices=["int8", "int4"],
        help="int8: one scale per output channel; int4: one scale and minimum per group of inputs",
    )
    p.add_argument(
        "--calib-data",
        metavar="DATA",
        default=None,
        help="round by GPTQ against each linear's inputs on the first rows of this corpus's training "
        "split (`looplm data build`), instead of to nearest",
    )
    p.add_argument(
        "--calib-rows",
        type=int,
        default=16,
        metavar="N",
        help="training rows (x the corpus's sequence length) for --calib-data",
    )
    p.add_argument(
        "--lora",
        default="shared",
        choices=["shared", "merged"],
        help="a relaxed model's LoRA: kept in float on the shared weights, or merged into one quantized "
        "weight per depth (no LoRA matmuls when serving)",
    )
    a = advanced(p)
    a.add_argument(
        "--group-size",
        type=int,
        default=None,
        choices=[32, 64, 128, 256],
        help="int4 group size (default: 32, the most accurate, at about the speed of the larger ones)",
    )
    a.add_argument(
        "--dtype",
        default="fp32",
        choices=["fp32", "bf16"],
        type=renamed_choices("--dtype", {"float32": "fp32", "bfloat16": "bf16"}),
        help="dtype of the float parameters left (LoRA, norms, biases) and of the residual stream",
    )
    a.add_argument(
        "--act-dtype",
        default="bf16",
        choices=["fp32", "bf16"],
        type=renamed_choices("--act-dtype", {"float32": "fp32", "bfloat16": "bf16"}),
        help="activations of the quantized matmuls (bf16: the CPU's fast integer-times-bf16 kernels)",
    )
    a.add_argument(
        "--equalize",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="with --calib-data: before rounding, scale each linear's input channels by the AWQ-style "
        "scales that round it with the least output error, folded into the norms and the rows "
        "that produce them (the model computes the same function; default: on with --calib-data)",
    )
    add_renamed(p, "--calibrate", "--calib-data")
    add_renamed(p, "--calibration-rows", "--calib-rows")
    p.set_defaults(func=cmd_quantize)

    p = sub.add_parser(
        "export-gguf",
        help="write a looped model, unrolled (LoRA merged per depth), as a "
        "llama-architecture GGUF file for llama.cpp and ollama",
        formatter_class=HelpFormatter,
    )
    add_model(p, "embedded name or float looplm directory (Llama/SmolLM2 family)")
    p.add_argument("--out", required=True, help="the .gguf file to write")
    p.add_argument(
        "--weights",
        default="f32",
        choices=["f32", "f16", "q8_0", "q4_1"],
        help="GGUF tensor type of the linear weights (norms stay f32; with q4_1 the embedding is q8_0)",
    )
    add_renamed(p, "--type", "--weights")
    p.set_defaults(func=cmd_export_gguf)

    p = sub.add_parser(
        "info", help="parameter counts (N-emb, total) and the layer map of a model", formatter_class=HelpFormatter
    )
    add_model(p, "embedded name, HF/looplm directory or .gguf file")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.set_defaults(func=cmd_info)


def _ppl(model, tok, text, max_tokens):
    from ..eval.perplexity import perplexity

    return perplexity(model, tok, text, seq_len=512, max_tokens=max_tokens)


def cmd_convert(args) -> int:
    from ..models import load_model, save_model
    from . import convert, count_parameters, parse_lora_ranks

    with Timer() as t_load:
        vanilla, tok = load_model(args.model)
    depth_plan = _plan(args, vanilla.config)
    rank, prefix = _relaxation(args, vanilla, depth_plan)
    ranks = parse_lora_ranks(args.lora_ranks, rank)
    data_aware = args.init == "aware" or (args.lora_init == "aware-svd" and any(ranks.values()))
    if args.norms is None and data_aware:
        args.norms = "per-depth"  # a data-aware init fits each depth; tied norms would undo part of that fit
    text = read_text_arg(args.text) if args.text else sample_text()
    plan = "" if (args.strategy, args.prelude, args.coda) == ("middle-cycle", 0, 0) else f"-{args.strategy}"
    plan += (f"-pre{args.prelude}" if args.prelude else "") + (f"-coda{args.coda}" if args.coda else "")
    name = f"{Path(args.model).name}-b{args.loops}{plan}-r{rank}" + (f"-p{prefix}" if prefix else "")
    out = Path(args.out) if args.out else Path("out") / name
    calibration = _calibration(args, vanilla, tok, text, data_aware)
    with Timer() as t_conv:
        model = convert(
            vanilla,
            loops=args.loops,
            strategy=args.strategy,
            init=args.init,
            norms=args.norms,
            lora_ranks=ranks,
            lora_init=args.lora_init,
            seed=args.seed,
            calibration=calibration,
            prefix_length=prefix,
            prelude=args.prelude,
            coda=args.coda,
        )
    for group, (asked, used) in model.config.conversion.get("capped_ranks", {}).items():
        print(
            f"looplm convert: note: LoRA rank {asked} for group {group} is capped at {used}, the min(in, out) "
            f"of its linears (a higher rank adds nothing)",
            file=sys.stderr,
        )
    save_model(model, tok, out)
    before, after = count_parameters(vanilla), count_parameters(model)
    result = {
        "out": str(out),
        "load_seconds": round(t_load.seconds, 2),
        "convert_seconds": round(t_conv.seconds, 2),
        "n_emb_before": before["n_emb"],
        "n_emb_after": after["n_emb"],
        "total_before": before["total"],
        "total_after": after["total"],
        "lora_ranks": model.config.lora_ranks,
        "prefix_length": prefix,
        "prefix_params": after["prefix"],
    }
    if calibration is not None:
        result["calibration"] = calibration.summary()
    if args.ppl_tokens:
        ppl_before, ppl_after = _ppl(vanilla, tok, text, args.ppl_tokens), _ppl(model, tok, text, args.ppl_tokens)
        result.update(
            ppl_before=ppl_before["perplexity"], ppl_after=ppl_after["perplexity"], ppl_tokens=ppl_after["tokens"]
        )
    if args.json:
        print_json(result)
        return 0
    print(
        f"converted {args.model}: {model.config.plan.describe()}, init {args.init}, "
        f"norms {model.config.conversion['norms']}, "
        f"LoRA {model.config.lora_ranks} ({args.lora_init if model.config.is_relaxed else 'none'})"
        + (f", prefix {prefix} per depth ({after['prefix']:,} parameters)" if prefix else "")
    )
    print(f"N-emb   {before['n_emb']:>13,} -> {after['n_emb']:>13,} ({after['n_emb'] / before['n_emb']:.1%})")
    print(f"total   {before['total']:>13,} -> {after['total']:>13,}")
    print(f"time    load {t_load.seconds:.1f} s, convert {t_conv.seconds:.1f} s")
    if args.ppl_tokens:
        print(
            f"held-out perplexity ({result['ppl_tokens']} tokens): original {result['ppl_before']:.2f}, "
            f"converted {result['ppl_after']:.2f}"
        )
    print(f"wrote {out}")
    return 0


def _plan(args, config):
    """The depth plan asked for; with --sharing left out, middle-cycle, the plan that heals best at the default's
    N-emb (docs/RESULTS.md, "Sharing plans"), where the model's attention pattern lets a shared block keep one
    attention kind; else (Gemma-3's 5:1 sliding/full layers) the paper's cycle, whose blocks keep their depths'
    kinds as they always did. A plan that does not fit is refused here, naming the fix."""
    from ..models.plan import DepthPlan, MixedAttentionError

    def plan(sharing: str) -> DepthPlan:
        return DepthPlan(config.num_hidden_layers, args.loops, sharing, args.prelude, args.coda, config.depth_attention)

    if args.strategy is not None:
        return plan(args.strategy)
    try:
        args.strategy = "middle-cycle"
        return plan(args.strategy)
    except MixedAttentionError:
        args.strategy = "cycle"
        print(
            f"looplm convert: note: the model's attention pattern leaves no middle-cycle plan at --loops "
            f"{args.loops}; using --sharing cycle",
            file=sys.stderr,
        )
        return plan(args.strategy)


def _relaxation(args, vanilla, plan) -> tuple[str, int]:
    """(--lora-rank, --prefix-length) after the defaults of --relax: LoRA at the rank that keeps N-emb at the paper's
    cycle plan's at rank 64 and no prefix, or prefix length 64 and LoRA rank 0 (an explicit --lora-rank adds LoRA
    to the prefixes)."""
    prefix = args.prefix_length
    if prefix is not None and prefix < 0:
        raise UsageError(f"--prefix-length must be >= 0, got {prefix}")
    if args.relax == "lora":
        if prefix:
            raise UsageError("--prefix-length needs --relax prefix")
        if args.lora_rank is not None:
            return args.lora_rank, 0
        from . import equal_nemb_rank

        return str(equal_nemb_rank(vanilla, plan)), 0
    prefix = 64 if prefix is None else prefix
    if prefix < 1:
        raise UsageError(f"--prefix-length must be >= 1 with --relax prefix, got {prefix}")
    return args.lora_rank or "0", prefix


def _calibration(args, vanilla, tok, heldout: str, data_aware: bool):
    """Input statistics of the original model on --calib-text / --calib-data, or on the shipped calibration
    text when the init is data-aware and none is given (None when nothing asks for them)."""
    if not (args.calib_text or args.calib_data or data_aware):
        return None
    from ..data import CALIBRATION_TEXT
    from ..models import ConfigError
    from . import aware

    files = args.calib_text if args.calib_text or args.calib_data else [CALIBRATION_TEXT]
    corpora = [d for d in args.calib_data if (Path(d) / "meta.json").exists()]
    try:
        texts, paths = aware.read_calibration_texts(files, [d for d in args.calib_data if d not in corpora])
    except ConfigError as e:
        raise UsageError(str(e)) from None
    for d in corpora:
        texts.append(_corpus_text(d, args.calib_tokens))
        paths.append(d)
    if aware.shares_text(texts, heldout) or aware.shares_text(texts, sample_text()):
        raise UsageError(
            "the calibration text contains held-out text (the --text file or the built-in Milton "
            "sample): calibrate on a training split only"
        )
    if args.norms != "per-depth" and (vanilla.config.sandwich_norms or vanilla.config.qk_norm):
        # Measured on Gemma-3-270M at B=3, rank 64: aware-svd 2.5e16 with tied-avg norms, 1,286 per-depth.
        print(
            "looplm convert: warning: this model's post-attention/post-FFN or q/k norms sit after a linear and "
            "cannot be folded into the data-aware LoRA, so tied norms undo it; use --norms per-depth",
            file=sys.stderr,
        )
    windows = aware.text_windows(
        tok, texts, args.calib_seq_len, args.calib_tokens, add_bos=bool(getattr(vanilla.config, "add_bos_token", False))
    )
    source = paths[0] if len(paths) == 1 else f"{len(paths)} files"
    return aware.collect_calibration(
        vanilla, windows, damp=args.calib_damp, fold_norms=not args.calib_no_fold_norms, source=source
    )


def _corpus_text(corpus_dir: str, tokens: int) -> str:
    """The first training rows of a built corpus, decoded: at least ``tokens`` tokens of calibration text."""
    import numpy as np

    from ..data.corpus import PackedCorpus, load_tokenizer

    corpus = PackedCorpus(corpus_dir)
    train = corpus.splits["train"]
    rows = min(len(train), -(-tokens // corpus.meta["seq_len"]) + 1)
    tok = load_tokenizer(corpus.meta["model"])
    return "\n\n".join(tok.decode(np.asarray(train[i]).tolist(), skip_special_tokens=True) for i in range(rows))


def cmd_info(args) -> int:
    from ..models import load_model
    from . import describe

    model, _ = load_model(args.model)
    info = describe(model)
    if args.json:
        print_json(info)
        return 0
    print(
        f"{args.model}: {info['family']}, depth {info['depth']} = {info['plan']}: "
        f"{info['shared_layers']} shared layers x {info['loops']} loops, {info['unique_layers']} unique"
    )
    print(f"N-emb      {info['n_emb']:>13,}   (LoRA {info['lora']:,}, prefixes {info['prefix']:,})")
    print(f"embedding  {info['embedding']:>13,}")
    if info["exit_adapter_spec"]:
        from ..models.exit_adapter import describe_spec

        print(
            f"exit adapter {info['exit_adapter']:>11,}   ({describe_spec(info['exit_adapter_spec'])}; in the "
            f"total, not in N-emb)"
        )
    print(f"total      {info['total']:>13,}")
    print(
        f"LoRA ranks {info['lora_ranks']}, prefix length {info['prefix_length']}, "
        f"per-depth norms: {info['per_depth_vectors']}"
    )
    if info["quantization"]:
        q = info["quantization"]
        print(
            f"weights    {q['format']}"
            + (", each depth's LoRA merged into its own weight (counted in N-emb)" if q.get("lora") == "merged" else "")
        )
    print("layer map  " + " ".join(f"{d}->{k}" for d, k in enumerate(info["layer_map"])))
    return 0


def cmd_unroll(args) -> int:
    from ..models import load_model, save_model
    from . import count_parameters, unroll

    model, tok = load_model(args.model)
    dense = unroll(model)
    save_model(dense, tok, args.out)
    print(
        f"unrolled {args.model} ({model.config.num_loops} loops) into {dense.config.num_hidden_layers} dense layers: "
        f"N-emb {count_parameters(dense)['n_emb']:,}; wrote {args.out}"
    )
    return 0


def cmd_quantize(args) -> int:
    from ..models import load_model
    from ..models.loading import save_quantized
    from ..models.quantized import DEFAULT_GROUP, DTYPES, GROUPS, check_format, stored_format, weight_bytes

    _DTYPE = {"fp32": DTYPES["float32"], "bf16": DTYPES["bfloat16"]}
    group = args.group_size or DEFAULT_GROUP
    if group not in GROUPS:
        raise UsageError(f"--group-size must be one of {', '.join(map(str, GROUPS))}; got {group}")
    check_format(args.weights, "cpu")
    if args.calib_rows <= 0:
        raise UsageError(f"--calib-rows must be positive; got {args.calib_rows}")
    model, tok = load_model(args.model)
    if stored_format(model) != "fp32":
        raise UsageError(f"{args.model} is already quantized ({stored_format(model)}); quantize its float checkpoint")
    if args.equalize and not args.calib_data:
        raise UsageError("--equalize chooses its scales on calibration rows: add --calib-data DATA")
    if args.equalize is None:  # equalized channels, then GPTQ: the rounding that keeps the model closest
        args.equalize = bool(args.calib_data)
    moments = calibration = None
    if args.calib_data:
        moments, calibration = _calibrate(model, tok, args)
    if args.equalize:
        from ..models.equalize import equalize

        print("looplm quantize: choosing each linear's equalization scales", file=sys.stderr, flush=True)
        moments, groups = equalize(model, moments, args.weights, group)
        plain, scaled = sum(g["error_before"] for g in groups), sum(g["error"] for g in groups)
        calibration["equalized"] = {
            "groups": len(groups),
            "scaled": sum(g["alpha"] + g["beta"] > 0 for g in groups),
            "output_error_ratio": scaled / plain if plain else 1.0,
        }
    before = weight_bytes(model)
    save_quantized(
        model,
        tok,
        args.out,
        args.weights,
        group,
        _DTYPE[args.dtype],
        act_dtype=_DTYPE[args.act_dtype],
        lora=args.lora,
        moments=moments,
        calibration=calibration,
        progress=moments is not None,
    )
    from ..models.checkpoint import WEIGHTS

    size = (Path(args.out) / WEIGHTS).stat().st_size
    print(
        f"quantized {args.model} to {args.weights}"
        + (f" (groups of {group})" if args.weights == "int4" else "")
        + (", LoRA merged per depth" if args.lora == "merged" else "")
        + (f", GPTQ on {calibration['tokens']:,} calibration tokens" if calibration else "")
        + (
            f", input channels equalized (rounding's output error "
            f"x{calibration['equalized']['output_error_ratio']:.3f})"
            if args.equalize
            else ""
        )
        + f": {before / 2**20:.0f} MB of float weights -> {size / 2**20:.0f} MB; wrote {args.out}"
    )
    return 0


def _calibrate(model, tok, args) -> tuple[dict, dict]:
    """GPTQ's input moments from the first ``--calib-rows`` rows of the corpus's training split."""
    import numpy as np
    import torch

    from ..data.corpus import PackedCorpus
    from ..models.gptq import input_moments
    from ..models.loading import tokenizer_fingerprint

    corpus = PackedCorpus(args.calib_data)
    if tok is None or tokenizer_fingerprint(tok) != corpus.tokenizer:
        raise UsageError(
            f"the corpus {args.calib_data} was tokenised with another tokenizer ({corpus.meta['model']}) "
            f"than {args.model}'s; rebuild it with `looplm data build {args.model} --out DIR`"
        )
    train = corpus.splits["train"]
    rows = torch.from_numpy(np.array(train[: args.calib_rows], dtype=np.int64))
    print(
        f"looplm quantize: running {rows.numel():,} calibration tokens through {args.model}",
        file=sys.stderr,
        flush=True,
    )
    moments = input_moments(model.float(), rows)
    return moments, {"data": str(args.calib_data), "split": "train", "rows": len(rows), "tokens": rows.numel()}


def cmd_export_gguf(args) -> int:
    from ..models import load_model
    from ..models.quantized import stored_format
    from .gguf_export import export_gguf, source_pre

    if not args.out.endswith(".gguf"):
        raise UsageError(f"--out must name a .gguf file; got {args.out!r}")
    model, tok = load_model(args.model)
    if stored_format(model) != "fp32":
        raise UsageError(f"{args.model} holds {stored_format(model)} weights; export its float checkpoint")
    info = export_gguf(model, tok, args.out, args.weights, pre=source_pre(model.config))
    print(
        f"wrote {args.out}: {info['layers']} llama layers ({info['loops']} loops unrolled), {args.weights}, "
        f"{info['bytes'] / 2**20:.0f} MB"
    )
    return 0
