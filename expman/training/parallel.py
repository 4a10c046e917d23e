"""Data-parallel training under ``torchrun``: the launch, the process group, gradient sums across processes, FSDP.

``train.gpus: N`` makes the stage start itself as ``torchrun --nproc-per-node N stages/train.py`` (``launch``),
so several GPUs or hosts need no edit of dvc.yaml; torchrun starts N copies of the stage; each takes its share of every
optimizer step's micro-batches, and after the backward passes the gradients are summed across processes with
one all-reduce (NCCL on GPUs, gloo on CPU). Every loss is scaled by 1 / (micro-batches of the step on all
processes), so N processes with ``train.accumulate`` a give the same update as one process with N·a.

With ``train.fsdp`` the drafter is sharded instead (FSDP2, ``fully_shard``): each process keeps 1/N of the
trainable weights, their gradients and the AdamW state, all-gathers the weights for the step, and gradients are
reduce-scattered as sums, so the updates are the same as replicated training's. For drafters whose optimizer
state does not fit one GPU (Kimi-K2's: about 1 B trainable parameters, 16 GB of fp32 weights, gradients and
AdamW moments).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from expman.params import TrainParams

__all__ = ["DataParallel", "launch"]


@dataclass(frozen=True)
class DataParallel:
    """Where this process stands: its rank among ``world`` processes (world 1: no process group)."""

    rank: int = 0
    world: int = 1
    sharded: bool = False
    """FSDP: weights, gradients and optimizer state sharded over the processes (only when world > 1)."""

    @classmethod
    def from_env(cls, device: str, fsdp: bool = False) -> DataParallel:
        """Join the process group ``torchrun`` describes in the environment (RANK, WORLD_SIZE, LOCAL_RANK)."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world == 1:
            return cls()
        import torch.distributed as dist

        if device == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        if not dist.is_initialized():
            dist.init_process_group("nccl" if device == "cuda" else "gloo")
        return cls(dist.get_rank(), world, fsdp)

    @property
    def main(self) -> bool:
        """The process that logs to MLflow and writes checkpoints, metrics and the manifest."""
        return self.rank == 0

    def shard(self, model: torch.nn.Module, device: str, compute_dtype: torch.dtype | None = None) -> torch.nn.Module:
        """Under FSDP, shard ``model``'s trainable weights in place, as one unit: each forward all-gathers them
        once and keeps them until the backward is done (the TTT unroll calls every layer once per step; a unit
        per layer would also re-pack the KV-cache lists the layers append to). Frozen weights (the embedding)
        stay whole on every process: sharding them would only add an all-gather per step. Gradients are
        reduce-scattered as sums, not averages. With ``compute_dtype`` (bf16 under autocast) the weights are
        gathered and their gradients computed in it, half the memory of fp32 copies, and the gradients are
        reduced into the fp32 shards in fp32."""
        if not self.sharded:
            return model
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        frozen = {p for p in model.parameters() if not p.requires_grad}
        mesh = init_device_mesh(device, (self.world,))
        policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
        fully_shard(model, mesh=mesh, reshard_after_forward=False, ignored_params=frozen, mp_policy=policy)
        model.set_gradient_divide_factor(1.0)
        model.set_force_sum_reduction_for_comms(True)  # a plain sum: gloo has no pre-multiplied sum
        return model

    def model_state(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The whole model's state dict: under FSDP gathered onto the main process's CPU ({} on the others, and
        every process must call it); otherwise the model's own."""
        if not self.sharded:
            return model.state_dict()
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return get_model_state_dict(model, options=self._whole())

    def optimizer_state(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
        """The optimizer's state dict, whole, as ``model_state`` (under FSDP keyed by parameter name)."""
        if not self.sharded:
            return optimizer.state_dict()
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return get_optimizer_state_dict(model, optimizer, options=self._whole())

    def load_states(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, weights: dict, moments: dict):
        """Restore what ``model_state`` and ``optimizer_state`` returned (``weights`` may omit frozen weights);
        under FSDP every process reads the whole states and keeps its shards."""
        if not self.sharded:
            model.load_state_dict(weights, strict=False)
            optimizer.load_state_dict(moments)
            return
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        whole = StateDictOptions(full_state_dict=True, strict=False)
        set_model_state_dict(model, weights, options=whole)
        set_optimizer_state_dict(model, optimizer, moments, options=whole)

    @staticmethod
    def _whole() -> object:
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        return StateDictOptions(full_state_dict=True, cpu_offload=True)

    def share(self, group: list, accumulate: int) -> list:
        """This process's micro-batches of one step's ``group`` (at most world × accumulate, in plan order)."""
        return group[self.rank * accumulate : (self.rank + 1) * accumulate]

    def fillers(self, group: list, accumulate: int) -> list:
        """Micro-batches a process trains with weight 0 in a step's last, partial group. Under FSDP every process
        must run as many backward passes as the others (each one reduce-scatters), so one short of ``accumulate``
        repeats the group's first micro-batch that many times; replicated, one with none of its own runs it once,
        for the names and shapes of the metrics every process adds to the step's (``sum_over_processes``)."""
        mine = len(self.share(group, accumulate))
        if self.sharded:
            return group[:1] * (accumulate - mine)
        return group[:1] if self.world > 1 and not mine else []

    def sum_gradients(self, parameters: list[torch.Tensor]) -> None:
        """Replace each gradient by its sum over all processes (a process without a micro-batch adds zeros).
        Under FSDP the backward pass has already summed them, shard by shard."""
        if self.world == 1 or self.sharded:
            return
        import torch.distributed as dist

        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in parameters])
        dist.all_reduce(flat)
        for parameter, grad in zip(parameters, flat.split([p.numel() for p in parameters]), strict=True):
            parameter.grad = grad.view_as(parameter)

    def sum_over_processes(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` summed over all processes (the step's metric sums and counts), without reading it."""
        if self.world == 1:
            return tensor
        import torch.distributed as dist

        dist.all_reduce(tensor)
        return tensor

    def gather(self, state: torch.Tensor) -> list[torch.Tensor]:
        """A tensor of equal shape from every process (the noise generators' states, peak memory), by rank."""
        if self.world == 1:
            return [state]
        import torch.distributed as dist

        device = "cuda" if dist.get_backend() == "nccl" else "cpu"
        parts = [torch.empty_like(state, device=device) for _ in range(self.world)]
        dist.all_gather(parts, state.to(device))
        return [part.cpu() for part in parts]

    def peak_memory_gib(self, device: str) -> list[float] | None:
        """Each process's peak CUDA memory held by torch's tensors since it started, GiB by rank; None on the CPU.
        A collective: every process calls it."""
        if device != "cuda":
            return None
        peak = torch.tensor([torch.cuda.max_memory_allocated()], dtype=torch.float64, device="cuda")
        return [float(part) / 2**30 for part in self.gather(peak)]

    def close(self) -> None:
        if self.world > 1:
            import torch.distributed as dist

            dist.barrier()
            dist.destroy_process_group()


def launch(section: TrainParams, argv: list[str]) -> int | None:
    """Start the stage ``argv`` again under torchrun when ``section`` asks for several processes (``gpus``, or
    ``nodes`` above 1) and this process is not one of them yet; return torchrun's exit code (None: run here).

    One host: ``--standalone`` (a free local port). Several: the c10d rendezvous at ``rdzv_endpoint``, whose id is
    the digest of the train section, the same on every host that runs the same params."""
    if (section.gpus == 1 and section.nodes == 1) or "LOCAL_RANK" in os.environ:
        return None
    import subprocess
    import sys

    from expman.devices import resolve_device
    from expman.errors import ExpmanError
    from expman.provenance import sha256_json

    if resolve_device(section.device) == "cuda" and section.gpus > torch.cuda.device_count():
        raise ExpmanError(f"train.gpus: {section.gpus}, but this host has {torch.cuda.device_count()} GPUs")
    if section.nodes == 1:
        rendezvous = ["--standalone"]
    else:
        rdzv_id = sha256_json(section.model_dump())[:16]
        rendezvous = ["--rdzv-backend", "c10d", "--rdzv-endpoint", section.rdzv_endpoint, "--rdzv-id", rdzv_id]
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        str(section.nodes),
        "--nproc-per-node",
        str(section.gpus),
        *rendezvous,
        *argv,
    ]
    return subprocess.run(command).returncode
