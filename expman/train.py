"""train: train the EAGLE-3 drafter on the extracted features, with full resume, tracked in MLflow.

Inputs are checked before any training: the extract manifest's shard checksums, and that the features, the
vocab and the prepared verifier all describe the same verifier. Batches pack whole documents into one row of at
most ``max_tokens``; the batch order is a pure function of (seed, epoch), so a resumed run replays exactly the
batches an uninterrupted run would, and with the model, optimizer, scheduler and RNG restored it ends with
bit-identical weights on CPU. The result is the canonical checkpoint (speculators format).
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from expman.checkpoint import save_speculators
from expman.conversations import prompt_id
from expman.drafter import DrafterConfig, Eagle3Drafter
from expman.errors import ExpmanError
from expman.extract import TENSORS, load_shard
from expman.objective import Packed, VerifierHead, compiled_ttt_loss, metric_values, simulated_tau, ttt_loss
from expman.parallel import DataParallel
from expman.params import TrainParams
from expman.provenance import atomic_write, atomic_write_json, read_manifest, sha256_file, sha256_json, upstream_entry
from expman.shards import remove_stale_temps
from expman.tracking import StageRun, stage_run

__all__ = ["SampleRef", "batch_plan", "new_optimizer", "train", "training_step"]

VAL_EPOCH = 1_000_000  # the validation batches' seed slot, apart from every training epoch


@dataclass(frozen=True)
class SampleRef:
    """One document inside one extract shard."""

    shard: int
    index: int
    sample_id: str
    length: int


def _hash_share(sample_id: str, salt: str = "") -> float:
    """A stable number in [0, 1) per sample id: splits stay the same across runs and machines."""
    digest = hashlib.sha256((salt + sample_id).encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def index_samples(manifest: dict[str, Any]) -> list[SampleRef]:
    """Every document of every shard (ids from the shard metadata, lengths from its offsets), no tensor load.

    A shard whose size or plan key differs from its manifest entry (torn, or another run's) is refused here, before
    any training; the full checksum is checked when the shard is loaded."""
    from safetensors import SafetensorError, safe_open

    refs = []
    folder = Path(manifest["shard_dir"])
    for shard, entry in enumerate(manifest["shards"]):
        path = folder / entry["path"]
        if not path.is_file():
            raise ExpmanError(f"{path}: shard listed in the manifest is missing; rerun `dvc repro -f extract`")
        foreign = f"{path}: not the shard the manifest lists (corrupted, or a shard from another run)"
        if path.stat().st_size != entry["bytes"]:
            raise ExpmanError(foreign)
        try:
            with safe_open(str(path), "pt") as handle:
                metadata = json.loads(handle.metadata()["expman"])
                offsets = handle.get_tensor("sample_offsets").tolist()
                tensor_names = set(handle.keys())
        except (SafetensorError, KeyError, TypeError, json.JSONDecodeError):
            raise ExpmanError(foreign) from None
        if "verifier_top1" not in tensor_names:
            raise ExpmanError(f"{path}: no verifier_top1 tensor (from an older expman); rerun `dvc repro -f extract`")
        if metadata.get("key") != entry["key"]:
            raise ExpmanError(foreign)
        ids = metadata["sample_ids"]
        refs.extend(SampleRef(shard, i, sample_id, offsets[i + 1] - offsets[i]) for i, sample_id in enumerate(ids))
    return refs


def batch_plan(refs: list[SampleRef], max_tokens: int, seed: int, epoch: int) -> list[list[SampleRef]]:
    """The epoch's batches: shards in a seeded order, documents shuffled within each shard, packed greedily."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    by_shard: dict[int, list[SampleRef]] = {}
    for ref in refs:
        by_shard.setdefault(ref.shard, []).append(ref)
    batches: list[list[SampleRef]] = []
    for shard in [sorted(by_shard)[i] for i in torch.randperm(len(by_shard), generator=generator).tolist()]:
        current, used = [], 0
        for ref in [by_shard[shard][i] for i in torch.randperm(len(by_shard[shard]), generator=generator).tolist()]:
            length = min(ref.length, max_tokens)
            if current and used + length > max_tokens:
                batches.append(current)
                current, used = [], 0
            current.append(ref)
            used += length
        if current:
            batches.append(current)
    return batches


class ShardCache:
    """Loads one shard at a time (batches are grouped by shard); each shard's checksum is verified once."""

    PER_TOKEN = [name for name in TENSORS if name != "sample_offsets"]

    def __init__(self, manifest: dict[str, Any]):
        self.manifest = manifest
        self.verified: set[int] = set()
        self.current: tuple[int, dict[str, torch.Tensor]] | None = None

    def document(self, ref: SampleRef, max_tokens: int) -> dict[str, torch.Tensor]:
        """One document's per-token tensors, cut to ``max_tokens``."""
        if self.current is None or self.current[0] != ref.shard:
            tensors = load_shard(self.manifest, ref.shard, verify=ref.shard not in self.verified)
            self.verified.add(ref.shard)
            self.current = (ref.shard, tensors)
        tensors = self.current[1]
        start = int(tensors["sample_offsets"][ref.index])
        end = min(int(tensors["sample_offsets"][ref.index + 1]), start + max_tokens)
        return {name: tensors[name][start:end] for name in self.PER_TOKEN}

    def packed(self, refs: list[SampleRef], max_tokens: int, device: str) -> Packed:
        """One packed batch of the documents ``refs``, on ``device``."""
        return Packed.of([self.document(ref, max_tokens) for ref in refs]).to(device)


def training_step(
    drafter: Eagle3Drafter,
    head: VerifierHead,
    batches: list[Packed],
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    section: TrainParams,
    noise: torch.Generator,
    device: str,
    micro_batches: int | None = None,
    parallel: DataParallel | None = None,
    fillers: list[Packed] = (),
) -> dict[str, float]:
    """One optimizer step over this process's micro-batches ``batches``: TTT loss (bf16 autocast where ``autocasts``)
    and backward for each, gradients summed across processes, clip, AdamW, schedule.

    Each loss is scaled by 1 / ``micro_batches``, the step's micro-batches on all processes (default: these), so
    the update is the mean over the whole global batch; ``fillers`` (FSDP's, see ``DataParallel.fillers``) run
    with weight 0. Metrics are this process's, averaged over its batches."""
    count = micro_batches or len(batches)
    compiled = compiles(section, device)
    objective = compiled_ttt_loss() if compiled else ttt_loss
    optimizer.zero_grad(set_to_none=True)
    tracked_all = []
    for batch, weight in [(b, 1.0) for b in batches] + [(b, 0.0) for b in fillers]:
        if compiled:  # one shape for the compiled loss (flex attention has no dynamic shapes)
            batch = batch.padded(section.max_tokens)
        with torch.autocast(device, dtype=torch.bfloat16) if autocasts(section, device) else nullcontext():
            loss, tracked = objective(
                drafter, head, batch, section.ttt_steps, section.step_loss_decay, section.noise_std, noise
            )
        (loss * weight / count).backward()
        if weight:
            tracked_all.append(tracked)
    trainable = [p for group in optimizer.param_groups for p in group["params"]]
    if parallel is not None:
        parallel.sum_gradients(trainable)
    grad_norm = torch.nn.utils.clip_grad_norm_(trainable, section.grad_clip)
    if parallel is not None and parallel.sharded:  # a DTensor: the norm over every process's shards
        grad_norm = grad_norm.full_tensor()
    optimizer.step()
    scheduler.step()
    each = [metric_values(tracked) for tracked in tracked_all]
    names = {name for metrics in each for name in metrics}
    averaged = {n: sum(m[n] for m in each if n in m) / sum(n in m for m in each) for n in names}
    return (each[0] if len(each) == 1 else averaged) | {"grad_norm": float(grad_norm)}


def autocasts(section: TrainParams, device: str) -> bool:
    """bf16 autocast: where ``train.dtype`` asks for bfloat16, and under ``auto`` on CUDA."""
    return section.dtype == "bfloat16" or (section.dtype == "auto" and device == "cuda")


def compiles(section: TrainParams, device: str) -> bool:
    """Whether training compiles its loss and uses flex attention (``train.compile``; auto: on CUDA)."""
    return section.compile is True or (section.compile == "auto" and device == "cuda")


def new_optimizer(drafter: Eagle3Drafter, section: TrainParams, total_steps: int) -> tuple[Any, Any]:
    """AdamW over the trainable parameters (the embedding is frozen) and the warmup + cosine/linear schedule."""
    trainable = [p for p in drafter.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        trainable,
        lr=section.lr,
        betas=(0.9, 0.95),
        weight_decay=section.weight_decay,
        fused=trainable[0].is_cuda,
    )
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, _schedule(section, total_steps))


