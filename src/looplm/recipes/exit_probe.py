"""The learned exit probe fitted on a corpus (`looplm fit-exit-probe`): rows of its training split, spread over every
source, half to fit the probe (serve/probe.py) and the others, interleaved, to calibrate its threshold; the probe is
written beside the model's weights and its report into the model's eval/ folder."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ..data.corpus import PackedCorpus
from ..errors import UsageError
from ..models import load_model
from ..models.loading import is_looplm_dir, tokenizer_fingerprint
from ..serve.probe import fit_probe


def fit_exit_probe(
    model: str,
    data: str,
    *,
    fit_rows: int,
    calib_rows: int,
    target_agreement: float,
    l2: float,
    features: str,
    log=print,
) -> dict:
    """Fit the probe of looped model directory ``model`` on corpus ``data``; its report, with where the probe is.
    The settings' defaults are `looplm fit-exit-probe`'s (commands/serve.py ``FitExitProbe``)."""
    d = Path(model)
    if not (d.is_dir() and is_looplm_dir(d)):
        raise UsageError(
            f"{d} is not a saved looplm model directory; the probe is written beside its weights "
            f"(save one with `looplm convert` or `looplm train`)"
        )
    if fit_rows < 1 or calib_rows < 1 or not 0 < target_agreement <= 1:
        raise UsageError("need --fit-rows >= 1, --calib-rows >= 1 and 0 < --target-agreement <= 1")
    corpus = PackedCorpus(data)
    looped, tok = load_model(d)
    if looped.config.num_loops < 2:
        raise UsageError(f"{d} has B = 1 loop: there is no early exit to fit a probe for")
    if tok is not None and tokenizer_fingerprint(tok) != corpus.tokenizer:
        raise UsageError(
            f"corpus {data} was tokenised with another tokenizer than {d}; build one with "
            f"`looplm data build {d} --out DIR`"
        )
    train = corpus.splits["train"]
    n = fit_rows + calib_rows
    if len(train) < n:
        raise UsageError(f"the corpus has {len(train)} training rows; lower --fit-rows/--calib-rows to at most that")
    picks = np.linspace(0, len(train) - 1, n).round().astype(int)  # spread over every source
    rows = [train[i].astype(np.int64).tolist() for i in picks]
    calib_at = set(np.linspace(0, n - 1, calib_rows).round().astype(int).tolist())  # interleaved with fit rows
    fitted = [r for i, r in enumerate(rows) if i not in calib_at]
    calibration = [r for i, r in enumerate(rows) if i in calib_at]
    probe, report = fit_probe(looped, fitted, calibration, target_agreement, l2, log=log, features=features)
    path = probe.save(d)
    report = {"model": str(d), "data": data, "probe": str(path), **report}  # report holds the threshold
    (d / "eval").mkdir(exist_ok=True)
    (d / "eval" / "exit_probe.json").write_text(json.dumps(report, indent=2))
    return report
