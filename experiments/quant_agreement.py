"""Where the quantized engine's disagreement with float32 comes from: the weights' rounding or the activations'.
Teacher-forced on held-out corpus rows (every position's greedy token against the float32 model's, and the
held-out perplexity), one row per variant:

  fp32                    the reference
  fp32, bf16 activations  float32 weights; every linear's input and output rounded to bfloat16 (hooks)
  ... only                the same for the layers' linears, the head's input or the head's logits alone
  int8 head dequantized   only the LM head (and the embeddings tied to it) rounded to int8, float32 math
  FMT dequantized         the quantized weights expanded back to float32, float32 math: the weights' rounding alone
  FMT layers dequantized  the same with the head left in float32
  FMT, bf16 activations   the engine's kernels as served (`looplm serve --weights FMT`, the default act dtype)
  ..., head logits not rescored  the same with the head's logits as its kernel returns them, in bfloat16
                          precision (before 2026-11-26 evening, what was served; ``QuantHead.RESCORED``)
  FMT, fp32 activations   the same kernels fed float32 activations (for the formats in --fp32-activations: the
                          kernels convert them per call, 4-13x slower on an AVX2-only CPU)

    PYTHONPATH=src OMP_NUM_THREADS=2 .venv/bin/python scripts/quant_agreement.py smollm2-135m \
        --data out/heal/corpus-smollm2-135m-512 --rows 16 --formats int8,int4 --json OUT.json

With ``--gptq-rows N`` the quantized rows come again with GPTQ rounding (models/gptq.py), calibrated on the
first N rows of the corpus's training split: the head alone, the layers alone, both, and as served. With
``--equalize`` as well, the layers' input channels are first equalized on those rows (models/equalize.py, `looplm
quantize --calibrate DATA --equalize`), then rounded to nearest or by GPTQ: the layers alone and as served.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys

import numpy as np
import torch
import torch.nn.functional as F

from looplm.data.corpus import PackedCorpus
from looplm.models import load_model
from looplm.models import equalize as EQ
from looplm.models import gptq
from looplm.models import quantized as Q


def bf16_activations(model, layers: bool = True, head_input: bool = True, head_output: bool = True):
    """Round every linear's input and output (the LM head's too) to bfloat16, as the bf16-activation kernels do;
    or only some of them."""
    def round_input(module, args):
        return (args[0].to(torch.bfloat16).float(), *args[1:])

    def round_output(module, args, output):
        return output.to(torch.bfloat16).float()

    for _, lin in Q.linears(model) if layers else ():
        lin.register_forward_pre_hook(round_input)
        lin.register_forward_hook(round_output)
    if head_input:
        model.lm_head.register_forward_pre_hook(round_input)
    if head_output:
        model.lm_head.register_forward_hook(round_output)
    return model


def dequantized(model, fmt: str | None, head: bool = True, moments: dict | None = None):
    """The layers' linears (``fmt``; None leaves them) and the head (int8, as quantize_model stores it; tied to the
    embeddings in SmolLM2, so both move, as served) replaced by their quantized weights, in float32; rounded to
    nearest, or by GPTQ with ``moments``."""
    tensors = Q.quantize_portable(model, fmt, moments=moments) if fmt else {}
    with torch.no_grad():
        for name, lin in Q.linears(model) if fmt else ():
            lin.weight.copy_(Q.dequantize(tensors[f"{name}.weight"]))
        if head:
            w = model.lm_head.weight
            if not tensors:  # the head alone: no layer is rounded for it
                t = gptq.gptq_portable(w, moments["lm_head"], "int8") if moments else Q.int8_portable(w)
            else:
                t = tensors.get("lm_head.weight", tensors["model.embed_tokens.weight"])
            w.copy_(Q.dequantize(t))
    return model


def unrescored(model):
    """The served model with its LM head's logits left as the kernel returns them (``QuantHead.RESCORED``)."""
    model.lm_head.RESCORED = 0
    return model


