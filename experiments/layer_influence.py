"""Issue 78 item 4: which of SmolLM2-135M's layers change their input most, on calibration text (never held out).

Per layer: Block Influence (ShortGPT: 1 - mean cosine of a token's state before and after the layer) and the
angular distance (arccos of that cosine / pi, Gromov et al.), over the calibration rows of the comparison's corpus.
Then, for each count U of unique layers, the split P + C = U whose end layers carry the most influence.

    PYTHONPATH=src .venv/bin/python experiments/layer_influence.py out/sharing/smollm2/calib/train.txt
"""

import json
import math
import sys

import torch

from looplm.models import load_model


@torch.no_grad()
def main(path: str, tokens: int = 8192, seq: int = 512) -> None:
    model, tok = load_model("smollm2-135m")
    ids = tok(open(path).read(), return_tensors="pt").input_ids[0][: tokens // seq * seq].view(-1, seq)
    cos = torch.zeros(model.config.num_hidden_layers, dtype=torch.float64)
    for row in ids.split(4):
        h0 = model.model.embed(row)
        _, states, _ = model.model(row, output_depth_states=True)
        prev = h0
        for d, h in enumerate(states):
            cos[d] += torch.nn.functional.cosine_similarity(prev.double(), h.double(), dim=-1).sum()
            prev = h
    cos /= ids.numel()
    bi = (1 - cos).tolist()
    ang = [math.acos(max(-1.0, min(1.0, c))) / math.pi for c in cos.tolist()]
    L = len(bi)
    best = {}
    for u in range(0, 7):
        splits = [(p, u - p) for p in range(u + 1)]
        score = {f"{p}+{c}": sum(bi[:p]) + sum(bi[L - c :]) for p, c in splits}
        best[u] = max(score, key=score.get)
    print(json.dumps({"block_influence": [round(b, 4) for b in bi], "angular": [round(a, 4) for a in ang],
                      "best_split_by_unique_layers": best, "tokens": ids.numel()}, indent=1))


if __name__ == "__main__":
    main(sys.argv[1])
