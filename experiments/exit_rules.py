"""How well does each exit rule rank tokens? Exit fraction at a target agreement, per rule, on held-out text.

The 1.4x serving goal hangs on the fraction of tokens that leave after loop 1 at >= 95% agreement with
full depth. The oracle says how many tokens *could* leave (their loop-1 argmax already equals the final
one); an exit rule is a score plus a threshold, and how many of them it finds at 95% agreement depends only
on how well its score ranks tokens. With a perfect ranking every oracle token exits, plus wrong ones up to
the 5% agreement budget. This script measures each rule's ranking on teacher-forced held-out text:

- confidence rules on the exit logits: ``softmax`` (max probability), ``margin`` (top-1 minus top-2
  probability), ``entropy`` (negated), ``logit-gap`` (top-1 minus top-2 logit);
- ``cosine``: cos(h after loop i, h before it);
- ``probe``: the probe saved with the model (`looplm fit-exit-probe`), if there is one;
- logistic regressions fitted here on the corpus' training split, one per loop: ``lr:hidden`` and
  ``lr:confidence`` (the two feature sets of `looplm fit-exit-probe --features`), ``lr:all`` (both);
- ``mlp:all``: a one-hidden-layer network on the same features as ``lr:all``;
- ``margin+copy``: the context's own guess first. Where the loop's argmax is the token that followed the last
  earlier occurrence of the current 3-gram in the row (serve/context_index.py ``ContextIndex``; a small model's greedy
  text repeats itself), the token ranks above every other, then by margin; ``lr:all+copy`` adds that match to
  ``lr:all``.
  The engine's ``+copy`` exit policies (``margin:0.19+copy``) apply the first.
- ``margin+copy:BONUS``: the same with BONUS nats added to the guess's logit first (the engine's
  ``margin:T+copy:BONUS``): a token leaves with the guess unless loop 1 ranks it more than BONUS below its top
  choice, so it may leave with a token that is not loop 1's own argmax, and the oracle no longer bounds it.
  The report also gives the share of tokens that have a guess and how often the guess alone is right.

Every rule's threshold is swept over its scores on the held-out rows (a token leaves at the first loop
whose score reaches the threshold), so the figures are each rule's best case; compare rules, not
thresholds. Writes a JSON report and a PNG of exit fraction against agreement.

``--text generated`` ranks the tokens the model generates instead (issue 18 asks for those): the first
``--prompt-tokens`` of each row are a prompt, the model continues it greedily at full depth, and only the
continuation's tokens are scored (learned rules are fitted on continuations of training prompts too). A
small model's greedy text repeats itself: the report gives the share of continuation tokens that close a
4-gram seen earlier in their row, and the first three continuations as text.

    PYTHONPATH=src .venv/bin/python scripts/exit_rules.py out/paper-b2/runs/rec-stepwise-exit-more/final \
        --data out/corpus-smollm2-512 --out docs/exits/rules-b2
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from looplm.models import load_model
from looplm.serve.context_index import copy_guesses
from looplm.serve.exits import with_copy_bonus
from looplm.serve.probe import PROBE_FILE, ExitProbe, confidence_features, exit_curve, fit_logistic, probe_features
from looplm.data.corpus import PackedCorpus


COPY_BONUSES = (0.0, 1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0)  # nats added to the guess's logit: +copy:BONUS


@torch.no_grad()
def collect(model, rows: list[list[int]], log, first: int = 0, copy_min_n: int = 3) -> dict[str, torch.Tensor]:
    """Teacher-forced full-depth passes: per exitable loop i < B - 1, both probe feature sets (probe.py:
    ``hidden``, final-normed h and cosine; ``confidence``, p1..p5, margin, -entropy, logit gap, cosine);
    the argmax of every loop; the context's copy guess (``copy_guesses``, -1: none) and, per copy bonus, the
    argmax and margin of each exitable loop's logits with the bonus on the guess. With ``first`` > 0 only
    positions first..len(row) - 2 count: those that predict a token of the row from position first + 1 on (a
    continuation's tokens)."""
    B = model.config.num_loops
    dev = next(model.parameters()).device
    hidden, conf, args, guesses, boost = [], [], [], [], {b: ([], []) for b in COPY_BONUSES}
    for n, row in enumerate(rows):
        x = torch.tensor([row], device=dev)
        h0 = model.model.embed(x)
        _, states, _ = model.model(x, output_loop_states=True)
        keep = slice(first, len(row) - 1) if first else slice(None)
        states = [s[0, keep] for s in states]
        prev = [h0[0, keep]] + states[:-1]
        guess = torch.tensor(copy_guesses(row, 3, copy_min_n)[keep], device=dev)
        h_l, c_l, a_l, b_l = [], [], [], {b: ([], []) for b in COPY_BONUSES}
        for i in range(B):
            logits = model.exit_logits(states[i], loop=i).float()
            a_l.append(logits.argmax(-1))
            if i == B - 1:
                break
            h_l.append(probe_features(model, states[i], prev[i]))
            c_l.append(confidence_features(logits, states[i], prev[i]))
            for b in COPY_BONUSES:
                top2 = with_copy_bonus(logits, guess, b).softmax(-1).topk(2, dim=-1)
                b_l[b][0].append(top2.indices[:, 0])
                b_l[b][1].append(top2.values[:, 0] - top2.values[:, 1])
        hidden.append(torch.stack(h_l))
        conf.append(torch.stack(c_l))
        args.append(torch.stack(a_l))
        guesses.append(guess)
        for b in COPY_BONUSES:
            boost[b][0].append(torch.stack(b_l[b][0]))
            boost[b][1].append(torch.stack(b_l[b][1]))
        log(f"  row {n + 1}/{len(rows)}")
    return {"hidden": torch.cat(hidden, 1).cpu(), "conf": torch.cat(conf, 1).cpu(), "args": torch.cat(args, 1).cpu(),
            "guess": torch.cat(guesses).cpu(),
            "boost": {b: (torch.cat(a, 1).cpu(), torch.cat(m, 1).cpu()) for b, (a, m) in boost.items()}}


@torch.no_grad()
def continue_greedily(model, rows: list[list[int]], prompt_tokens: int, new_tokens: int) -> list[list[int]]:
    """Each row's first ``prompt_tokens`` continued by ``new_tokens`` greedy tokens at full depth (all rows'
    prompts have one length, so they run as one batch with no padding)."""
    dev = next(model.parameters()).device
    prompts = torch.tensor([r[:prompt_tokens] for r in rows], device=dev)
    out = model.generate(prompts, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                         pad_token_id=0)
    return out.tolist()


def repeated_share(rows: list[list[int]], first: int, n: int = 4) -> float:
    """Share of the tokens from ``first`` on that close an n-gram already seen earlier in their row."""
    hits = total = 0
    for row in rows:
        seen = {tuple(row[j:j + n]) for j in range(first - n + 1)}
        for t in range(first, len(row)):
            gram = tuple(row[t - n + 1:t + 1])
            hits += gram in seen
            total += 1
            seen.add(gram)
    return hits / max(total, 1)


def fit_mlp(x: torch.Tensor, y: torch.Tensor, width: int = 128, steps: int = 400, seed: int = 0):
    """A small network predicting P(exit is right); standardised inputs, Adam, weight decay. Returns a scorer."""
    g = torch.Generator().manual_seed(seed)
    mu, sd = x.mean(0), x.std(0).clamp_min(1e-6)
    net = torch.nn.Sequential(torch.nn.Linear(x.shape[1], width), torch.nn.GELU(), torch.nn.Linear(width, 1))
    for p in net.parameters():
        if p.dim() > 1:
            torch.nn.init.normal_(p, std=0.02, generator=g)
        else:
            torch.nn.init.zeros_(p)
    opt = torch.optim.AdamW(net.parameters(), lr=3e-3, weight_decay=0.05)
    xs, yf = (x - mu) / sd, y.float()
    with torch.enable_grad():
        for _ in range(steps):
            opt.zero_grad()
            F.binary_cross_entropy_with_logits(net(xs)[:, 0], yf).backward()
            opt.step()
    net.eval()
    return lambda z: torch.sigmoid(net((z - mu) / sd)[:, 0]).detach()


def rule_scores(model_dir: Path, fit: dict, ev: dict) -> dict[str, torch.Tensor]:
    """Scores [B - 1, N] of every rule on the held-out rows (higher = exit)."""
    loops = ev["conf"].shape[0]
    scores = {"softmax": ev["conf"][..., 0], "margin": ev["conf"][..., 5], "entropy": ev["conf"][..., 6],
              "logit-gap": ev["conf"][..., 7], "cosine": ev["conf"][..., 8]}
    if (model_dir / PROBE_FILE).exists():
        probe = ExitProbe.load(model_dir / PROBE_FILE)
        scores["probe"] = torch.stack([probe.prob(ev["hidden"][i], torch.full((ev["hidden"].shape[1],), i))
                                       for i in range(loops)])
    sets = {"hidden": lambda d, i: d["hidden"][i], "confidence": lambda d, i: d["conf"][i],
            "all": lambda d, i: torch.cat([d["hidden"][i], d["conf"][i][:, :8]], -1)}  # one cosine
    for name, feats in sets.items():
        out = []
        for i in range(loops):
            y = fit["args"][i] == fit["args"][-1]
            w, b = fit_logistic(feats(fit, i), y)
            out.append(torch.sigmoid(feats(ev, i) @ w + b))
        scores[f"lr:{name}"] = torch.stack(out)
    scores["mlp:all"] = torch.stack([fit_mlp(sets["all"](fit, i), fit["args"][i] == fit["args"][-1])(sets["all"](ev, i))
                                     for i in range(loops)])
    match = lambda d, i: (d["args"][i] == d["guess"]).float()[:, None]  # noqa: E731  the loop's argmax is the guess
    with_copy = lambda d, i: torch.cat([sets["all"](d, i), match(d, i)], -1)  # noqa: E731
    out = []
    for i in range(loops):
        w, b = fit_logistic(with_copy(fit, i), fit["args"][i] == fit["args"][-1])
        out.append(torch.sigmoid(with_copy(ev, i) @ w + b))
    scores["lr:all+copy"] = torch.stack(out)
    for b, (a, m) in ev["boost"].items():  # a margin is at most 1: a match ranks first
        scores["margin+copy" + (f":{b:g}" if b else "")] = (m + (a == ev["guess"]).float(), a)
    return scores


def thin(curve: list[dict], every: int = 4) -> list[dict]:
    """Every few points of a 402-point curve, and its last: enough to redraw it, a quarter of the JSON."""
    return curve[::every] + ([curve[-1]] if (len(curve) - 1) % every else [])


def best_at(curve: list[dict], target: float, B: int) -> dict:
    """The curve point leaving most tokens early at >= target agreement, with the mean loops a token runs."""
    ok = [r for r in curve if r["agreement"] >= target]
    best = dict(max(ok, key=lambda r: r["early_exit_fraction"])) if ok else \
        {"early_exit_fraction": 0.0, "per_loop": [0.0] * (B - 1), "agreement": None}
    fs = best["per_loop"]
    best["loops_per_token"] = round(sum((i + 1) * f for i, f in enumerate(fs)) + B * (1 - sum(fs)), 3)
    return best


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("model", help="a saved looped model directory (B >= 2)")
    p.add_argument("--data", required=True, help="a corpus from `looplm data build` with the model's tokenizer")
    p.add_argument("--fit-rows", type=int, default=32, help="training-split rows to fit the learned rules on")
    p.add_argument("--eval-rows", type=int, default=16, help="held-out rows to rank on")
    p.add_argument("--target", type=float, default=0.95, help="agreement with full depth to report the exit fraction at")
    p.add_argument("--text", default="heldout", choices=("heldout", "generated"), help="rank teacher-forced "
                   "corpus text (heldout) or the model's own greedy continuations of prompts cut from it (generated)")
    p.add_argument("--prompt-tokens", type=int, default=64, help="--text generated: prompt length")
    p.add_argument("--new-tokens", type=int, default=128, help="--text generated: tokens generated per prompt")
    p.add_argument("--copy-min-n", type=int, default=3, choices=(1, 2, 3), help="the copy guess backs off from "
                   "the final 3-gram to shorter ones, down to this length, where the 3-gram is new")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", required=True, help="output prefix: writes OUT.json and OUT.png")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    log = lambda *a: print(*a, file=sys.stderr, flush=True)  # noqa: E731
    model_dir = Path(args.model)
    model, tok = load_model(model_dir)
    model.eval()
    if model.config.num_loops < 2:
        raise SystemExit(f"{model_dir} has B = 1: no early exit to rank")
    corpus = PackedCorpus(args.data)
    train, held = corpus.splits["train"], corpus.splits["heldout"]
    if len(train) < args.fit_rows or len(held) < args.eval_rows:
        raise SystemExit(f"the corpus has {len(train)} training and {len(held)} held-out rows; lower --fit-rows/--eval-rows")
    pick = lambda split, n: [split[i].astype(np.int64).tolist() for i in np.linspace(0, len(split) - 1, n).round().astype(int)]  # noqa: E731
    t0 = time.time()
    fit_rows, eval_rows, first, repeated, samples = pick(train, args.fit_rows), pick(held, args.eval_rows), 0, None, []
    if args.text == "generated":
        if not 0 < args.prompt_tokens < len(eval_rows[0]) or args.new_tokens < 1:
            raise SystemExit(f"--prompt-tokens must lie in 1..{len(eval_rows[0]) - 1} and --new-tokens be >= 1")
        log(f"continuing {args.fit_rows} + {args.eval_rows} prompts of {args.prompt_tokens} tokens by {args.new_tokens}")
        fit_rows = continue_greedily(model, fit_rows, args.prompt_tokens, args.new_tokens)
        eval_rows = continue_greedily(model, eval_rows, args.prompt_tokens, args.new_tokens)
        first, repeated = args.prompt_tokens - 1, repeated_share(eval_rows, args.prompt_tokens)
        samples = [tok.decode(r[args.prompt_tokens:]) for r in eval_rows[:3]]
        log(f"{repeated:.1%} of the generated tokens close a 4-gram seen earlier in their row")
    log(f"collecting {args.fit_rows} training rows")
    fit = collect(model, fit_rows, log, first, args.copy_min_n)
    log(f"collecting {args.eval_rows} held-out rows")
    ev = collect(model, eval_rows, log, first, args.copy_min_n)
    scores = rule_scores(model_dir, fit, ev)
    B, N = ev["args"].shape
    oracle_loop = torch.full((N,), B - 1)
    for i in range(B - 2, -1, -1):
        oracle_loop = torch.where(ev["args"][i] == ev["args"][-1], torch.full_like(oracle_loop, i), oracle_loop)
    oracle = float((oracle_loop < B - 1).float().mean())
    rules = {}
    for name, s in scores.items():
        args_r = ev["args"]
        if isinstance(s, tuple):  # a rule that may emit another token than the loop's argmax
            s, emitted = s
            args_r = torch.cat([emitted, ev["args"][-1:]])
        thresholds = torch.quantile(s.flatten().double(), torch.linspace(0, 1, 401, dtype=torch.float64)).tolist()
        if name.startswith("margin+copy"):  # above 1 a match would need a margin too, which the engine never asks
            thresholds = [t for t in thresholds if t <= 1.0]
        curve = exit_curve(s, args_r, thresholds + [float("inf")])
        rules[name] = {"at_target": best_at(curve, args.target, B), "curve": curve}
        log(f"{name:<14} {rules[name]['at_target']['early_exit_fraction']:.1%} exit at >= {args.target} agreement")
    report = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "model": str(model_dir), "data": args.data,
              "text": args.text, **({"prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens,
                                     "repeated_4gram_share": round(repeated, 4), "samples": samples}
                 if args.text == "generated" else {}),
              "fit_tokens": int(fit["args"].shape[1]), "eval_tokens": N, "target_agreement": args.target,
              "oracle_early_fraction": round(oracle, 4), "copy_min_n": args.copy_min_n,
              "copy_guess_share": round(float((ev["guess"] >= 0).float().mean()), 4),
              "copy_guess_right": round(float((ev["guess"] == ev["args"][-1]).float().sum() / (ev["guess"] >= 0).sum()
                                              .clamp_min(1)), 4),
              "perfect_ranking_bound": round(min(1.0, oracle + (1 - args.target)), 4) if B == 2 else None,
              "seconds": round(time.time() - t0, 1),
              "rules": {k: v["at_target"] for k, v in rules.items()},
              "curves": {k: thin(v["curve"]) for k, v in rules.items()}}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=1))
    plot(rules, report, out.with_suffix(".png"))
    print(f"| rule | exit fraction at >= {args.target} agreement | after loops 1..B-1 | loops per token (of {B}) "
          "| agreement there |")
    print("|---|---:|---|---:|---:|")
    for name, r in sorted(report["rules"].items(), key=lambda kv: kv[1]["loops_per_token"]):
        print(f"| {name} | {r['early_exit_fraction']:.1%} | {' / '.join(f'{f:.1%}' for f in r['per_loop'])} | "
              f"{r['loops_per_token']} | {r['agreement'] if r['agreement'] is not None else '-'} |")
    print(f"| oracle (exits only right tokens) | {oracle:.1%} | | | 1.0 |")
    print(f"| the context's guess alone, wherever there is one | {report['copy_guess_share']:.1%} | | | "
          f"{report['copy_guess_right']} |")
    if report["perfect_ranking_bound"] is not None:
        print(f"| perfect ranking (oracle + the {1 - args.target:.0%} budget) | {report['perfect_ranking_bound']:.1%} "
              f"| | | {args.target} |")
    log(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")
    return 0


def plot(rules: dict, report: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    for name, r in rules.items():
        if name.startswith("margin+copy:") and name.split(":")[1] not in ("2", "4", "8"):
            continue  # three bonuses show the trend
        c = [p for p in r["curve"] if p["agreement"] >= 0.85]
        ax.plot([p["early_exit_fraction"] for p in c], [p["agreement"] for p in c], label=name, lw=1.2,
                ls="--" if name.startswith("margin+copy:") else "-")
    ax.axhline(report["target_agreement"], color="grey", ls=":", lw=1)
    ax.axvline(report["oracle_early_fraction"], color="black", ls="--", lw=1, label="oracle")
    ax.set_xlabel("fraction of tokens leaving early")
    ax.set_ylabel("agreement with full depth")
    text = "generated" if report["text"] == "generated" else "teacher-forced held-out"
    ax.set_title(f"Exit rules, {text} text ({report['eval_tokens']} tokens)", fontsize=10)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