def _schedule(section: TrainParams, total_steps: int) -> Any:
    warmup = max(1, int(section.warmup_ratio * total_steps))

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total_steps - warmup)
        return 0.5 * (1 + math.cos(math.pi * progress)) if section.schedule == "cosine" else 1 - progress

    return factor


def _new_drafter(
    verifier_dir: Path, head: VerifierHead, contract: dict, vocab: dict, section: TrainParams
) -> Eagle3Drafter:
    verifier_config = json.loads((verifier_dir / "config.json").read_text())
    config = DrafterConfig.from_verifier(
        verifier_config, int(vocab["d2t"].numel()), contract["aux_layers"], num_layers=section.num_layers
    )
    config = replace(config, norm_before_residual=section.norm_before_residual)
    torch.manual_seed(section.seed)
    drafter = Eagle3Drafter(config)
    with torch.no_grad():
        drafter.embed_tokens.weight.copy_(head.embed)
        drafter.d2t.copy_(vocab["d2t"])
        drafter.t2d.copy_(vocab["t2d"])
        drafter.lm_head.weight.copy_(head.lm_head)  # start from the verifier's own rows of the draft vocab
        if section.fc_init == "top_aux":  # fc passes the highest captured layer's state through
            aux, hidden = contract["aux_layers"], drafter.fc.out_features
            top = aux.index(max(aux)) * hidden
            drafter.fc.weight.zero_()
            drafter.fc.weight[:, top : top + hidden] = torch.eye(hidden)
    return drafter


