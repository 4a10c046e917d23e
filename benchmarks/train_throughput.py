"""Training throughput of expman's real training step (``expman.train.training_step``: TTT loss, backward,
clip, AdamW, schedule) at a verifier's drafter shape, on random features.

Default: SmolLM2-135M-Instruct's shape (H 576, 9/3 heads, I 1536, vocab 49152, draft vocab 8192), TTT 3,
1024-token packed batches of 256-token documents, float32 on CPU.

  python benchmarks/train_throughput.py --out benchmarks/results/train_cpu.json
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import click
import torch
from reporting import write_report

from expman.drafter import DrafterConfig, Eagle3Drafter
from expman.extract import default_aux_layers
from expman.objective import Packed, VerifierHead
from expman.params import TrainParams
from expman.provenance import package_versions
from expman.train import new_optimizer, training_step
from expman.verifier import resolve_device

SHAPES = {
    "smollm2-135m": {
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 8192,
        "vocab_size": 49152,
        "hidden_act": "silu",
        "rope_theta": 100000.0,
        "num_hidden_layers": 30,
    },
}


def _batch(shape: dict, tokens: int, document: int, generator: torch.Generator) -> Packed:
    hidden, vocab = shape["hidden_size"], shape["vocab_size"]
    documents = []
    for _ in range(tokens // document):
        mask = torch.ones(document, dtype=torch.bool)
        mask[:32] = False
        documents.append(
            {
                "input_ids": torch.randint(0, vocab, (document,), generator=generator),
                "loss_mask": mask,
                "aux_hidden_states": torch.randn(document, 3 * hidden, generator=generator),
                "final_hidden_states": torch.randn(document, hidden, generator=generator),
            }
        )
    return Packed.of(documents)


@click.command()
@click.option("--shape", type=click.Choice(sorted(SHAPES)), default="smollm2-135m", show_default=True)
@click.option("--tokens", default=1024, show_default=True, help="tokens per packed batch")
@click.option("--document", default=256, show_default=True, help="tokens per document")
@click.option("--ttt", default=3, show_default=True)
@click.option("--draft-vocab", default=8192, show_default=True)
@click.option("--steps", default=6, show_default=True, help="timed steps (after 2 warm-up steps)")
@click.option("--device", default="auto", show_default=True)
@click.option("--out", type=click.Path(path_type=Path), required=True)
def main(
    shape: str, tokens: int, document: int, ttt: int, draft_vocab: int, steps: int, device: str, out: Path
) -> None:
    device = resolve_device(device)
    verifier = SHAPES[shape]
    generator = torch.Generator().manual_seed(0)
    hidden, vocab = verifier["hidden_size"], verifier["vocab_size"]
    head = VerifierHead(
        torch.randn(vocab, hidden, generator=generator) * 0.02,
        torch.ones(hidden),
        verifier["rms_norm_eps"],
        torch.randn(vocab, hidden, generator=generator) * 0.02,
    ).to(device)
    config = DrafterConfig.from_verifier(verifier, draft_vocab, default_aux_layers(verifier["num_hidden_layers"]))
    drafter = Eagle3Drafter(config)
    with torch.no_grad():
        chosen = torch.randperm(vocab, generator=generator)[:draft_vocab].sort().values
        drafter.t2d[chosen] = True
        drafter.d2t.copy_(chosen - torch.arange(draft_vocab))
    drafter = drafter.to(device)
    section = TrainParams(ttt_steps=ttt, max_tokens=tokens)
    optimizer, scheduler = new_optimizer(drafter, section, total_steps=steps + 2)
    noise = torch.Generator().manual_seed(0)
    batches = [_batch(verifier, tokens, document, generator).to(device) for _ in range(steps + 2)]
    times = []
    for index, batch in enumerate(batches):
        started = time.perf_counter()
        training_step(drafter, head, batch, optimizer, scheduler, section, noise, device)
        if device == "cuda":
            torch.cuda.synchronize()
        if index >= 2:
            times.append(time.perf_counter() - started)
    median = statistics.median(times)
    report = {
        "benchmark": "train_throughput",
        "command": "python " + " ".join(sys.argv),
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "cpu_threads": torch.get_num_threads(),
        "shape": shape,
        "tokens_per_step": tokens,
        "document_tokens": document,
        "ttt_steps": ttt,
        "draft_vocab": draft_vocab,
        "trainable_params": sum(p.numel() for p in drafter.parameters() if p.requires_grad),
        "step_s": {"median": median, "min": min(times), "max": max(times)},
        "tok_per_s": tokens / median,
        "packages": package_versions(),
    }
    write_report(report, out)


if __name__ == "__main__":
    main()
