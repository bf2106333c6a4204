"""Conversion subcommands: convert, unroll, info, quantize, export-gguf."""

from __future__ import annotations

import sys
from pathlib import Path

from ..data import sample_text
from ..errors import UsageError
from ..util import Timer, print_json, read_text_arg

def register(sub) -> None:
    p = sub.add_parser("convert", help="convert a pretrained model into a (Relaxed) Recursive Transformer")
    p.add_argument("--model", default="smollm2-135m", help="embedded name, HF/looplm directory or .gguf file")
    p.add_argument("--loops", type=int, default=2, help="B, the number of loops (must divide the layer count)")
    p.add_argument("--strategy", default="cycle", choices=["cycle", "sequence", "cycle-rev"])
    p.add_argument("--init", default="average",
                   help="stepwise | stepwise-start | average | lower | random | aware (needs --calib-text/-data)")
    p.add_argument("--norms", default=None,
                   help="tied-avg | tied-choice | tied-zero | per-depth (default: follows --init: tied-choice "
                        "for stepwise/lower, which copy one layer, tied-avg for average/aware)")
    p.add_argument("--relax", default="lora", choices=["lora", "prefix"],
                   help="per-depth relaxation: LoRA (section 2.3) or learned prefixes (appendix G)")
    p.add_argument("--lora-rank", default=None,
                   help="rank of every per-depth LoRA (0 = plain recursive, 'full'; default 64, 0 with --relax prefix)")
    p.add_argument("--lora-ranks", default=None, help="per-group ranks, e.g. q=128,kv=64,out=128,ffn=256")
    p.add_argument("--lora-init", default="svd", help="svd | zero | aware-svd (needs --calib-text/--calib-data)")
    p.add_argument("--prefix-length", type=int, default=None,
                   help="with --relax prefix: learned prefix vectors per depth (default 64)")
    p.add_argument("--out", default=None, help="output directory (default: out/<model>-b<loops>-r<rank>)")
    p.add_argument("--text", default=None, help="held-out text for the before/after perplexity")
    p.add_argument("--ppl-tokens", type=int, default=2048, help="tokens of held-out text to score (0 = skip)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--calib-text", action="append", default=[], metavar="FILE",
                   help="training-split text for --init aware / --lora-init aware-svd (repeatable; never held-out)")
    p.add_argument("--calib-data", action="append", default=[], metavar="DIR",
                   help="directory of training-split .txt files for calibration (repeatable)")
    p.add_argument("--calib-tokens", type=int, default=16384, help="calibration tokens run through the original model")
    p.add_argument("--calib-seq-len", type=int, default=512, help="calibration window length in tokens")
    p.add_argument("--calib-damp", type=float, default=0.01,
                   help="damping of the input statistics, relative to their mean diagonal (docs/AWARE.md)")
    p.add_argument("--calib-no-fold-norms", action="store_true",
                   help="do not account for tied norm weights in the data-aware objective")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.set_defaults(func=cmd_convert)

    p = sub.add_parser("unroll", help="export the equivalent vanilla model: each depth's LoRA merged into dense weights")
    p.add_argument("model")
    p.add_argument("--out", required=True)
    p.set_defaults(func=cmd_unroll)

    p = sub.add_parser("quantize", help="store a model with int8 or int4 weights for CPU serving (docs/SERVING.md)")
    p.add_argument("model", help="a float model: embedded name or looplm directory")
    p.add_argument("--out", required=True)
    p.add_argument("--weights", default="int4", choices=["int8", "int4"])
    p.add_argument("--group-size", type=int, default=None, help="int4 group size: 32, 64, 128 or 256 "
                   "(default: 32, measured in docs/BENCHMARKS.md)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="dtype of the float parameters left (LoRA, norms, biases) and of the residual stream")
    p.add_argument("--act-dtype", default="bfloat16", choices=["float32", "bfloat16"],
                   help="activations of the quantized matmuls (float32 ran 10-60x slower on this CPU)")
    p.add_argument("--lora", default="shared", choices=["shared", "merged"],
                   help="a relaxed model's LoRA: kept in float on the shared weights, or merged into one quantized "
                        "weight per depth (docs/SERVING.md)")
    p.add_argument("--calibrate", metavar="DATA", default=None,
                   help="round by GPTQ against each linear's inputs on the first rows of this corpus's training "
                        "split (`looplm data build`), instead of to nearest (docs/SERVING.md)")
    p.add_argument("--calibration-rows", type=int, default=16,
                   help="training rows (x the corpus's sequence length) for --calibrate")
    p.add_argument("--equalize", action="store_true",
                   help="with --calibrate: before rounding, scale each linear's input channels by the AWQ-style "
                        "scales that round it with the least output error, folded into the norms and the rows "
                        "that produce them (models/equalize.py; the model computes the same function)")
    p.set_defaults(func=cmd_quantize)

    p = sub.add_parser("export-gguf", help="write a looped model, unrolled (LoRA merged per depth), as a "
                       "llama-architecture GGUF file for llama.cpp and ollama")
    p.add_argument("model", help="embedded name or float looplm directory (Llama/SmolLM2 family)")
    p.add_argument("--out", required=True, help="the .gguf file to write")
    p.add_argument("--type", default="f32", choices=["f32", "f16", "q8_0", "q4_1"], help="tensor type of the "
                   "linear weights (norms stay f32; with q4_1 the embedding is q8_0)")
    p.set_defaults(func=cmd_export_gguf)

    p = sub.add_parser("info", help="parameter counts (N-emb, total) and the layer map of a model")
    p.add_argument("model")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_info)


