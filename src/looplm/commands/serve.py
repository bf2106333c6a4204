"""`looplm generate`, `looplm serve` (the HTTP server is serve/server.py), `looplm fit-exit-probe` and `looplm data
generate` (the teacher-text generator drives the engine)."""

from __future__ import annotations

from dataclasses import dataclass

from ..convert.recursive import INITS
from ..errors import UsageError
from ..recipes.teacher_text import GenerateConfig
from ..settings import setting
from . import command
from .args import call_with, write_settings

EXIT_POLICY_HELP = (
    "exit policy[:threshold][+copy[:BONUS]]: softmax, margin, entropy, cosine, probe or none; +copy (or copy alone) "
    "also exits where the loop's argmax continues a repeat of the context, BONUS nats added to that guess's logit "
    "first (e.g. margin:0.49+copy:8)"
)
SCHEDULER_HELP = (
    "static (a batch runs to its end), sequence (continuous batching of whole tokens) or depth (continuous batching "
    "of (token, loop) items: exits free their slot at once)"
)
KV_MODE_HELP = (
    "KV of the loops an exited token skips: copy (its exit state projected through the skipped depths) or later (it "
    "runs them beside its successor: exact, slower at small batches)"
)
SPECULATE_HELP = (
    "speculative decoding, the same tokens as full depth only faster: drafts from the context (prompt lookup: the "
    "tokens that followed the last occurrence of the final n-gram; any model), from the model's own loop 1 (looped "
    "models), or both (the context's where it has one), verified at full depth; off by default; refuses an exit "
    "policy"
)
WEIGHT_FORMATS = ("fp32", "bf16", "int8", "int4")
THREADS_HELP = "torch CPU threads (default: torch's)"


@dataclass
class EngineSettings:
    """What every command that builds an engine is given: weight format, LoRA layout, compilation, speculation."""

    weights: str | None = setting(
        None,
        "weight format: int8 (per-channel) or int4 (group-wise) quantized at load on CPU, with LoRA and norms in "
        "float on top; bf16: the whole model in bfloat16, where the hardware multiplies it natively (AMX, AVX-512 "
        "BF16, CUDA): the fastest batched steps on a CPU with AMX (default: as stored)",
        choices=WEIGHT_FORMATS,
    )
    lora: str | None = setting(
        None,
        "with --weights int8|int4: keep each shared weight once with its per-depth LoRA in float on top (shared, the "
        "default), or quantize W + B_s A_s once per depth (merged: no LoRA matmuls)",
        choices=("shared", "merged"),
    )
    compile: bool = setting(
        False,
        "run each layer's work around attention as torch.compile regions (needs a C++ compiler on CPU; the graphs "
        "are built before serving starts, which takes a minute or more)",
    )
    speculate: str = setting("off", SPECULATE_HELP, choices=("off", "context", "loop1", "both"))
    kv_mode: str = setting("copy", KV_MODE_HELP, choices=("copy", "later"), advanced=True)


@dataclass
class OnTheFly(EngineSettings):
    """A command that can also convert its model at load (serve, bench serve): never healed, so only with consent."""

    allow_unhealed: bool = setting(
        False,
        "serve a model converted at load although no healing has touched it (its output is poor: for tests and "
        "timing only)",
    )
    init: str = setting(
        "stepwise",
        "init when converting at load",
        choices=tuple(i for i in INITS if i != "aware"),  # "aware" needs calibration text
        advanced=True,
    )
    lora_rank: str = setting("64", "LoRA rank when converting at load (0 = recursive; full: full rank)", advanced=True)


@dataclass
class Generate(EngineSettings):
    """Generate text with the serving engine."""

    model: str | None = setting(None, "embedded name or saved model directory", positional=True)
    prompt: list[str] = setting([], "one or more prompts, generated as one batch", positional=True, nargs="+")
    max_new_tokens: int = setting(
        32, "generated tokens per prompt at most", metavar="N", renamed_from=("--max-tokens",)
    )
    temperature: float = setting(0.0, "sampling temperature (0: greedy)")
    top_p: float = setting(1.0, "nucleus sampling: the smallest set of tokens whose probabilities reach this sum")
    top_k: int = setting(0, "sample among the k most likely tokens (0: all)")
    seed: int | None = setting(None, "seed of sampling (default: a random one)")
    exit_policy: str = setting("none", EXIT_POLICY_HELP, renamed_from=("--exit",))
    json: bool = setting(
        False,
        "print one JSON object instead of text: per prompt the token ids and the loop each left at; tokens/s; with "
        "--speculate the acceptance rate and mean accepted length",
    )
    scheduler: str = setting("depth", SCHEDULER_HELP, choices=("static", "sequence", "depth"), advanced=True)


