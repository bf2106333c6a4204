"""The paper's hypothetical throughput (section 3.7, appendix J), following its protocol:

1. per-token time of the transformer blocks only (no embedding, no head), measured for each model on
   its own: the vanilla model's full depth, the looped model's one loop (its LoRAs included), at batch
   sizes up to each model's memory-limited maximum batch;
2. oracle exit trajectories teacher-forced on held-out text, "as if the model generated it": each token
   leaves at the first loop whose argmax equals the final loop's;
3. a queue of such requests served three ways: the vanilla model with static batching and with
   continuous sequence-wise batching (CSB), the looped model with continuous depth-wise batching (CDB).
   Delta_V = CDB / vanilla static, Delta_Seq = CDB / vanilla CSB.

What it leaves out, as the paper does: the exit decision (the head after each loop), the KV entries of
skipped loops, prefill, and scheduling overheads. serving.py measures those on the real engine.
"""

from __future__ import annotations

import time

import torch
from transformers import DynamicCache

# --- 1. per-model step times and memory-limited batches --------------------------------------------


def model_bytes(model) -> int:
    """Bytes of the model's parameters, tied ones counted once."""
    seen = {id(p): p for p in model.parameters()}
    return sum(p.numel() * p.element_size() for p in seen.values())


def kv_bytes_per_sequence(model, context_len: int) -> int:
    """A sequence's KV cache at ``context_len`` tokens: every depth keeps its own keys and values, and a
    prefix-relaxed model (appendix G) its P prefix entries in front of them in every row (serve/cache.py)."""
    c = model.config
    item = next(model.parameters()).element_size()
    entries = context_len + c.prefix_length
    return c.num_hidden_layers * 2 * c.num_key_value_heads * c.head_dim * entries * item