def _ppl(model, tok, text, max_tokens):
    from ..eval.perplexity import perplexity
    return perplexity(model, tok, text, seq_len=512, max_tokens=max_tokens)


def cmd_convert(args) -> int:
    from . import convert, count_parameters, parse_lora_ranks
    from ..models import load_model, save_model

    rank, prefix = _relaxation(args)
    ranks = parse_lora_ranks(args.lora_ranks, rank)
    text = read_text_arg(args.text) if args.text else sample_text()
    name = f"{Path(args.model).name}-b{args.loops}-r{rank}" + (f"-p{prefix}" if prefix else "")
    out = Path(args.out) if args.out else Path("out") / name
    with Timer() as t_load:
        vanilla, tok = load_model(args.model)
    calibration = _calibration(args, vanilla, tok, text)
    with Timer() as t_conv:
        model = convert(vanilla, loops=args.loops, strategy=args.strategy, init=args.init, norms=args.norms,
                        lora_ranks=ranks, lora_init=args.lora_init, seed=args.seed, calibration=calibration,
                        prefix_length=prefix)
    for group, (asked, used) in model.config.conversion.get("capped_ranks", {}).items():
        print(f"looplm convert: note: LoRA rank {asked} for group {group} is capped at {used}, the min(in, out) "
              f"of its linears (a higher rank adds nothing)", file=sys.stderr)
    save_model(model, tok, out)
    before, after = count_parameters(vanilla), count_parameters(model)
    result = {"out": str(out), "load_seconds": round(t_load.seconds, 2), "convert_seconds": round(t_conv.seconds, 2),
              "n_emb_before": before["n_emb"], "n_emb_after": after["n_emb"],
              "total_before": before["total"], "total_after": after["total"], "lora_ranks": model.config.lora_ranks,
              "prefix_length": prefix, "prefix_params": after["prefix"]}
    if calibration is not None:
        result["calibration"] = calibration.summary()
    if args.ppl_tokens:
        ppl_before, ppl_after = _ppl(vanilla, tok, text, args.ppl_tokens), _ppl(model, tok, text, args.ppl_tokens)
        result.update(ppl_before=ppl_before["perplexity"], ppl_after=ppl_after["perplexity"],
                      ppl_tokens=ppl_after["tokens"])
    if args.json:
        print_json(result)
        return 0
    print(f"converted {args.model}: B={args.loops} {args.strategy}, init {args.init}, "
          f"norms {model.config.conversion['norms']}, "
          f"LoRA {model.config.lora_ranks} ({args.lora_init if model.config.is_relaxed else 'none'})"
          + (f", prefix {prefix} per depth ({after['prefix']:,} parameters)" if prefix else ""))
    print(f"N-emb   {before['n_emb']:>13,} -> {after['n_emb']:>13,} ({after['n_emb'] / before['n_emb']:.1%})")
    print(f"total   {before['total']:>13,} -> {after['total']:>13,}")
    print(f"time    load {t_load.seconds:.1f} s, convert {t_conv.seconds:.1f} s")
    if args.ppl_tokens:
        print(f"held-out perplexity ({result['ppl_tokens']} tokens): original {result['ppl_before']:.2f}, "
              f"converted {result['ppl_after']:.2f}")
    print(f"wrote {out}")
    return 0


