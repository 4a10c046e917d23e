"""The EAGLE-3 training objective: targets from the verifier's head, the TTT loss, and per-step metrics.

Alignment for a document x_0..x_{n-1} with aux states a_t and final states g_t (the verifier's logits at t
predict x_{t+1}): at TTT step k, position t is fed token x_{t+1+k} and predicts x_{t+2+k}; its target is the
verifier's distribution at t+1+k restricted to the draft vocab (soft cross-entropy). A position counts only if
x_{t+2+k} is an assistant token of the same document and the verifier's top-1 there (computed once by extract)
lies in the draft vocab; so training needs only the draft vocab's rows of the verifier's lm_head.
Tokens are teacher-forced: at inference a draft is only extended while every earlier draft was right, i.e. equal
to these tokens. Hidden states are the drafter's own from step k-1, as at inference.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from expman.drafter.model import Eagle3Drafter
from expman.errors import ExpmanError

__all__ = ["Packed", "VerifierHead", "metric_values", "simulated_tau", "ttt_loss"]


@dataclass(frozen=True)
class VerifierHead:
    """The frozen verifier tensors training needs: input embedding, final norm, and the lm_head rows of the draft
    vocab (all rows when loaded without one)."""

    embed: torch.Tensor
    norm_weight: torch.Tensor
    norm_eps: float
    lm_head: torch.Tensor

    @classmethod
    def load(cls, model_dir: Path, t2d: torch.Tensor | None = None) -> VerifierHead:
        """Read only these tensors from the verifier's safetensors (no full model load); with ``t2d`` keep only the
        draft vocab's lm_head rows (on Kimi-K2 that is 32K of 164K rows, 3.8 GB less fp32 weight on the GPU)."""
        import json

        from safetensors import SafetensorError, safe_open

        config = json.loads((model_dir / "config.json").read_text())
        found: dict[str, torch.Tensor] = {}
        wanted = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
        for path in sorted(model_dir.glob("*.safetensors")):
            try:
                with safe_open(str(path), "pt") as handle:
                    for name in wanted & set(handle.keys()):
                        found[name] = handle.get_tensor(name)  # in the stored dtype until the rows are chosen
            except SafetensorError as err:
                raise ExpmanError(f"{path}: unreadable safetensors ({err}); rerun `dvc repro -f prepare`") from None
        if "lm_head.weight" not in found and config.get("tie_word_embeddings"):
            found["lm_head.weight"] = found.get("model.embed_tokens.weight")
        for name in wanted:
            if found.get(name) is None:
                raise ExpmanError(f"{model_dir}: tensor {name} not found in the verifier's safetensors")
        lm_head = found["lm_head.weight"]
        if t2d is not None:
            if t2d.numel() != lm_head.shape[0]:
                raise ExpmanError(
                    f"{model_dir}: lm_head.weight has {lm_head.shape[0]} rows but the vocab's t2d covers {t2d.numel()}"
                )
            lm_head = lm_head[t2d]
        eps = float(config.get("rms_norm_eps", 1e-6))
        return cls(found["model.embed_tokens.weight"].float(), found["model.norm.weight"].float(), eps, lm_head.float())

    def to(self, device: str, dtype: torch.dtype | None = None) -> VerifierHead:
        """On ``device``; with ``dtype`` the two vocab matrices are stored in it once (bf16 under CUDA autocast,
        rather than a fresh cast of the lm_head at every matmul)."""
        return VerifierHead(
            self.embed.to(device, dtype), self.norm_weight.to(device), self.norm_eps, self.lm_head.to(device, dtype)
        )

    def normed(self, final_pre_norm: torch.Tensor) -> torch.Tensor:
        """norm(h) in fp32, from pre-norm final states [..., H]."""
        h = final_pre_norm.float()
        return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.norm_eps) * self.norm_weight

    def logits(self, final_pre_norm: torch.Tensor) -> torch.Tensor:
        """Logits over the rows held, lm_head(norm(h)), in the lm_head's dtype."""
        return self.normed(final_pre_norm).to(self.lm_head.dtype) @ self.lm_head.T

    def target_probs(self, final_pre_norm: torch.Tensor) -> torch.Tensor:
        """The verifier's distribution restricted to the rows held (the draft vocab), in fp32 [T, Vd]."""
        return torch.softmax(self.logits(final_pre_norm).float(), dim=-1)


@dataclass(frozen=True)
class Packed:
    """Documents packed into one row: every tensor is [1, T] (aux [1, T, 3H], final [1, T, H])."""

    aux: torch.Tensor
    final: torch.Tensor
    top1: torch.Tensor
    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    document_ids: torch.Tensor
    position_ids: torch.Tensor

    @classmethod
    def of(cls, documents: list[dict[str, torch.Tensor]]) -> Packed:
        """Pack documents given as dicts of input_ids, loss_mask, aux_hidden_states, final_hidden_states,
        verifier_top1 (the extract shard tensors)."""
        document_ids = torch.cat([torch.full((len(d["input_ids"]),), i) for i, d in enumerate(documents)])
        positions = torch.cat([torch.arange(len(d["input_ids"])) for d in documents])
        return cls(
            aux=torch.cat([d["aux_hidden_states"] for d in documents])[None],
            final=torch.cat([d["final_hidden_states"] for d in documents])[None],
            top1=torch.cat([d["verifier_top1"] for d in documents]).long()[None],
            input_ids=torch.cat([d["input_ids"] for d in documents]).long()[None],
            loss_mask=torch.cat([d["loss_mask"] for d in documents]).bool()[None],
            document_ids=document_ids[None],
            position_ids=positions[None],
        )

    def to(self, device: str) -> Packed:
        return Packed(*(getattr(self, f).to(device) for f in self.__dataclass_fields__))

    def padded(self, length: int) -> Packed:
        """The row padded to ``length`` tokens with a padding document (id -1, out of the loss): every batch of
        the compiled loss then has one shape, so it compiles once (flex attention has no dynamic shapes)."""
        pad = length - self.input_ids.shape[1]
        if pad <= 0:
            return self
        fills = {"top1": -1, "loss_mask": False, "document_ids": -1}

        def grow(name: str) -> torch.Tensor:
            tensor = getattr(self, name)
            tail = tensor.new_full((1, pad, *tensor.shape[2:]), fills.get(name, 0))
            return torch.cat([tensor, tail], dim=1)

        return Packed(*(grow(name) for name in self.__dataclass_fields__))


