"""`looplm convert`, `unroll`, `quantize`, `export-gguf` and `info`."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import UsageError
from ..recipes.convert import ConvertConfig
from ..recipes.quantize import QuantizeConfig
from ..settings import setting
from . import command
from .args import write_settings

JSON_HELP = "print one JSON object instead of text"


@dataclass
class Convert(ConvertConfig):
    """Convert a pretrained model into a (Relaxed) Recursive Transformer."""

    json: bool = setting(False, JSON_HELP)


@dataclass
class Unroll:
    """Export the equivalent vanilla model: each depth's LoRA merged into dense weights."""

    model: str | None = setting(None, "a looped model: embedded name or looplm directory", positional=True)
    out: str | None = setting(None, "directory of the unrolled model", required=True)


@dataclass
class ExportGguf:
    """Write a looped model, unrolled (LoRA merged per depth), as a llama-architecture GGUF file for llama.cpp and
    ollama."""

    model: str | None = setting(None, "embedded name or float looplm directory (Llama/SmolLM2 family)", positional=True)
    out: str | None = setting(None, "the .gguf file to write", required=True)
    weights: str = setting(
        "f32",
        "GGUF tensor type of the linear weights (norms stay f32; with q4_1 the embedding is q8_0)",
        choices=("f32", "f16", "q8_0", "q4_1"),
        renamed_from=("--type",),
    )


@dataclass
class Baseline:
    """The reduced-size baseline: some of the original's layers, run once (or as many fresh ones)."""

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
    """Parameter counts (N-emb, total) and the layer map of a model."""

    model: str | None = setting(None, "embedded name, HF/looplm directory or .gguf file", positional=True)
    json: bool = setting(False, JSON_HELP)


def _ppl(model, tok, text, max_tokens):
    from ..eval.perplexity import perplexity

    return perplexity(model, tok, text, seq_len=512, max_tokens=max_tokens)


@command("convert")
def cmd_convert(s: Convert) -> dict:
    from ..models import save_model
    from ..recipes.convert import convert_model

    model, tok, report = convert_model(s)
    save_model(model, tok, report["out"])
    write_settings(report["out"], "looplm convert", s)
    if not s.json:
        _print_conversion(s, model.config, report)
    return report


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


@command("info")
def cmd_info(s: Info) -> dict:
    from ..convert import describe
    from ..models import load_model

    model, _ = load_model(s.model)
    info = describe(model)
    if s.json:
        return info
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
        + (", a loop scale" if info["loop_scale"] else "")
        + (", a magnitude per depth" if info["magnitude"] else "")
    )
    if info["quantization"]:
        q = info["quantization"]
        print(
            f"weights    {q['format']}"
            + (", each depth's LoRA merged into its own weight (counted in N-emb)" if q.get("lora") == "merged" else "")
        )
    print("layer map  " + " ".join(f"{d}->{k}" for d, k in enumerate(info["layer_map"])))
    return info


@command("unroll")
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


@command("quantize", help="Store a model with int8 or int4 weights for CPU serving.")
def cmd_quantize(s: QuantizeConfig) -> int:
    from ..recipes.quantize import quantize_model

    r = quantize_model(s)
    calibration = r["calibration"]
    print(
        f"quantized {s.model} to {s.weights}"
        + (f" (groups of {r['group']})" if s.weights == "int4" else "")
        + (", LoRA merged per depth" if s.lora == "merged" else "")
        + (f", GPTQ on {calibration['tokens']:,} calibration tokens" if calibration else "")
        + (
            f", input channels equalized (rounding's output error "
            f"x{calibration['equalized']['output_error_ratio']:.3f})"
            if s.equalize
            else ""
        )
        + f": {r['float_bytes'] / 2**20:.0f} MB of float weights -> {r['bytes'] / 2**20:.0f} MB; wrote {s.out}"
    )
    return 0


@command("export-gguf")
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


@command("baseline")
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
