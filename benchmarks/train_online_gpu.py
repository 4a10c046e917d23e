"""The train *stage* with online features against offline ones, on one GPU: ``expman.training.train.train`` with
its real MLflow run on a sqlite file, at the llama3-8b drafter shape, TTT 3, 8192-token batches of 2048-token
documents, with a verifier of Llama-3.1-8B's shape built here with random bf16 weights and saved as a prepared
verifier folder (nothing to download).

The project holds what the stage reads: the verifier (safetensors, the prepare manifest of ``verifier_facts``), its
responses (``--documents`` random token documents in generate's format), a draft vocab, and the extract manifest,
written by expman's own ``extract`` stage: with ``train.features: online`` it records the contract and the shard
plan, offline it computes every shard and publishes the set in the project's feature store. Arms, in one process:

  forward         the verifier alone on 4 × 2048-token batches: the decoder, the capture hooks (three aux layers and
                  the last), the full-vocab top-1 from its lm_head; nothing copied or kept
  step            the bare training step on batches already on the GPU (train_throughput.measure)
  online          the train stage, ``train.features: online``, no cache: every epoch computes its states
  online_cached   the same with ``train.online_cache_gib`` large enough to hold them: epochs after the first read
                  host memory
  offline         extract (timed), the page cache dropped, then the train stage on the stored shards: epoch 1 reads
                  the disk (cold), later ones the page cache (warm)

The stage's rates are the ones it logs per epoch (``epoch_tok_per_s``, read back from MLflow; the run's first step,
compilation and the verifier's load among it, is left out of epoch 1's clock). The limit of co-located online on one
GPU is the two costs added, 1 / (1/forward + 1/step). Feature bytes written by the online arms: the bytes in the
feature store after them (the store starts empty), and the process's own ``write_bytes`` (/proc/self/io) during the
arm (MLflow, the checkpoint and the resume state included).

  python benchmarks/train_online_gpu.py --out benchmarks/results/train_online_gpu.json
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import click
import torch
from harness import SHAPES, header, timed, write_report
from train_stage_throughput import DRAFT_VOCAB, drop_page_cache, run_stage, section_for, write_vocab
from train_throughput import StepConfig, measure

from expman.data.extract import CaptureHooks, capture_contract, extract
from expman.data.features import STORE_VARIABLE, FeatureStore
from expman.data.verifier import verifier_facts
from expman.params import ExtractParams, Params, TrainParams
from expman.paths import ExtractPaths, TrainPaths
from expman.provenance import atomic_write_json, sha256_file

TOKENS = 8192
DOCUMENT = 2048
PROMPT_TOKENS = 32


def project_paths(root: Path) -> TrainPaths:
    return TrainPaths(
        verifier=root / "verifier",
        extract=root / "extract",
        vocab=root / "vocab",
        out=root / "drafter",
        state=root / "state",
        metrics=root / "metrics.json",
        plots=None,
        generated=root / "generated",
    )


def write_verifier(folder: Path, shape: str) -> dict:
    """A Llama-3.1-8B-shaped verifier with random weights (bf16, built on the GPU), saved as prepare saves one."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(**SHAPES[shape], tie_word_embeddings=False)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(folder, safe_serialization=True)
    del model
    torch.cuda.empty_cache()
    facts = verifier_facts(folder)
    atomic_write_json(folder / "manifest.json", {"stage": "prepare", "trust_remote_code": False, "verifier": facts})
    return facts


def write_responses(folder: Path, verifier: dict, documents: int) -> None:
    """``documents`` random token documents of DOCUMENT tokens as generate writes its train split."""
    generator = torch.Generator().manual_seed(0)
    (folder / "train").mkdir(parents=True)
    path = folder / "train" / "shard-00000.jsonl"
    with open(path, "w", encoding="utf-8") as handle:
        for index in range(documents):
            ids = torch.randint(0, verifier["vocab_size"], (DOCUMENT,), generator=generator).tolist()
            record = {"id": f"doc-{index:05d}", "ok": True, "input_ids": ids, "prompt_tokens": PROMPT_TOKENS}
            handle.write(json.dumps(record) + "\n")
    entry = {"path": path.name, "bytes": path.stat().st_size, "sha256": sha256_file(path)}
    manifest = {"stage": "generate", "verifier": verifier, "splits": {"train": {"shards": [entry]}}}
    atomic_write_json(folder / "manifest.json", manifest)


