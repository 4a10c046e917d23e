"""Data-parallel training under ``torchrun``: the process group, and gradient sums across processes.

``torchrun --nproc_per_node N stages/train.py`` starts N copies of the stage; each takes its share of every
optimizer step's micro-batches, and after the backward passes the gradients are summed across processes with
one all-reduce (NCCL on GPUs, gloo on CPU). Every loss is scaled by 1 / (micro-batches of the step on all
processes), so N processes with ``train.accumulate`` a give the same update as one process with N·a.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

__all__ = ["DataParallel"]


@dataclass(frozen=True)
class DataParallel:
    """Where this process stands: its rank among ``world`` processes (world 1: no process group)."""

    rank: int = 0
    world: int = 1

    @classmethod
    def from_env(cls, device: str) -> DataParallel:
        """Join the process group ``torchrun`` describes in the environment (RANK, WORLD_SIZE, LOCAL_RANK)."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world == 1:
            return cls()
        import torch.distributed as dist

        if device == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        if not dist.is_initialized():
            dist.init_process_group("nccl" if device == "cuda" else "gloo")
        return cls(dist.get_rank(), world)

    @property
    def main(self) -> bool:
        """The process that logs to MLflow and writes checkpoints, metrics and the manifest."""
        return self.rank == 0

    def share(self, group: list, accumulate: int) -> list:
        """This process's micro-batches of one step's ``group`` (at most world × accumulate, in plan order)."""
        return group[self.rank * accumulate : (self.rank + 1) * accumulate]

    def sum_gradients(self, parameters: list[torch.Tensor]) -> None:
        """Replace each gradient by its sum over all processes (a process without a micro-batch adds zeros)."""
        if self.world == 1:
            return
        import torch.distributed as dist

        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in parameters])
        dist.all_reduce(flat)
        for parameter, grad in zip(parameters, flat.split([p.numel() for p in parameters]), strict=True):
            parameter.grad = grad.view_as(parameter)

    def gather(self, state: torch.Tensor) -> list[torch.Tensor]:
        """A byte tensor of equal size from every process (the noise generators' states), by rank."""
        if self.world == 1:
            return [state]
        import torch.distributed as dist

        device = "cuda" if dist.get_backend() == "nccl" else "cpu"
        parts = [torch.empty_like(state, device=device) for _ in range(self.world)]
        dist.all_gather(parts, state.to(device))
        return [part.cpu() for part in parts]

    def close(self) -> None:
        if self.world > 1:
            import torch.distributed as dist

            dist.barrier()
            dist.destroy_process_group()
