"""Forward tokens/s of looplm's vanilla decoder against transformers on the same weights, batch
8 x 512, float32 and bfloat16, measured alternately in one run (ratios are what to read).

    python benchmarks/bench_forward.py [--model smollm2-135m] [--batch 8] [--seq 512] [--repeats 3]
"""

import argparse
import json
import statistics
import time

import torch

from looplm.models import load_hf_reference, load_model


@torch.inference_mode()
def tokens_per_s(model, ids, **kw):
    t = time.perf_counter()
    model(ids, **kw)
    return ids.numel() / (time.perf_counter() - t)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    ours, _ = load_model(args.model)
    hf, _ = load_hf_reference(args.model)
    ids = torch.randint(0, ours.config.vocab_size, (args.batch, args.seq))
    report = {"model": args.model, "batch": args.batch, "seq": args.seq, "threads": torch.get_num_threads(),
              "date": time.strftime("%Y-%m-%d"), "dtypes": {}}
    for dtype in (torch.float32, torch.bfloat16):
        ours.to(dtype), hf.to(dtype)
        tokens_per_s(ours, ids[:1, :64]), tokens_per_s(hf, ids[:1, :64])  # warm-up
        a, b = [], []
        for _ in range(args.repeats):  # alternate so that machine noise hits both alike
            a.append(tokens_per_s(ours, ids))
            b.append(tokens_per_s(hf, ids))
        report["dtypes"][str(dtype).split(".")[-1]] = {
            "looplm_tok_s": statistics.median(a), "transformers_tok_s": statistics.median(b),
            "ratio": statistics.median(x / y for x, y in zip(a, b)),
        }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