def forward_rate(verifier: Path, contract: dict, documents: int) -> dict:
    """The verifier's forward with capture and top-1 on 4 × DOCUMENT-token batches, nothing copied out."""
    from expman.data.verifier import load_verifier

    model = load_verifier(verifier, "cuda", torch.bfloat16)
    capture = CaptureHooks(model, contract["aux_layers"], "pre_norm")
    generator = torch.Generator(device="cuda").manual_seed(0)
    vocab = contract["verifier"]["vocab_size"]
    batch = TOKENS // DOCUMENT
    ids = torch.randint(0, vocab, (batch, DOCUMENT), generator=generator, device="cuda")
    mask = torch.ones_like(ids)

    def forward() -> None:
        with torch.inference_mode():
            capture(ids, mask)

    times = timed(forward, min(20, max(4, documents // batch)), warmup=3, device="cuda")
    capture.remove()
    return {"forward_s": times.summary(), "verifier_forward_tok_s": TOKENS / times.median}


def store_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in (root / "features").rglob("*") if p.is_file())


def process_write_bytes() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("write_bytes:"):
            return int(line.split()[1])
    return 0


def run_extract(root: Path, features: str) -> tuple[float, dict]:
    """expman's extract stage for ``features`` (online: the contract and plan only), timed."""
    section = ExtractParams(device="cuda", dtype="bfloat16", max_seq_len=DOCUMENT, batch_tokens=TOKENS)
    section = section.model_copy(update={"samples_per_shard": 8})
    # the two sections extract reads, each validated; the project's other sections name files this folder lacks
    params = Params.model_construct(extract=section, train=TrainParams(features=features))
    where = ExtractPaths(root / "verifier", root / "generated", root / "extract")
    here = Path.cwd()
    os.chdir(root)
    try:
        started = time.perf_counter()
        manifest = extract(params, where)
        return time.perf_counter() - started, manifest
    finally:
        os.chdir(here)


def stage_arm(root: Path, epochs: int, **train: object) -> dict:
    """The train stage from nothing (no drafter, no resume state), its rates, seconds and bytes written."""
    for folder in ("drafter", "state"):
        shutil.rmtree(root / folder, ignore_errors=True)
    section = section_for("cuda", epochs, TOKENS, 3, **train)
    written = process_write_bytes()
    row = run_stage(root, section, project_paths(root))
    row["process_write_bytes"] = process_write_bytes() - written
    return row


@click.command()
@click.option("--shape", default="llama3-8b", show_default=True)
@click.option("--documents", default=192, show_default=True, help=f"training documents of {DOCUMENT} tokens")
@click.option("--workdir", type=click.Path(path_type=Path), help="where the project goes (default: a temp folder)")
@click.option("--skip-offline", is_flag=True, help="leave out extract and the offline arm (a short device call)")
@click.option("--out", type=click.Path(path_type=Path), required=True)
def main(shape: str, documents: int, workdir: Path | None, skip_offline: bool, out: Path) -> None:
    root = Path(tempfile.mkdtemp(prefix="online-", dir=workdir))
    os.environ[STORE_VARIABLE] = str(root / "features")
    where = project_paths(root)
    row: dict = {"shape": shape, "ttt_steps": 3, "tokens_per_step": TOKENS, "document_tokens": DOCUMENT}
    report = header("train_online_gpu", "cuda") | {"results": [row]}
    try:
        started = time.perf_counter()
        verifier = write_verifier(where.verifier, shape)
        write_responses(where.generated, verifier, documents)
        write_vocab(where.vocab, verifier, DRAFT_VOCAB["cuda"])
        row["setup_s"] = time.perf_counter() - started
        row["data"] = {"documents": documents, "tokens": documents * DOCUMENT}
        contract = capture_contract(verifier, ExtractParams(max_seq_len=DOCUMENT))
        row |= forward_rate(where.verifier, contract, documents)
        torch.cuda.empty_cache()  # the forward's verifier is gone with its frame
        write_report(out, report)
        step = measure(StepConfig(shape, 3, TOKENS, DOCUMENT, DRAFT_VOCAB["cuda"], 12, 4), "cuda")
        row |= {"step_tok_s": step["tok_per_s"], "step": step}
        row["limit_tok_s"] = 1 / (1 / row["verifier_forward_tok_s"] + 1 / row["step_tok_s"])
        write_report(out, report)

        row["online_extract_s"], _ = run_extract(root, "online")
        online = stage_arm(root, 2, features="online", online_cache_gib=0.0)
        row["online"] = online
        row["online_tok_s"] = min(online["stage_tok_s"])
        row["online_vs_limit"] = row["online_tok_s"] / row["limit_tok_s"]
        write_report(out, report)

        cached = stage_arm(root, 3, features="online", online_cache_gib=64.0)
        row["online_cached"] = cached
        row["online_cached_tok_s"] = min(cached["stage_tok_s"][1:])
        row["feature_bytes_written"] = store_bytes(root)
        write_report(out, report)
        if skip_offline:
            return

        row["offline_extract_s"], manifest = run_extract(root, "offline")
        row["offline_feature_bytes"] = store_bytes(root)
        row["page_cache"] = drop_page_cache(FeatureStore.default().folder(manifest["features"]["key"]))
        offline = stage_arm(root, 3, features="offline")
        row["offline"] = offline
        row["offline_cold_tok_s"] = offline["stage_tok_s"][0]
        row["offline_warm_tok_s"] = min(offline["stage_tok_s"][1:])
        row["online_vs_offline_warm"] = row["online_tok_s"] / row["offline_warm_tok_s"]
        row["online_cached_vs_offline_warm"] = row["online_cached_tok_s"] / row["offline_warm_tok_s"]
        write_report(out, report)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
