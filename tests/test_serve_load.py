"""`looplm serve` under concurrent load: 28 clients at once against a real uvicorn server (in a thread) on a small
random relaxed model (B=2) with a byte-level tokenizer (no wheel needed), prompts and outputs of mixed lengths,
half of them streamed. Every request succeeds, every output is the model's own greedy continuation computed
without the server, and nothing is kept afterwards: every KV cache row is free and the process's resident memory
grows by less than RSS_BOUND over a second identical round."""

from __future__ import annotations

import http.client
import json
import random
from concurrent.futures import ThreadPoolExecutor

import psutil  # accelerate's dependency, so always installed
import pytest
from conftest import full_depth_greedy, serve_in_thread, small_relaxed
from test_train_fixtures import byte_tokenizer

from looplm.serve.server import TextStream

pytestmark = pytest.mark.usefixtures("one_torch_thread")
NAME = "tiny-load"
CLIENTS = 28
RSS_BOUND = 48 * 2**20  # bytes a second round of CLIENTS requests may add to the process's resident memory


@pytest.fixture(scope="module")
def served():
    tok = byte_tokenizer()
    model = small_relaxed(vocab_size=len(tok))
    with serve_in_thread(model, tok, NAME, max_concurrency=8, max_queue=CLIENTS, max_seq_len=96) as (url, ls):
        yield model, tok, url, ls


def workload(vocab: int, seed: int = 0) -> list[dict]:
    """CLIENTS greedy requests: prompts of 1-48 token ids, 1-24 new tokens, every other one streamed."""
    rng = random.Random(seed)
    return [
        {
            "prompt": [rng.randrange(vocab) for _ in range(rng.randint(1, 48))],
            "max_tokens": rng.randint(1, 24),
            "stream": i % 2 == 1,
        }
        for i in range(CLIENTS)
    ]


def post(url: str, job: dict) -> tuple[int, str, str | None]:
    """One request over its own connection (the standard library's client): (status, text, finish reason). A
    stream's text is its deltas joined; an error event in a stream counts as status 500."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    body = {"model": NAME, "temperature": 0, "ignore_eos": True, **job}
    conn.request("POST", "/v1/completions", json.dumps(body), {"content-type": "application/json"})
    r = conn.getresponse()
    try:
        if r.status != 200 or not job["stream"]:
            data = json.loads(r.read())
            if r.status != 200:
                return r.status, json.dumps(data), None
            return r.status, data["choices"][0]["text"], data["choices"][0]["finish_reason"]
        text, reason = [], None
        for line in r:
            line = line.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                return 500, json.dumps(event), None
            text.append(event["choices"][0]["text"])
            reason = event["choices"][0]["finish_reason"] or reason
        return r.status, "".join(text), reason
    finally:
        conn.close()


def expected(model, tok, job: dict) -> str:
    """What the client must receive: the full-depth greedy tokens (the model's forward, no cache, no server),
    detokenized as the response carries them (a stream: incrementally)."""
    ids = full_depth_greedy(model, job["prompt"], job["max_tokens"])
    if not job["stream"]:
        return tok.decode(ids, skip_special_tokens=True)
    stream = TextStream(tok, [])
    return "".join(stream.add(t) for t in ids) + stream.flush()


def rss() -> int:
    return psutil.Process().memory_info().rss


def test_concurrent_clients_get_their_own_greedy_output_and_leave_nothing_behind(served, monkeypatch):
    model, tok, url, ls = served
    jobs = workload(len(tok))
    want = [expected(model, tok, j) for j in jobs]
    assert len({len(j["prompt"]) for j in jobs}) > 10 and len({j["max_tokens"] for j in jobs}) > 10
    widest = [0]  # the most requests one engine step served
    observe = ls.metrics.observe_step
    monkeypatch.setattr(
        ls.metrics, "observe_step", lambda items: (widest.__setitem__(0, max(widest[0], len(items))), observe(items))
    )

    rss_after = []
    for _ in range(2):  # the first round also warms up (threads, allocator arenas); the second is measured
        with ThreadPoolExecutor(CLIENTS) as pool:
            got = list(pool.map(lambda j: post(url, j), jobs))
        errors = [(i, g) for i, g in enumerate(got) if g[0] != 200]
        assert not errors, errors
        assert [g[1] for g in got] == want
        assert all(g[2] == "length" for g in got)  # ignore_eos: every request ran to its max_tokens
        assert ls.engine.cache.free_rows == ls.engine.cache.num_rows  # every KV row given back
        assert ls.worker.inflight == 0 and not ls.worker.active
        rss_after.append(rss())
    # the load really was concurrent: every slot busy at once
    assert widest[0] == ls.engine.cache.num_rows
    assert ls.metrics.requests == {"done": 2 * CLIENTS, "error": 0, "cancelled": 0} and not ls.metrics.http_errors
    assert ls.metrics.tokens_total == 2 * sum(j["max_tokens"] for j in jobs)
    grown = rss_after[1] - rss_after[0]
    assert grown < RSS_BOUND, f"a second round of {CLIENTS} requests kept {grown / 2**20:.1f} MiB"