def memory_max_batch(model, memory_mb: float, context_len: int, cap: int) -> int:
    """The largest batch whose weights plus KV caches fit in ``memory_mb`` (the paper grows the batch
    until the memory limit), at most ``cap``. Fewer parameters leave room for more sequences."""
    free = memory_mb * 2**20 - model_bytes(model)
    fits = int(free // kv_bytes_per_sequence(model, context_len))
    if fits < 1:
        raise ValueError(
            f"{memory_mb} MB does not hold the weights and one {context_len}-token KV cache; raise --sim-memory-mb"
        )
    return min(fits, cap)


@torch.no_grad()
def block_step_time(model, batch: int, context_len: int, loops: int, reps: int = 3) -> float:
    """Seconds of one decode step through ``loops`` loops of the transformer blocks (no embedding, no
    head) for ``batch`` sequences holding ``context_len`` tokens of KV cache; best of ``reps``."""
    c = model.config
    dev, dtype = next(model.parameters()).device, next(model.parameters()).dtype
    cache = DynamicCache(config=c)
    prefix = torch.randn(batch, context_len, c.hidden_size, device=dev, dtype=dtype)
    model.model(inputs_embeds=prefix, past_key_values=cache, num_loops=loops)
    step = torch.randn(batch, 1, c.hidden_size, device=dev, dtype=dtype)
    best = float("inf")
    for _ in range(reps):
        started = time.perf_counter()
        model.model(inputs_embeds=step, past_key_values=cache, num_loops=loops)
        best = min(best, time.perf_counter() - started)
        cache.crop(-1)  # drop the timed token: every step sees the same context
    return best


def batch_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, ... up to and including ``max_batch``."""
    sizes = [1]
    while sizes[-1] * 2 < max_batch:
        sizes.append(sizes[-1] * 2)
    return sorted(set(sizes + [max_batch]))


def step_times(model, max_batch: int, context_len: int, loops: int, reps: int = 3) -> dict[int, float]:
    return {n: block_step_time(model, n, context_len, loops, reps) for n in batch_sizes(max_batch)}


def interpolate(table: dict[int, float]):
    """t(n), piecewise linear between the measured batch sizes."""
    ns = sorted(table)

    def t(n: int) -> float:
        if n <= ns[0]:
            return table[ns[0]]
        hi = next(m for m in ns if m >= n)
        lo = max(m for m in ns if m < n)
        return table[lo] + (table[hi] - table[lo]) * (n - lo) / (hi - lo)

    return t


# --- 2. oracle exit trajectories, teacher-forced ---------------------------------------------------


@torch.no_grad()
def oracle_trajectories(model, token_ids: list[int], prefix_len: int, decode_len: int, samples: int) -> list[list[int]]:
    """Per held-out window of prefix_len + decode_len tokens, the oracle exit loop (1..B) of each of
    its last decode_len tokens: the first loop whose argmax equals the final loop's."""
    width = prefix_len + decode_len
    if len(token_ids) < width:
        raise ValueError(
            f"the held-out text has {len(token_ids)} tokens, fewer than one {width}-token "
            f"window; lower --sim-prefix/--sim-decode"
        )
    dev = next(model.parameters()).device
    out = []
    for s in range(0, min(samples, len(token_ids) // width) * width, width):
        ids = torch.tensor([token_ids[s : s + width]], device=dev)
        _, states, _ = model.model(ids, output_loop_states=True)
        arg = torch.stack(
            [model.exit_logits(h[:, prefix_len - 1 : width - 1], loop=i)[0].argmax(-1) for i, h in enumerate(states)]
        )
        first_match = (arg == arg[-1]).int().argmax(0)  # the final loop always matches
        out.append((first_match + 1).tolist())
    return out


# --- 3. the queue, served three ways ----------------------------------------------------------------


def simulate(trajectories: list[list[int]], vanilla: tuple[int, callable], looped: tuple[int, callable]) -> dict:
    """Decode-only throughput (tokens per simulated second). ``vanilla`` = (max batch, t(n) of one
    full-depth step), ``looped`` = (max batch, t(n) of one loop); each model uses its own."""
    (mv, tv), (mr, tr) = vanilla, looped
    total = sum(len(t) for t in trajectories)
    # static: batches of mv in queue order; every step runs the full depth over the whole batch
    t_static = sum(
        max(len(t) for t in trajectories[i : i + mv]) * tv(len(trajectories[i : i + mv]))
        for i in range(0, len(trajectories), mv)
    )
    # continuous sequence-wise: a finished request's slot is refilled at once
    queue, active, t_seq = list(range(len(trajectories))), [], 0.0
    left = [len(t) for t in trajectories]
    while queue or active:
        while queue and len(active) < mv:
            active.append(queue.pop(0))
        t_seq += tv(len(active))
        for a in active:
            left[a] -= 1
        active = [a for a in active if left[a] > 0]
    # continuous depth-wise with oracle exits: one loop per step; an exit frees the slot for the next token
    queue, active, t_cdb = list(range(len(trajectories))), {}, 0.0  # request -> (token index, loop)
    while queue or active:
        while queue and len(active) < mr:
            active[queue.pop(0)] = (0, 0)
        t_cdb += tr(len(active))
        for a, (ti, loop) in list(active.items()):
            if loop + 1 < trajectories[a][ti]:
                active[a] = (ti, loop + 1)
            elif ti + 1 < len(trajectories[a]):
                active[a] = (ti + 1, 0)
            else:
                del active[a]
    thr = {"static": total / t_static, "sequence": total / t_seq, "depth_oracle": total / t_cdb}
    return {
        "tokens_per_s": {k: round(v, 2) for k, v in thr.items()},
        "delta_v": round(thr["depth_oracle"] / thr["static"], 3),
        "delta_seq": round(thr["depth_oracle"] / thr["sequence"], 3),
        "mean_exit_loop": round(sum(map(sum, trajectories)) / total, 3),
    }


def hypothetical(
    vanilla,
    looped,
    token_ids: list[int],
    prefix_len: int = 64,
    decode_len: int = 256,
    samples: int = 8,
    memory_mb: float = 1024,
    batch_cap: int = 64,
    log=None,
) -> dict:
    """The whole protocol; the figures and every input they came from."""
    say = log or (lambda *a: None)
    context = prefix_len + decode_len
    trajectories = oracle_trajectories(looped, token_ids, prefix_len, decode_len, samples)
    timed = {}
    for name, model, loops in (("vanilla", vanilla, None), ("looped", looped, 1)):
        m = memory_max_batch(model, memory_mb, context, batch_cap)
        # per-token time at the mean context of the decode (the paper divides total time by the length)
        table = step_times(model, m, prefix_len + decode_len // 2, loops)
        timed[name] = {"max_batch": m, "step_seconds": {n: round(s, 6) for n, s in table.items()}}
        say(f"  {name}: max batch {m} in {memory_mb} MB, block step times {timed[name]['step_seconds']}")
    sim = simulate(
        trajectories,
        (timed["vanilla"]["max_batch"], interpolate(timed["vanilla"]["step_seconds"])),
        (timed["looped"]["max_batch"], interpolate(timed["looped"]["step_seconds"])),
    )
    B = looped.config.num_loops
    sim.update(
        timed,
        protocol={
            "prefix_len": prefix_len,
            "decode_len": decode_len,
            "samples": len(trajectories),
            "memory_mb": memory_mb,
            "batch_cap": batch_cap,
        },
        oracle_exits_per_loop=[sum(l == i + 1 for t in trajectories for l in t) for i in range(B)],
    )
    return sim
