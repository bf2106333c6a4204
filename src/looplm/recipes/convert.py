"""The conversion recipe behind `looplm convert`: the settings (``ConvertConfig``) and ``convert_model``, which
loads the original, picks the plan (middle-cycle unless the model's attention pattern leaves none), the relaxation
(the LoRA rank that keeps N-emb at the paper's cycle plan's at rank 64) and the calibration a data-aware init needs,
then converts. From Python it is the command line's conversion::

    from looplm.recipes import ConvertConfig, convert_model
    looped, tok, report = convert_model(ConvertConfig("smollm2-135m"))
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from ..convert.recursive import INITS, LORA_INITS, NORMS
from ..data import sample_text
from ..errors import UsageError
from ..models.plan import SHARING_STRATEGIES
from ..settings import setting
from ..util import Timer, read_text_arg

BEST = "the defaults are the conversion that heals best"


def _note(message: str) -> None:
    print(f"looplm convert: {message}", file=sys.stderr)


@dataclass
class ConvertConfig:
    """How `looplm convert` (and ``convert_model``) makes a looped model: each field a ``setting``, its default the
    recommended recipe."""

    model: str = setting("smollm2-135m", "embedded name, HF/looplm directory or .gguf file", positional=True)
    loops: int = setting(2, "B, the number of loops of the core")
    lora_rank: str | None = setting(
        None,
        "rank of every per-depth LoRA (0 = plain recursive, 'full'; default: the largest rank that keeps N-emb at "
        "most the paper's cycle plan's at rank 64, 56 for SmolLM2-135M middle-cycle; 0 with --relax prefix)",
    )
    out: str | None = setting(
        None, "output directory (default: out/<model>-b<loops>[-<sharing>]-r<rank>, the default plan unnamed)"
    )
    calib_data: list[str] = setting(
        [],
        "calibration data for the data-aware init: a corpus from `looplm data build` (its first training rows) or "
        "a directory of training-split .txt files (repeatable; default: a text the package ships, rows of the "
        "default corpus's training split)",
        repeat=True,
        metavar="DIR",
    )
    calib_text: list[str] = setting(
        [],
        "a training-split text file to calibrate on (repeatable; never held-out text; default: none)",
        repeat=True,
        metavar="FILE",
    )
    calib_tokens: int = setting(8192, "calibration tokens run through the original model")
    ppl_tokens: int = setting(
        2048,
        "tokens of held-out text scored before and after (0 = skip)",
        flag="--scored-tokens",
        metavar="N",
        renamed_from=("--ppl-tokens",),
    )
    text: str | None = setting(None, "held-out text for that perplexity (default: a Milton sample)")
    strategy: str | None = setting(
        None,
        "the core's pattern: depth d runs shared layer d mod K (cycle), d div B (sequence) or cycle with the last "
        "loop reversed (cycle-rev); middle-cycle and middle-sequence keep the first and the last layer unique "
        "(default: middle-cycle, or cycle where the model's attention pattern leaves no middle-cycle plan)",
        flag="--sharing",
        choices=SHARING_STRATEGIES,
        renamed_from=("--strategy",),
        advanced=BEST,
    )
    prelude: int = setting(
        0,
        "the original's first P layers run once, unique and exact, before the looped core",
        metavar="P",
        advanced=BEST,
    )
    coda: int = setting(
        0,
        "the original's last C layers run once, unique and exact, after the looped core (and after every exit); a "
        "remainder of core layers that B does not divide joins them",
        metavar="C",
        advanced=BEST,
    )
    init: str = setting(
        "average",
        "shared weights from the layers they replace (average, aware: needs calibration) or from one of them "
        "(stepwise, stepwise-start, lower, upper: the core's last K), or random",
        choices=INITS,
        advanced=BEST,
    )
    lora_init: str = setting(
        "aware-svd",
        "per-depth LoRA: SVD of each depth's residual, weighted by the original's inputs on the calibration text "
        "(aware-svd), unweighted (svd), or zero",
        choices=LORA_INITS,
        advanced=BEST,
    )
    norms: str | None = setting(
        None,
        "per-depth norm vectors, or tied ones (default: per-depth with a data-aware init; else tied-choice for "
        "stepwise/lower, which copy one layer, tied-avg for average)",
        choices=NORMS,
        advanced=BEST,
    )
    relax: str = setting(
        "lora",
        "per-depth relaxation: LoRA (section 2.3) or learned prefixes (appendix G)",
        choices=("lora", "prefix"),
        advanced=BEST,
    )
    lora_ranks: str | None = setting(None, "per-group ranks, e.g. q=128,kv=64,out=128,ffn=256", advanced=BEST)
    prefix_length: int | None = setting(
        None, "with --relax prefix: learned prefix vectors per depth (default 64)", advanced=BEST
    )
    loop_scale: bool = setting(
        False,
        "scale each loop's output by a vector of its own, initialised to ones (Mixture-of-Recursions' per-recursion "
        "vector; a cycle core only; the model then has no vanilla equivalent to unroll or export)",
        advanced=BEST,
    )
    magnitude: bool = setting(
        False,
        "a vector per depth scaling each shared linear's output, initialised to ones (DoRA's magnitude beside the "
        "LoRA)",
        advanced=BEST,
    )
    calib_seq_len: int = setting(512, "calibration window length in tokens", advanced=BEST)
    calib_damp: float = setting(0.01, "damping of the input statistics, relative to their mean diagonal", advanced=BEST)
    calib_no_fold_norms: bool = setting(
        False, "do not account for tied norm weights in the data-aware objective", advanced=BEST
    )
    seed: int = setting(0, "seed of the random init and of random LoRA factors", advanced=BEST)


def default_out(c: ConvertConfig, rank, prefix: int) -> Path:
    """out/<model>-b<loops>[-<sharing>][-pre<P>][-coda<C>]-r<rank>[-p<prefix>], the default plan unnamed."""
    plan = "" if (c.strategy, c.prelude, c.coda) == ("middle-cycle", 0, 0) else f"-{c.strategy}"
    plan += (f"-pre{c.prelude}" if c.prelude else "") + (f"-coda{c.coda}" if c.coda else "")
    return Path("out") / (f"{Path(c.model).name}-b{c.loops}{plan}-r{rank}" + (f"-p{prefix}" if prefix else ""))


def convert_model(c: ConvertConfig, log=_note):
    """The original of ``c.model`` converted as ``c`` says: (looped model, tokenizer, report). The report holds N-emb
    and total parameters before and after, the LoRA ranks, the prefix, the calibration, the seconds taken, the
    output directory the command writes to and, with ``ppl_tokens``, the perplexity before and after on ``text``.
    ``c`` is completed with the defaults taken (``strategy``, ``norms``)."""
    from ..convert import convert, parse_lora_ranks
    from ..models import load_model

    with Timer() as t_load:
        vanilla, tok = load_model(c.model)
    depth_plan = _plan(c, vanilla.config, log)
    rank, prefix = _relaxation(c, vanilla, depth_plan)
    ranks = parse_lora_ranks(c.lora_ranks, rank)
    data_aware = c.init == "aware" or (c.lora_init == "aware-svd" and any(ranks.values()))
    if c.norms is None and data_aware:
        c.norms = "per-depth"  # a data-aware init fits each depth; tied norms would undo part of that fit
    text = read_text_arg(c.text) if c.text else sample_text()
    calibration = _calibration(c, vanilla, tok, text, data_aware, log)
    with Timer() as t_conv:
        model = convert(
            vanilla,
            loops=c.loops,
            strategy=c.strategy,
            init=c.init,
            norms=c.norms,
            lora_ranks=ranks,
            lora_init=c.lora_init,
            seed=c.seed,
            calibration=calibration,
            prefix_length=prefix,
            prelude=c.prelude,
            coda=c.coda,
            loop_scale=c.loop_scale,
            magnitude=c.magnitude,
        )
    _note_capped_ranks(model, log)
    report = _report(c, vanilla, model, rank, prefix, t_load.seconds, t_conv.seconds)
    if calibration is not None:
        report["calibration"] = calibration.summary()
    if c.ppl_tokens:
        report.update(_perplexities((vanilla, model), tok, text, c.ppl_tokens))
    return model, tok, report


def _note_capped_ranks(model, log) -> None:
    """Tell which LoRA ranks asked for the linears' sizes capped."""
    for group, (asked, used) in model.config.conversion.get("capped_ranks", {}).items():
        log(
            f"note: LoRA rank {asked} for group {group} is capped at {used}, the min(in, out) of its linears (a "
            f"higher rank adds nothing)"
        )