def incompatibilities(source: Eagle3Drafter, target: Eagle3Drafter) -> list[str]:
    """What keeps ``source``'s weights from meaning the same thing in ``target``: shapes, vocab map, aux ids."""
    found = []
    for key in (
        "hidden_size",
        "intermediate_size",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "num_hidden_layers",
        "vocab_size",
    ):
        mine, theirs = target.config.layer.get(key), source.config.layer.get(key)
        if mine != theirs:
            found.append(f"{key} {theirs} != {mine}")
    if source.config.draft_vocab_size != target.config.draft_vocab_size:
        found.append(f"draft_vocab_size {source.config.draft_vocab_size} != {target.config.draft_vocab_size}")
    elif not torch.equal(source.d2t, target.d2t):
        moved = int((source.d2t != target.d2t).sum())
        found.append(f"d2t maps {moved} of {target.config.draft_vocab_size} draft ids to other target ids")
    if source.config.aux_layer_ids != target.config.aux_layer_ids:
        found.append(f"aux_layer_ids {list(source.config.aux_layer_ids)} != {list(target.config.aux_layer_ids)}")
    if source.config.norm_before_residual != target.config.norm_before_residual:
        found.append(
            f"norm_before_residual {source.config.norm_before_residual} != {target.config.norm_before_residual}"
        )
    return found


def start_from(drafter: Eagle3Drafter, section: TrainParams, head: VerifierHead) -> Eagle3Drafter:
    """Load ``train.finetune_from`` into ``drafter`` after the compatibility check; refuse naming what differs."""
    from expman.checkpoint import load_drafter

    if not (Path(section.finetune_from) / "config.json").is_file():
        raise ExpmanError(
            f"train.finetune_from: {section.finetune_from}: not a drafter checkpoint folder (no config.json)"
        )
    source = load_drafter(Path(section.finetune_from), section.finetune_layer_convention, embedding=head.embed)
    problems = incompatibilities(source, drafter)
    if problems:
        raise ExpmanError(f"train.finetune_from: {section.finetune_from} is incompatible: {'; '.join(problems)}")
    weights = {k: v for k, v in source.state_dict().items() if k != "embed_tokens.weight"}
    drafter.load_state_dict(weights, strict=False)
    return drafter


