"""`looplm bench speculate`: speculative decoding against plain decoding, side by side in one run.

Batch 1, greedy, a fixed number of new tokens (EOS ignored), three prompt kinds (code, prose continuation, a
question); per model and weight format every speculation mode runs each prompt in turn with plain decoding
(interleaved, so that a shared machine's drift falls on all of them alike). Reports tokens/s, the ratio to plain
decoding, acceptance rate, mean accepted length and whether the tokens equal plain decoding's.
"""

from __future__ import annotations

import time

PROMPTS = {
    "code": (
        "import json\n\n\ndef load_config(path):\n"
        '    """Read a JSON config file and fill in defaults."""\n'
        "    with open(path) as f:\n        config = json.load(f)\n"
        '    config.setdefault("host", "127.0.0.1")\n    config.setdefault("port", 8000)\n'
        '    config.setdefault("workers", 4)\n    return config\n\n\ndef save_config(path, config):\n'
    ),
    "prose": (
        "The village sat at the edge of a wide valley, where the river slowed and spread into marshes before it "
        "reached the sea. In summer the fields were green with barley, and in winter the fog came up from the "
        "water and lay over the houses until noon. Most of the people who lived there"
    ),
    "question": "Question: Why do leaves change colour in autumn?\nAnswer:",
}


def _engine_run(model, ids, n, mode):
    from ..serve.engine import Engine, Request
    from ..serve.schedulers import make_scheduler, replay

    engine = Engine(model, max_batch=1, max_seq_len=len(ids) + n + 1, speculate=mode)
    replay(make_scheduler("sequence", engine), [Request(ids[:8], 8)])  # warm-up, untimed
    engine.reset_stats()
    req = Request(ids, n)
    t0 = time.perf_counter()
    replay(make_scheduler("sequence", engine), [req])
    seconds = time.perf_counter() - t0
    s = engine.stats
    return req.output, {
        "tokens": len(req.output),
        "seconds": round(seconds, 3),
        "tokens_per_s": round(len(req.output) / seconds, 2),
        "acceptance_rate": round(s["spec_accepted"] / s["spec_drafted"], 4) if s["spec_drafted"] else None,
        "mean_accepted_length": round(s["spec_tokens"] / s["spec_rounds"], 3) if s["spec_rounds"] else None,
    }


def bench_speculate(models, weights, modes, new_tokens: int = 256, rounds: int = 1, log=print) -> dict:
    from ..models import load_model
    from ..models.quantized import load_dtype, prepare

    runs = []
    for path in models:
        for fmt in weights:
            model, tok = load_model(path, dtype=load_dtype(fmt))
            model = prepare(model, fmt).eval()
            B = model.config.num_loops
            usable = [m for m in modes if m != "loop1" or B > 1]
            for kind, text in PROMPTS.items():
                ids = tok(text, add_special_tokens=bool(model.config.add_bos_token))["input_ids"]
                figs: dict[str, list] = {m: [] for m in ["off", *usable]}
                outputs = {}
                for _ in range(rounds):
                    for mode in figs:
                        outputs[mode], fig = _engine_run(model, ids, new_tokens, mode)
                        figs[mode].append(fig)
                best = {m: max(f, key=lambda x: x["tokens_per_s"]) for m, f in figs.items()}
                base = best["off"]["tokens_per_s"]
                for mode, fig in best.items():
                    row = {
                        "model": str(path),
                        "loops": B,
                        "weights": fmt,
                        "prompt": kind,
                        "speculate": mode,
                        **fig,
                        "vs_off": round(fig["tokens_per_s"] / base, 3),
                        "same_tokens_as_off": outputs[mode] == outputs["off"],
                    }
                    runs.append(row)
                    log(
                        f"{path} {fmt} {kind:<9} {mode:<8} {fig['tokens_per_s']:>7.1f} tok/s  x{row['vs_off']:.2f}"
                        f"  acceptance {fig['acceptance_rate']}  accepted length {fig['mean_accepted_length']}"
                        f"  same tokens {row['same_tokens_as_off']}"
                    )
            del model
    return {"new_tokens": new_tokens, "rounds": rounds, "runs": runs}
