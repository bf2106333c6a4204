"""The paper's hypothetical throughput protocol (appendix J) on tiny random models."""

import pytest
import torch
from conftest import TINY

from looplm.bench.hypothetical import (
    block_step_time,
    hypothetical,
    interpolate,
    kv_bytes_per_sequence,
    memory_max_batch,
    model_bytes,
    oracle_trajectories,
    simulate,
)
from looplm.convert import convert
from looplm.models import LoopLMConfig, LoopLMForCausalLM


@pytest.fixture(scope="module")
def pair():
    torch.manual_seed(0)
    vanilla = LoopLMForCausalLM(LoopLMConfig(**TINY)).eval()
    return vanilla, convert(vanilla, loops=2, init="stepwise", lora_ranks=4)


def test_simulation_by_hand_each_model_with_its_own_batch_and_time():
    # request 0 exits every token after loop 1, request 1 never exits early
    traj = [[1, 1], [2, 2]]
    sim = simulate(traj, vanilla=(1, lambda n: 2.0), looped=(1, lambda n: 1.0))
    assert sim["tokens_per_s"] == {"static": 0.5, "sequence": 0.5, "depth_oracle": round(4 / 6, 2)}
    # the vanilla step is timed on its own, not as B looped steps
    assert simulate(traj, (1, lambda n: 3.0), (1, lambda n: 1.0))["tokens_per_s"]["static"] == round(4 / 12, 2)
    # the looped model's smaller weights leave room for two sequences: 4 loop steps serve all 4 tokens
    sim = simulate(traj, vanilla=(1, lambda n: 2.0), looped=(2, lambda n: 1.0))
    assert sim["tokens_per_s"]["depth_oracle"] == 1.0 and sim["delta_v"] == 2.0 and sim["mean_exit_loop"] == 1.5


def test_memory_limited_batch_per_model(pair):
    vanilla, looped = pair
    ctx, mb = 32, 4
    # by hand: a sequence's KV cache is 4 depths x (keys, values) x 2 KV heads x 16 dims x 32 tokens x 4 bytes;
    # the weights are transformers' own count of the (unique) parameters x 4 bytes
    kv = 4 * 2 * 2 * 16 * ctx * 4
    for m in pair:
        assert kv_bytes_per_sequence(m, ctx) == kv == 32_768 and model_bytes(m) == 4 * m.num_parameters()
        assert memory_max_batch(m, mb, ctx, cap=10**6) == (4 * 2**20 - 4 * m.num_parameters()) // kv
    assert memory_max_batch(looped, mb, ctx, 10**6) > memory_max_batch(vanilla, mb, ctx, 10**6)
    assert memory_max_batch(looped, mb, ctx, cap=3) == 3
    with pytest.raises(ValueError, match="--sim-memory-mb"):
        memory_max_batch(vanilla, 0.1, ctx, 8)


def test_kv_bytes_count_the_prefix_entries_every_row_holds(pair):
    vanilla, _ = pair
    prefixed = convert(vanilla, loops=2, init="stepwise", lora_ranks=0, prefix_length=5)
    per_entry = 4 * 2 * 2 * 16 * 4  # depths x (k, v) x kv heads x head dim x float32 bytes
    assert kv_bytes_per_sequence(vanilla, 32) == 32 * per_entry
    assert kv_bytes_per_sequence(prefixed, 32) == (32 + 5) * per_entry


def test_block_step_runs_only_the_blocks_of_each_model(pair):
    """Vanilla: its own L layers per step; looped: K layers (one loop); no embedding, no head."""
    calls = {"layers": 0, "embed": 0, "head": 0}

    def counter(key):
        def hook(*_):
            calls[key] += 1

        return hook

    for model, loops, per_step in ((pair[0], None, 4), (pair[1], 1, 2)):
        calls.update(layers=0, embed=0, head=0)
        hooks = [layer.register_forward_hook(counter("layers")) for layer in model.model.layers]
        hooks += [
            model.model.embed_tokens.register_forward_hook(counter("embed")),
            model.lm_head.register_forward_hook(counter("head")),
        ]
        assert block_step_time(model, batch=2, context_len=8, loops=loops, reps=3) > 0
        for h in hooks:
            h.remove()
        assert calls == {"layers": (1 + 3) * per_step, "embed": 0, "head": 0}  # prefill + 3 timed steps


def test_oracle_trajectories_are_teacher_forced_first_matching_loops(pair):
    _, looped = pair
    ids = torch.randint(0, 256, (40,)).tolist()
    traj = oracle_trajectories(looped, ids, prefix_len=6, decode_len=10, samples=5)
    assert len(traj) == 2 and all(len(t) == 10 for t in traj)  # 40 tokens hold two 16-token windows
    with torch.no_grad():
        for w, t in enumerate(traj):
            x = torch.tensor([ids[16 * w : 16 * w + 16]])
            first = looped(x, num_loops=1).logits[0, 5:15].argmax(-1)
            final = looped(x).logits[0, 5:15].argmax(-1)
            assert t == [1 if a == b else 2 for a, b in zip(first.tolist(), final.tolist())]
    with pytest.raises(ValueError, match="--sim-prefix"):
        oracle_trajectories(looped, ids[:10], 6, 10, 1)


def test_interpolation_between_measured_batches():
    t = interpolate({1: 1.0, 2: 2.0, 4: 3.0})
    assert [t(1), t(2), t(3), t(4)] == [1.0, 2.0, 2.5, 3.0]


def test_hypothetical_end_to_end(pair):
    vanilla, looped = pair
    ids = torch.randint(0, 256, (64,)).tolist()
    sim = hypothetical(vanilla, looped, ids, prefix_len=8, decode_len=8, samples=3, memory_mb=4, batch_cap=8)
    assert sum(sim["oracle_exits_per_loop"]) == 3 * 8
    assert sim["vanilla"]["max_batch"] <= sim["looped"]["max_batch"] <= 8
    assert sim["delta_v"] > 0 and sim["delta_seq"] > 0
    assert set(sim["looped"]["step_seconds"]) == {1, 2, 4, sim["looped"]["max_batch"]}
