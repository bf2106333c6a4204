"""`looplm bench`: the maintained benchmarks. Each prints a short table naming the machine and writes its result
as JSON with ``--out FILE``."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..bench.llamacpp import FORMATS
from ..bench.llamacpp import Settings as LlamacppSettings
from ..bench.report import choice_list, token_range
from ..errors import UsageError
from ..settings import setting
from ..train.heal import E2E_ROWS, HealConfig
from ..train.loop import TrainConfig
from ..train.settings import PRECISIONS
from . import command
from .args import call_with, setting_values
from .serve import OnTheFly, check_engine_args

PRECISION_HELP = "auto: bf16 autocast where the hardware has bf16 matmuls"
TRADEOFF = "the exit-policy table and the paper's simulated throughput"
SPECULATION_MODES = ("context", "loop1", "both")


@dataclass
class BenchOutput:
    """What every benchmark is given: threads, and a file for its result."""

    threads: int | None = setting(None, "torch threads (default: torch's own choice)")
    out: str | None = setting(None, "also write the result as JSON to FILE", metavar="FILE")


@dataclass
class Speculate(BenchOutput):
    """Speculative decoding (--speculate) against plain decoding at batch 1, greedy, side by side."""

    models: list[str] = setting([], "embedded names or model directories", positional=True, nargs="+", metavar="MODEL")
    weights: list[str] = setting(
        ["fp32"], f"comma list of weight formats ({', '.join(FORMATS)})", parse=choice_list(*FORMATS)
    )
    modes: list[str] = setting(
        ["context", "loop1", "both"],
        "comma list of speculation modes to time",
        parse=choice_list("context", "loop1", "both"),
    )
    new_tokens: int = setting(256, "generated tokens per prompt (EOS ignored)", minimum=1)
    rounds: int = setting(1, "times each run repeats, interleaved (the best is kept)", minimum=1)
    llamacpp: str | None = setting(
        None,
        "also time llama.cpp on this GGUF file (or an embedded model's own, by name), plain and with its prompt-lookup "
        "decoding, on the same prompts and threads (needs the `bench` extra)",
        metavar="GGUF",
    )
    json: bool = setting(False, "print the result as one JSON object")


@dataclass
class BenchServe(OnTheFly, BenchOutput):
    """Static vs sequence-wise vs depth-wise batching on real-text traces."""

    model: str = setting("smollm2-135m", "the vanilla model (embedded name or directory)", positional=True)
    looped: str | None = setting(None, "a saved looped model (default: convert MODEL on the fly)")
    loops: int = setting(2, "B when converting on the fly")
    requests: int = setting(24, "requests in the trace", minimum=1)
    prompt_len: tuple[int, int] = setting((16, 96), "prompt tokens", parse=token_range, metavar="LO:HI")
    output_len: tuple[int, int] = setting((8, 64), "generated tokens", parse=token_range, metavar="LO:HI")
    arrivals: list[str] = setting(
        ["all", "poisson"], "comma list of all (at once), poisson", parse=choice_list("all", "poisson")
    )
    rate: float | None = setting(
        None,
        "Poisson requests/s (default: about 80%% of the sequence-wise capacity measured on the all-at-once trace)",
    )
    max_batch: int = setting(
        8,
        "requests served at once (KV cache rows)",
        flag="--max-concurrency",
        metavar="N",
        renamed_from=("--max-batch",),
        minimum=1,
    )
    exit: str = setting(
        "softmax:0.9",
        "exit policy[:threshold][+copy[:BONUS]] of the depth-wise run (softmax, margin, entropy, cosine, probe, "
        "oracle, none; +copy: also exit where the loop's argmax continues a repeat of the context, BONUS nats added "
        "to that guess's logit first)",
        flag="--exit-policy",
        metavar="POLICY",
        renamed_from=("--exit",),
    )
    extra: bool = setting(
        False, "also: the other KV mode, and the looped model under sequence-wise batching without exits"
    )
    seed: int = setting(0, "seed of the traces and of an on-the-fly conversion")
    json: bool = setting(False, "print the result as one JSON object (progress goes to stderr)")
    hf: int = setting(
        0,
        "also time transformers generate (batch 1) and generate_batch on the first N requests against our engine "
        "(vanilla, sequence-wise)",
        advanced="the transformers comparison",
    )
    hf_b1: int = setting(
        0,
        "time generate at batch 1 on only the first N of the --hf requests (0: all of them)",
        advanced="the transformers comparison",
    )
    hf_rounds: int = setting(
        1,
        "run generate_batch and our engine in turn this many times (medians and the median of per-round ratios are "
        "reported)",
        advanced="the transformers comparison",
    )
    hf_batch_tokens: int = setting(512, "generate_batch's max_batch_tokens", advanced="the transformers comparison")
    hf_only: bool = setting(
        False, "only the transformers comparison (with --hf N)", advanced="the transformers comparison"
    )
    tradeoff_tokens: int = setting(1024, "held-out tokens for the exit-policy table (0: skip it)", advanced=TRADEOFF)
    sim_samples: int = setting(
        8, "held-out windows for the paper's hypothetical throughput (0: skip it)", advanced=TRADEOFF
    )
    sim_prefix: int = setting(64, "prefix tokens of each simulated request", advanced=TRADEOFF)
    sim_decode: int = setting(256, "decoded tokens of each simulated request", advanced=TRADEOFF)
    sim_memory_mb: float = setting(
        1024, "memory limit that sets each model's largest batch (weights + KV caches)", advanced=TRADEOFF
    )
    sim_max_batch: int = setting(64, "cap on the simulated batch", advanced=TRADEOFF)


@dataclass
class Llamacpp(LlamacppSettings, BenchOutput):
    """Our engine and llama.cpp side by side (needs the `bench` extra)."""


@dataclass
class HealStep(BenchOutput):
    """Seconds of a layer-local, an end-to-end and an exit-adapter step of `looplm heal`."""

    model: str | None = setting(None, "the converted student (a looplm directory)", positional=True)
    teacher: str | None = setting(None, "the original model the student was converted from", required=True)
    data: str | None = setting(None, "a corpus from `looplm data build`", required=True)
    seq_len: int = setting(HealConfig.seq_len, "tokens per row")
    local_batch: int = setting(HealConfig.local_batch, "rows per tied depth of a local step")
    e2e_batch: int = setting(HealConfig.e2e_batch, "rows of an end-to-end step")
    e2e_rows: str = setting(
        HealConfig.e2e_rows,
        "where the end-to-end rows come from: the teacher cache, or any training row with the original run on it "
        "each step",
        choices=E2E_ROWS,
    )
    exit_adapter: str = setting(HealConfig.exit_adapter, "the exit stage's adapter: affine, head-lora:R, or none")
    cache_rows: int = setting(8, "training rows in the teacher cache")
    cache: str | None = setting(None, "keep the teacher cache in DIR (default: a temporary directory)", metavar="DIR")
    precision: str = setting(HealConfig.precision, PRECISION_HELP, choices=PRECISIONS)
    compile: bool = setting(False, "time the steps with each layer through torch.compile")
    rounds: int = setting(2, "timings, each on a fresh copy of the student (the median is reported)", minimum=1)


@dataclass
class TrainStep(BenchOutput):
    """Seconds of a `looplm train` step."""

    model: str | None = setting(None, "the model to train (embedded name, HF or looplm directory)", positional=True)
    data: str | None = setting(None, "a corpus from `looplm data build`", required=True)
    teacher: str | None = setting(None, "distil from this model too (as `looplm train --teacher`)")
    batch_size: int = setting(TrainConfig.batch_size, "sequences per step")
    seq_len: int | None = setting(None, "crop the corpus's rows (default: their full length)")
    steps: int = setting(6, "steps to run", minimum=1)
    warmup: int = setting(2, "first steps left out of the figures", minimum=0)
    precision: str = setting(TrainConfig.precision, PRECISION_HELP, choices=PRECISIONS)


def _report(s: BenchOutput, result: dict, table_of) -> dict:
    """The result with the settings the benchmark ran with; the machine and the benchmark's table (``table_of(result)
    -> (header, rows)``) printed, and the result written to ``--out``."""
    from ..bench.report import finish

    result["settings"] = setting_values(s)
    finish(result, *table_of(result), s.out)
    return result


@command("bench", "speculate")
def cmd_speculate(s: Speculate) -> dict:
    from ..bench.speculate import bench_speculate, speculate_table
    from ..util import machine

    gguf = s.llamacpp
    if gguf:  # before anything loads
        from ..bench.llamacpp import check_available
        from ..models.loading import EMBEDDED, embedded_gguf

        check_available()
        gguf = str(embedded_gguf(gguf)) if gguf in EMBEDDED else gguf
        if not Path(gguf).is_file():
            raise UsageError(f"--llamacpp {gguf}: no such GGUF file; give a file or an embedded model's name")
    result = bench_speculate(s.models, s.weights, s.modes, s.new_tokens, s.rounds, llamacpp=gguf, threads=s.threads)
    result["machine"] = machine()
    return _report(s, result, speculate_table)


@command("bench", "serve")
def cmd_serve(s: BenchServe) -> dict:
    from ..bench.serving import bench_serve, serve_table
    from ..util import machine

    check_engine_args(s)
    if not s.looped and not s.hf_only:  # before anything loads
        from ..serve.on_the_fly import check_unhealed

        check_unhealed(s.model, s.loops, s.allow_unhealed)
    result = bench_serve(s, s.arrivals)
    result["machine"] = {**machine(), **result.get("machine", {})}
    return _report(s, result, serve_table)


@command("bench", "llamacpp")
def cmd_llamacpp(s: Llamacpp) -> dict:
    from ..bench.llamacpp import bench_llamacpp, check_available, llamacpp_table

    check_available()  # before any model loads
    if s.equalize and not s.calib_data:
        raise UsageError("--equalize chooses its scales on calibration rows: add --calib-data DATA")
    r = _report(s, bench_llamacpp(s), llamacpp_table)
    for part, ratios in r["ratios"].items():
        if ratios:
            print(f"{part}: " + ", ".join(f"{k} {v}x" for k, v in ratios.items()))
    return r


@command("bench", "heal-step")
def cmd_heal_step(s: HealStep) -> dict:
    from ..bench.heal_step import heal_step, heal_step_table

    # out: the benchmark's JSON; the steps run in a directory of their own
    cfg = call_with(HealConfig, s, out=None, progress=False)
    return _report(s, heal_step(cfg, s.rounds), heal_step_table)


@command("bench", "train-step")
def cmd_train_step(s: TrainStep) -> dict:
    from ..bench.train_step import train_step, train_step_table

    cfg = call_with(TrainConfig, s, out=None, max_steps=s.steps, progress=False)
    return _report(s, train_step(cfg, s.warmup), train_step_table)
