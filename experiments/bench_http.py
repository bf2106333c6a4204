"""HTTP load test for `looplm serve` on loopback, against the in-process engine on the same trace.

1. Builds (or loads) a model and saves it to a temporary directory, so that the server and the
   in-process run use the very same weights.
2. In-process: the trace through `run_trace` (the code `looplm bench serve` uses for its depth-wise
   run): same model, scheduler, slots and exit policy, all requests queued at t=0.
3. Over HTTP: `looplm serve DIR` in a subprocess; a bounded async client (httpx2, shipped with the
   openai client) sends the same requests (token-id prompts, greedy, ignore_eos so every request
   makes exactly its max_tokens) with at most --concurrency in flight, then stops.
Reports tokens/s, latency p50/p99 (and TTFT with --stream), errors, and the HTTP/in-process ratio.

    OMP_NUM_THREADS=1 PYTHONPATH=src nice -n 5 python benchmarks/bench_http.py --requests 200 --concurrency 32
    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/bench_http.py --model smollm2-135m --loops 2 --requests 16 \\
        --concurrency 8 --output-len 8:32
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch


def _range(text):
    lo, _, hi = text.partition(":")
    return int(lo), int(hi or lo)


def build_model(args):
    from looplm.convert import convert
    from looplm.models import LoopLMConfig, LoopLMForCausalLM, load_model
    if args.model == "random":
        _, tok = load_model("smollm2-135m")  # only its tokenizer
        torch.manual_seed(args.seed)
        model = LoopLMForCausalLM(LoopLMConfig(vocab_size=len(tok), hidden_size=args.hidden,
                                               intermediate_size=3 * args.hidden, num_hidden_layers=args.layers,
                                               num_attention_heads=4, num_key_value_heads=2))
        desc = f"random {args.layers} layers x {args.hidden} hidden, SmolLM2 tokenizer"
    else:
        model, tok = load_model(args.model)
        desc = args.model
    if args.loops > 1:
        model = convert(model, loops=args.loops, init="stepwise", lora_ranks=args.lora_rank, norms="per-depth",
                        seed=args.seed)
        desc += f", converted to B={args.loops} (stepwise, LoRA {args.lora_rank}, per-depth norms)"
    return model.eval(), tok, desc


def percentile(xs, q):
    from looplm.serve.bench import percentile as p
    v = p(xs, q)
    return None if v is None else round(v, 4)


async def http_run(url, name, trace, concurrency, stream):
    import httpx2 as httpx
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    results = []

    async def one(client, r):
        body = {"model": name, "prompt": r["prompt"], "max_tokens": r["max_tokens"], "temperature": 0,
                "ignore_eos": True, "stream": stream}
        async with sem:
            t0 = time.perf_counter()
            ttft, tokens, status, error = None, 0, None, None
            try:
                if stream:
                    async with client.stream("POST", "/v1/completions", json=body) as resp:
                        status = resp.status_code
                        async for line in resp.aiter_lines():
                            if not line.startswith("data: ") or line == "data: [DONE]":
                                continue
                            ev = json.loads(line[6:])
                            if "error" in ev:
                                error = ev["error"]["message"]
                            elif ev["choices"] and ev["choices"][0]["text"] and ttft is None:
                                ttft = time.perf_counter() - t0
                    tokens = r["max_tokens"] if error is None and status == 200 else 0
                else:
                    resp = await client.post("/v1/completions", json=body)
                    status = resp.status_code
                    if status == 200:
                        tokens = resp.json()["usage"]["completion_tokens"]
                    else:
                        error = resp.text[:200]
            except Exception as e:  # a transport error is a failed request, counted, not fatal
                error = f"{type(e).__name__}: {e}"
            results.append({"start": t0, "end": time.perf_counter(), "ttft": ttft, "tokens": tokens,
                            "status": status, "error": error})

    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        t = time.perf_counter()
        await asyncio.gather(*(one(client, r) for r in trace))
        wall = time.perf_counter() - t
    ok = [r for r in results if r["status"] == 200 and r["error"] is None]
    span = max(r["end"] for r in results) - min(r["start"] for r in results)
    tokens = sum(r["tokens"] for r in ok)
    out = {"requests": len(results), "ok": len(ok), "errors": len(results) - len(ok),
           "error_samples": [r["error"] or r["status"] for r in results if r not in ok][:3],
           "tokens": tokens, "seconds": round(span, 3), "wall_seconds": round(wall, 3),
           "tokens_per_s": round(tokens / span, 2), "requests_per_s": round(len(ok) / span, 3),
           "latency_p50": percentile([r["end"] - r["start"] for r in ok], 0.5),
           "latency_p99": percentile([r["end"] - r["start"] for r in ok], 0.99)}
    if stream:
        out["ttft_p50"] = percentile([r["ttft"] for r in ok], 0.5)
        out["ttft_p99"] = percentile([r["ttft"] for r in ok], 0.99)
    return out


def scrape(text) -> dict[str, float]:
    """Prometheus text -> {name{labels}: value}."""
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith("looplm_")}


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model_dir, name, args, max_seq_len):
    import httpx2 as httpx
    port = free_port()
    cmd = [sys.executable, "-m", "looplm.cli", "serve", str(model_dir), "--port", str(port), "--served-model-name",
           name, "--max-concurrency", str(args.max_batch), "--max-queue", str(args.requests),
           "--max-seq-len", str(max_seq_len), "--exit-policy", args.exit, "--kv-mode", args.kv_mode,
           "--scheduler", "depth", "--threads", str(args.threads)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while True:
        if proc.poll() is not None:
            raise RuntimeError("server exited:\n" + proc.stdout.read())
        try:
            if httpx.get(url + "/health").status_code == 200:
                return proc, url, cmd
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError("server did not come up")
        time.sleep(0.2)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="random", help="'random' (a small random model) or a model name/directory")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--loops", type=int, default=2, help="convert to B loops (1: as is)")
    ap.add_argument("--lora-rank", type=int, default=16)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--concurrency", type=int, default=32, help="client requests in flight")
    ap.add_argument("--max-batch", type=int, default=8, help="server slots (= in-process max_batch)")
    ap.add_argument("--prompt-len", type=_range, default=(16, 96))
    ap.add_argument("--output-len", type=_range, default=(8, 64))
    ap.add_argument("--exit", default="softmax:0.9")
    ap.add_argument("--kv-mode", default="copy", choices=["copy", "later"])
    ap.add_argument("--stream", action="store_true", help="SSE streaming requests (adds TTFT)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=2, help="alternating in-process / HTTP runs")
    ap.add_argument("--out", default=None, help="write the JSON result here")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from looplm.models import save_model
    from looplm.serve.bench import heldout_text, make_trace, run_trace
    from looplm.serve.exits import parse_policy

    model, tok, desc = build_model(args)
    ids = tok(heldout_text(), add_special_tokens=False)["input_ids"]
    trace = make_trace(ids, args.requests, args.prompt_len, args.output_len, "all", seed=args.seed)
    max_seq_len = args.prompt_len[1] + args.output_len[1]
    result = {"model": desc, "requests": args.requests, "concurrency": args.concurrency,
              "max_batch": args.max_batch, "exit_policy": args.exit, "kv_mode": args.kv_mode, "stream": args.stream,
              "prompt_len": args.prompt_len, "output_len": args.output_len, "threads": args.threads,
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "command": "python benchmarks/bench_http.py " + " ".join(argv if argv is not None else sys.argv[1:])}

    print(f"{desc}; {args.requests} requests, prompts {args.prompt_len}, outputs {args.output_len}", flush=True)
    import httpx2 as httpx
    policy = parse_policy(args.exit)
    rounds = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = save_model(model, tok, Path(tmp) / "model")
        proc, url, cmd = start_server(model_dir, "bench", args, max_seq_len)
        try:
            # alternate in-process and HTTP runs: on a shared machine the load drifts between runs
            for r in range(args.rounds):
                fig, _, engine = run_trace(model, trace, "depth", args.max_batch, max_seq_len, policy, args.kv_mode)
                inproc = {k: fig[k] for k in ("tokens", "seconds", "tokens_per_s", "ttft_p50", "ttft_p99",
                                              "exits_per_loop", "failed", "steps")}
                inproc["step_seconds"] = round(engine.stats["stage_seconds"], 3)
                print(f"  round {r + 1} in-process (run_trace, depth): {fig['tokens_per_s']} tok/s over "
                      f"{fig['seconds']} s, {fig['steps']} steps taking {inproc['step_seconds']} s, "
                      f"exits/loop {fig['exits_per_loop']}", flush=True)
                before = scrape(httpx.get(url + "/metrics").text)
                http = asyncio.run(http_run(url, "bench", trace, args.concurrency, args.stream))
                after = scrape(httpx.get(url + "/metrics").text)
                delta = {k: after[k] - before.get(k, 0) for k in after}
                http["server_exits_per_loop"] = [int(delta[k]) for k in sorted(delta) if k.startswith("looplm_exits_total")]
                http["server_errors"] = int(delta["looplm_errors_total"])
                http["server_steps"] = int(delta["looplm_engine_steps_total"])
                # time inside engine steps: how much of the HTTP run's span the engine was computing
                http["server_step_seconds"] = round(delta["looplm_engine_step_seconds_total"], 3)
                ratio = round(http["tokens_per_s"] / fig["tokens_per_s"], 3)
                print(f"  round {r + 1} HTTP ({'stream' if args.stream else 'non-stream'}, {args.concurrency} "
                      f"concurrent): {http['tokens_per_s']} tok/s over {http['seconds']} s, {http['requests_per_s']} "
                      f"req/s, latency p50 {http['latency_p50']} s p99 {http['latency_p99']} s"
                      + (f", TTFT p50 {http['ttft_p50']} s p99 {http['ttft_p99']} s" if args.stream else "")
                      + f", errors {http['errors']}, {http['server_steps']} steps taking {http['server_step_seconds']} s, "
                      f"exits/loop {http['server_exits_per_loop']}; HTTP / in-process {ratio}", flush=True)
                rounds.append({"in_process": inproc, "http": http, "http_vs_in_process": ratio})
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
    result["rounds"] = rounds
    result["server_command"] = " ".join(["looplm", "serve", "<model dir>", "--port", "<free port>"] + cmd[7:])
    tok_in = sum(r["in_process"]["tokens"] for r in rounds) / sum(r["in_process"]["seconds"] for r in rounds)
    tok_http = sum(r["http"]["tokens"] for r in rounds) / sum(r["http"]["seconds"] for r in rounds)
    result["in_process_tokens_per_s"], result["http_tokens_per_s"] = round(tok_in, 2), round(tok_http, 2)
    result["http_vs_in_process"] = round(tok_http / tok_in, 3)
    result["http_errors"] = sum(r["http"]["errors"] for r in rounds)
    print(f"  over {len(rounds)} rounds: in-process {tok_in:.1f} tok/s, HTTP {tok_http:.1f} tok/s, "
          f"HTTP / in-process {result['http_vs_in_process']}, HTTP errors {result['http_errors']}", flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2))
        print(f"wrote {args.out}")
    return 0 if result["http_errors"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