def _relaxation(args) -> tuple[str, int]:
    """(--lora-rank, --prefix-length) after the defaults of --relax: LoRA rank 64 and no prefix, or
    prefix length 64 and LoRA rank 0 (an explicit --lora-rank adds LoRA to the prefixes)."""
    prefix = args.prefix_length
    if prefix is not None and prefix < 0:
        raise UsageError(f"--prefix-length must be >= 0, got {prefix}")
    if args.relax == "lora":
        if prefix:
            raise UsageError("--prefix-length needs --relax prefix")
        return args.lora_rank or "64", 0
    prefix = 64 if prefix is None else prefix
    if prefix < 1:
        raise UsageError(f"--prefix-length must be >= 1 with --relax prefix, got {prefix}")
    return args.lora_rank or "0", prefix


def _calibration(args, vanilla, tok, heldout: str):
    """Input statistics of the original model on --calib-text / --calib-data (None without them)."""
    if not (args.calib_text or args.calib_data):
        return None
    from . import aware
    from ..models import ConfigError
    try:
        texts, paths = aware.read_calibration_texts(args.calib_text, args.calib_data)
    except ConfigError as e:
        raise UsageError(str(e)) from None
    if aware.shares_text(texts, heldout) or aware.shares_text(texts, sample_text()):
        raise UsageError("the calibration text contains held-out text (the --text file or the built-in Milton "
                         "sample): calibrate on a training split only")
    if args.norms != "per-depth" and (vanilla.config.sandwich_norms or vanilla.config.qk_norm):
        # Measured on Gemma-3-270M at B=3, rank 64: aware-svd 2.5e16 with tied-avg norms, 1,286 per-depth.
        print("looplm convert: warning: this model's post-attention/post-FFN or q/k norms sit after a linear and "
              "cannot be folded into the data-aware LoRA, so tied norms undo it; use --norms per-depth "
              "(docs/AWARE.md)", file=sys.stderr)
    windows = aware.text_windows(tok, texts, args.calib_seq_len, args.calib_tokens,
                                 add_bos=bool(getattr(vanilla.config, "add_bos_token", False)))
    source = paths[0] if len(paths) == 1 else f"{len(paths)} files"
    return aware.collect_calibration(vanilla, windows, damp=args.calib_damp,
                                     fold_norms=not args.calib_no_fold_norms, source=source)


def cmd_info(args) -> int:
    from . import describe
    from ..models import load_model
    model, _ = load_model(args.model)
    info = describe(model)
    if args.json:
        print_json(info)
        return 0
    print(f"{args.model}: {info['family']}, depth {info['depth']} = {info['shared_layers']} shared layers x "
          f"{info['loops']} loops ({info['sharing']})")
    print(f"N-emb      {info['n_emb']:>13,}   (LoRA {info['lora']:,}, prefixes {info['prefix']:,})")
    print(f"embedding  {info['embedding']:>13,}")
    if info["exit_adapter_spec"]:
        from ..models.exit_adapter import describe_spec
        print(f"exit adapter {info['exit_adapter']:>11,}   ({describe_spec(info['exit_adapter_spec'])}; in the "
              f"total, not in N-emb)")
    print(f"total      {info['total']:>13,}")
    print(f"LoRA ranks {info['lora_ranks']}, prefix length {info['prefix_length']}, "
          f"per-depth norms: {info['per_depth_vectors']}")
    if info["quantization"]:
        q = info["quantization"]
        print(f"weights    {q['format']}" + (", each depth's LoRA merged into its own weight (counted in N-emb)"
                                            if q.get("lora") == "merged" else ""))
    print("layer map  " + " ".join(f"{d}->{k}" for d, k in enumerate(info["layer_map"])))
    return 0


def cmd_unroll(args) -> int:
    from . import count_parameters, unroll
    from ..models import load_model, save_model
    model, tok = load_model(args.model)
    dense = unroll(model)
    save_model(dense, tok, args.out)
    print(f"unrolled {args.model} ({model.config.num_loops} loops) into {dense.config.num_hidden_layers} dense layers: "
          f"N-emb {count_parameters(dense)['n_emb']:,}; wrote {args.out}")
    return 0


