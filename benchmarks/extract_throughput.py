"""Extraction throughput: expman's real extract path against a bare forward of the same model on the same tokens,
and against the disk it writes to.

Arms, all over the same token batches:
  bare     the decoder stack alone (no hooks, nothing kept): the compute ceiling the issue names
  greedy   the decoder stack and the lm_head's argmax in chunks of tokens (no hooks, nothing kept): the compute
           ceiling of what extract computes, since it also keeps the verifier's top-1 for training
  capture  expman.data.extract.extract_shard for every shard: hooks and device-to-host copies, nothing written
  expman   expman.data.extract.write_shards, the stage's own loop: capture, then safetensors shards written, fsynced
           and hashed in background threads while the next shard computes. Its time includes the drain, the
           writes still in flight when the last shard has computed (reported apart as ``expman_drain_s``): a
           fixed cost of about two shards' writes, a larger share of a short run than of a real extraction
  naive    batch-1 ``output_hidden_states=True`` copying every layer to the host (the loop people start from)
  disk     sequential write bandwidth of the shard folder's disk (shard-sized files, each fsynced), measured in
           the same run: the disk ceiling is that bandwidth over the bytes expman writes per token
Also bytes written per token against 4·H·2 (three aux states and the final state in bf16).

CPU, the prepared SmolLM2 verifier:

  python benchmarks/extract_throughput.py --verifier models/verifier --out benchmarks/results/extract_cpu.json

GPU (``--gpu``): a verifier with Llama-3.1-8B's shape built from its config with random weights, bf16, sdpa,
batches of 4 × 2048 tokens, 768 sequences (1.6 M tokens, about 45 s per arm on an H200):

  python benchmarks/extract_throughput.py --gpu --out benchmarks/results/extract_gpu_h200.json
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

import click
import torch
from harness import SHAPES, header, shape_option, timed, write_report

from expman.data.extract import CaptureHooks, capture_contract, extract_shard, greedy_tokens, write_shards
from expman.data.shards import ShardSet
from expman.data.verifier import load_verifier
from expman.devices import resolve_device, resolve_dtype
from expman.params import ExtractParams


def _random_verifier(shape: str) -> torch.nn.Module:
    """A causal LM with a real model's shape and random weights, built directly on the GPU in bf16."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(**SHAPES[shape], attn_implementation="sdpa")
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config)
    return model.to(torch.bfloat16).eval()


def _samples(vocab: int, count: int, length: int, seed: int) -> list[dict]:
    generator = torch.Generator().manual_seed(seed)
    return [
        {"id": f"s{k:05d}", "ids": ids.tolist(), "prompt_tokens": 32}
        for k, ids in enumerate(torch.randint(0, vocab, (count, length), generator=generator))
    ]


def _disk_write_bandwidth(folder: Path, file_bytes: int, files: int) -> float:
    """Bytes per second of sequential writes of ``files`` files of ``file_bytes`` each, fsynced like shards."""
    block = bytes(16 << 20)
    blocks = max(1, round(file_bytes / len(block)))
    started = time.perf_counter()
    for k in range(files):
        with open(folder / f"disk-probe-{k}", "wb") as handle:
            for _ in range(blocks):
                handle.write(block)
            os.fsync(handle.fileno())
    elapsed = time.perf_counter() - started
    for k in range(files):
        (folder / f"disk-probe-{k}").unlink()
    return files * blocks * len(block) / elapsed