@torch.no_grad()
def score(model, rows: torch.Tensor, reference: list[torch.Tensor] | None):
    """(greedy tokens per row, summed NLL, predicted tokens, agreement with ``reference``)."""
    greedy, nll, n, same = [], 0.0, 0, 0
    for i, row in enumerate(rows):
        logits = model(row[None]).logits[0].float()
        nll += float(F.cross_entropy(logits[:-1], row[1:], reduction="sum"))
        n += len(row) - 1
        g = logits.argmax(-1)
        greedy.append(g)
        if reference is not None:
            same += int((g == reference[i]).sum())
    agree = same / (len(rows) * rows.shape[1]) if reference is not None else 1.0
    return greedy, nll, n, agree


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="model name or saved model directory (float32)")
    p.add_argument("--data", required=True, help="corpus directory (its held-out split is read)")
    p.add_argument("--rows", type=int, default=16, help="held-out rows (x the corpus's sequence length)")
    p.add_argument("--formats", default="int8,int4")
    p.add_argument("--fp32-activations", default="int8", help="formats also run with float32 activations")
    p.add_argument("--gptq-rows", type=int, default=0,
                   help="also round by GPTQ, calibrated on this many rows of the corpus's training split")
    p.add_argument("--equalize", action="store_true", help="also equalize the input channels before rounding "
                   "(needs --gptq-rows: its calibration rows choose the scales)")
    p.add_argument("--only", help="run only the rows whose name contains one of these comma-separated strings "
                                  "(the fp32 reference always runs)")
    p.add_argument("--json", help="write the results here (after every row)")
    args = p.parse_args()
    if args.equalize and not args.gptq_rows:
        p.error("--equalize needs --gptq-rows N (its calibration rows)")
    held = PackedCorpus(args.data).splits["heldout"]
    rows = torch.from_numpy(np.array(held[:args.rows], dtype=np.int64))
    fresh = lambda: load_model(args.model)[0].float().eval()  # noqa: E731

    @functools.cache
    def moments():  # calibration inputs' moments for GPTQ, from training rows (never the held-out ones)
        train = PackedCorpus(args.data).splits["train"]
        return gptq.input_moments(fresh(), torch.from_numpy(np.array(train[:args.gptq_rows], dtype=np.int64)))

    @functools.cache
    def equalized_state(fmt):  # the scales are searched once per format
        model = fresh()
        scaled, groups = EQ.equalize(model, moments(), fmt)
        print(f"equalized for {fmt}: {sum(g['alpha'] + g['beta'] > 0 for g in groups)} of {len(groups)} groups scaled, "
              f"summed output error x{sum(g['error'] for g in groups) / max(sum(g['error_before'] for g in groups), 1e-30):.3f}",
              flush=True)
        return {k: v.clone() for k, v in model.state_dict().items()}, scaled

    def equalized(fmt):  # (the model with its input channels equalized for fmt, its inputs' moments)
        state, scaled = equalized_state(fmt)
        model = fresh()
        model.load_state_dict(state)
        return model, scaled

    def gptq_equalized(fmt, served: bool):  # equalized, then rounded by GPTQ against the scaled inputs' moments
        model, scaled = equalized(fmt)
        return Q.quantize_model(model, fmt, moments=scaled) if served else dequantized(model, fmt, False, scaled)
    variants = [("fp32", fresh), ("fp32, bf16 activations", lambda: bf16_activations(fresh())),
                ("fp32, bf16 layer activations only", lambda: bf16_activations(fresh(), True, False, False)),
                ("fp32, bf16 head input only", lambda: bf16_activations(fresh(), False, True, False)),
                ("fp32, bf16 head logits only", lambda: bf16_activations(fresh(), False, False, True)),
                ("int8 head dequantized", lambda: dequantized(fresh(), None))]
    for fmt in args.formats.split(","):
        variants += [(f"{fmt} dequantized", lambda f=fmt: dequantized(fresh(), f)),
                     (f"{fmt} layers dequantized", lambda f=fmt: dequantized(fresh(), f, head=False)),
                     (f"{fmt}, bf16 activations", lambda f=fmt: Q.quantize_model(fresh(), f)),
                     (f"{fmt}, bf16 activations, head logits not rescored",
                      lambda f=fmt: unrescored(Q.quantize_model(fresh(), f)))]
        if fmt in args.fp32_activations.split(","):
            variants += [(f"{fmt}, fp32 activations",
                          lambda f=fmt: Q.quantize_model(fresh(), f, act_dtype=torch.float32))]
        if args.gptq_rows:
            variants += [(f"{fmt} GPTQ layers dequantized", lambda f=fmt: dequantized(fresh(), f, False, moments())),
                         (f"{fmt} GPTQ dequantized", lambda f=fmt: dequantized(fresh(), f, True, moments())),
                         (f"{fmt} GPTQ, bf16 activations", lambda f=fmt: Q.quantize_model(fresh(), f, moments=moments())),
                         (f"{fmt} GPTQ, bf16 activations, head logits not rescored",
                          lambda f=fmt: unrescored(Q.quantize_model(fresh(), f, moments=moments())))]
            if fmt in args.fp32_activations.split(","):
                variants += [(f"{fmt} GPTQ, fp32 activations", lambda f=fmt: Q.quantize_model(
                    fresh(), f, act_dtype=torch.float32, moments=moments()))]
        if args.equalize:
            variants += [(f"{fmt} equalized layers dequantized", lambda f=fmt: dequantized(equalized(f)[0], f, False)),
                         (f"{fmt} equalized, bf16 activations", lambda f=fmt: Q.quantize_model(equalized(f)[0], f)),
                         (f"{fmt} GPTQ equalized layers dequantized", lambda f=fmt: gptq_equalized(f, False)),
                         (f"{fmt} GPTQ equalized, bf16 activations", lambda f=fmt: gptq_equalized(f, True))]
    if args.gptq_rows:
        after_head = [n for n, _ in variants].index("int8 head dequantized") + 1
        variants.insert(after_head, ("int8 GPTQ head dequantized", lambda: dequantized(fresh(), None, moments=moments())))
    if args.only:
        keep = args.only.split(",")
        variants = variants[:1] + [(n, m) for n, m in variants[1:] if any(k in n for k in keep)]
    reference, results = None, []
    print(f"| {args.model}, {rows.numel():,} held-out positions | greedy agreement with fp32 | held-out perplexity |")
    print("|---|---:|---:|")
    for name, make in variants:
        greedy, nll, n, agree = score(make(), rows, reference)
        reference = reference or greedy
        se = math.sqrt(agree * (1 - agree) / rows.numel())
        results.append({"variant": name, "agreement": round(agree, 4), "agreement_se": round(se, 4),
                        "perplexity": round(math.exp(nll / n), 3)})
        print(f"| {name} | {agree:.4f} (+-{se:.4f}) | {math.exp(nll / n):.2f} |", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"model": args.model, "data": args.data, "positions": rows.numel(), "rows": results}, f,
                          indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
