"""Where does int4 speculative decoding part from plain decoding, and is it a floating-point tie? Decodes a
`bench speculate` prompt plainly and with a speculation mode (int4 weights, greedy, 256 tokens), finds the first
token that differs and prints the model's three best logits there (a full forward over the prompt and the plain
output before it).

    PYTHONPATH=src .venv/bin/python experiments/speculate_ties.py smollm2-135m question context
    PYTHONPATH=src .venv/bin/python experiments/speculate_ties.py out/b2-r128-healed/final code context
"""

import sys

import torch

from looplm.bench.speculate import PROMPTS, _engine_run
from looplm.models import load_model
from looplm.models.quantized import load_dtype, prepare


def main() -> None:
    path, kind, mode = sys.argv[1], sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else "context"
    model, tok = load_model(path, dtype=load_dtype("int4"))
    model = prepare(model, "int4").eval()
    ids = tok(PROMPTS[kind], add_special_tokens=bool(model.config.add_bos_token))["input_ids"]
    plain, _ = _engine_run(model, ids, 256, "off")
    spec, _ = _engine_run(model, ids, 256, mode)
    i = next((j for j, (a, b) in enumerate(zip(plain, spec)) if a != b), None)
    print("first difference at", i)
    if i is not None:
        with torch.no_grad():
            logits = model(torch.tensor([ids + plain[:i]])).logits[0, -1].float()
        top = logits.topk(3)
        print("plain", plain[i], "speculative", spec[i], "best three", top.indices.tolist(),
              [round(v, 4) for v in top.values.tolist()])


if __name__ == "__main__":
    main()
