"""train: train the EAGLE-3 drafter on the extracted features, with full resume, tracked in MLflow.

Inputs are checked before any training: the extract manifest's shard checksums, and that the features, the
vocab and the prepared verifier all describe the same verifier. Batches pack whole documents into one row of at
most ``max_tokens``; the batch order is a pure function of (seed, epoch), so a resumed run replays exactly the
batches an uninterrupted run would, and with the model, optimizer, scheduler and RNG restored it ends with
bit-identical weights on CPU. The result is the canonical checkpoint (speculators format).
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from expman.data.conversations import prompt_id
from expman.data.shards import remove_stale_temps
from expman.devices import compiles as setting_compiles
from expman.devices import dtype_name, precision_facts, resolve_device
from expman.drafter.checkpoint import save_speculators, weights_sha256
from expman.drafter.model import DrafterConfig, Eagle3Drafter
from expman.drafter.objective import Packed, VerifierHead, compiled_ttt_loss, metric_values, simulated_tau, ttt_loss
from expman.errors import ExpmanError
from expman.params import LAUNCH_KEYS, TrainParams
from expman.paths import TrainPaths
from expman.plots import TRAIN_FIGURE, train_figure, train_row, write_tables
from expman.provenance import atomic_write, atomic_write_json, read_manifest, sha256_json, upstream_entry
from expman.registry.tracking import StageRun, stage_run
from expman.training.batches import (
    BatchFeed,
    FeatureReader,
    SampleRef,
    ShardReader,
    batch_plan,
    index_samples,
    split_samples,
)
from expman.training.online import OnlineFeatures, online_chunks, online_refs
from expman.training.parallel import DataParallel

__all__ = ["new_optimizer", "train", "training_step"]

VAL_EPOCH = 1_000_000  # the validation batches' seed slot, apart from every training epoch


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
) -> dict[str, torch.Tensor]:
    """One optimizer step over this process's micro-batches ``batches``: TTT loss (bf16 autocast where ``autocasts``)
    and backward for each, gradients summed across processes, clip, AdamW, schedule.

    Each loss is scaled by 1 / ``micro_batches``, the step's micro-batches on all processes (default: these), so
    the update is the mean over the whole global batch; ``fillers`` (see ``DataParallel.fillers``) run with weight
    0. Metrics are the global batch's, averaged over the step's micro-batches on all processes (one all-reduce of a
    few numbers), as 0-d tensors still on the device: the step never waits for the GPU to read them
    (``metric_values`` reads them, once per logging interval)."""
    count = micro_batches or len(batches)
    compiled = compiles(section, device)
    objective = compiled_ttt_loss() if compiled else ttt_loss
    optimizer.zero_grad(set_to_none=True)
    tracked_all, names = [], []
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
        names = names or list(tracked)
    trainable = [p for group in optimizer.param_groups for p in group["params"]]
    if parallel is not None:
        parallel.sum_gradients(trainable)
    grad_norm = torch.nn.utils.clip_grad_norm_(trainable, section.grad_clip)
    if parallel is not None and parallel.sharded:  # a DTensor: the norm over every process's shards
        grad_norm = grad_norm.full_tensor()
    optimizer.step()
    scheduler.step()
    if parallel is None or parallel.world == 1:
        metrics = mean_metrics(tracked_all)
    else:
        sums, counts = metric_sums(tracked_all, names, grad_norm.device)
        totals = parallel.sum_over_processes(torch.stack([sums, counts]))
        metrics = dict(zip(names, totals[0] / totals[1].clamp(min=1), strict=True))
    return metrics | {"grad_norm": grad_norm.detach()}


def metric_sums(
    tracked: list[dict[str, torch.Tensor]], names: list[str], device: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per metric of ``names``: its sum over ``tracked`` (batches or steps) and how many of them count; a ``loss_k``
    counts only where its step had positions (``metric_values`` drops it where none had). On the device, unread."""
    sums, counts = [], []
    for name in names:
        values = torch.stack([t[name].float() for t in tracked]) if tracked else torch.zeros(0, device=device)
        counted = torch.ones_like(values)
        if name.startswith("loss_") and f"positions_{name[5:]}" in names and tracked:
            counted = torch.stack([(t[f"positions_{name[5:]}"] > 0).float() for t in tracked])
        sums.append((values * counted).sum())
        counts.append(counted.sum())
    return torch.stack(sums), torch.stack(counts)


