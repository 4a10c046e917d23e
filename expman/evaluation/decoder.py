"""decoder: the reference speculative decoder in torch, the one every engine number is checked against.

The HF verifier keeps its KV cache; the drafter keeps its own (step-0 entries for every committed position, draft
entries dropped after each round). Per round the drafter proposes a chain of k tokens, the verifier scores the
pending token plus the k drafts in one forward, the longest agreeing prefix is accepted and the verifier's own
next token is appended (the bonus). Greedy by default: every output must equal plain greedy decoding up to ties
(a divergence where plain decoding's logits for both tokens are within ``TIE_ULPS`` units in the last place of the
compute dtype: a verifier forward over k + 1 tokens rounds differently from one over a single token, and in bf16
that flips exact and near ties); other divergences are counted as mismatches, not hidden. With
``temperature > 0`` drafts are sampled and accepted by lossless rejection sampling (accept with min(1, p/q), else
resample from max(p - q, 0)). ``summarize`` pools the per-prompt acceptance counters and timings into τ, acceptance
rates and speedup.

Models in, tokens and counters out: no files, parameters, processes or MLflow (the evaluate stage has those).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from expman.drafter.model import Eagle3Drafter

__all__ = [
    "TIE_ULPS",
    "DecodeStats",
    "DrafterSession",
    "GreedyReference",
    "VerifierSession",
    "greedy_decode",
    "speculative_decode",
    "summarize",
]


TIE_ULPS = 2
"""A greedy divergence is a tie when plain decoding's logits for its token and the speculative one are at most this
many units in the last place (of the compute dtype, at the top logit's magnitude) apart. Measured on the quality
preset's bf16 evaluation: all 82 divergences were at most 1 unit apart (benchmarks/results/quality_eval_dtype.json)."""
TOP_LOGITS = 8
"""Logits kept per greedy step to size a divergence; a token outside them is never a tie."""


@dataclass
class DecodeStats:
    """Counters of one speculative decode: rounds, accepted drafts (total and per chain position)."""

    k: int
    rounds: int = 0
    accepted: int = 0
    drafted: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.accepted_per_position = self.accepted_per_position or [0] * self.k

    def record(self, accepted: int) -> None:
        self.rounds += 1
        self.accepted += accepted
        self.drafted += self.k
        for position in range(accepted):
            self.accepted_per_position[position] += 1


class VerifierSession:
    """The HF verifier with one growing KV cache; returns logits and, when asked, the drafter's aux states."""

    def __init__(self, model: Any, aux_layer_ids: Sequence[int]):
        from transformers import DynamicCache

        self.model = model
        self.aux_layer_ids = list(aux_layer_ids)
        self.cache = DynamicCache(config=model.config)

    def feed(self, ids: Sequence[int], with_aux: bool, last_only: bool = False) -> tuple[torch.Tensor, Any]:
        """Append ``ids``; returns (logits [n or 1, V], aux [n, 3H] or None)."""
        device = self.model.device
        out = self.model(
            input_ids=torch.tensor([list(ids)], device=device),
            past_key_values=self.cache,
            use_cache=True,
            output_hidden_states=with_aux,
            logits_to_keep=1 if last_only else 0,
        )
        aux = torch.cat([out.hidden_states[i][0] for i in self.aux_layer_ids], dim=-1) if with_aux else None
        return out.logits[0].float(), aux

    def crop(self, length: int) -> None:
        """Keep the first ``length`` positions (the rejected drafts go)."""
        extra = self.cache.get_seq_length() - length
        if extra:
            self.cache.crop(-extra)


def _finished(tokens: list[int], eos_ids: set[int], max_new_tokens: int) -> bool:
    return len(tokens) >= max_new_tokens or bool(tokens and tokens[-1] in eos_ids)


def _append(tokens: list[int], new: list[int], eos_ids: set[int], max_new_tokens: int) -> None:
    """Extend ``tokens`` with ``new`` up to the first EOS and the length limit."""
    for token in new:
        if _finished(tokens, eos_ids, max_new_tokens):
            return
        tokens.append(token)


def _pick(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> int:
    if not temperature:
        return int(logits.argmax())
    probs = torch.softmax(logits / temperature, dim=-1)
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))