def _check_inputs(verifier: dict, extract: dict, vocab: dict, paths: tuple[Path, Path, Path]) -> None:
    if extract["contract"]["verifier"] != verifier["verifier"]:
        raise ExpmanError(f"{paths[1]}: features were captured from another verifier than {paths[0]}")
    if vocab["verifier"] != verifier["verifier"]:
        raise ExpmanError(f"{paths[2]}: the vocab was built for another verifier than {paths[0]}")
    if extract["contract"]["final_state"] != "pre_norm":
        raise ExpmanError(f"{paths[1]}: train needs pre_norm final states (extract.final_state)")


def _evaluate(drafter, head, cache, batches, section, device) -> dict[str, float]:
    totals: dict[str, float] = {}
    weights: dict[str, float] = {}
    drafter.eval()
    with torch.no_grad():
        for refs in batches:
            batch = cache.packed(refs, section.max_tokens, device)
            if compiles(section, device):  # one shape for compiled flex attention, as in training
                batch = batch.padded(section.max_tokens)
            metrics = metric_values(ttt_loss(drafter, head, batch, section.ttt_steps, section.step_loss_decay)[1])
            for k in range(section.ttt_steps):
                for name in (f"loss_{k}", f"acc_{k}", f"cond_acc_{k}"):
                    if name in metrics:
                        totals[name] = totals.get(name, 0.0) + metrics[name] * metrics[f"positions_{k}"]
                        weights[name] = weights.get(name, 0.0) + metrics[f"positions_{k}"]
    drafter.train()
    result = {name: totals[name] / weights[name] for name in totals if weights[name]}
    cond = [result.get(f"cond_acc_{k}", 0.0) for k in range(section.ttt_steps)]
    for k in range(1, section.ttt_steps + 1):
        result[f"sim_tau_k{k}"] = simulated_tau(cond, k)
    return result


