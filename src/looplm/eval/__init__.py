"""Evaluation: perplexity (per loop exit), few-shot tasks through lm-evaluation-harness, reports.

``perplexity`` is imported here; the lm-eval parts load lazily (lm-eval is slow to import):
``looplm.eval.lm_eval_adapter`` (registers the lm-eval model "looplm"), ``looplm.eval.fewshot``
(``run_fewshot``), ``looplm.eval.tasks`` (task files, ``PAPER7``), ``looplm.eval.report``.
See docs/guides/evaluate.md."""

from .perplexity import perplexity

__all__ = ["perplexity"]