@dataclass
class GreedyReference:
    """Plain decoding's tokens and, per step, its top logits: enough to tell a tie flip from a real divergence."""

    tokens: list[int]
    top_values: list[torch.Tensor]
    top_ids: list[torch.Tensor]
    eps: float
    """Machine epsilon of the compute dtype (one unit in the last place at magnitude 1)."""
    check_seconds: float = 0.0
    """Time spent keeping the top logits, which the no-speculation arm's timing leaves out."""

    def divergence(self, tokens: list[int]) -> dict[str, Any] | None:
        """None when ``tokens`` equals the reference; otherwise the first differing position, the reference's logit
        gap there between its token and the other one in units in the last place (None: the other token is not
        among its top logits) and whether that gap is a tie."""
        position = next(
            (i for i, (ours, theirs) in enumerate(zip(self.tokens, tokens, strict=False)) if ours != theirs), None
        )
        if position is None:
            if len(tokens) == len(self.tokens):
                return None
            return {"position": min(len(tokens), len(self.tokens)), "gap_ulps": None, "tie": False}
        values, ids = self.top_values[position], self.top_ids[position].tolist()
        gap_ulps = None
        if tokens[position] in ids:
            top = float(values[0])
            ulp = self.eps * 2.0 ** math.floor(math.log2(abs(top))) if top else self.eps
            gap_ulps = (top - float(values[ids.index(tokens[position])])) / ulp
        return {"position": position, "gap_ulps": gap_ulps, "tie": gap_ulps is not None and gap_ulps <= TIE_ULPS}


@torch.inference_mode()
def greedy_decode(
    model: Any,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    eos_ids: set[int],
    temperature: float = 0.0,
    seed: int = 0,
) -> GreedyReference:
    """Plain decoding, one verifier forward per token: the no-speculation arm and, when greedy, the equality
    reference (sampled outputs are not compared, so their top logits are not kept)."""
    generator = torch.Generator().manual_seed(seed)
    session = VerifierSession(model, [])
    reference = GreedyReference([], [], [], torch.finfo(model.dtype).eps)
    logits, _ = session.feed(prompt_ids, with_aux=False, last_only=True)
    while True:
        reference.tokens.append(_pick(logits[-1], temperature, generator))
        if not temperature:
            started = time.perf_counter()
            top = logits[-1].topk(min(TOP_LOGITS, logits.shape[-1]))
            reference.top_values.append(top.values)
            reference.top_ids.append(top.indices)
            reference.check_seconds += time.perf_counter() - started
        if _finished(reference.tokens, eos_ids, max_new_tokens):
            return reference
        logits, _ = session.feed(reference.tokens[-1:], with_aux=False)


def _context_mask(new: int, cached: int, device: Any) -> torch.Tensor | None:
    """New context positions see every cached entry and each other causally (None when one position)."""
    if new == 1:
        return None
    causal = torch.ones(new, new, dtype=torch.bool, device=device).tril()
    return torch.cat([torch.ones(new, cached, dtype=torch.bool, device=device), causal], dim=1)[None, None]


class DrafterSession:
    """The drafter's KV cache: step-0 entries for committed positions; a round's draft entries are dropped."""

    def __init__(self, drafter: Eagle3Drafter):
        self.drafter = drafter
        self.dtype = drafter.fc.weight.dtype
        self.caches: list[list] = [[] for _ in drafter.layers]
        self.length = 0  # committed positions

    def extend(self, aux: torch.Tensor, next_ids: Sequence[int]) -> torch.Tensor:
        """Commit positions ``length..length+n-1`` (aux [n, 3H], the token after each); returns the hidden [1, 1, H]
        of the last one."""
        for cache in self.caches:  # drop the last round's drafts, keep one merged step-0 chunk
            if cache:
                keys = torch.cat([c[0] for c in cache], dim=2)[:, :, : self.length]
                values = torch.cat([c[1] for c in cache], dim=2)[:, :, : self.length]
                cache[:] = [(keys, values)]
        n = aux.shape[0]
        device = aux.device
        positions = torch.arange(self.length, self.length + n, device=device)[None]
        ids = torch.tensor([list(next_ids)], device=device)
        mask = _context_mask(n, self.length, device)
        hidden = self.drafter.decode(self.drafter.fc(aux[None].to(self.dtype)), ids, positions, self.caches, mask)
        self.length += n
        return hidden[:, -1:]

    def draft(
        self, hidden: torch.Tensor, k: int, temperature: float, generator: torch.Generator | None
    ) -> tuple[list[int], list[torch.Tensor]]:
        """A chain of k target-vocab tokens from the last committed position, with their draft distributions
        (draft vocab; only used when sampling)."""
        drafter = self.drafter
        tokens: list[int] = []
        dists: list[torch.Tensor] = []
        for step in range(k):
            logits = drafter.draft_logits(hidden)[0, -1].float()
            if temperature:
                dists.append(torch.softmax(logits / temperature, dim=-1))
            draft_id = _pick(logits, temperature, generator)
            tokens.append(int(drafter.draft_to_target(torch.tensor(draft_id, device=logits.device))))
            if step + 1 < k:
                position = torch.tensor([[self.length - 1 + step + 1]], device=hidden.device)
                ids = torch.tensor([[tokens[-1]]], device=hidden.device)
                hidden = drafter.decode(hidden, ids, position, self.caches)
        return tokens, dists


