"""Extraction throughput: expman's real extract path against a bare forward of the same model on the same inputs.

Arms, all on the same token batches:
  bare     the decoder stack alone (no hooks, nothing kept) — the ceiling
  expman   expman.extract's shard path: hooks, bf16 copies, safetensors shard + sidecar written to disk
  naive    batch-1 ``output_hidden_states=True`` keeping every layer (the hand-written loop people start from)
Also bytes written per token against 4·H·2 (three aux states + the final state in bf16).

  python benchmarks/extract_throughput.py --verifier models/verifier --out benchmarks/results/extract_cpu.json
"""

from __future__ import annotations

import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import click
import torch
from reporting import cpu_name, write_report

from expman.extract import CaptureHooks, default_aux_layers, extract_shard
from expman.params import ExtractParams
from expman.provenance import package_versions
from expman.shards import ShardSet
from expman.verifier import load_verifier, resolve_device, resolve_dtype


def _samples(vocab: int, count: int, length: int, seed: int) -> list[dict]:
    generator = torch.Generator().manual_seed(seed)
    return [
        {"id": f"s{k}", "ids": torch.randint(0, vocab, (length,), generator=generator).tolist(), "prompt_tokens": 32}
        for k in range(count)
    ]


def _time(fn, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    return times


@click.command()
@click.option("--verifier", type=click.Path(exists=True, path_type=Path), default=Path("models/verifier"))
@click.option("--samples", default=8, show_default=True, help="sequences per shard")
@click.option("--length", default=512, show_default=True, help="tokens per sequence")
@click.option("--batch-tokens", default=4096, show_default=True)
@click.option("--repeats", default=3, show_default=True)
@click.option("--device", default="auto", show_default=True)
@click.option("--out", type=click.Path(path_type=Path), required=True)
def main(verifier: Path, samples: int, length: int, batch_tokens: int, repeats: int, device: str, out: Path) -> None:
    device = resolve_device(device)
    dtype = resolve_dtype("auto", device)
    model = load_verifier(verifier, device, dtype)
    config = model.config
    aux = default_aux_layers(config.num_hidden_layers)
    section = ExtractParams(batch_tokens=batch_tokens, samples_per_shard=samples)
    batch = _samples(config.vocab_size, samples, length, seed=0)
    tokens = samples * length
    rows = max(1, batch_tokens // length)
    ids = torch.tensor([s["ids"] for s in batch], device=device)
    mask = torch.ones_like(ids)
    base = model.get_decoder()

    def bare() -> None:
        with torch.inference_mode():
            for start in range(0, samples, rows):
                base(input_ids=ids[start : start + rows], attention_mask=mask[start : start + rows], use_cache=False)

    capture = CaptureHooks(model, aux, section.final_state)
    shard_root = Path(tempfile.mkdtemp(prefix="expman-bench-"))

    def expman_path() -> None:
        from safetensors.torch import save_file

        shards = ShardSet(shard_root)
        tensors = extract_shard(capture, batch, section, device)
        shards.write("shard.safetensors", str(time.time()), lambda tmp: save_file(tensors, str(tmp)))

    def naive() -> None:
        with torch.inference_mode():
            for k in range(samples):
                out = model(input_ids=ids[k : k + 1], output_hidden_states=True)
                [h.to(torch.bfloat16).cpu().clone() for h in out.hidden_states]

    bare()  # warm-up
    results = {}
    for name, fn in (("bare", bare), ("expman", expman_path), ("naive", naive)):
        if name == "expman":
            capture.remove()
            capture = CaptureHooks(model, aux, section.final_state)
        elif name == "naive":
            capture.remove()
        times = _time(fn, repeats)
        results[name] = {"median_s": statistics.median(times), "tok_per_s": tokens / statistics.median(times)}
    stored = (shard_root / "shard.safetensors").stat().st_size
    shutil.rmtree(shard_root)
    hidden_bytes = 4 * config.hidden_size * 2
    report = {
        "benchmark": "extract_throughput",
        "command": "python " + " ".join(sys.argv),
        "device": torch.cuda.get_device_name() if device == "cuda" else cpu_name(),
        "cpu_threads": torch.get_num_threads(),
        "dtype": str(dtype),
        "model": {"layers": config.num_hidden_layers, "hidden": config.hidden_size, "vocab": config.vocab_size},
        "tokens_per_repeat": tokens,
        "arms": results,
        "expman_vs_bare": results["expman"]["tok_per_s"] / results["bare"]["tok_per_s"],
        "expman_vs_naive": results["expman"]["tok_per_s"] / results["naive"]["tok_per_s"],
        "bytes_per_token": stored / tokens,
        "hidden_bytes_per_token": hidden_bytes,
        "bytes_ratio": stored / tokens / hidden_bytes,
        "packages": package_versions(),
    }
    write_report(report, out)


if __name__ == "__main__":
    main()
