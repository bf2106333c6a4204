"""`looplm convert`, `unroll`, `quantize`, `export-gguf` and `info`."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from ..convert.recursive import INITS, LORA_INITS, NORMS
from ..data import sample_text
from ..errors import UsageError
from ..models.plan import SHARING_STRATEGIES
from ..settings import setting
from ..util import Timer, print_json, read_text_arg
from . import Command
from .args import write_settings

JSON_HELP = "print one JSON object instead of text"
BEST = "the defaults are the conversion that heals best"


@dataclass
class Convert:
    model: str = setting("smollm2-135m", "embedded name, HF/looplm directory or .gguf file", positional=True)
    loops: int = setting(2, "B, the number of loops of the core")
    lora_rank: str | None = setting(
        None,
        "rank of every per-depth LoRA (0 = plain recursive, 'full'; default: the largest rank that keeps N-emb at "
        "most the paper's cycle plan's at rank 64, 56 for SmolLM2-135M middle-cycle; 0 with --relax prefix)",
    )
    out: str | None = setting(
        None, "output directory (default: out/<model>-b<loops>[-<sharing>]-r<rank>, the default plan unnamed)"
    )
    calib_data: list[str] = setting(
        [],
        "calibration data for the data-aware init: a corpus from `looplm data build` (its first training rows) or "
        "a directory of training-split .txt files (repeatable; default: a text the package ships, rows of the "
        "default corpus's training split)",
        repeat=True,
        metavar="DIR",
    )
    calib_text: list[str] = setting(
        [],
        "a training-split text file to calibrate on (repeatable; never held-out text; default: none)",
        repeat=True,
        metavar="FILE",
    )
    calib_tokens: int = setting(8192, "calibration tokens run through the original model")
    ppl_tokens: int = setting(
        2048,
        "tokens of held-out text scored before and after (0 = skip)",
        flag="--scored-tokens",
        metavar="N",
        renamed_from=("--ppl-tokens",),
    )
    text: str | None = setting(None, "held-out text for that perplexity (default: a Milton sample)")
    json: bool = setting(False, JSON_HELP)
    strategy: str | None = setting(
        None,
        "the core's pattern: depth d runs shared layer d mod K (cycle), d div B (sequence) or cycle with the last "
        "loop reversed (cycle-rev); middle-cycle and middle-sequence keep the first and the last layer unique "
        "(default: middle-cycle, or cycle where the model's attention pattern leaves no middle-cycle plan)",
        flag="--sharing",
        choices=SHARING_STRATEGIES,
        renamed_from=("--strategy",),
        advanced=BEST,
    )
    prelude: int = setting(
        0,
        "the original's first P layers run once, unique and exact, before the looped core",
        metavar="P",
        advanced=BEST,
    )
    coda: int = setting(
        0,
        "the original's last C layers run once, unique and exact, after the looped core (and after every exit); a "
        "remainder of core layers that B does not divide joins them",
        metavar="C",
        advanced=BEST,
    )
    init: str = setting(
        "average",
        "shared weights from the layers they replace (average, aware: needs calibration) or from one of them "
        "(stepwise, stepwise-start, lower, upper: the core's last K), or random",
        choices=INITS,
        advanced=BEST,
    )
    lora_init: str = setting(
        "aware-svd",
        "per-depth LoRA: SVD of each depth's residual, weighted by the original's inputs on the calibration text "
        "(aware-svd), unweighted (svd), or zero",
        choices=LORA_INITS,
        advanced=BEST,
    )
    norms: str | None = setting(
        None,
        "per-depth norm vectors, or tied ones (default: per-depth with a data-aware init; else tied-choice for "
        "stepwise/lower, which copy one layer, tied-avg for average)",
        choices=NORMS,
        advanced=BEST,
    )
    relax: str = setting(
        "lora",
        "per-depth relaxation: LoRA (section 2.3) or learned prefixes (appendix G)",
        choices=("lora", "prefix"),
        advanced=BEST,
    )
    lora_ranks: str | None = setting(None, "per-group ranks, e.g. q=128,kv=64,out=128,ffn=256", advanced=BEST)
    prefix_length: int | None = setting(
        None, "with --relax prefix: learned prefix vectors per depth (default 64)", advanced=BEST
    )
    calib_seq_len: int = setting(512, "calibration window length in tokens", advanced=BEST)
    calib_damp: float = setting(0.01, "damping of the input statistics, relative to their mean diagonal", advanced=BEST)
    calib_no_fold_norms: bool = setting(
        False, "do not account for tied norm weights in the data-aware objective", advanced=BEST
    )
    seed: int = setting(0, "seed of the random init and of random LoRA factors", advanced=BEST)


@dataclass
class Unroll:
    model: str | None = setting(
        None, "a looped model: embedded name or looplm directory", positional=True, required=True
    )
    out: str | None = setting(None, "directory of the unrolled model", required=True)


@dataclass
class Quantize:
    model: str | None = setting(
        None, "a float model: embedded name or looplm directory", positional=True, required=True
    )
    out: str | None = setting(None, "directory of the quantized model", required=True)
    weights: str = setting(
        "int4",
        "int8: one scale per output channel; int4: one scale and minimum per group of inputs",
        choices=("int8", "int4"),
    )
    calib_data: str | None = setting(
        None,
        "round by GPTQ against each linear's inputs on the first rows of this corpus's training split "
        "(`looplm data build`), instead of to nearest",
        metavar="DATA",
        renamed_from=("--calibrate",),
    )
    calib_rows: int = setting(
        16,
        "training rows (x the corpus's sequence length) for --calib-data",
        metavar="N",
        renamed_from=("--calibration-rows",),
    )
    lora: str = setting(
        "shared",
        "a relaxed model's LoRA: kept in float on the shared weights, or merged into one quantized weight per depth "
        "(no LoRA matmuls when serving)",
        choices=("shared", "merged"),
    )
    group_size: int | None = setting(
        None,
        "int4 group size (default: 32, the most accurate, at about the speed of the larger ones)",
        choices=(32, 64, 128, 256),
        advanced=True,
    )
    dtype: str = setting(
        "fp32",
        "dtype of the float parameters left (LoRA, norms, biases) and of the residual stream",
        choices=("fp32", "bf16"),
        advanced=True,
    )
    act_dtype: str = setting(
        "bf16",
        "activations of the quantized matmuls (bf16: the CPU's fast integer-times-bf16 kernels)",
        choices=("fp32", "bf16"),
        advanced=True,
    )
    equalize: bool | None = setting(
        None,
        "with --calib-data: before rounding, scale each linear's input channels by the AWQ-style scales that round "
        "it with the least output error, folded into the norms and the rows that produce them (the model computes "
        "the same function; default: on with --calib-data)",
        advanced=True,
    )


@dataclass
class ExportGguf:
    model: str | None = setting(
        None, "embedded name or float looplm directory (Llama/SmolLM2 family)", positional=True, required=True
    )
    out: str | None = setting(None, "the .gguf file to write", required=True)
    weights: str = setting(
        "f32",
        "GGUF tensor type of the linear weights (norms stay f32; with q4_1 the embedding is q8_0)",
        choices=("f32", "f16", "q8_0", "q4_1"),
        renamed_from=("--type",),
    )


@dataclass
class Baseline:
    model: str = setting("smollm2-135m", "the vanilla (full-size) model: embedded name or directory", positional=True)
    out: str | None = setting(None, "directory of the baseline model", required=True)
    layers: int | None = setting(
        None, "how many layers to keep (the reduced-size model of a plan's N-emb)", exclusive="depth", metavar="N"
    )
    loops: int | None = setting(
        None, "instead: B of the recursive model it is the baseline of (L / B layers)", exclusive="depth", metavar="B"
    )
    init: str = setting(
        "stepwise",
        "stepwise: the original's Stepwise-selected layers, the first and the last among them, run once; scratch: "
        "fresh weights of that depth",
        choices=("stepwise", "scratch"),
    )
    seed: int = setting(0, "seed of the fresh weights (scratch)")


@dataclass
class Info:
    model: str | None = setting(
        None, "embedded name, HF/looplm directory or .gguf file", positional=True, required=True
    )
    json: bool = setting(False, JSON_HELP)


def _ppl(model, tok, text, max_tokens):
    from ..eval.perplexity import perplexity

    return perplexity(model, tok, text, seq_len=512, max_tokens=max_tokens)


def cmd_convert(s: Convert) -> int:
    from ..convert import convert, count_parameters, parse_lora_ranks
    from ..models import load_model, save_model

    with Timer() as t_load:
        vanilla, tok = load_model(s.model)
    depth_plan = _plan(s, vanilla.config)
    rank, prefix = _relaxation(s, vanilla, depth_plan)
    ranks = parse_lora_ranks(s.lora_ranks, rank)
    data_aware = s.init == "aware" or (s.lora_init == "aware-svd" and any(ranks.values()))
    if s.norms is None and data_aware:
        s.norms = "per-depth"  # a data-aware init fits each depth; tied norms would undo part of that fit
    text = read_text_arg(s.text) if s.text else sample_text()
    plan = "" if (s.strategy, s.prelude, s.coda) == ("middle-cycle", 0, 0) else f"-{s.strategy}"
    plan += (f"-pre{s.prelude}" if s.prelude else "") + (f"-coda{s.coda}" if s.coda else "")
    name = f"{Path(s.model).name}-b{s.loops}{plan}-r{rank}" + (f"-p{prefix}" if prefix else "")
    out = Path(s.out) if s.out else Path("out") / name
    calibration = _calibration(s, vanilla, tok, text, data_aware)
    with Timer() as t_conv:
        model = convert(
            vanilla,
            loops=s.loops,
            strategy=s.strategy,
            init=s.init,
            norms=s.norms,
            lora_ranks=ranks,
            lora_init=s.lora_init,
            seed=s.seed,
            calibration=calibration,
            prefix_length=prefix,
            prelude=s.prelude,
            coda=s.coda,
        )
    for group, (asked, used) in model.config.conversion.get("capped_ranks", {}).items():
        print(
            f"looplm convert: note: LoRA rank {asked} for group {group} is capped at {used}, the min(in, out) "
            f"of its linears (a higher rank adds nothing)",
            file=sys.stderr,
        )
    save_model(model, tok, out)
    write_settings(out, "looplm convert", s)
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
    if s.ppl_tokens:
        ppl_before, ppl_after = _ppl(vanilla, tok, text, s.ppl_tokens), _ppl(model, tok, text, s.ppl_tokens)
        result.update(
            ppl_before=ppl_before["perplexity"], ppl_after=ppl_after["perplexity"], ppl_tokens=ppl_after["tokens"]
        )
    if s.json:
        print_json(result)
    else:
        _print_conversion(s, model.config, result)
    return 0


def _print_conversion(s: Convert, config, r: dict) -> None:
    prefix = r["prefix_length"]
    print(
        f"converted {s.model}: {config.plan.describe()}, init {s.init}, norms {config.conversion['norms']}, "
        f"LoRA {config.lora_ranks} ({s.lora_init if config.is_relaxed else 'none'})"
        + (f", prefix {prefix} per depth ({r['prefix_params']:,} parameters)" if prefix else "")
    )
    print(f"N-emb   {r['n_emb_before']:>13,} -> {r['n_emb_after']:>13,} ({r['n_emb_after'] / r['n_emb_before']:.1%})")
    print(f"total   {r['total_before']:>13,} -> {r['total_after']:>13,}")
    print(f"time    load {r['load_seconds']:.1f} s, convert {r['convert_seconds']:.1f} s")
    if "ppl_tokens" in r:
        print(
            f"held-out perplexity ({r['ppl_tokens']} tokens): original {r['ppl_before']:.2f}, "
            f"converted {r['ppl_after']:.2f}"
        )
    print(f"wrote {r['out']}")


def _plan(s, config):
    """The depth plan asked for; with --sharing left out, middle-cycle, the plan that heals best at the default's
    N-emb (docs/RESULTS.md, "Sharing plans"), where the model's attention pattern lets a shared block keep one
    attention kind; else (Gemma-3's 5:1 sliding/full layers) the paper's cycle, whose blocks keep their depths'
    kinds as they always did. A plan that does not fit is refused here, naming the fix."""
    from ..models.plan import DepthPlan, MixedAttentionError

    def plan(sharing: str) -> DepthPlan:
        return DepthPlan(config.num_hidden_layers, s.loops, sharing, s.prelude, s.coda, config.depth_attention)

    if s.strategy is not None:
        return plan(s.strategy)
    try:
        s.strategy = "middle-cycle"
        return plan(s.strategy)
    except MixedAttentionError:
        s.strategy = "cycle"
        print(
            f"looplm convert: note: the model's attention pattern leaves no middle-cycle plan at --loops "
            f"{s.loops}; using --sharing cycle",
            file=sys.stderr,
        )
        return plan(s.strategy)


def _relaxation(s, vanilla, plan) -> tuple[str, int]:
    """(--lora-rank, --prefix-length) after the defaults of --relax: LoRA at the rank that keeps N-emb at the paper's
    cycle plan's at rank 64 and no prefix, or prefix length 64 and LoRA rank 0 (an explicit --lora-rank adds LoRA
    to the prefixes)."""
    prefix = s.prefix_length
    if prefix is not None and prefix < 0:
        raise UsageError(f"--prefix-length must be >= 0, got {prefix}")
    if s.relax == "lora":
        if prefix:
            raise UsageError("--prefix-length needs --relax prefix")
        if s.lora_rank is not None:
            return s.lora_rank, 0
        from ..convert import equal_nemb_rank

        return str(equal_nemb_rank(vanilla, plan)), 0
    prefix = 64 if prefix is None else prefix
    if prefix < 1:
        raise UsageError(f"--prefix-length must be >= 1 with --relax prefix, got {prefix}")
    return s.lora_rank or "0", prefix


def _calibration(s, vanilla, tok, heldout: str, data_aware: bool):
    """Input statistics of the original model on --calib-text / --calib-data, or on the shipped calibration
    text when the init is data-aware and none is given (None when nothing asks for them)."""
    if not (s.calib_text or s.calib_data or data_aware):
        return None
    from ..convert import aware
    from ..data import CALIBRATION_TEXT
    from ..models import ConfigError

    files = s.calib_text if s.calib_text or s.calib_data else [CALIBRATION_TEXT]
    corpora = [d for d in s.calib_data if (Path(d) / "meta.json").exists()]
    try:
        texts, paths = aware.read_calibration_texts(files, [d for d in s.calib_data if d not in corpora])
    except ConfigError as e:
        raise UsageError(str(e)) from None
    for d in corpora:
        texts.append(_corpus_text(d, s.calib_tokens))
        paths.append(d)
    if aware.shares_text(texts, heldout) or aware.shares_text(texts, sample_text()):
        raise UsageError(
            "the calibration text contains held-out text (the --text file or the built-in Milton "
            "sample): calibrate on a training split only"
        )
    if s.norms != "per-depth" and (vanilla.config.sandwich_norms or vanilla.config.qk_norm):
        # Measured on Gemma-3-270M at B=3, rank 64: aware-svd 2.5e16 with tied-avg norms, 1,286 per-depth.
        print(
            "looplm convert: warning: this model's post-attention/post-FFN or q/k norms sit after a linear and "
            "cannot be folded into the data-aware LoRA, so tied norms undo it; use --norms per-depth",
            file=sys.stderr,
        )
    windows = aware.text_windows(
        tok, texts, s.calib_seq_len, s.calib_tokens, add_bos=bool(getattr(vanilla.config, "add_bos_token", False))
    )
    source = paths[0] if len(paths) == 1 else f"{len(paths)} files"
    return aware.collect_calibration(
        vanilla, windows, damp=s.calib_damp, fold_norms=not s.calib_no_fold_norms, source=source
    )


def _corpus_text(corpus_dir: str, tokens: int) -> str:
    """The first training rows of a built corpus, decoded: at least ``tokens`` tokens of calibration text."""
    from ..data.corpus import PackedCorpus

    corpus = PackedCorpus(corpus_dir)
    return corpus.training_text(range(min(len(corpus.splits["train"]), -(-tokens // corpus.meta["seq_len"]) + 1)))


def cmd_info(s: Info) -> int:
    from ..convert import describe
    from ..models import load_model

    model, _ = load_model(s.model)
    info = describe(model)
    if s.json:
        print_json(info)
        return 0
    print(
        f"{s.model}: {info['family']}, depth {info['depth']} = {info['plan']}: "
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


def cmd_unroll(s: Unroll) -> int:
    from ..convert import count_parameters, unroll
    from ..models import load_model, save_model

    model, tok = load_model(s.model)
    dense = unroll(model)
    save_model(dense, tok, s.out)
    print(
        f"unrolled {s.model} ({model.config.num_loops} loops) into {dense.config.num_hidden_layers} dense layers: "
        f"N-emb {count_parameters(dense)['n_emb']:,}; wrote {s.out}"
    )
    return 0


def cmd_quantize(s: Quantize) -> int:
    from ..models import load_model
    from ..models.loading import save_quantized
    from ..models.quantized import DEFAULT_GROUP, DTYPES, GROUPS, check_format, stored_format, weight_bytes

    _DTYPE = {"fp32": DTYPES["float32"], "bf16": DTYPES["bfloat16"]}
    group = s.group_size or DEFAULT_GROUP
    if group not in GROUPS:
        raise UsageError(f"--group-size must be one of {', '.join(map(str, GROUPS))}; got {group}")
    check_format(s.weights, "cpu")
    if s.calib_rows <= 0:
        raise UsageError(f"--calib-rows must be positive; got {s.calib_rows}")
    model, tok = load_model(s.model)
    if stored_format(model) != "fp32":
        raise UsageError(f"{s.model} is already quantized ({stored_format(model)}); quantize its float checkpoint")
    if s.equalize and not s.calib_data:
        raise UsageError("--equalize chooses its scales on calibration rows: add --calib-data DATA")
    if s.equalize is None:  # equalized channels, then GPTQ: the rounding that keeps the model closest
        s.equalize = bool(s.calib_data)
    moments = calibration = None
    if s.calib_data:
        moments, calibration = _calibrate(model, tok, s)
    if s.equalize:
        from ..models.equalize import equalize

        print("looplm quantize: choosing each linear's equalization scales", file=sys.stderr, flush=True)
        moments, groups = equalize(model, moments, s.weights, group)
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
        s.out,
        s.weights,
        group,
        _DTYPE[s.dtype],
        act_dtype=_DTYPE[s.act_dtype],
        lora=s.lora,
        moments=moments,
        calibration=calibration,
        progress=moments is not None,
    )
    from ..models.checkpoint import WEIGHTS

    size = (Path(s.out) / WEIGHTS).stat().st_size
    print(
        f"quantized {s.model} to {s.weights}"
        + (f" (groups of {group})" if s.weights == "int4" else "")
        + (", LoRA merged per depth" if s.lora == "merged" else "")
        + (f", GPTQ on {calibration['tokens']:,} calibration tokens" if calibration else "")
        + (
            f", input channels equalized (rounding's output error "
            f"x{calibration['equalized']['output_error_ratio']:.3f})"
            if s.equalize
            else ""
        )
        + f": {before / 2**20:.0f} MB of float weights -> {size / 2**20:.0f} MB; wrote {s.out}"
    )
    return 0


def _calibrate(model, tok, s) -> tuple[dict, dict]:
    """GPTQ's input moments from the first ``--calib-rows`` rows of the corpus's training split."""
    import numpy as np
    import torch

    from ..data.corpus import PackedCorpus
    from ..models.gptq import input_moments
    from ..models.loading import tokenizer_fingerprint

    corpus = PackedCorpus(s.calib_data)
    if tok is None or tokenizer_fingerprint(tok) != corpus.tokenizer:
        raise UsageError(
            f"the corpus {s.calib_data} was tokenised with another tokenizer ({corpus.meta['model']}) "
            f"than {s.model}'s; rebuild it with `looplm data build {s.model} --out DIR`"
        )
    train = corpus.splits["train"]
    rows = torch.from_numpy(np.array(train[: s.calib_rows], dtype=np.int64))
    print(
        f"looplm quantize: running {rows.numel():,} calibration tokens through {s.model}",
        file=sys.stderr,
        flush=True,
    )
    moments = input_moments(model.float(), rows)
    return moments, {"data": str(s.calib_data), "split": "train", "rows": len(rows), "tokens": rows.numel()}


def cmd_export_gguf(s: ExportGguf) -> int:
    from ..convert.gguf_export import export_gguf, source_pre
    from ..models import load_model
    from ..models.quantized import stored_format

    if not s.out.endswith(".gguf"):
        raise UsageError(f"--out must name a .gguf file; got {s.out!r}")
    model, tok = load_model(s.model)
    if stored_format(model) != "fp32":
        raise UsageError(f"{s.model} holds {stored_format(model)} weights; export its float checkpoint")
    info = export_gguf(model, tok, s.out, s.weights, pre=source_pre(model.config))
    print(
        f"wrote {s.out}: {info['layers']} llama layers ({info['loops']} loops unrolled), {s.weights}, "
        f"{info['bytes'] / 2**20:.0f} MB"
    )
    return 0


def cmd_baseline(s: Baseline) -> int:
    from ..models import load_model, save_model
    from ..train.baselines import scratch_model, stepwise_model

    if s.init == "scratch" and s.layers is None:
        raise UsageError("--init scratch needs --layers N")
    vanilla, tok = load_model(s.model)
    model = (
        scratch_model(vanilla, s.layers, s.seed) if s.init == "scratch" else stepwise_model(vanilla, s.loops, s.layers)
    )
    save_model(model, tok, s.out)
    write_settings(s.out, "looplm baseline", s)
    n = sum(p.numel() for p in model.parameters())
    layers = model.config.conversion["layers"]
    what = "fresh weights" if s.init == "scratch" else f"pretrained layers {layers}"
    print(f"wrote {s.out}: {len(layers)} layers, {n:,} parameters, {what}")
    return 0


COMMANDS = [
    Command(("convert",), Convert, cmd_convert, "convert a pretrained model into a (Relaxed) Recursive Transformer"),
    Command(
        ("unroll",),
        Unroll,
        cmd_unroll,
        "export the equivalent vanilla model: each depth's LoRA merged into dense weights",
    ),
    Command(("quantize",), Quantize, cmd_quantize, "store a model with int8 or int4 weights for CPU serving"),
    Command(
        ("export-gguf",),
        ExportGguf,
        cmd_export_gguf,
        "write a looped model, unrolled (LoRA merged per depth), as a llama-architecture GGUF file for llama.cpp and "
        "ollama",
    ),
    Command(
        ("baseline",),
        Baseline,
        cmd_baseline,
        "the reduced-size baseline: some of the original's layers, run once (or as many fresh ones)",
    ),
    Command(("info",), Info, cmd_info, "parameter counts (N-emb, total) and the layer map of a model"),
]