def _accept(
    drafts: list[int],
    dists: list[torch.Tensor],
    logits: torch.Tensor,
    t2d: torch.Tensor,
    temperature: float,
    generator: torch.Generator | None,
) -> tuple[int, int]:
    """(accepted draft count, the verifier's next token). Greedy: the longest prefix equal to the verifier's
    argmax. Sampling: lossless rejection sampling against the verifier's distribution."""
    if not temperature:
        targets = logits.argmax(-1).tolist()
        accepted = 0
        while accepted < len(drafts) and drafts[accepted] == targets[accepted]:
            accepted += 1
        return accepted, targets[accepted]
    draft_ids = torch.nonzero(t2d).flatten()
    for index, token in enumerate(drafts):
        p = torch.softmax(logits[index] / temperature, dim=-1)
        q = torch.zeros_like(p)
        q[draft_ids] = dists[index]
        if float(torch.rand((), generator=generator)) * float(q[token]) <= float(p[token]):
            continue
        residual = (p - q).clamp(min=0)
        residual = residual / residual.sum() if residual.sum() > 0 else p
        return index, int(torch.multinomial(residual.cpu(), 1, generator=generator))
    return len(drafts), _pick(logits[len(drafts)], temperature, generator)


@torch.inference_mode()
def speculative_decode(
    model: Any,
    drafter: Eagle3Drafter,
    prompt_ids: Sequence[int],
    k: int,
    max_new_tokens: int,
    eos_ids: set[int],
    temperature: float = 0.0,
    seed: int = 0,
) -> tuple[list[int], DecodeStats]:
    """Decode with a chain of k drafts per verifier forward; returns the tokens and the acceptance counters."""
    generator = torch.Generator().manual_seed(seed)
    verifier = VerifierSession(model, drafter.config.aux_layer_ids)
    logits, aux = verifier.feed(prompt_ids, with_aux=True, last_only=True)
    pending = _pick(logits[-1], temperature, generator)
    tokens = [pending]
    session = DrafterSession(drafter)
    hidden = session.extend(aux, [*prompt_ids[1:], pending])
    stats = DecodeStats(k)
    while not _finished(tokens, eos_ids, max_new_tokens):
        drafts, dists = session.draft(hidden, k, temperature, generator)
        logits, aux = verifier.feed([pending, *drafts], with_aux=True)
        accepted, bonus = _accept(drafts, dists, logits, drafter.t2d, temperature, generator)
        stats.record(accepted)
        verifier.crop(len(prompt_ids) + len(tokens) + accepted)
        committed = [*drafts[:accepted], bonus]
        _append(tokens, committed, eos_ids, max_new_tokens)
        pending = bonus
        if not _finished(tokens, eos_ids, max_new_tokens):
            hidden = session.extend(aux[: accepted + 1], committed)
    return tokens, stats


def _pooled(rows: list[dict[str, Any]], k: int) -> dict[str, Any]:
    rounds = sum(r["rounds"] for r in rows)
    accepted = sum(r["accepted"] for r in rows)
    drafted = sum(r["drafted"] for r in rows)
    per_position = [sum(r["accepted_per_position"][i] for r in rows) for i in range(k)]
    return {
        "tau": (accepted + rounds) / rounds if rounds else 1.0,
        "acceptance_rate": accepted / drafted if drafted else 0.0,
        "per_position": [count / rounds if rounds else 0.0 for count in per_position],
        "greedy_mismatches": sum(r["matches_greedy"] is False for r in rows),
        "greedy_tie_flips": sum(bool(r.get("greedy_divergence")) and r["matches_greedy"] is True for r in rows),
    }


def _tok_per_s(rows: list[dict[str, Any]]) -> float | None:
    """Tokens per second over the rows' decodes; None without any (no prompt of a category was timed)."""
    return sum(r["tokens"] for r in rows) / max(sum(r["seconds"] for r in rows), 1e-9) if rows else None


def summarize(prompts: list[dict[str, Any]], arms: list[str], ks: list[int]) -> dict[str, Any]:
    """τ, acceptance, per-position rates, tok/s and speedup per arm and k, overall and per category; tok/s and speedup
    over the timed prompts only."""

    def block(rows: list[dict[str, Any]]) -> dict[str, Any]:
        timed = [r for r in rows if r.get("timed", True)]  # rows written before the key existed were all timed
        nospec = _tok_per_s([r["nospec"] for r in timed])
        result: dict[str, Any] = {"prompts": len(rows), "timed_prompts": len(timed), "nospec": {"tok_per_s": nospec}}
        for arm in arms:
            result[arm] = {}
            for k in ks:
                pooled = _pooled([r[arm][str(k)] for r in rows], k)
                pooled["tok_per_s"] = _tok_per_s([r[arm][str(k)] for r in timed])
                pooled["speedup"] = None if nospec is None else pooled["tok_per_s"] / nospec
                result[arm][f"k{k}"] = pooled
        return result

    categories = sorted({p["category"] for p in prompts})
    return {
        **block(prompts),
        "by_category": {c: block([p for p in prompts if p["category"] == c]) for c in categories},
    }