@click.command()
@click.option("--verifier", type=click.Path(exists=True, path_type=Path), help="a prepared verifier folder (CPU)")
@click.option("--gpu", is_flag=True, help="Llama-3.1-8B's shape with random weights on CUDA")
@shape_option("llama3-8b", help="with --gpu")
@click.option("--samples", type=int, help="sequences in all  [default: 8 on CPU, 768 with --gpu]")
@click.option("--samples-per-shard", default=8, show_default=True, help="8 × 2048 tokens of Llama-3.1-8B: 0.5 GiB")
@click.option("--length", type=int, help="tokens per sequence  [default: 512 on CPU, 2048 with --gpu]")
@click.option("--batch-tokens", type=int, help="[default: 4096 on CPU, 8192 with --gpu]")
@click.option("--naive-samples", default=8, show_default=True)
@click.option("--repeats", default=2, show_default=True)
@click.option("--disk-dir", type=click.Path(file_okay=False, path_type=Path), help="shards go to a temp folder in it")
@click.option("--out", type=click.Path(path_type=Path), required=True)
def main(
    verifier: Path | None,
    gpu: bool,
    shape: str,
    samples: int | None,
    samples_per_shard: int,
    length: int | None,
    batch_tokens: int | None,
    naive_samples: int,
    repeats: int,
    disk_dir: Path | None,
    out: Path,
) -> None:
    if gpu:
        device, dtype, model = "cuda", torch.bfloat16, _random_verifier(shape)
        samples = samples or 768
        length, batch_tokens = length or 2048, batch_tokens or 8192
    else:
        device = resolve_device("auto")
        dtype = resolve_dtype("auto", device)
        model = load_verifier(verifier or Path("models/verifier"), device, dtype)
        samples = samples or 8
        length, batch_tokens = length or 512, batch_tokens or 4096
    config = model.config
    section = ExtractParams(batch_tokens=batch_tokens, samples_per_shard=samples_per_shard)
    contract = capture_contract({"num_hidden_layers": config.num_hidden_layers}, section)
    batch = _samples(config.vocab_size, samples, length, seed=0)
    tokens = samples * length
    rows = max(1, batch_tokens // length)
    ids = torch.tensor([s["ids"] for s in batch])
    base = model.get_decoder()
    root = Path(tempfile.mkdtemp(prefix="expman-bench-", dir=disk_dir))

    def bare() -> None:
        with torch.inference_mode():
            for start in range(0, samples, rows):
                chunk = ids[start : start + rows].to(device)
                base(input_ids=chunk, attention_mask=torch.ones_like(chunk), use_cache=False)

    def greedy() -> None:
        with torch.inference_mode():
            for start in range(0, samples, rows):
                chunk = ids[start : start + rows].to(device)
                out = base(input_ids=chunk, attention_mask=torch.ones_like(chunk), use_cache=False)
                greedy_tokens(model.lm_head, out.last_hidden_state)

    capture = CaptureHooks(model, contract["aux_layers"], section.final_state)

    def capture_only() -> None:
        for start in range(0, samples, samples_per_shard):
            extract_shard(capture, batch[start : start + samples_per_shard], section, device)

    computed_at: list[float] = []  # when each shard had computed (its writes queued)

    def expman(shards: Path) -> None:
        computed_at.clear()
        write_shards(
            lambda chunk: extract_shard(capture, chunk, section, device),
            batch,
            section,
            contract,
            ShardSet(shards),
            device,
            lambda _tokens: computed_at.append(time.perf_counter()),
        )
        computed_at.append(time.perf_counter())

    def fresh_folder() -> Path:
        shutil.rmtree(root / "shards", ignore_errors=True)
        return root / "shards"

    warm = batch[: 3 * samples_per_shard]  # warm-up: kernels chosen, allocator and pinned-memory caches filled
    for start in range(0, len(warm), samples_per_shard):
        extract_shard(capture, warm[start : start + samples_per_shard], section, device)
    seconds = {
        "bare": timed(bare, repeats, device=device).median,
        "greedy": timed(greedy, repeats, device=device).median,
        "capture": timed(capture_only, repeats, device=device).median,
        "expman": timed(expman, repeats, setup=fresh_folder, device=device).median,
    }
    drain = computed_at[-1] - computed_at[-2]  # the last run's: from its last shard computed to its writes done
    stored = sum(p.stat().st_size for p in (root / "shards").glob("*.safetensors"))
    capture.remove()

    def naive() -> None:
        with torch.inference_mode():
            for k in range(naive_samples):
                out = model(input_ids=ids[k : k + 1].to(device), output_hidden_states=True)
                [h.to(torch.bfloat16).cpu() for h in out.hidden_states]

    arms = {name: {"median_s": s, "tok_per_s": tokens / s} for name, s in seconds.items()}
    naive_s = timed(naive, repeats, device=device).median
    arms["naive"] = {"median_s": naive_s, "tok_per_s": naive_samples * length / naive_s}
    fresh_folder()
    shard_bytes = stored // max(1, -(-samples // samples_per_shard))
    disk_bps = _disk_write_bandwidth(root, shard_bytes, files=4)
    shutil.rmtree(root)
    bytes_per_token = stored / tokens
    disk_ceiling = disk_bps / bytes_per_token
    ceiling = min(arms["bare"]["tok_per_s"], disk_ceiling)
    hidden_bytes = 4 * config.hidden_size * 2
    report = header("extract_throughput", device) | {
        "dtype": str(dtype),
        "attention": config._attn_implementation,
        "model": {"layers": config.num_hidden_layers, "hidden": config.hidden_size, "vocab": config.vocab_size},
        "batch": {"rows": rows, "length": length, "samples": samples, "samples_per_shard": samples_per_shard},
        "tokens_per_repeat": tokens,
        "arms": arms,
        "disk_write_bytes_per_s": disk_bps,
        "disk_ceiling_tok_per_s": disk_ceiling,
        "ceiling_tok_per_s": ceiling,
        "expman_vs_ceiling": arms["expman"]["tok_per_s"] / ceiling,
        "expman_vs_bare": arms["expman"]["tok_per_s"] / arms["bare"]["tok_per_s"],
        "expman_vs_greedy": arms["expman"]["tok_per_s"] / arms["greedy"]["tok_per_s"],
        "expman_vs_naive": arms["expman"]["tok_per_s"] / arms["naive"]["tok_per_s"],
        "expman_drain_s": drain,
        "naive_vs_bare": arms["naive"]["tok_per_s"] / arms["bare"]["tok_per_s"],
        "bytes_per_token": bytes_per_token,
        "hidden_bytes_per_token": hidden_bytes,
        "bytes_ratio": bytes_per_token / hidden_bytes,
    }
    write_report(out, report)


if __name__ == "__main__":
    main()
