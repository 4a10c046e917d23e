"""evaluate: real speculative decoding in torch, the reference every engine number is checked against.

The HF verifier keeps its KV cache; the drafter keeps its own (step-0 entries for every committed position, draft
entries dropped after each round). Per round the drafter proposes a chain of k tokens, the verifier scores the
pending token plus the k drafts in one forward, the longest agreeing prefix is accepted and the verifier's own
next token is appended (the bonus). Greedy by default: every output must equal plain greedy decoding up to ties
(a divergence where plain decoding's logits for both tokens are within ``TIE_ULPS`` units in the last place of the
compute dtype: a verifier forward over k + 1 tokens rounds differently from one over a single token, and in bf16
that flips exact and near ties); other divergences are counted as mismatches, not hidden. With
``temperature > 0`` drafts are sampled and accepted by lossless rejection sampling (accept with min(1, p/q), else
resample from max(p - q, 0)).

Three arms on the held-out prompts in one run: no speculation, the baseline drafter and the candidate; arms are
interleaved prompt by prompt so machine noise hits them alike, and speedup is always against the no-speculation
arm of the same run. Per-prompt results are kept so ``expman compare`` can bootstrap confidence intervals.
"""

from __future__ import annotations

import math
import shutil
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from expman.data.generate import read_responses
from expman.devices import attention_kernels, precision_facts, resolve_device, resolve_dtype, speedup_target
from expman.drafter.model import Eagle3Drafter
from expman.errors import ExpmanError
from expman.params import EvaluateParams, Params
from expman.paths import EvaluatePaths
from expman.provenance import atomic_write_json, read_manifest, sha256_file, upstream_entry
from expman.registry.tracking import stage_run