def mean_metrics(tracked: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The mean of each metric over ``tracked`` (batches or steps), as ``metric_sums`` counts them; {} when empty."""
    if not tracked:
        return {}
    names = list(tracked[0])
    sums, counts = metric_sums(tracked, names, None)
    return dict(zip(names, sums / counts.clamp(min=1), strict=True))


def autocasts(section: TrainParams, device: str) -> bool:
    """bf16 autocast: where ``train.dtype`` asks for bfloat16, and under ``auto`` where the hardware computes bf16
    natively (CUDA, a CPU with AVX512-BF16 or AMX). Weights and optimizer state stay float32 either way."""
    return dtype_name(section.dtype, device) == "bfloat16"


def compiles(section: TrainParams, device: str) -> bool:
    """Whether training compiles its loss and uses flex attention (``train.compile``; auto: on CUDA)."""
    return setting_compiles(section.compile, device)


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
    from expman.drafter.checkpoint import load_drafter

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


def _evaluate(drafter, head, reader: FeatureReader, batches, section, device) -> dict[str, float]:
    """Held-out loss, accuracies and simulated τ of ``batches``, weighted by their scored positions; under the
    training step's autocast (FSDP gathers the weights in its dtype, and the drafter is measured as it trains)."""
    totals: dict[str, float] = {}
    weights: dict[str, float] = {}
    drafter.eval()
    pad_to = section.max_tokens if compiles(section, device) else None  # one shape for compiled flex attention
    autocast = torch.autocast(device, dtype=torch.bfloat16) if autocasts(section, device) else nullcontext()
    with torch.no_grad(), autocast:
        for batch in _feed(reader, batches, section, device, pad_to):
            metrics = metric_values(ttt_loss(drafter, head, batch, section.ttt_steps, section.step_loss_decay)[1])
            for k in range(section.ttt_steps):
                for name in (f"loss_{k}", f"acc_{k}", f"cond_acc_{k}"):
                    if name in metrics:
                        totals[name] = totals.get(name, 0.0) + metrics[name] * metrics[f"positions_{k}"]
                        weights[name] = weights.get(name, 0.0) + metrics[f"positions_{k}"]
    drafter.train()
    result = {name: totals[name] / weights[name] for name in totals if weights[name]}
    losses = [(k, result[f"loss_{k}"]) for k in range(section.ttt_steps) if f"loss_{k}" in result]
    result["loss"] = sum(section.step_loss_decay**k * loss for k, loss in losses)  # the training objective's sum
    cond = [result.get(f"cond_acc_{k}", 0.0) for k in range(section.ttt_steps)]
    for k in range(1, section.ttt_steps + 1):
        result[f"sim_tau_k{k}"] = simulated_tau(cond, k)
    return result


@dataclass(frozen=True)
class _Inputs:
    """What train reads before it builds anything: the three input manifests (checked against each other), the
    training and validation samples, and the upstream entries its manifest and MLflow run record (the drafter it
    finetunes from is added once checked)."""

    verifier: dict[str, Any]
    extract: dict[str, Any]
    train_refs: list[SampleRef]
    val_refs: list[SampleRef]
    upstream: dict[str, Any]
    online: list[list[dict[str, Any]]] | None
    """With online features: each shard's samples, which the verifier computes the states of while training."""


def _read_inputs(section: TrainParams, where: TrainPaths, sample_share: float, stage: str) -> _Inputs:
    manifests = {
        "prepare": (where.verifier / "manifest.json", read_manifest(where.verifier / "manifest.json", "prepare")),
        "extract": (where.extract / "manifest.json", read_manifest(where.extract / "manifest.json", "extract")),
        "vocab": (where.vocab / "manifest.json", read_manifest(where.vocab / "manifest.json", "vocab")),
    }
    _check_inputs(*(m for _, m in manifests.values()), tuple(p for p, _ in manifests.values()))
    extract_manifest = manifests["extract"][1]
    online = _online_shards(section, where, extract_manifest, stage)
    if online is not None:  # the responses are an input: the states are computed from them
        manifests["generate"] = (where.generated / "manifest.json", None)
    refs = index_samples(extract_manifest) if online is None else online_refs(online)
    # by prompt: the sampled copies of a prompt go where the prompt goes, so validation never sees a trained prompt
    train_refs, val_refs = split_samples(refs, section.val_fraction, sample_share, prompt_id)
    if not train_refs:
        raise ExpmanError(f"{where.extract / 'manifest.json'}: no training samples left after the validation split")
    upstream = {name: upstream_entry(path) for name, (path, _) in manifests.items()}
    return _Inputs(manifests["prepare"][1], extract_manifest, train_refs, val_refs, upstream, online)


def _online_shards(
    section: TrainParams, where: TrainPaths, extract_manifest: dict[str, Any], stage: str
) -> list[list[dict[str, Any]]] | None:
    """The online shards' samples when extract recorded online features (None: stored ones); the train stage
    refuses a manifest of the other kind than ``train.features`` asks for (the baseline follows the manifest)."""
    mode = extract_manifest.get("features", {}).get("mode", "offline")
    if stage == "train" and mode != section.features:
        raise ExpmanError(
            f"train.features: {section.features}, but {where.extract / 'manifest.json'} records {mode} features; "
            "rerun dvc repro extract"
        )
    return online_chunks(extract_manifest, where.generated) if mode == "online" else None


def _feature_readers(
    inputs: _Inputs, section: TrainParams, where: TrainPaths, device: str, validates: bool
) -> tuple[FeatureReader, FeatureReader]:
    """Where the training and the validation batches get their features: the stored shards, or the verifier
    computing them (online; validation reads the held-out documents training kept, in this process if it
    ``validates``)."""
    if inputs.online is None:
        reader = ShardReader(inputs.extract)
        return reader, reader
    held_out = inputs.val_refs if validates else []
    reader = OnlineFeatures(inputs.extract, inputs.online, where.verifier, device, section.online_cache_gib, held_out)
    return reader, reader.held_out()


def _build_drafter(
    section: TrainParams, where: TrainPaths, contract: dict, device: str, parallel: DataParallel
) -> tuple[Any, VerifierHead]:
    """The drafter (new, or started from ``train.finetune_from``) sharded onto ``device``, and the verifier's head."""
    from safetensors.torch import load_file

    vocab = load_file(str(where.vocab / "vocab.safetensors"))
    head = VerifierHead.load(where.verifier, vocab["t2d"])
    drafter = _new_drafter(where.verifier, head, contract, vocab, section)
    if section.finetune_from:
        drafter = start_from(drafter, section, head)
    compute_dtype = torch.bfloat16 if autocasts(section, device) else None
    drafter = parallel.shard(drafter.to(device), device, compute_dtype)
    if compiles(section, device):
        drafter.use_flex_attention()
    return drafter, head.to(device, compute_dtype)


def _plans(section: TrainParams, refs: list[SampleRef], parallel: DataParallel) -> list[list[list[SampleRef]]]:
    """Per epoch, the optimizer steps' groups of micro-batches (``accumulate`` per process, on all processes)."""
    per_step = section.accumulate * parallel.world
    return [
        _steps(batch_plan(refs, section.max_tokens, section.seed, epoch, section.shard_window), per_step)
        for epoch in range(section.epochs)
    ]


def _plan_key(section: TrainParams, parallel: DataParallel, sample_share: float, upstream: dict[str, Any]) -> str:
    """What a resume state must have been planned with to be resumed: params, world size, sample share, inputs."""
    return sha256_json(
        {
            "params": section.model_dump(exclude=LAUNCH_KEYS),
            "world": parallel.world,
            "sample_share": sample_share,
            "upstream": {k: v["manifest_sha256"] for k, v in upstream.items()},
        }
    )


def _remove_stale_temps(where: TrainPaths) -> None:
    """What a kill during an atomic write left beside each output."""
    tables = [] if where.plots is None else [where.plots / "steps.csv", where.plots / "heldout.csv"]
    for path in (where.state / "state.pt", where.out, where.metrics, *tables):
        remove_stale_temps(path)


def _write_outputs(
    run: StageRun,
    loop: _Loop,
    drafter: Any,
    final: dict[str, float],
    inputs: _Inputs,
    where: TrainPaths,
    finish: Callable[[StageRun, Path], dict[str, Any]] | None,
) -> dict[str, Any]:
    """The checkpoint, held-out metrics, plot tables and figure; the manifest, with what ``finish`` returns recorded in
    the run's provenance."""
    section = loop.section
    save_speculators(
        drafter.cpu(),
        where.out,
        str(where.verifier),
        [inputs.verifier["verifier"]["architecture"]],
        speculative_tokens=section.ttt_steps,
    )
    metrics = {"train_samples": len(inputs.train_refs), "val_samples": len(inputs.val_refs), "steps": loop.step}
    metrics |= final
    atomic_write_json(where.metrics, metrics)
    if where.plots is not None:
        write_tables(where.plots, {"steps": loop.history["steps"], "heldout": loop.history["heldout"]})
    run.log_figure(train_figure(loop.history["steps"], loop.history["heldout"], loop.stage), TRAIN_FIGURE)
    contract = inputs.extract["contract"]
    facts = {"contract": contract, "draft_vocab_size": drafter.config.draft_vocab_size, "metrics": metrics}
    facts["precision"] = precision_facts(loop.device, section.dtype)
    if loop.peak_gib is not None:  # what each GPU had to hold: the number that says whether FSDP is needed
        facts["gpu_peak_gib"] = loop.peak_gib
        run.log_metrics({f"gpu{rank}/peak_gib": gib for rank, gib in enumerate(loop.peak_gib)})
    if isinstance(loop.reader, OnlineFeatures):  # what computing the features cost (a time: the run, not the manifest)
        features = loop.reader
        run.log_metrics(
            {
                "online_features_tokens": features.computed_tokens,
                "online_features_s": features.compute_seconds,
                "online_held_out_bytes": features.held_bytes,
            }
        )
    recorded = finish(run, where.out) if finish is not None else None
    return run.write_manifest(where.out / "manifest.json", facts, recorded)


def train(
    section: TrainParams,
    where: TrainPaths,
    stage: str = "train",
    sample_share: float = 1.0,
    finish: Callable[[StageRun, Path], dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """Train (or resume) the drafter; write the speculators-format checkpoint and manifest to ``where.out``,
    held-out metrics to ``where.metrics``, the training curves for ``dvc plots`` to ``where.plots`` (when given:
    ``steps.csv`` per logging window, ``heldout.csv`` per epoch); resume state lives in ``where.state``. The run
    logs the curves as the figure ``figures/train.png``.

    The baseline stage reuses this with its own ``stage`` name, a ``sample_share`` of the training samples and a
    ``finish`` step (registration) that runs inside the same MLflow run and records facts in its provenance."""

    inputs = _read_inputs(section, where, sample_share, stage)
    device = resolve_device(section.device)
    section = section.resolved(dtype_name(section.dtype, device))
    parallel = DataParallel.from_env(device, section.fsdp)
    drafter, head = _build_drafter(section, where, inputs.extract["contract"], device, parallel)
    if section.finetune_from:  # an input too, once start_from has checked it is a drafter
        inputs.upstream["finetune_from"] = {
            "manifest": section.finetune_from,
            "manifest_sha256": weights_sha256(Path(section.finetune_from)),
        }
    plans = _plans(section, inputs.train_refs, parallel)
    optimizer, scheduler = new_optimizer(drafter, section, sum(len(p) for p in plans))
    noise = torch.Generator(device=device).manual_seed(section.seed + parallel.rank)
    plan_key = _plan_key(section, parallel, sample_share, inputs.upstream)
    _remove_stale_temps(where)
    step, history = _resume(where.state, plan_key, drafter, optimizer, scheduler, noise, parallel, device)
    readers = _feature_readers(inputs, section, where, device, parallel.main or parallel.sharded)
    val_refs = inputs.val_refs
    val_batches = (
        batch_plan(val_refs, section.max_tokens, section.seed, VAL_EPOCH, section.shard_window) if val_refs else []
    )
    logged = section.model_dump() | {"resolved": precision_facts(device, section.dtype)}
    logged |= {"sample_share": sample_share} if sample_share < 1 else {}
    loop = _Loop(section, device, parallel, drafter, head, optimizer, scheduler, noise, readers, stage, history)
    try:
        with stage_run(stage, logged, inputs.upstream) if parallel.main else nullcontext() as run:
            final = loop.run(run, plans, step, val_batches, where.state, plan_key)
            loop.peak_gib = parallel.peak_memory_gib(device)
            weights = parallel.model_state(drafter)
            if not parallel.main:
                parallel.close()  # waits until the main process has written every output
                return {}
            if parallel.sharded:
                drafter = Eagle3Drafter(drafter.config)
                drafter.load_state_dict(weights)
            manifest = _write_outputs(run, loop, drafter, final, inputs, where, finish)
    finally:
        readers[0].close()  # the validation reader reads through it
    parallel.close()
    return manifest


def _feed(reader: FeatureReader, plan: list[list[SampleRef]], section: TrainParams, device: str, pad_to=None):
    """The packed batches of ``plan`` in order, read and packed off this thread (see ``expman.training.batches``)."""
    return BatchFeed(
        reader, plan, section.max_tokens, device, pad_to, prefetch=section.prefetch, resident=2 * section.shard_window
    )


class _Loop:
    """The training loop over the planned steps: batches from the feed, one ``training_step`` each, metrics read
    from the device once per ``log_every`` steps and sent to MLflow off this thread, resume checkpoints.

    ``history`` (saved with each checkpoint, so a resumed run draws the whole curve): the rows of the curves so
    far (``steps``, ``heldout``) and the metrics of the logging window still open (``window``)."""

    def __init__(self, section, device, parallel, drafter, head, optimizer, scheduler, noise, readers, stage, history):
        self.section, self.device, self.parallel = section, device, parallel
        self.drafter, self.head, self.optimizer, self.scheduler, self.noise = drafter, head, optimizer, scheduler, noise
        (self.reader, self.val_reader), self.stage, self.history = readers, stage, history
        self.step, self.tokens, self.started = 0, 0, time.perf_counter()
        self.epoch_tokens, self.epoch_started, self.warm = 0, self.started, False
        self.epoch_waited = 0.0  # seconds this epoch's steps waited for their batches from the feed
        self.peak_gib: list[float] | None = None  # CUDA: each process's peak memory, by rank (set after the run)

    def run(self, run, plans, step, val_batches, state_dir: Path, plan_key: str) -> dict[str, float]:
        """Train from ``step`` to the end of ``plans`` (per epoch, the optimizer steps' micro-batch groups);
        return the last held-out metrics."""
        from tqdm import tqdm

        section, parallel = self.section, self.parallel
        self.step = step
        total_steps = sum(len(p) for p in plans)
        todo, mine = self._remaining(plans, step)
        pad_to = section.max_tokens if compiles(section, self.device) else None
        feed = _feed(self.reader, [refs for own, fill in mine for refs in own + fill], section, self.device, pad_to)
        batches = iter(feed)
        final: dict[str, float] = {}
        self.epoch_tokens, self.epoch_started, self.warm = 0, time.perf_counter(), False
        bar = tqdm(total=total_steps, initial=step, desc=self.stage, unit="step", disable=not parallel.main)
        try:
            for index, ((epoch, group), (own, fill)) in enumerate(zip(todo, mine, strict=True)):
                metrics = training_step(
                    self.drafter,
                    self.head,
                    self._take(batches, len(own)),
                    self.optimizer,
                    self.scheduler,
                    section,
                    self.noise,
                    self.device,
                    len(group),
                    parallel,
                    self._take(batches, len(fill)),
                )
                self.step += 1
                self._count_tokens(group)
                epoch_ends = index + 1 == len(todo) or todo[index + 1][0] != epoch
                if epoch_ends:  # the epoch's rate, before its last resume state is written
                    self._log_epoch_rate(run, epoch)
                if parallel.main:
                    self.history["window"].append(metrics)
                    bar.update(1)
                    if self.step % section.log_every == 0 or self.step == total_steps:
                        self._log_window(run)
                if epoch_ends:
                    final = self._end_epoch(run, val_batches) or final
                if self.step % section.checkpoint_every == 0 or self.step == total_steps:  # after what it records
                    self._checkpoint(state_dir, plan_key)
        finally:
            feed.close()
            bar.close()
        if val_batches and not final and (parallel.main or parallel.sharded):  # resumed after the last epoch ended
            final = _evaluate(self.drafter, self.head, self.val_reader, val_batches, section, self.device)
        return final

    def _remaining(self, plans, step: int) -> tuple[list, list]:
        """The (epoch, group) of every step from ``step`` on, and per step this process's micro-batches and fillers."""
        epoch_starts = [sum(len(p) for p in plans[:epoch]) for epoch in range(len(plans))]
        todo = [
            (epoch, group) for epoch, steps in enumerate(plans) for group in steps[max(0, step - epoch_starts[epoch]) :]
        ]
        accumulate = self.section.accumulate
        return todo, [(self.parallel.share(g, accumulate), self.parallel.fillers(g, accumulate)) for _, g in todo]

    def _take(self, batches: Iterator[Any], count: int) -> list[Any]:
        """The step's next ``count`` batches from the feed, the time spent waiting for them counted."""
        started = time.perf_counter()
        taken = [next(batches) for _ in range(count)]
        self.epoch_waited += time.perf_counter() - started
        return taken

    def _count_tokens(self, group: list[list[SampleRef]]) -> None:
        """The first step compiles (on CUDA): rates are timed from its end, so its tokens are not counted."""
        if not self.warm:
            self._synchronize()
            self.epoch_tokens, self.epoch_started, self.warm = 0, time.perf_counter(), True
            self.tokens, self.started, self.epoch_waited = 0, self.epoch_started, 0.0
        else:
            tokens = _tokens(group, self.section.max_tokens)
            self.epoch_tokens += tokens
            self.tokens += tokens

    def _log_epoch_rate(self, run: StageRun, epoch: int) -> None:
        self._synchronize()
        seconds = time.perf_counter() - self.epoch_started
        if self.parallel.main and self.epoch_tokens:  # a feed that cannot keep up shows as a large input-wait share
            rate = {"epoch_tok_per_s": self.epoch_tokens / seconds, "epoch_input_wait": self.epoch_waited / seconds}
            run.log_metrics(rate, step=epoch)

    def _end_epoch(self, run: StageRun, val_batches) -> dict[str, float]:
        """The held-out metrics after an epoch (empty without validation batches); the next epoch's rate starts."""
        final: dict[str, float] = {}
        if val_batches and (self.parallel.main or self.parallel.sharded):  # FSDP: every forward is a collective
            final = _evaluate(self.drafter, self.head, self.val_reader, val_batches, self.section, self.device)
            if self.parallel.main:
                run.log_metrics({f"val/{k}": v for k, v in final.items()}, step=self.step)
                self.history["heldout"].append(train_row(self.step, final, self.section.ttt_steps))
        self.epoch_tokens, self.epoch_started, self.epoch_waited = 0, time.perf_counter(), 0.0
        return final

    def _synchronize(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()

    def _log_window(self, run: StageRun) -> None:
        """The logging window's means, read from the device in one transfer, with simulated τ: to MLflow with the
        lr and tokens/s, and to the curves; the window closes."""
        averaged = metric_values(mean_metrics(self.history["window"]))
        cond = [averaged.get(f"cond_acc_{k}", 0.0) for k in range(self.section.ttt_steps)]
        for k in range(1, self.section.ttt_steps + 1):
            averaged[f"sim_tau_k{k}"] = simulated_tau(cond, k)
        rate = {"tok_per_s": self.tokens / (time.perf_counter() - self.started)} if self.tokens else {}
        logged = {f"train/{k}": v for k, v in averaged.items()} | {"lr": self.scheduler.get_last_lr()[0]} | rate
        run.log_metrics(logged, step=self.step)
        self.history["steps"].append(train_row(self.step, averaged, self.section.ttt_steps))
        self.history["window"] = []

    def _checkpoint(self, state_dir: Path, plan_key: str) -> None:
        """The resume state (collectives: every process takes part; the main process writes it)."""
        parallel = self.parallel
        noise_states = parallel.gather(self.noise.get_state())
        weights = parallel.model_state(self.drafter)
        moments = parallel.optimizer_state(self.drafter, self.optimizer)
        if parallel.main:
            history = self.history | {"window": [{k: v.cpu() for k, v in m.items()} for m in self.history["window"]]}
            _save_state(state_dir, plan_key, self.step, weights, moments, self.scheduler, noise_states, history)


def _tokens(group: list[list[SampleRef]], max_tokens: int) -> int:
    """The real (unpadded) tokens of one optimizer step's micro-batches on all processes."""
    return sum(min(ref.length, max_tokens) for refs in group for ref in refs)


def _steps(batches: list, per_step: int) -> list[list]:
    """An epoch's micro-batches grouped into optimizer steps of ``per_step`` (the last step may have fewer)."""
    return [batches[start : start + per_step] for start in range(0, len(batches), per_step)]


def _save_state(state_dir: Path, plan_key: str, step: int, weights, moments, scheduler, noise_states, history) -> None:
    """Everything a resume needs, written atomically (read back with ``weights_only=True``: no pickle code):
    the drafter's ``weights`` but the frozen embedding, the optimizer's ``moments``, ``noise_states``, each
    process's noise generator state, by rank, and the curves' ``history`` (its open window on the CPU)."""
    state = {
        "plan_key": plan_key,
        "step": step,
        "model": {k: v for k, v in weights.items() if k != "embed_tokens.weight"},
        "optimizer": moments,
        "scheduler": scheduler.state_dict(),
        "torch_rng": torch.get_rng_state(),
        "noise_rng": noise_states,
        "history": history,
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


def _resume(
    state_dir: Path, plan_key: str, drafter, optimizer, scheduler, noise, parallel: DataParallel, device: str
) -> tuple[int, dict[str, list]]:
    """Restore the last state of this exact plan; any other state is ignored (a fresh start). Returns the step and
    the curves' history (see ``_Loop``)."""
    path = state_dir / "state.pt"
    fresh: dict[str, list] = {"steps": [], "heldout": [], "window": []}
    if not path.is_file():
        return 0, fresh
    state = torch.load(path, weights_only=True, map_location="cpu")
    if state.get("plan_key") != plan_key:
        return 0, fresh
    parallel.load_states(drafter, optimizer, state["model"], state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["torch_rng"])
    noise.set_state(state["noise_rng"][parallel.rank])
    history = state.get("history", fresh)
    history["window"] = [{k: v.to(device) for k, v in m.items()} for m in history["window"]]
    return int(state["step"]), history