def _report(c: ConvertConfig, vanilla, model, rank, prefix: int, load_seconds: float, convert_seconds: float) -> dict:
    """The conversion's report without calibration and perplexity: where it goes, the time taken, the sizes."""
    from ..convert import count_parameters

    before, after = count_parameters(vanilla), count_parameters(model)
    return {
        "out": str(Path(c.out) if c.out else default_out(c, rank, prefix)),
        "load_seconds": round(load_seconds, 2),
        "convert_seconds": round(convert_seconds, 2),
        "n_emb_before": before["n_emb"],
        "n_emb_after": after["n_emb"],
        "total_before": before["total"],
        "total_after": after["total"],
        "lora_ranks": model.config.lora_ranks,
        "prefix_length": prefix,
        "prefix_params": after["prefix"],
    }


def _perplexities(models, tok, text: str, tokens: int) -> dict:
    """The perplexity of the original and the looped model on the first ``tokens`` tokens of held-out ``text``."""
    from ..eval.perplexity import perplexity

    scored = [perplexity(m, tok, text, seq_len=512, max_tokens=tokens) for m in models]
    return dict(ppl_before=scored[0]["perplexity"], ppl_after=scored[1]["perplexity"], ppl_tokens=scored[1]["tokens"])


def _plan(s, config, log):
    """The depth plan asked for; with --sharing left out, middle-cycle, the plan that heals best at the default's
    N-emb (docs/RESULTS.md, "Sharing plans"), where the model's attention pattern lets a shared block keep one
    attention kind; else (Gemma-3's 5:1 sliding/full layers) the paper's cycle, whose blocks keep their depths'
    kinds as they always did. A plan that does not fit is refused here, naming the fix."""
    from ..models.plan import DepthPlan, MixedAttentionError

    def plan(sharing: str) -> DepthPlan:
        return DepthPlan(config.num_hidden_layers, s.loops, sharing, s.prelude, s.coda, config.depth_attention)

    if s.strategy is not None:
        return plan(s.strategy)
    try:
        s.strategy = "middle-cycle"
        return plan(s.strategy)
    except MixedAttentionError:
        s.strategy = "cycle"
        log(f"note: the model's attention pattern leaves no middle-cycle plan at --loops {s.loops}; using cycle")
        return plan(s.strategy)