__all__ = [
    "TIE_ULPS",
    "DecodeStats",
    "GreedyReference",
    "evaluate",
    "greedy_decode",
    "select_prompts",
    "speculative_decode",
    "summarize",
    "trained_aux_layers",
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


def select_prompts(records: list[dict[str, Any]], limit: int | None) -> list[dict[str, Any]]:
    """Up to ``limit`` records, taken round-robin over categories (in id order) so every category is represented."""
    by_category: dict[str, list[dict[str, Any]]] = {}
    for record in sorted(records, key=lambda r: r["id"]):
        by_category.setdefault(record["category"], []).append(record)
    chosen: list[dict[str, Any]] = []
    queues = [list(v) for _, v in sorted(by_category.items())]
    while queues and (limit is None or len(chosen) < limit):
        for queue in queues:
            if queue and (limit is None or len(chosen) < limit):
                chosen.append(queue.pop(0))
        queues = [q for q in queues if q]
    return chosen


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


def trained_aux_layers(drafter_dir: Path) -> list[int] | None:
    """The aux layers a drafter trained here was trained on (its manifest's capture contract); None for an
    imported drafter, whose checkpoint is the only record."""
    import json

    manifest = json.loads((drafter_dir / "manifest.json").read_text())
    contract = manifest.get("contract")
    return None if contract is None or manifest.get("source") else list(contract["aux_layers"])


def _load_arm(
    path: Path, embedding: torch.Tensor, verifier: dict[str, Any], device: str, dtype: torch.dtype
) -> Eagle3Drafter:
    """The drafter in the verifier's compute dtype, fed the layers it was trained on: the reference measures the
    drafter, not its config (an engine reads the config; the benchmark stage flags the difference as an
    integration fault)."""
    import dataclasses

    from expman.drafter.checkpoint import load_drafter

    drafter = load_drafter(path, embedding=embedding)
    trained = trained_aux_layers(path)
    if trained is not None:
        drafter.config = dataclasses.replace(drafter.config, aux_layer_ids=tuple(trained))
    layer = drafter.config.layer
    for key, expected in (("hidden_size", verifier["hidden_size"]), ("vocab_size", verifier["vocab_size"])):
        if layer[key] != expected:
            raise ExpmanError(f"{path}: drafter {key} {layer[key]} does not match the verifier's {expected}")
    if max(drafter.config.aux_layer_ids) > verifier["num_hidden_layers"]:
        raise ExpmanError(f"{path}: aux layer ids {list(drafter.config.aux_layer_ids)} exceed the verifier's layers")
    return drafter.to(device=device, dtype=dtype).eval()


def _arm_row(
    tokens: list[int], stats: DecodeStats, seconds: float, reference: GreedyReference | None
) -> dict[str, Any]:
    divergence = None if reference is None else reference.divergence(tokens)
    return {
        "rounds": stats.rounds,
        "accepted": stats.accepted,
        "drafted": stats.drafted,
        "accepted_per_position": stats.accepted_per_position,
        "tokens": len(tokens),
        "seconds": seconds,
        "matches_greedy": None if reference is None else divergence is None or divergence["tie"],
        "greedy_divergence": divergence,
    }


def _read_inputs(section: EvaluateParams, where: EvaluatePaths) -> tuple[dict, list[dict], dict[str, Path], dict]:
    """The verifier's manifest, the held-out prompts, each drafter arm's folder and the upstream entries."""
    verifier_manifest = read_manifest(where.verifier / "manifest.json", "prepare")
    generated_manifest = read_manifest(where.generated / "manifest.json", "generate")
    if generated_manifest["verifier"] != verifier_manifest["verifier"]:
        raise ExpmanError(
            f"{where.generated / 'manifest.json'}: responses come from another verifier than {where.verifier}"
        )
    prompts = select_prompts(read_responses(where.generated, section.split), section.max_prompts)
    if not prompts:
        raise ExpmanError(
            f"{where.generated / 'manifest.json'}: no successful {section.split!r} records to evaluate on"
        )
    arm_paths = {"candidate": where.drafter}
    if section.baseline:
        arm_paths = {"baseline": Path(section.baseline), **arm_paths}
    upstream = {
        "prepare": upstream_entry(where.verifier / "manifest.json"),
        "generate": upstream_entry(where.generated / "manifest.json"),
    }
    for arm, path in arm_paths.items():
        stage = "train" if arm == "candidate" else "baseline"
        read_manifest(path / "manifest.json", stage)  # a drafter folder without its stage's manifest is refused here
        upstream[arm] = upstream_entry(path / "manifest.json")
    return verifier_manifest, prompts, arm_paths, upstream


@dataclass(frozen=True)
class _Decoding:
    """What a decoding process loads and how it decodes; picklable, so a worker process gets it whole."""

    section: EvaluateParams
    verifier: Path
    arms: dict[str, Path]
    device: str
    dtype: torch.dtype

    def load(self) -> tuple[Any, set[int], dict[str, Eagle3Drafter]]:
        """The verifier, its end-of-turn ids and one drafter per arm."""
        from expman.data.verifier import load_tokenizer, load_verifier
        from expman.drafter.objective import VerifierHead

        facts = read_manifest(self.verifier / "manifest.json", "prepare")["verifier"]
        embedding = VerifierHead.load(self.verifier).embed
        drafters = {arm: _load_arm(p, embedding, facts, self.device, self.dtype) for arm, p in self.arms.items()}
        model = load_verifier(self.verifier, self.device, self.dtype)
        eos = model.generation_config.eos_token_id
        eos_ids = set(eos if isinstance(eos, list) else [eos]) | {load_tokenizer(self.verifier).eos_token_id}
        return model, eos_ids, drafters


def _checked_aux_layers(
    verifier_dir: Path, verifier: dict[str, Any], arm_paths: dict[str, Path]
) -> dict[str, list[int]]:
    """Each arm checked against the verifier before any decode starts; the aux layers it will be fed."""
    from expman.drafter.objective import VerifierHead

    embedding = VerifierHead.load(verifier_dir).embed
    return {
        arm: list(_load_arm(path, embedding, verifier, "cpu", torch.float32).config.aux_layer_ids)
        for arm, path in arm_paths.items()
    }


def _prompt_row(model, drafters: dict[str, Any], record: dict[str, Any], section: EvaluateParams, eos_ids) -> dict:
    """One prompt through every arm: plain decoding first (the greedy reference), then each drafter at each k."""
    temperature, seed, limit = section.temperature, section.seed, section.max_new_tokens
    prompt_ids = record["input_ids"][: record["prompt_tokens"]]
    started = time.perf_counter()
    reference = greedy_decode(model, prompt_ids, limit, eos_ids, temperature, seed)
    row: dict[str, Any] = {
        "id": record["id"],
        "category": record["category"],
        "nospec": {"tokens": len(reference.tokens), "seconds": time.perf_counter() - started - reference.check_seconds},
    }
    for arm, drafter in drafters.items():
        row[arm] = {}
        for k in section.ks:
            started = time.perf_counter()
            tokens, stats = speculative_decode(model, drafter, prompt_ids, k, limit, eos_ids, temperature, seed)
            seconds = time.perf_counter() - started
            row[arm][str(k)] = _arm_row(tokens, stats, seconds, None if temperature else reference)
    return row


def _decode_rows(
    section: EvaluateParams,
    loaded: tuple[Any, set[int], dict[str, Eagle3Drafter]],
    prompts: list[dict[str, Any]],
    timed: bool,
) -> Iterator[dict[str, Any]]:
    """Warm the loaded models up outside the timings, then yield the prompts' rows one by one, the arms
    interleaved; ``timed``: whether the rows' seconds count for tok/s and speedup."""
    model, eos_ids, drafters = loaded
    first = prompts[0]["input_ids"][: prompts[0]["prompt_tokens"]]
    with attention_kernels(section.cudnn_attention):
        greedy_decode(model, first, 8, eos_ids)
        for drafter in drafters.values():
            speculative_decode(model, drafter, first, max(section.ks), 8, eos_ids)
    for record in prompts:
        with attention_kernels(section.cudnn_attention):
            row = _prompt_row(model, drafters, record, section, eos_ids)
        yield row | {"timed": timed}


def _decode_worker(decoding: _Decoding, prompts: list[dict[str, Any]], rows_path: Path, threads: int) -> None:
    """A worker process: its share of the prompts, one JSON row per line as each finishes; its timings count
    unless some prompts are timed alone instead (``evaluate.timed_prompts``)."""
    torch.set_num_threads(threads)
    timed = decoding.section.timed_prompts is None
    _write_rows(_decode_rows(decoding.section, decoding.load(), prompts, timed), rows_path)


def _write_rows(rows: Iterator[dict[str, Any]], rows_path: Path) -> None:
    """Each row on its own flushed line as it comes, so a kill loses at most the prompt being decoded."""
    import json

    with rows_path.open("a") as out:
        for row in rows:
            out.write(json.dumps(row) + "\n")
            out.flush()


def _finished_rows(folder: Path) -> dict[str, dict[str, Any]]:
    """The rows an earlier, killed run of the same evaluation wrote, by prompt id (a line cut short is skipped)."""
    import json

    rows: dict[str, dict[str, Any]] = {}
    for part in sorted(folder.glob("*.jsonl")):
        for line in part.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            rows[row["id"]] = row
    return rows


def _state_folder(where: EvaluatePaths, key: dict[str, Any]) -> Path:
    """The rows folder of exactly this evaluation (settings, verifier, drafter files, prompts); the folders of any
    other evaluation are stale and go."""
    import hashlib
    import json

    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]
    folder = where.state / digest
    for other in where.state.glob("*"):
        if other != folder:
            shutil.rmtree(other, ignore_errors=True)
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def _decode_in_workers(decoding: _Decoding, prompts: list[dict[str, Any]], folder: Path, bar: Any) -> None:
    """Prompts dealt round-robin to ``evaluate.workers`` processes, each with its own verifier and drafters (a batch-1
    decode on a GPU is bound by kernel launches, so one GPU serves several), each appending to its rows file."""
    import os

    workers = min(decoding.section.workers, len(prompts))
    threads = 1 if decoding.device.startswith("cuda") else max(1, (os.cpu_count() or 1) // workers)
    context = torch.multiprocessing.get_context("spawn")
    stamp = time.time_ns()
    files = [folder / f"rows-{stamp}-{i}.jsonl" for i in range(workers)]
    processes = [
        context.Process(target=_decode_worker, args=(decoding, prompts[i::workers], files[i], threads))
        for i in range(workers)
    ]
    for process in processes:
        process.start()
    start = bar.n
    try:
        while any(p.is_alive() for p in processes):
            time.sleep(1.0)
            done = sum(len(f.read_text().splitlines()) for f in files if f.exists())
            bar.update(start + done - bar.n)
    finally:
        for process in processes:
            process.terminate()
            process.join()
    failed = [i for i, p in enumerate(processes) if p.exitcode != 0]
    if failed:
        code = processes[failed[0]].exitcode
        raise ExpmanError(f"evaluate: worker {failed[0]} exited with {code} (its error is above)")


def _counted(rows: Iterator[dict[str, Any]], bar: Any) -> Iterator[dict[str, Any]]:
    """The rows as they come, each one ticking the progress bar."""
    for row in rows:
        yield row
        bar.update(1)


def _measure(
    decoding: _Decoding,
    loaded: tuple[Any, set[int], dict[str, Eagle3Drafter]] | None,
    prompts: list[dict[str, Any]],
    folder: Path,
) -> tuple[list[dict[str, Any]], int]:
    """Every prompt's row, in prompt order, and how many came from a killed earlier run: the rest decoded with
    the models loaded here, or in ``evaluate.workers`` processes (``loaded`` None), except the first
    ``evaluate.timed_prompts``, decoded here alone once the workers finish, for the timings."""
    from tqdm import tqdm

    section = decoding.section
    todo = [record for record in prompts if record["id"] not in _finished_rows(folder)]
    reused = len(prompts) - len(todo)
    alone = {record["id"] for record in prompts[: section.timed_prompts]} if section.timed_prompts else set()
    shared = [] if loaded is not None else [record for record in todo if record["id"] not in alone]
    here = [record for record in todo if loaded is not None or record["id"] in alone]
    workers = f" ({min(section.workers, len(shared))} workers)" if shared else ""
    with tqdm(total=len(prompts), initial=reused, desc=f"evaluate{workers}", unit="prompt") as bar:
        if shared:
            _decode_in_workers(decoding, shared, folder, bar)
        if here:
            _decode_here(section, loaded or decoding.load(), here, folder, bar)
    finished = _finished_rows(folder)
    return [finished[record["id"]] for record in prompts], reused


def _decode_here(
    section: EvaluateParams,
    loaded: tuple[Any, set[int], dict[str, Eagle3Drafter]],
    prompts: list[dict[str, Any]],
    folder: Path,
    bar: Any,
) -> None:
    """The prompts decoded in this process, alone on its device: their timings count."""
    _write_rows(_counted(_decode_rows(section, loaded, prompts, True), bar), folder / f"rows-{time.time_ns()}.jsonl")


def _flat_metrics(summary: dict[str, Any], arms: Sequence[str]) -> dict[str, float]:
    """The summary as MLflow metrics: ``<arm>/<k>/<name>``."""
    flat = {"nospec/tok_per_s": summary["nospec"]["tok_per_s"]}
    for arm in arms:
        for key, values in summary[arm].items():
            flat.update({f"{arm}/{key}/{name}": values[name] for name in ("tau", "acceptance_rate", "speedup")})
            flat[f"{arm}/{key}/greedy_mismatches"] = values["greedy_mismatches"]
            flat[f"{arm}/{key}/greedy_tie_flips"] = values["greedy_tie_flips"]
    return flat


def evaluate(params: Params, where: EvaluatePaths) -> dict[str, Any]:
    """Run the three arms on the held-out prompts; write ``evaluation.json`` (per-prompt results + summary) and
    ``manifest.json`` to ``where.out``, the summary to ``where.metrics`` and its tables for ``dvc plots`` to
    ``where.plots``; the run logs the same pictures as ``figures/evaluate.png``."""
    from expman.plots import EVALUATE_FIGURE, evaluation_figure, evaluation_tables, write_tables

    section: EvaluateParams = params.evaluate
    verifier_manifest, prompts, arm_paths, upstream = _read_inputs(section, where)
    device = resolve_device(section.device)
    dtype = resolve_dtype(section.dtype, device)
    decoding = _Decoding(section, where.verifier, arm_paths, device, dtype)
    loaded = decoding.load() if section.workers == 1 else None  # workers load their own
    if loaded is None:  # each arm checked against the verifier before any worker starts
        aux_layers = _checked_aux_layers(where.verifier, verifier_manifest["verifier"], arm_paths)
    else:
        aux_layers = {arm: list(drafter.config.aux_layer_ids) for arm, drafter in loaded[2].items()}
    resolved = {"resolved": precision_facts(device, section.dtype)}
    arm_files = {arm: sha256_file(p / "model.safetensors") for arm, p in arm_paths.items()}
    this_evaluation = {"evaluate": section.model_dump(), "verifier": verifier_manifest["verifier"], "arms": arm_files}
    folder = _state_folder(where, this_evaluation | {"prompts": [record["id"] for record in prompts]})  # until done
    with stage_run("evaluate", section.model_dump() | resolved, upstream) as run:
        rows, reused = _measure(decoding, loaded, prompts, folder)
        summary = summarize(rows, list(arm_paths), section.ks)
        evaluation = {
            "ks": section.ks,
            "max_new_tokens": section.max_new_tokens,
            "temperature": section.temperature,
            **precision_facts(device, section.dtype),
            "target": speedup_target(device, section.dtype),
            "workers": section.workers,
            "resumed_prompts": reused,  # decoded by a killed earlier run of the same evaluation, timings included
            "arms": {
                arm: {
                    "path": str(p),
                    "sha256": arm_files[arm],
                    "aux_layers": aux_layers[arm],  # as fed here: the trained ones
                }
                for arm, p in arm_paths.items()
            },
            "prompts": rows,
            "summary": summary,
        }
        atomic_write_json(where.out / "evaluation.json", evaluation)
        run.log_artifact(where.out / "evaluation.json")
        metrics = _flat_metrics(summary, list(arm_paths))
        run.log_metrics(metrics)
        run.show_columns([name for name in metrics if name.endswith(("/tau", "/speedup"))])  # in expman ui's table
        atomic_write_json(where.metrics, {k: v for k, v in summary.items() if k != "by_category"})
        write_tables(where.plots, evaluation_tables(evaluation))
        run.log_figure(evaluation_figure(evaluation), EVALUATE_FIGURE)
        facts = {"prompts": len(rows), "ks": section.ks, "arms": evaluation["arms"], "summary_file": "evaluation.json"}
        manifest = run.write_manifest(where.out / "manifest.json", facts)
    shutil.rmtree(folder)  # finished: a forced rerun measures again
    return manifest
