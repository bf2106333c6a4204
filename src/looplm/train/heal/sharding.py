"""Fully sharded healing (FSDP2), for a student whose training state does not fit one device.

Launched with `accelerate launch --config_file configs/accelerate/fsdp.yaml`, every shared layer (``Block``: the
shared weights with their per-depth LoRA and norms) of the student is sharded over the processes with
``fully_shard``, and so is every layer of the original once its cache is built; the embeddings, final norm, head
and exit adapters stay whole on every process (frozen, or small). A sharded layer's forward gathers its weights and
its backward reduce-scatters, and so averages over the processes, its gradients: also when the local stage runs a
layer once per tied depth before one backward. Checkpoints and the final model hold the full weights, in the files
one process writes: every process takes part in gathering them (``full_state``), the main one writes them."""

from __future__ import annotations

import copy

import torch
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor


def launched() -> bool:
    """Whether the processes were launched with an FSDP config. Accelerate reports FSDP as its distributed type
    on GPUs only (on the CPU the same launch is MULTI_CPU), so the launcher's environment is what tells."""
    from accelerate.utils import parse_flag_from_env

    return parse_flag_from_env("ACCELERATE_USE_FSDP")


def shard_layers(model) -> None:
    """Shard each layer of ``model`` (a LoopLMForCausalLM) over all processes, one FSDP unit per layer; its other
    parameters stay as they are. Each layer is an FSDP root of its own (the local stage runs a layer alone), and a
    root keeps its weights gathered after its forward unless told otherwise: every layer would then stay whole on
    every process until a backward, and what a stage then makes trainable would be the gathered copies, not the
    shards the optimizer holds."""
    for layer in model.model.layers:
        fully_shard(layer, reshard_after_forward=True)


def sharded_copy(model, device):
    """A copy of ``model`` whose layers are sharded as its own are (a sharded module cannot be deep-copied): built
    on the meta device, sharded, then given ``model``'s values."""
    with torch.device("meta"):
        twin = type(model)(copy.deepcopy(model.config))
    shard_layers(twin)
    twin.to_empty(device=device)
    twin.load_state_dict(model.state_dict())
    if twin.config.tie_word_embeddings:
        twin.tie_weights()
    twin.model.rotary.reset()  # its frequencies are not in the state dict
    return twin.eval()


def full_state(state, keep: bool = True):
    """``state`` (a state dict: nested dicts and lists of tensors and numbers) with every sharded tensor gathered
    whole onto the host. Every process must call it, in the same order (a gather is collective); only where ``keep``
    are the whole tensors kept (None elsewhere)."""
    if isinstance(state, DTensor):
        whole = state.full_tensor()
        return whole.cpu() if keep else None
    if isinstance(state, dict):
        return {k: full_state(v, keep) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(full_state(v, keep) for v in state)
    return state


def shard_as(tensor: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The whole ``tensor`` sharded as the parameter ``like`` is (itself when ``like`` is not sharded)."""
    if not isinstance(like, DTensor):
        return tensor
    return distribute_tensor(tensor.to(like.device), like.device_mesh, like.placements)


def shard_optimizer_state(state: dict, opt: torch.optim.Optimizer) -> dict:
    """An optimizer's state dict saved whole (``full_state``) with every per-parameter tensor (a tensor of its
    parameter's shape: AdamW's moments) sharded as its parameter is, ready for ``opt.load_state_dict``."""
    params = [p for group in opt.param_groups for p in group["params"]]
    per_param = {
        i: {k: shard_as(v, params[i]) if torch.is_tensor(v) and v.shape == params[i].shape else v for k, v in s.items()}
        for i, s in state["state"].items()
    }
    return {**state, "state": per_param}
