"""Where a looped model's batch-1 token goes: timers around the engine's parts, for each exit policy and KV mode,
beside the vanilla model on the same engine settings.

One process; for each setting one engine (compiled ones warmed up first), the same requests served once untimed
and once timed, settings interleaved round by round. Parts, in milliseconds per generated token: ``forward``
(the loops: one compiled call per loop at batch 1), ``exit logits`` (the LM head: at the last loop, and at loop 1
for the policies that decide from logits), ``KV fill`` (kv mode copy: the skipped depths' k/v of an exited token),
``other after-loop`` (sampling, exit decisions, bookkeeping) and ``between steps`` (the scheduler, embedding).
Steps are also split by what they hold: ``token@L`` one token at loop L, ``+kv`` a later-mode KV item beside it
(a mixed-depth step, eager). Agreement: generated tokens equal to the float32 looped model's full-depth greedy
choice given the same prefix (teacher-forced).

    PYTHONPATH=src OMP_NUM_THREADS=2 .venv/bin/python benchmarks/bench_looped_b1.py --looped out/probe/b2-r64 \
        --policies none,margin:0.05,margin:0.6,probe --kv-modes copy,later --rounds 2 --json
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import time

import torch

from bench_llamacpp import _cpu, compiled, engine_model, outputs_agreement
from looplm.models import load_model
from looplm.serve import Engine, Request, make_scheduler, warm_up
from looplm.serve.bench import heldout_text, make_trace
from looplm.serve.exits import parse_policy
from looplm.serve.schedulers import replay


class Timers:
    """Wraps engine methods with wall-clock timers (seconds and calls per key)."""

    def __init__(self, engine):
        self.seconds, self.calls = collections.Counter(), collections.Counter()
        for name, key in (("_forward", "forward"), ("_exit_logits", "exit logits"), ("fill_copy", "KV fill"),
                          ("_after_loop", "after loop")):
            self._wrap(engine, name, key)
        self._wrap(engine, "step", self._step_kind)

    @staticmethod
    def _step_kind(items) -> str:
        live = [it for it in items if it.req.status == "running"]
        kinds = sorted({f"{it.kind}@{it.loop + 1}" for it in live})
        return "step " + "+".join(kinds)

    def _wrap(self, obj, name, key):
        fn = getattr(obj, name)

        def timed(*a, **kw):
            k = key(a[0]) if callable(key) else key  # before the call: the step changes its items' loops
            t = time.perf_counter()
            out = fn(*a, **kw)
            self.seconds[k] += time.perf_counter() - t
            self.calls[k] += 1
            return out
        setattr(obj, name, timed)


def measure(engine, timers, trace, scheduler) -> dict:
    def serve():
        reqs = [Request(r["prompt"], r["max_tokens"]) for r in trace]
        t = time.perf_counter()
        replay(make_scheduler(scheduler, engine), reqs)
        return time.perf_counter() - t, reqs

    serve()  # first use of each cache length
    timers.seconds.clear()
    timers.calls.clear()
    wall, reqs = serve()
    n = sum(len(r.output) for r in reqs)
    ms = lambda s: round(s / n * 1e3, 3)  # noqa: E731
    sec = timers.seconds
    parts = {"forward": ms(sec["forward"]), "exit logits": ms(sec["exit logits"]), "KV fill": ms(sec["KV fill"]),
             "other after-loop": ms(sec["after loop"] - sec["exit logits"] - sec["KV fill"])}
    steps = sum(v for k, v in sec.items() if k.startswith("step "))
    parts["between steps"] = ms(wall - steps)
    exits = collections.Counter(l for r in reqs for l in r.exit_loops)
    return {"tokens_per_s": round(n / wall, 2), "ms_per_token": ms(wall), "parts_ms_per_token": parts,
            "steps": {k[5:]: {"calls_per_token": round(timers.calls[k] / n, 3), "ms_per_call": round(v / timers.calls[k] * 1e3, 3)}
                      for k, v in sorted(sec.items()) if k.startswith("step ")},
            "exit_loop_share": {str(l): round(c / n, 4) for l, c in sorted(exits.items())},
            "outputs": [r.output for r in reqs]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m", help="the vanilla model served beside the looped one")
    p.add_argument("--looped", required=True, help="a saved looped model directory (with exit_probe.safetensors for "
                   "the probe policy)")
    p.add_argument("--config", default="int4-m-c", help="engine configuration as in bench_llamacpp.py "
                   "(FORMAT[-bf16][-gN][-h4][-f32act][-m][-c]); the vanilla model takes it without -m")
    p.add_argument("--policies", default="none,margin:0.6,probe")
    p.add_argument("--kv-modes", default="copy,later")
    p.add_argument("--requests", type=int, default=4)
    p.add_argument("--output", type=int, default=64)
    p.add_argument("--prompt-len", default="16:64")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    log = (lambda *a: print(*a, file=sys.stderr, flush=True)) if args.json else print
    vanilla, tok = load_model(args.model)
    base, _ = load_model(args.looped)
    lo, hi = (int(x) for x in args.prompt_len.split(":"))
    ids = tok(heldout_text(), add_special_tokens=False)["input_ids"]
    trace = make_trace(ids, args.requests, (lo, hi), (args.output, args.output), "all", seed=1)
    max_len = hi + args.output + 1
    compile = compiled(args.config)
    vanilla_spec = args.config.replace("-m", "")
    models = {"vanilla": engine_model(vanilla, vanilla_spec), "looped": engine_model(base, args.config)}
    engines = {"vanilla": (Engine(models["vanilla"], max_batch=1, max_seq_len=max_len, compile=compile), "sequence")}
    for policy in args.policies.split(","):
        for kv in (args.kv_modes.split(",") if policy != "none" else ["copy"]):
            eng = Engine(models["looped"], max_batch=1, max_seq_len=max_len, kv_mode=kv, compile=compile,
                         exit_policy=parse_policy(policy).bind(models["looped"]))
            engines[f"looped {policy}" + (f" kv {kv}" if policy != "none" else "")] = (eng, "depth")
    timers = {}
    for name, (eng, _) in engines.items():
        warm_up(eng)
        timers[name] = Timers(eng)
    runs: dict[str, list] = {}
    for rnd in range(args.rounds):
        log(f"round {rnd + 1}")
        for name, (eng, scheduler) in engines.items():
            r = measure(eng, timers[name], trace, scheduler)
            runs.setdefault(name, []).append(r)
            log(f"  {name:<28} {r['tokens_per_s']:6.1f} tok/s  {r['parts_ms_per_token']}  exits {r['exit_loop_share']}")
    result = {"model": args.model, "looped": args.looped, "config": args.config, "threads": args.threads,
              "requests": args.requests, "output": args.output, "rounds": args.rounds, "cpu": _cpu(),
              "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "command": " ".join(sys.argv[1:]), "settings": {}}
    for name, rs in runs.items():
        best = statistics.median_low([r["tokens_per_s"] for r in rs])
        r = next(r for r in rs if r["tokens_per_s"] == best)  # the median round's parts
        s = {k: v for k, v in r.items() if k != "outputs"}
        s["rounds_tokens_per_s"] = [x["tokens_per_s"] for x in rs]
        if name.startswith("looped"):
            s["agreement_full_depth"] = round(outputs_agreement(base, trace, rs[0]["outputs"]), 4)
        result["settings"][name] = s
        log(f"  {name:<28} median round {best} tok/s, agreement {s.get('agreement_full_depth', '')}")
    if args.json:
        print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
