"""A run on several processes, `looplm train`'s and healing's alike: one way to reduce gradients, and fully sharded
layers (FSDP2) for a model whose training state does not fit one device.

Data parallel (``accelerate launch`` with configs/accelerate/ddp.yaml, or torchrun): every process holds the whole
model, computes the loss on its share of a step's rows, and ``average_gradients`` replaces each gradient by its mean
over the processes before the update (one all-reduce of them all, flattened), so that every process takes the step of
the mean loss over all of the step's rows. One call after the backward passes, not a DDP wrapper: healing's local
stage runs a shared layer once per tied depth before one backward, which DDP's one forward per backward does not
allow, and gradient accumulation then needs no ``no_sync``.

Sharded (configs/accelerate/fsdp.yaml): every layer (``Block``: the shared weights with their per-depth LoRA and
norms) is sharded over the processes with ``fully_shard`` (``shard_layers``); the embeddings, final norm, head and
exit adapters stay whole on every process. A sharded layer's forward gathers its weights and its backward
reduce-scatters, and so averages, its gradients; ``average_gradients`` averages the rest. Checkpoints and the final
model hold the full weights, in the files one process writes: every process takes part in gathering them
(``full_state``), the main one writes them."""

from __future__ import annotations

import copy

import torch
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor


def start_processes(command: str):
    """The processes torchrun or ``accelerate launch`` started (one when neither did; an Accelerator, used for its
    process group and device only), on CUDA when there is one. Refused under a launch this module does not reduce
    gradients for (DeepSpeed, Megatron, XLA)."""
    from accelerate import Accelerator

    from ..errors import UsageError

    processes = Accelerator(mixed_precision="no", cpu=not torch.cuda.is_available())
    if processes.distributed_type.name not in ("NO", "MULTI_CPU", "MULTI_GPU", "FSDP"):
        raise UsageError(
            f"looplm {command} runs on one process, data parallel or fully sharded (FSDP2), not under "
            f"{processes.distributed_type.name}; launch it with torchrun, or `accelerate launch --config_file "
            f"configs/accelerate/ddp.yaml` (fsdp.yaml for a model whose training state does not fit one device)"
        )
    return processes


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


def apart_by_sharding(groups: list[dict]) -> list[dict]:
    """An optimizer's parameter groups split so that none mixes sharded and whole parameters: a fused AdamW step
    over one group takes either kind, not both."""
    split = []
    for group in groups:
        for sharded in (True, False):
            params = [p for p in group["params"] if isinstance(p, DTensor) == sharded]
            if params:
                split.append({**group, "params": params})
    return split


def average_gradients(params) -> None:
    """Each gradient of ``params`` replaced by its mean over the processes; a sharded parameter's gradient is left
    alone (its backward's reduce-scatter averaged it already)."""
    from accelerate.utils import reduce

    grads = [p.grad for p in params if p.grad is not None and not isinstance(p.grad, DTensor)]
    if not grads:
        return
    mean = reduce(torch.cat([g.reshape(-1) for g in grads]), reduction="mean")
    for g, m in zip(grads, mean.split([g.numel() for g in grads])):
        g.copy_(m.view_as(g))


def clip_gradients(params, clip: float) -> torch.Tensor:
    """The gradients of ``params`` scaled to total norm at most ``clip``; their total norm before. Sharded and whole
    gradients are normed apart and their norms combined: one ``clip_grad_norm_`` takes either kind, not both. The
    norm stays a tensor: reading it would wait for the device."""
    from torch.nn.utils import clip_grads_with_norm_, get_total_norm

    params = [p for p in params if p.grad is not None]
    groups = [
        g
        for g in (
            [p for p in params if isinstance(p.grad, DTensor)],
            [p for p in params if not isinstance(p.grad, DTensor)],
        )
        if g
    ]
    if not groups:
        return torch.zeros(())
    norms = [get_total_norm([p.grad for p in g]) for g in groups]
    norm = torch.linalg.vector_norm(torch.stack([n.full_tensor() if isinstance(n, DTensor) else n for n in norms]))
    for g in groups:
        clip_grads_with_norm_(g, clip, norm)
    return norm


def mean_values(processes, values: dict) -> dict:
    """Each of ``values`` (floats: this process's losses on its share of a step) averaged over the processes."""
    if processes is None or processes.num_processes == 1:
        return values
    from accelerate.utils import reduce

    mean = reduce(torch.tensor(list(values.values()), device=processes.device), reduction="mean")
    return dict(zip(values, mean.tolist()))


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
