"""How a training run spreads over `torchrun` processes: one process, DDP, or FSDP.

- DDP (`--parallel ddp`, the default under torchrun): every process holds the whole drafter and
  its optimizer state; gradients are averaged after each backward.
- FSDP (`--parallel fsdp`, FSDP2's `fully_shard` per draft layer, its attention and the root): each process
  holds 1/N of the drafter's weights, gradients and Adam moments, gathering a layer's weights for
  its forward and backward only. For drafters of big targets (a Qwen3-8B drafter: ~1B trained
  parameters, 16 GB of fp32 weights and moments before sharding). The target itself stays whole
  on every process (frozen, bf16 on CUDA): FSDP here shards what training adds, not the target.

Both normalise the loss by the global batch's weight, so N processes train as one process on the
same global batch. Saving, evaluation and resuming see whole tensors: under FSDP every process
joins in gathering them (`full_state`), then rank 0 writes or scores an unsharded copy.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from ..errors import BlockdraftError

KINDS = ("ddp", "fsdp")


@dataclass
class Parallel:
    rank: int = 0
    world: int = 1
    kind: str = "none"  # "none" (one process), "ddp" or "fsdp"

    @property
    def sharded(self) -> bool:
        return self.kind == "fsdp"

    def wrap(self, draft: torch.nn.Module) -> torch.nn.Module:
        """The module the training step calls. FSDP shards `draft` in place (its parameters
        become DTensor shards), so build the optimizer after this."""
        if self.kind == "ddp":
            return torch.nn.parallel.DistributedDataParallel(draft)
        if self.kind == "fsdp":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

            device = "cuda" if torch.cuda.is_available() else "cpu"
            mesh = init_device_mesh(device, (self.world,))
            for layer in draft.layers:
                # the drafter's forward projects the context into each layer's K/V by calling
                # self_attn.context_kv directly, not through a forward: gather for it too
                fully_shard(layer.self_attn, mesh=mesh)
                register_fsdp_forward_method(layer.self_attn, "context_kv")
                fully_shard(layer, mesh=mesh)
            fully_shard(draft, mesh=mesh)
        return draft

    def full_state(self, draft: torch.nn.Module, opt: torch.optim.Optimizer | None) -> tuple[dict, dict | None]:
        """(model state, optimizer state) as whole CPU tensors, the optimizer's in torch's own
        format (state keyed by parameter index); opt None: the model's only (for evaluation, where
        gathering the Adam moments would move twice the weights for nothing). A collective under
        FSDP: every rank must call it; rank 0 gets the tensors (the others get empty dicts)."""
        if not self.sharded:
            return draft.state_dict(), opt.state_dict() if opt is not None else None
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                             get_state_dict)

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        if opt is None:
            msd, osd = get_model_state_dict(draft, options=options), None
        else:
            msd, osd = get_state_dict(draft, opt, options=options)
        if self.rank:
            return {}, {} if opt is not None else None
        if osd is None:
            return msd, None
        names = [n for n, _ in draft.named_parameters()]
        index = {n: i for i, n in enumerate(names)}
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [index[p] for p in g["params"]]}
                  for g in osd["param_groups"]]
        return msd, {"state": {index[n]: st for n, st in osd["state"].items()}, "param_groups": groups}

    def load_optimizer(self, draft: torch.nn.Module, opt: torch.optim.Optimizer, state: dict) -> None:
        """Load a whole optimizer state (torch's format) into a sharded or plain optimizer."""
        if not self.sharded:
            opt.load_state_dict(state)
            return
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        names = [n for n, _ in draft.named_parameters()]
        fqn = {"state": {names[i]: st for i, st in state["state"].items()},
               "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in state["param_groups"]]}
        set_optimizer_state_dict(draft, opt, fqn, options=StateDictOptions(full_state_dict=True))

    def whole(self, draft: torch.nn.Module, model_state: dict, fresh) -> torch.nn.Module:
        """The drafter as one unsharded module on rank 0 (for saving and evaluation): `draft`
        itself unless sharded, else `fresh()` loaded with the gathered `model_state`."""
        if not self.sharded:
            return draft
        copy = fresh()
        copy.load_state_dict(model_state)
        return copy

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        if self.world > 1:
            torch.distributed.all_reduce(t)
        return t

    def barrier(self) -> None:
        if self.world > 1:
            torch.distributed.barrier()


def setup(kind: str) -> Parallel:
    """Join the process group under torchrun (WORLD_SIZE > 1); one process otherwise."""
    if kind not in KINDS:
        raise BlockdraftError(f"--parallel must be one of {list(KINDS)} (got {kind!r})")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return Parallel()
    import torch.distributed as dist

    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return Parallel(dist.get_rank(), world, kind)