def cmd_quantize(args) -> int:
    from ..models import load_model
    from ..models.loading import save_quantized
    from ..models.quantized import DEFAULT_GROUP, DTYPES, GROUPS, check_format, stored_format, weight_bytes
    group = args.group_size or DEFAULT_GROUP
    if group not in GROUPS:
        raise UsageError(f"--group-size must be one of {', '.join(map(str, GROUPS))}; got {group}")
    check_format(args.weights, "cpu")
    if args.calibration_rows <= 0:
        raise UsageError(f"--calibration-rows must be positive; got {args.calibration_rows}")
    model, tok = load_model(args.model)
    if stored_format(model) != "fp32":
        raise UsageError(f"{args.model} is already quantized ({stored_format(model)}); quantize its float checkpoint")
    if args.equalize and not args.calibrate:
        raise UsageError("--equalize chooses its scales on calibration rows: add --calibrate DATA")
    moments = calibration = None
    if args.calibrate:
        moments, calibration = _calibrate(model, tok, args)
    if args.equalize:
        from ..models.equalize import equalize
        moments, groups = equalize(model, moments, args.weights, group)
        plain, scaled = sum(g["error_before"] for g in groups), sum(g["error"] for g in groups)
        calibration["equalized"] = {"groups": len(groups), "scaled": sum(g["alpha"] + g["beta"] > 0 for g in groups),
                                    "output_error_ratio": scaled / plain if plain else 1.0}
    before = weight_bytes(model)
    save_quantized(model, tok, args.out, args.weights, group, DTYPES[args.dtype], act_dtype=DTYPES[args.act_dtype],
                   lora=args.lora, moments=moments, calibration=calibration)
    from ..models.checkpoint import WEIGHTS
    size = (Path(args.out) / WEIGHTS).stat().st_size
    print(f"quantized {args.model} to {args.weights}" + (f" (groups of {group})" if args.weights == "int4" else "")
          + (", LoRA merged per depth" if args.lora == "merged" else "")
          + (f", GPTQ on {calibration['tokens']:,} calibration tokens" if calibration else "")
          + (f", input channels equalized (rounding's output error x{calibration['equalized']['output_error_ratio']:.3f})"
             if args.equalize else "")
          + f": {before / 2 ** 20:.0f} MB of float weights -> {size / 2 ** 20:.0f} MB; wrote {args.out}")
    return 0


def _calibrate(model, tok, args) -> tuple[dict, dict]:
    """GPTQ's input moments from the first ``--calibration-rows`` rows of the corpus's training split."""
    import numpy as np
    import torch

    from ..data.corpus import PackedCorpus
    from ..models.gptq import input_moments
    from ..models.loading import tokenizer_fingerprint
    corpus = PackedCorpus(args.calibrate)
    if tok is None or tokenizer_fingerprint(tok) != corpus.tokenizer:
        raise UsageError(f"the corpus {args.calibrate} was tokenised with another tokenizer ({corpus.meta['model']}) "
                         f"than {args.model}'s; rebuild it with `looplm data build --model {args.model}`")
    train = corpus.splits["train"]
    rows = torch.from_numpy(np.array(train[:args.calibration_rows], dtype=np.int64))
    moments = input_moments(model.float(), rows)
    return moments, {"data": str(args.calibrate), "split": "train", "rows": len(rows), "tokens": rows.numel()}


def cmd_export_gguf(args) -> int:
    from ..models import load_model
    from ..models.quantized import stored_format
    from .gguf_export import export_gguf, source_pre
    if not args.out.endswith(".gguf"):
        raise UsageError(f"--out must name a .gguf file; got {args.out!r}")
    model, tok = load_model(args.model)
    if stored_format(model) != "fp32":
        raise UsageError(f"{args.model} holds {stored_format(model)} weights; export its float checkpoint")
    info = export_gguf(model, tok, args.out, args.type, pre=source_pre(model.config))
    print(f"wrote {args.out}: {info['layers']} llama layers ({info['loops']} loops unrolled), {args.type}, "
          f"{info['bytes'] / 2 ** 20:.0f} MB")
    return 0