@dataclass
class Serve(OnTheFly):
    """OpenAI-compatible HTTP server on the depth-wise engine."""

    model: str | None = setting(None, "embedded model name or a saved model directory", positional=True)
    host: str = setting("127.0.0.1", "address to listen on")
    port: int = setting(8000, "port to listen on")
    max_concurrency: int = setting(8, "requests served at once (KV cache rows)", minimum=1)
    max_queue: int = setting(64, "requests waiting beyond the slots; more get 429", minimum=0)
    max_seq_len: int = setting(1024, "context per request (prompt + max_tokens - 1)", minimum=2)
    exit_policy: str = setting("none", EXIT_POLICY_HELP + "; for every request unless it asks for full depth")
    device: str | None = setting(None, "torch device (default: where the model loads)")
    threads: int | None = setting(None, THREADS_HELP)
    served_model_name: str | None = setting(None, "the id clients send as `model` (default: MODEL)", advanced=True)
    scheduler: str = setting("depth", SCHEDULER_HELP, choices=("static", "sequence", "depth"), advanced=True)
    loops: int = setting(
        0,
        "convert MODEL to B loops at load (0: serve as saved); such a model was never healed, so this needs "
        "--allow-unhealed",
        advanced=True,
    )
    shutdown_timeout: float = setting(
        10.0, "seconds in-flight requests may finish after SIGINT/SIGTERM before they are failed", advanced=True
    )
    max_body_bytes: int | None = setting(
        None,
        "largest request body accepted, in bytes (default: 1 MiB); a larger one gets 413 (request_too_large)",
        advanced=True,
        minimum=1,
    )
    log_level: str = setting(
        "warning",
        "uvicorn's log level",
        choices=("critical", "error", "warning", "info", "debug", "trace"),
        advanced=True,
    )


@dataclass
class FitExitProbe:
    """Fit the learned exit probe (the `probe` exit policy) of a saved looped model on a corpus' training split."""

    model: str | None = setting(None, "a saved looped model directory (the probe is written into it)", positional=True)
    data: str | None = setting(None, "a corpus from `looplm data build` (its training split is used)", required=True)
    fit_rows: int = setting(32, "training-split rows to fit on")
    calib_rows: int = setting(16, "other training-split rows to calibrate the threshold on")
    target_agreement: float = setting(
        0.95, "calibrate the threshold to this teacher-forced agreement with the final loop"
    )
    threads: int | None = setting(None, THREADS_HELP)
    json: bool = setting(False, "print one JSON object instead of text")
    l2: float = setting(1e-3, "L2 penalty on the standardised weights", advanced=True)
    features: str = setting(
        "hidden",
        "hidden: final-normed hidden state + cosine, decides without the LM head; confidence: top-5 probabilities, "
        "margin, entropy, logit gap, cosine, needs the head on every row but ranks tokens better",
        choices=("hidden", "confidence"),
        advanced=True,
    )


def check_speculate_args(s) -> None:
    """Before the model loads: speculation and an exit policy together are a usage error."""
    policy = getattr(s, "exit_policy", "none")
    if getattr(s, "speculate", "off") != "off" and policy not in ("none", None):
        raise UsageError(
            f"--speculate {s.speculate} gives the full model's tokens and --exit-policy {policy} changes them; "
            "use one or the other"
        )


def check_engine_args(s, device: str = "cpu") -> None:
    """Before the model loads: a weight format this device cannot run, merging a LoRA into float weights, or
    compiling without a compiler is a one-line usage error."""
    if s.weights:
        from ..models.quantized import check_format

        check_format(s.weights, device)
    if s.lora == "merged" and s.weights in ("fp32", "bf16"):
        raise UsageError("--lora merged needs quantized weights (--weights int8 or int4)")
    if s.compile:
        from ..util import check_compile_available

        check_compile_available(device)


# a source of `looplm data build --sources ...,DIR`
@command("data", "generate", help="Sample a training corpus from a model with the serving engine (resumable).")
def cmd_data_generate(s: GenerateConfig) -> int:
    from ..recipes.teacher_text import generate_corpus

    m = generate_corpus(s)
    write_settings(s.out, "looplm data generate", s)
    print(
        f"wrote {s.out}: {m['kept']} samples kept of {m['samples']} ({m['duplicates']} duplicates, "
        f"{m['degenerate']} degenerate), {m['tokens']:,} tokens, {m['tokens_per_second']} tokens/s "
        f"({m['weights']}, {m['machine']['cpu']})"
    )
    return 0