def _relaxation(s, vanilla, plan) -> tuple[str, int]:
    """(--lora-rank, --prefix-length) after the defaults of --relax: LoRA at the rank that keeps N-emb at the paper's
    cycle plan's at rank 64 and no prefix, or prefix length 64 and LoRA rank 0 (an explicit --lora-rank adds LoRA
    to the prefixes)."""
    prefix = s.prefix_length
    if prefix is not None and prefix < 0:
        raise UsageError(f"--prefix-length must be >= 0, got {prefix}")
    if s.relax == "lora":
        if prefix:
            raise UsageError("--prefix-length needs --relax prefix")
        if s.lora_rank is not None:
            return s.lora_rank, 0
        from ..convert import equal_nemb_rank

        return str(equal_nemb_rank(vanilla, plan)), 0
    prefix = 64 if prefix is None else prefix
    if prefix < 1:
        raise UsageError(f"--prefix-length must be >= 1 with --relax prefix, got {prefix}")
    return s.lora_rank or "0", prefix


def _calibration(s, vanilla, tok, heldout: str, data_aware: bool, log):
    """Input statistics of the original model on --calib-text / --calib-data, or on the shipped calibration
    text when the init is data-aware and none is given (None when nothing asks for them)."""
    if not (s.calib_text or s.calib_data or data_aware):
        return None
    from ..convert import aware
    from ..data import CALIBRATION_TEXT
    from ..models import ConfigError

    files = s.calib_text if s.calib_text or s.calib_data else [CALIBRATION_TEXT]
    corpora = [d for d in s.calib_data if (Path(d) / "meta.json").exists()]
    try:
        texts, paths = aware.read_calibration_texts(files, [d for d in s.calib_data if d not in corpora])
    except ConfigError as e:
        raise UsageError(str(e)) from None
    for d in corpora:
        texts.append(_corpus_text(d, s.calib_tokens))
        paths.append(d)
    if aware.shares_text(texts, heldout) or aware.shares_text(texts, sample_text()):
        raise UsageError(
            "the calibration text contains held-out text (the --text file or the built-in Milton "
            "sample): calibrate on a training split only"
        )
    if s.norms != "per-depth" and (vanilla.config.sandwich_norms or vanilla.config.qk_norm):
        # Measured on Gemma-3-270M at B=3, rank 64: aware-svd 2.5e16 with tied-avg norms, 1,286 per-depth.
        log(
            "warning: this model's post-attention/post-FFN or q/k norms sit after a linear and cannot be folded into "
            "the data-aware LoRA, so tied norms undo it; use --norms per-depth"
        )
    windows = aware.text_windows(
        tok, texts, s.calib_seq_len, s.calib_tokens, add_bos=bool(getattr(vanilla.config, "add_bos_token", False))
    )
    source = paths[0] if len(paths) == 1 else f"{len(paths)} files"
    return aware.collect_calibration(
        vanilla, windows, damp=s.calib_damp, fold_norms=not s.calib_no_fold_norms, source=source
    )


def _corpus_text(corpus_dir: str, tokens: int) -> str:
    """The first training rows of a built corpus, decoded: at least ``tokens`` tokens of calibration text."""
    from ..data.corpus import PackedCorpus

    corpus = PackedCorpus(corpus_dir)
    return corpus.training_text(range(min(len(corpus.splits["train"]), -(-tokens // corpus.meta["seq_len"]) + 1)))