def _ahead(x: torch.Tensor, n: int, fill: float | int | bool) -> torch.Tensor:
    """x[:, t+n] at position t (dim 1), ``fill`` past the end."""
    tail = x.new_full((x.shape[0], n, *x.shape[2:]), fill)
    return torch.cat([x[:, n:], tail], dim=1)


def simulated_tau(cond_acc: list[float], k: int) -> float:
    """Expected tokens per verifier round with a chain of k drafts: 1 + Σ_j Π_{i<=j} cond_acc_i."""
    tau, alive = 1.0, 1.0
    for rate in cond_acc[:k]:
        alive *= rate
        tau += alive
    return tau


def soft_cross_entropy(logits: torch.Tensor, target_probs: torch.Tensor) -> torch.Tensor:
    """-Σ p·log_softmax(logits) per position, as logsumexp(logits) - Σ p·logits (the targets sum to 1)."""
    logits = logits.float()
    return torch.logsumexp(logits, dim=-1) - (target_probs * logits).sum(-1)


@functools.cache
def _compiled_soft_cross_entropy() -> Any:
    """On CUDA one fused kernel per direction instead of several passes over [T, draft vocab] in fp32."""
    return torch.compile(soft_cross_entropy, dynamic=True)


@functools.cache
def compiled_ttt_loss() -> Any:
    """``ttt_loss`` compiled as one program, the TTT unroll, flex attention, soft-CE and metrics together: on an
    H200 1.14-1.20x the tokens/s of compiling each layer's pieces apart, and less memory (fewer kernels, fewer
    launch gaps, fusion across the steps; benchmarks/results/train_gpu_h200.json). For one static shape: give it
    batches ``Packed.padded`` to one length."""
    return torch.compile(ttt_loss, dynamic=False)


def ttt_loss(
    drafter: Eagle3Drafter,
    head: VerifierHead,
    batch: Packed,
    steps: int,
    step_decay: float,
    noise_std: float = 0.0,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Σ_k decay^k · soft-CE_k over valid positions, plus per-step accuracy (full and conditional).

    Step k's logits at positions t < T-1-k are scored against the targets at t+1+k (slices, no shifted copy of
    the [T, draft vocab] targets). The metrics are 0-d tensors still on the device (``metric_values`` reads
    them in one transfer), so a training step never waits for the GPU before its backward pass.
    """
    with torch.no_grad():
        target_probs = head.target_probs(batch.final[0])[None]
    top1 = batch.top1
    aux = batch.aux.float()
    if noise_std:
        noise = torch.rand(aux.shape, generator=generator, device=generator.device if generator else "cpu")
        aux = aux + (noise.to(aux.device) * 2 - 1) * noise_std
    inputs = [_ahead(batch.input_ids, 1 + k, 0) for k in range(steps)]
    all_logits = drafter(aux, inputs, batch.position_ids, batch.document_ids)
    cross_entropy = _compiled_soft_cross_entropy() if aux.is_cuda else soft_cross_entropy
    length = batch.input_ids.shape[1]
    loss = aux.new_zeros(())
    tracked: dict[str, torch.Tensor] = {}
    alive = torch.ones_like(batch.loss_mask)
    for k, logits in enumerate(all_logits):
        target_top1 = _ahead(top1, 1 + k, -1)
        valid = (
            _ahead(batch.loss_mask, 2 + k, False)
            & (_ahead(batch.document_ids, 2 + k, -1) == batch.document_ids)
            & drafter.t2d[target_top1.clamp(min=0)]
        )
        correct = drafter.draft_to_target(logits.argmax(-1)) == target_top1
        count = valid.sum()
        scored = length - 1 - k
        if scored > 0:
            per_position = cross_entropy(logits[:, :scored], target_probs[:, 1 + k :])
            step_loss = (per_position * valid[:, :scored]).sum() / count.clamp(min=1)
            loss = loss + step_decay**k * step_loss
            tracked[f"loss_{k}"] = step_loss.detach()
        else:  # a batch too short for this step: no position counts, but every batch names the same metrics
            tracked[f"loss_{k}"] = loss.new_zeros(())
        tracked[f"acc_{k}"] = (correct & valid).sum() / count.clamp(min=1)
        conditional = valid & alive
        tracked[f"cond_acc_{k}"] = (correct & conditional).sum() / conditional.sum().clamp(min=1)
        tracked[f"positions_{k}"] = count
        alive = alive & correct
    tracked["loss"] = loss.detach()
    return loss, tracked


def metric_values(tracked: dict[str, torch.Tensor]) -> dict[str, float]:
    """The metrics of ``ttt_loss`` (plus any other 0-d tensors) as numbers, read in one device transfer; a step
    with no valid position has no ``loss_k``."""
    values = dict(zip(tracked, torch.stack([v.float() for v in tracked.values()]).tolist(), strict=True))
    metrics: dict[str, float] = {}
    for name, value in values.items():
        if name.startswith("positions_"):
            metrics[name] = int(value)
        elif not (name.startswith("loss_") and values[f"positions_{name[5:]}"] == 0):
            metrics[name] = value
    return metrics
