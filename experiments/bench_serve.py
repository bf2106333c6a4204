"""Serving benchmark: SmolLM2 B=2 with continuous depth-wise batching and early exit vs the vanilla
model under static and sequence-wise batching, plus the vanilla model on our engine vs transformers
`generate` (batch 1) and `generate_batch`, all in one run on one trace. Writes the JSON result.

    PYTHONPATH=src nice -n 5 python benchmarks/bench_serve.py --out benchmarks/results/serve.json [bench serve args]

Any `looplm bench serve` option can follow (e.g. --lora-rank full, --exit softmax:0.95, --threads 1).
"""

from __future__ import annotations

import argparse
import io
import json
import sys
from contextlib import redirect_stdout
from pathlib import Path

DEFAULTS = ["--requests", "16", "--prompt-len", "16:64", "--output-len", "8:48", "--max-batch", "8",
            "--extra", "--hf", "4", "--json"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="benchmarks/results/serve.json")
    args, rest = ap.parse_known_args(argv)
    from looplm.cli import main as looplm_main
    buf = io.StringIO()
    with redirect_stdout(buf):
        rc = looplm_main(["bench", "serve", *DEFAULTS, *rest])
    if rc:
        return rc
    result = json.loads(buf.getvalue())
    result["command"] = "python benchmarks/bench_serve.py " + " ".join(DEFAULTS + rest)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(json.dumps({k: result[k] for k in ("schedulers", "agreement", "speedup") if k in result}, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