@command("serve")
def cmd_serve(s: Serve) -> int:
    from ..serve.exits import parse_policy
    from ..serve.schedulers import scheduler_name

    policy = parse_policy(s.exit_policy)  # a bad policy is a usage error before the model loads
    if policy.kind == "oracle":
        raise UsageError(
            "the oracle policy is for analysis (it never exits); use softmax, margin, entropy, cosine, probe or none"
        )
    check_engine_args(s, s.device or "cpu")
    check_speculate_args(s)
    s.scheduler = scheduler_name(s.scheduler, s.speculate)
    from ..serve.on_the_fly import check_unhealed

    check_unhealed(s.model, s.loops, s.allow_unhealed)
    from ..serve.server import main

    return main(s)


@command("fit-exit-probe")
def cmd_fit_exit_probe(s: FitExitProbe) -> dict:
    from ..recipes.exit_probe import fit_exit_probe

    report = call_with(fit_exit_probe, s)
    if not s.json:
        at = report["calib_at_threshold"]
        print(
            f"wrote {report['probe']}: threshold {report['threshold']} (calibration rows: "
            f"{at['early_exit_fraction']:.1%} of tokens leave early at {at['agreement']:.3f} agreement with the final "
            f"loop); use it with --exit-policy probe (or probe:THRESHOLD)"
        )
    return report


def _prompt_requests(s: Generate, model, tok) -> list:
    """One request per prompt, special tokens added only where the model's config asks for a BOS."""
    from ..serve import Request
    from ..serve.sampling import SamplingParams

    sp = SamplingParams(s.temperature, s.top_p, s.top_k, s.seed)
    return [
        Request(
            tok(p, add_special_tokens=bool(model.config.add_bos_token))["input_ids"],
            s.max_new_tokens,
            sp,
            eos_token_id=tok.eos_token_id,
        )
        for p in s.prompt
    ]


def _generated(s: Generate, tok, reqs: list, seconds: float, speculator) -> dict:
    """Every figure of a generation: per prompt its text, token ids and the loop each token left at; tokens/s; with
    speculation the acceptance figures. ``ok``: every request finished."""
    from ..serve.speculative import figures

    out = [
        {
            "prompt": p,
            "status": r.status,
            "error": r.error,
            "text": tok.decode(r.output),
            "tokens": len(r.output),
            "token_ids": r.output,
            "exit_loops": r.exit_loops,
            **({"speculation": figures(st)} if speculator and (st := speculator.state_of(r)) else {}),
        }
        for p, r in zip(s.prompt, reqs)
    ]
    total = sum(len(r.output) for r in reqs)
    summary = {"ok": all(r.status == "done" for r in reqs), "results": out, "seconds": round(seconds, 3)}
    summary["tokens_per_second"] = round(total / seconds, 2) if seconds > 0 else None
    if s.speculate != "off":
        summary["speculation"] = {"mode": s.speculate, **figures(speculator.stats)}
    return summary


@command("generate")
def cmd_generate(s: Generate) -> dict:
    from ..models import load_model
    from ..models.quantized import load_dtype, prepare
    from ..serve import Engine
    from ..serve.exits import parse_policy
    from ..serve.schedulers import make_scheduler, replay, scheduler_name, warm_up

    check_engine_args(s)
    check_speculate_args(s)
    model, tok = load_model(s.model, dtype=load_dtype(s.weights))
    model = prepare(model, s.weights, lora=s.lora)
    reqs = _prompt_requests(s, model, tok)
    need = max(len(r.prompt) for r in reqs) + s.max_new_tokens
    engine = Engine(
        model,
        max_batch=max(1, min(len(reqs), 16)),
        max_seq_len=max(need, 64),
        exit_policy=parse_policy(s.exit_policy),
        kv_mode=s.kv_mode,
        compile=s.compile,
    )
    warm_up(engine)
    scheduler = make_scheduler(scheduler_name(s.scheduler, s.speculate), engine)
    res = replay(scheduler, reqs)
    summary = _generated(s, tok, reqs, res["seconds"], getattr(scheduler, "speculator", None))
    if not s.json:
        for o in summary["results"]:
            print(o["prompt"] + (o["text"] if o["status"] == "done" else f"  [error: {o['error']}]"))
    return summary
