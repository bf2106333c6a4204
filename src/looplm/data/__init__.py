"""Training corpora (fetch, split held-out text by block, tokenise, pack; `corpus.py`, `sources.py`)
and the packaged held-out sample text. Train, eval and serve read corpora from here."""

from importlib import resources

HELDOUT_SAMPLE = "heldout_sample.txt"  # Milton, Paradise Regained book II (public domain); not in any training split
# 16 rows of 512 tokens from the default corpus's training split (`looplm data text CORPUS --rows 16`): what
# `looplm convert` calibrates its data-aware init on unless given other training text
CALIBRATION_TEXT = resources.files("looplm").joinpath("data", "calibration.txt")


def sample_text() -> str:
    return resources.files("looplm").joinpath("data", HELDOUT_SAMPLE).read_text(encoding="utf-8")


__all__ = ["CALIBRATION_TEXT", "HELDOUT_SAMPLE", "sample_text"]
