"""evaluate: the stage that measures the reference decoder (``expman.evaluation.decoder``) on the held-out prompts.

Three arms in one run: no speculation, the baseline drafter and the candidate; arms are interleaved prompt by prompt
so machine noise hits them alike, and speedup is always against the no-speculation arm of the same run. Greedy
outputs are checked against plain decoding (ties apart). Per-prompt results are kept so ``expman compare`` can
bootstrap confidence intervals; rows are written as they finish, so a killed run resumes where it stopped, and
``evaluate.workers`` processes can share the prompts.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from expman.data.generate import read_responses
from expman.devices import attention_kernels, precision_facts, resolve_device, resolve_dtype, speedup_target
from expman.drafter.model import Eagle3Drafter
from expman.errors import ExpmanError
from expman.evaluation.decoder import DecodeStats, GreedyReference, greedy_decode, speculative_decode, summarize
from expman.params import EvaluateParams, Params
from expman.paths import EvaluatePaths
from expman.provenance import atomic_write_json, read_manifest, sha256_file, upstream_entry
from expman.registry.tracking import stage_run

__all__ = ["evaluate", "select_prompts", "trained_aux_layers"]


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
