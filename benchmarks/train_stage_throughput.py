"""Throughput of the train *stage*, not the step: ``expman.training.train.train`` itself (the real MLflow run on a
sqlite file, the real shard reads, checksums, packing and copies of its data pipeline, resume state) over shards written
to disk by extract's own writer, next to the bare step on batches already on the device and the peer's step.

The features are random verifier states at a harness shape (no 8B or 1T verifier here), stored exactly as extract
stores them (bf16 safetensors shards with sha256 sidecars, an extract manifest); the verifier folder holds the
three tensors training reads (embedding, final norm, lm_head) at that shape. Before the stage runs, the page cache
is dropped where the machine allows it (``/proc/sys/vm/drop_caches``, else ``posix_fadvise(DONTNEED)`` per
shard), so the first epoch reads from the disk. Each epoch's rate is the one the stage logs (``epoch_tok_per_s``,
read back from MLflow); the run's first optimizer step (torch.compile) is left out of the first epoch's clock,
as the bare step's warm-up steps are left out of its own.

GPU, the peer harness's configs (llama3-8b and kimi-k2, TTT 3, 8192-token batches of 2048-token documents):

  python benchmarks/train_stage_throughput.py --gpu --gib 12 --peer ../shared/bench/speculators_anchor.py \\
      --out benchmarks/results/train_stage_gpu_h200.json

CPU (``--cpu``, SmolLM2's shape, the default recipe's 1024-token batches, fp32): only the stage, for comparing one
checkout's train stage with another's (run it with ``PYTHONPATH`` at the other checkout).
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import tempfile
import time
from pathlib import Path

import click
import torch
from harness import SHAPES, cpu_flags, cpu_name, header, write_report
from train_throughput import StepConfig, measure, run_peer

from expman.data.extract import save_streamed
from expman.data.features import STORE_VARIABLE
from expman.data.shards import ShardSet
from expman.params import TrainParams
from expman.paths import TrainPaths
from expman.provenance import atomic_write_json, sha256_json

DRAFT_VOCAB = {"cuda": 32000, "cpu": 8192}
"""The peer harness's draft vocab on GPU; the default graph's (vocab.draft_vocab_size) on the CPU."""

FEATURE_KEY = "bench"
"""The key of the feature set the script publishes in its feature store (root/features)."""


def shards_folder(root: Path) -> Path:
    """The published feature set of the project in ``root``: ``EXPMAN_FEATURE_STORE`` is root/features."""
    return root / "features" / FEATURE_KEY


def bench_paths(root: Path) -> TrainPaths:
    """Where this script's project keeps the train stage's inputs and outputs (the shards go to the feature store,
    root/features)."""
    return TrainPaths(
        verifier=root / "verifier",
        extract=root / "extract",
        vocab=root / "vocab",
        out=root / "drafter",
        state=root / "state",
        metrics=root / "metrics.json",
        plots=None,
    )


def write_project(
    where: TrainPaths, shards_dir: Path, shape: dict, gib: float, document: int, shard_gib: float, device: str
) -> dict:
    """A prepared verifier (config + the three head tensors), a vocab and an extract manifest with ``gib`` of
    random feature shards of ``document``-token documents, published as the feature set ``FEATURE_KEY`` in
    ``shards_dir`` (that set's folder in the feature store); returns the data's facts."""
    hidden, vocab = shape["hidden_size"], shape["vocab_size"]
    verifier = {"architecture": "LlamaForCausalLM", "hidden_size": hidden, "vocab_size": vocab}
    verifier |= {"num_hidden_layers": shape["num_hidden_layers"]}
    generator = torch.Generator(device=device).manual_seed(0)
    where.verifier.mkdir(parents=True)
    config = shape | {"architectures": ["LlamaForCausalLM"], "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
    (where.verifier / "config.json").write_text(json.dumps(config))
    head = {
        "model.embed_tokens.weight": torch.randn(vocab, hidden, generator=generator, device=device) * 0.02,
        "model.norm.weight": torch.ones(hidden, device=device),
        "lm_head.weight": torch.randn(vocab, hidden, generator=generator, device=device) * 0.02,
    }
    save_streamed({k: v.to(torch.bfloat16).cpu() for k, v in head.items()}, where.verifier / "model.safetensors", {})
    atomic_write_json(where.verifier / "manifest.json", {"stage": "prepare", "verifier": verifier})

    write_vocab(where.vocab, verifier, DRAFT_VOCAB[device])

    aux_layers = [2, shape["num_hidden_layers"] // 2, shape["num_hidden_layers"] - 3]
    contract = {"verifier": verifier, "aux_layers": aux_layers, "final_state": "pre_norm", "dtype": "bfloat16"}
    token_bytes = 4 * hidden * 2 + 4 + 1 + 4
    per_shard = max(1, round(shard_gib * 2**30 / token_bytes / document))
    shard_count = max(2, round(gib * 2**30 / (token_bytes * document * per_shard)))
    shards = ShardSet(shards_dir)
    entries = []
    for index in range(shard_count):
        tokens = per_shard * document
        mask = torch.ones(tokens, dtype=torch.bool)
        mask.view(per_shard, document)[:, :32] = False
        tensors = {
            "input_ids": torch.randint(0, vocab, (tokens,), generator=generator, device=device, dtype=torch.int32),
            "loss_mask": mask,
            "aux_hidden_states": torch.randn(tokens, 3 * hidden, generator=generator, device=device).bfloat16(),
            "final_hidden_states": torch.randn(tokens, hidden, generator=generator, device=device).bfloat16(),
            "verifier_top1": torch.randint(0, vocab, (tokens,), generator=generator, device=device, dtype=torch.int32),
            "sample_offsets": torch.arange(0, tokens + 1, document, dtype=torch.int64),
        }
        tensors = {name: tensor.cpu() for name, tensor in tensors.items()}
        ids = [f"bench/{index}-{i}" for i in range(per_shard)]
        key = sha256_json({"contract": contract, "samples": ids})
        metadata = {"expman": json.dumps({"key": key, "sample_ids": ids})}
        name = f"shard-{index:05d}.safetensors"
        facts = {"samples": per_shard, "tokens": tokens, "loss_tokens": int(mask.sum())}
        entries.append(shards.write(name, key, lambda tmp, t=tensors, m=metadata: save_streamed(t, tmp, m), **facts))
    atomic_write_json(shards_dir / "set.json", {"key": FEATURE_KEY, "contract": contract, "shards": entries})
    manifest = {"stage": "extract", "contract": contract, "features": {"key": FEATURE_KEY}, "shards": entries}
    atomic_write_json(where.extract / "manifest.json", manifest)
    stored = sum(e["bytes"] for e in entries)
    return {
        "shards": shard_count,
        "shard_gib": stored / shard_count / 2**30,
        "data_gib": stored / 2**30,
        "tokens": shard_count * per_shard * document,
        "bytes_per_token": stored / (shard_count * per_shard * document),
    }


def write_vocab(folder: Path, verifier: dict, draft: int) -> None:
    """A draft vocab of ``draft`` verifier tokens drawn at random (seeded), with the vocab stage's manifest."""
    vocab = verifier["vocab_size"]
    chosen = torch.randperm(vocab, generator=torch.Generator().manual_seed(0))[:draft].sort().values
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[chosen] = True
    folder.mkdir(parents=True)
    save_streamed({"d2t": chosen - torch.arange(draft), "t2d": t2d}, folder / "vocab.safetensors", {})
    atomic_write_json(folder / "manifest.json", {"stage": "vocab", "verifier": verifier})


def drop_page_cache(folder: Path) -> str:
    """Evict the shards from the page cache: the kernel's drop_caches where writable, else fadvise per file."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return "drop_caches"
    except OSError:
        pass
    for path in folder.glob("*.safetensors"):
        descriptor = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(descriptor, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(descriptor)
    return "posix_fadvise_dontneed"


def read_rates(root: Path) -> dict:
    """The data path alone, every shard once from a cold page cache: plain reads on the feed's reader threads
    (the disk), then the feed's own first read (sha256 against the manifest, then the tensors)."""
    from concurrent.futures import ThreadPoolExecutor

    from expman.training.batches import ShardReader, reader_threads

    manifest = json.loads((root / "extract/manifest.json").read_text())
    total = sum(entry["bytes"] for entry in manifest["shards"])
    paths = sorted(shards_folder(root).glob("*.safetensors"))

    def read(path: Path) -> None:
        with open(path, "rb", buffering=0) as handle:
            while handle.read(16 << 20):
                pass

    drop_page_cache(shards_folder(root))
    started = time.perf_counter()
    with ThreadPoolExecutor(reader_threads()) as pool:
        list(pool.map(read, paths))
    disk = total / (time.perf_counter() - started)
    drop_page_cache(shards_folder(root))
    reader = ShardReader(manifest)
    started = time.perf_counter()
    futures = [reader.read(index) for index in range(len(manifest["shards"]))]
    for future in futures:
        future.result()
    checked = total / (time.perf_counter() - started)
    reader.close()
    return {"reader_threads": reader_threads(), "cold_read_gib_s": disk / 2**30, "cold_checked_gib_s": checked / 2**30}


def run_stage(root: Path, section: TrainParams, where: TrainPaths | None = None) -> dict:
    """``train()`` in ``root`` (MLflow on root/mlflow.db; its paths ``where``, by default ``bench_paths(root)``);
    the per-epoch rates it logged, read back from MLflow."""
    from mlflow import MlflowClient

    from expman.training.train import train

    here = Path.cwd()
    os.chdir(root)
    os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{root / 'mlflow.db'}"  # MLflow keeps the last run's URI here
    try:
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        started = time.perf_counter()
        manifest = train(section, where or bench_paths(root))
        seconds = time.perf_counter() - started
    finally:
        os.chdir(here)
    run_id = manifest["provenance"]["mlflow_run_id"]
    client = MlflowClient(f"sqlite:///{root / 'mlflow.db'}")
    epochs = sorted(client.get_metric_history(run_id, "epoch_tok_per_s"), key=lambda m: m.step)
    return {
        "stage_tok_s": [m.value for m in epochs],
        "stage_seconds": seconds,
        "steps": manifest["metrics"]["steps"],
        "mlflow_run_id": run_id,
        "host_peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "gpu_peak_gib": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None,
    }


def section_for(device: str, epochs: int, tokens: int, ttt: int, **overrides) -> TrainParams:
    """The train section of the run: the stage's defaults but for the batch, TTT, epochs; no validation split
    (the rate is training's) and no resume state before the end (checkpoint writes are timed apart)."""
    keys = {"ttt_steps": ttt, "epochs": epochs, "max_tokens": tokens, "val_fraction": 0.0, "device": device}
    keys |= {"checkpoint_every": 1_000_000} | overrides
    return TrainParams(**{k: v for k, v in keys.items() if k in TrainParams.model_fields})


@click.command()
@click.option("--gpu", is_flag=True, help="llama3-8b and kimi-k2 at TTT 3 on CUDA, with the bare step")
@click.option("--cpu", is_flag=True, help="SmolLM2's shape on the CPU, the stage only")
@click.option("--shapes", default="llama3-8b,kimi-k2", show_default=True, help="with --gpu")
@click.option("--gib", default=12.0, show_default=True, help="GiB of feature shards per shape")
@click.option("--shard-gib", default=0.5, show_default=True)
@click.option("--epochs", default=3, show_default=True)
@click.option("--shard-window", type=int, help="train.shard_window (default: the stage's)")
@click.option("--peer", type=click.Path(exists=True, path_type=Path), help="speculators harness script (--gpu)")
@click.option("--workdir", type=click.Path(path_type=Path), help="where the shards go (default: a temp folder)")
@click.option("--out", type=click.Path(path_type=Path), required=True)
def main(
    gpu: bool,
    cpu: bool,
    shapes: str,
    gib: float,
    shard_gib: float,
    epochs: int,
    shard_window: int | None,
    peer: Path | None,
    workdir: Path | None,
    out: Path,
) -> None:
    if gpu == cpu:
        raise click.UsageError("give one of --gpu or --cpu")
    device = "cuda" if gpu else "cpu"
    configs = [(s, 8192, 2048) for s in shapes.split(",")] if gpu else [("smollm2-135m", 1024, 256)]
    results = []
    for shape_name, tokens, document in configs:
        root = Path(tempfile.mkdtemp(prefix=f"stage-{shape_name}-", dir=workdir))
        try:
            shape = SHAPES[shape_name]
            os.environ[STORE_VARIABLE] = str(root / "features")  # the stage and the reader find the set there
            data = write_project(bench_paths(root), shards_folder(root), shape, gib, document, shard_gib, device)
            if gpu:
                data |= read_rates(root)
                data["cold_checked_tok_s"] = data["cold_checked_gib_s"] * 2**30 / data["bytes_per_token"]
            data["page_cache"] = drop_page_cache(shards_folder(root))
            section = section_for(device, epochs, tokens, 3, **({"shard_window": shard_window} if shard_window else {}))
            row = {"shape": shape_name, "ttt_steps": 3, "tokens_per_step": tokens, "document_tokens": document}
            row |= {"data": data, "shard_window": getattr(section, "shard_window", None)}
            row |= run_stage(root, section)
            row["stage_tok_s_overall"] = data["tokens"] * epochs / row["stage_seconds"]  # start-up included
            click.echo(json.dumps(row), err=True)
        finally:
            shutil.rmtree(root, ignore_errors=True)
        if gpu:
            step = measure(StepConfig(shape_name, 3, tokens, document, DRAFT_VOCAB[device], 12, 4), device)
            row["step_tok_s"] = step["tok_per_s"]
            row["step_peak_gib"] = step["peak_gib"]
            row["stage_vs_step"] = min(row["stage_tok_s"]) / step["tok_per_s"]
            if peer is not None:
                theirs = run_peer(peer, shape_name, tokens, document, 3)
                row["speculators"] = theirs
                if "tok_per_s" in theirs:
                    row["speculators_tok_s"] = theirs["tok_per_s"]
                    row["stage_vs_speculators"] = min(row["stage_tok_s"]) / theirs["tok_per_s"]
        results.append(row)
        write_report(out, _report(device, results))  # after each shape: a cut-off run keeps what it measured


def _report(device: str, results: list) -> dict:
    return header("train_stage_throughput") | {
        "device": torch.cuda.get_device_name() if device == "cuda" else None,
        "cpu": cpu_name(),
        "cpu_flags": cpu_flags(),
        "cpu_threads": os.cpu_count(),
        "epoch_rate": "tokens of the epoch's steps / their seconds; the run's first step (compile) left out",
        "results": results,
    }


if __name__ == "__main__":
    main()
