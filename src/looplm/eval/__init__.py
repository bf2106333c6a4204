"""Evaluation: perplexity (per loop exit), few-shot tasks through lm-evaluation-harness, reports."""

from .perplexity import perplexity

__all__ = ["perplexity"]