def train(
    section: TrainParams,
    verifier_dir: Path,
    extract_dir: Path,
    vocab_dir: Path,
    out_dir: Path,
    state_dir: Path,
    metrics_path: Path,
    stage: str = "train",
    sample_share: float = 1.0,
    finish: Callable[[StageRun, Path], dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """Train (or resume) the drafter; write the speculators-format checkpoint and manifest to ``out_dir``,
    held-out metrics to ``metrics_path``; resume state lives in ``state_dir``.

    The baseline stage reuses this with its own ``stage`` name, a ``sample_share`` of the training samples and a
    ``finish`` step (registration) that runs inside the same MLflow run and adds facts to the manifest."""
    from safetensors.torch import load_file
    from tqdm import tqdm

    from expman.verifier import resolve_device

    manifests = {
        "prepare": (verifier_dir / "manifest.json", read_manifest(verifier_dir / "manifest.json", "prepare")),
        "extract": (extract_dir / "manifest.json", read_manifest(extract_dir / "manifest.json", "extract")),
        "vocab": (vocab_dir / "manifest.json", read_manifest(vocab_dir / "manifest.json", "vocab")),
    }
    _check_inputs(*(m for _, m in manifests.values()), tuple(p for p, _ in manifests.values()))
    extract_manifest = manifests["extract"][1]
    contract = extract_manifest["contract"]
    refs = index_samples(extract_manifest)
    # by prompt: the sampled copies of a prompt go where the prompt goes, so validation never sees a trained prompt
    val_refs = [r for r in refs if _hash_share(prompt_id(r.sample_id)) < section.val_fraction]
    train_refs = [
        r
        for r in refs
        if _hash_share(prompt_id(r.sample_id)) >= section.val_fraction
        and _hash_share(prompt_id(r.sample_id), "share") < sample_share
    ]
    if not train_refs:
        raise ExpmanError(f"{extract_dir / 'manifest.json'}: no training samples left after the validation split")
    device = resolve_device(section.device)
    parallel = DataParallel.from_env(device, section.fsdp)
    vocab = load_file(str(vocab_dir / "vocab.safetensors"))
    head = VerifierHead.load(verifier_dir, vocab["t2d"])
    drafter = _new_drafter(verifier_dir, head, contract, vocab, section)
    if section.finetune_from:
        drafter = start_from(drafter, section, head)
    compute_dtype = torch.bfloat16 if autocasts(section, device) else None
    drafter = parallel.shard(drafter.to(device), device, compute_dtype)
    if compiles(section, device):
        drafter.use_flex_attention()
    head = head.to(device, compute_dtype)
    per_step = section.accumulate * parallel.world  # micro-batches of one optimizer step on all processes
    plans = [
        _steps(batch_plan(train_refs, section.max_tokens, section.seed, epoch), per_step)
        for epoch in range(section.epochs)
    ]
    epoch_starts = [sum(len(p) for p in plans[:epoch]) for epoch in range(section.epochs)]
    total_steps = sum(len(p) for p in plans)
    optimizer, scheduler = new_optimizer(drafter, section, total_steps)
    noise = torch.Generator(device=device).manual_seed(section.seed + parallel.rank)
    upstream = {name: upstream_entry(path, manifest) for name, (path, manifest) in manifests.items()}
    if section.finetune_from:
        upstream["finetune_from"] = {
            "manifest": section.finetune_from,
            "manifest_sha256": sha256_file(Path(section.finetune_from) / "model.safetensors"),
        }
    plan_key = sha256_json(
        {
            "params": section.model_dump(),
            "sample_share": sample_share,
            "upstream": {k: v["manifest_sha256"] for k, v in upstream.items()},
        }
    )
    for path in (state_dir / "state.pt", out_dir, metrics_path):
        remove_stale_temps(path)  # what a kill during an atomic write left beside it
    step = _resume(state_dir, plan_key, drafter, optimizer, scheduler, noise, parallel)
    cache = ShardCache(extract_manifest)
    val_batches = batch_plan(val_refs, section.max_tokens, section.seed, VAL_EPOCH) if val_refs else []
    logged = section.model_dump() | ({"sample_share": sample_share} if sample_share < 1 else {})
    with stage_run(stage, logged, upstream) if parallel.main else nullcontext() as run:
        drafter.train()
        window: list[dict[str, float]] = []
        final: dict[str, float] = {}
        tokens, started = 0, time.perf_counter()
        with tqdm(total=total_steps, initial=step, desc=stage, unit="step", disable=not parallel.main) as bar:
            for epoch, steps in enumerate(plans):
                if epoch_starts[epoch] + len(steps) <= step:
                    continue  # finished before a resume
                for group in steps[step - epoch_starts[epoch] :]:
                    batches = [
                        cache.packed(refs, section.max_tokens, device)
                        for refs in parallel.share(group, section.accumulate)
                    ]
                    fillers = [
                        cache.packed(refs, section.max_tokens, device)
                        for refs in parallel.fillers(group, section.accumulate)
                    ]
                    metrics = training_step(
                        drafter,
                        head,
                        batches,
                        optimizer,
                        scheduler,
                        section,
                        noise,
                        device,
                        len(group),
                        parallel,
                        fillers,
                    )
                    step += 1
                    checkpoint = step % section.checkpoint_every == 0 or step == total_steps
                    if checkpoint:  # collectives: every process takes part
                        noise_states = parallel.gather(noise.get_state())
                        weights, moments = parallel.model_state(drafter), parallel.optimizer_state(drafter, optimizer)
                    if not parallel.main:
                        continue
                    tokens += sum(batch.input_ids.numel() for batch in batches) * parallel.world
                    window.append(metrics)
                    bar.update(1)
                    if step % section.log_every == 0 or step == total_steps:
                        averaged = {k: sum(m.get(k, 0.0) for m in window) / len(window) for k in window[-1]}
                        cond = [averaged.get(f"cond_acc_{k}", 0.0) for k in range(section.ttt_steps)]
                        for k in range(1, section.ttt_steps + 1):
                            averaged[f"sim_tau_k{k}"] = simulated_tau(cond, k)
                        averaged = {f"train/{k}": v for k, v in averaged.items()}
                        averaged["lr"] = scheduler.get_last_lr()[0]
                        averaged["tok_per_s"] = tokens / (time.perf_counter() - started)
                        run.log_metrics(averaged, step=step)
                        window = []
                    if checkpoint:
                        _save_state(state_dir, plan_key, step, weights, moments, scheduler, noise_states)
                if val_batches and (parallel.main or parallel.sharded):  # FSDP: every forward is a collective
                    final = _evaluate(drafter, head, cache, val_batches, section, device)
                    if parallel.main:
                        run.log_metrics({f"val/{k}": v for k, v in final.items()}, step=step)
        if val_batches and not final and (parallel.main or parallel.sharded):  # resumed after the last epoch ended
            final = _evaluate(drafter, head, cache, val_batches, section, device)
        weights = parallel.model_state(drafter)
        if not parallel.main:
            parallel.close()  # waits until the main process has written every output
            return {}
        if parallel.sharded:
            drafter = Eagle3Drafter(drafter.config)
            drafter.load_state_dict(weights)
        save_speculators(
            drafter.cpu(),
            out_dir,
            str(verifier_dir),
            [manifests["prepare"][1]["verifier"]["architecture"]],
            speculative_tokens=section.ttt_steps,
        )
        metrics = {"train_samples": len(train_refs), "val_samples": len(val_refs), "steps": step, **final}
        atomic_write_json(metrics_path, metrics)
        facts = {"contract": contract, "draft_vocab_size": drafter.config.draft_vocab_size, "metrics": metrics}
        if finish is not None:
            facts.update(finish(run, out_dir))
        manifest = run.write_manifest(out_dir / "manifest.json", facts)
    parallel.close()
    return manifest


def _steps(batches: list, per_step: int) -> list[list]:
    """An epoch's micro-batches grouped into optimizer steps of ``per_step`` (the last step may have fewer)."""
    return [batches[start : start + per_step] for start in range(0, len(batches), per_step)]


def _save_state(state_dir: Path, plan_key: str, step: int, weights, moments, scheduler, noise_states) -> None:
    """Everything a resume needs, written atomically (read back with ``weights_only=True``: no pickle code):
    the drafter's ``weights`` but the frozen embedding, the optimizer's ``moments``, and ``noise_states``, each
    process's noise generator state, by rank."""
    state = {
        "plan_key": plan_key,
        "step": step,
        "model": {k: v for k, v in weights.items() if k != "embed_tokens.weight"},
        "optimizer": moments,
        "scheduler": scheduler.state_dict(),
        "torch_rng": torch.get_rng_state(),
        "noise_rng": noise_states,
    }

    def write(tmp: Path) -> None:
        with open(tmp, "wb") as handle:  # to a path, torch names the archive's root folder after the random temp file
            torch.save(_interned(state), handle)

    atomic_write(state_dir / "state.pt", write)


def _interned(value: Any) -> Any:
    """``value`` with every dict key interned. Pickle writes a repeated string once only when it is one object: a
    resumed optimizer's keys come from unpickling, and without this its state files differ in bytes, not content."""
    if isinstance(value, dict):
        return {sys.intern(k) if isinstance(k, str) else k: _interned(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_interned(v) for v in value]
    return value


def _resume(state_dir: Path, plan_key: str, drafter, optimizer, scheduler, noise, parallel: DataParallel) -> int:
    """Restore the last state of this exact plan; any other state is ignored (a fresh start). Returns the step."""
    path = state_dir / "state.pt"
    if not path.is_file():
        return 0
    state = torch.load(path, weights_only=True, map_location="cpu")
    if state.get("plan_key") != plan_key:
        return 0
    parallel.load_states(drafter, optimizer, state["model"], state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["torch_rng"])
    noise.set_state(state["noise_rng"][parallel.rank])
    return int(state["step"])
