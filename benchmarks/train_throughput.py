"""Training throughput of expman's real training step (``expman.training.train.training_step``: TTT loss, backward,
clip, AdamW, schedule; on CUDA the same compiled loss and flex attention as ``expman.training.train.train``) at a
verifier's drafter shape, on random features.

CPU default: SmolLM2-135M-Instruct's shape, TTT 3, 1024-token batches of 256-token documents, float32.

  python benchmarks/train_throughput.py --out benchmarks/results/train_cpu.json

GPU (``--gpu``): the peer harness's configs (llama3-8b TTT 3 and 7, kimi-k2 TTT 3; 8192 tokens packed in
documents of 2048, draft vocab 32000, bf16 autocast), each followed in the same process run by the peer
(speculators' own Eagle3DraftModel, ``--peer``: the harness script of ../shared/bench) at the same config:

  python benchmarks/train_throughput.py --gpu --peer ../shared/bench/speculators_anchor.py \\
      --out benchmarks/results/train_gpu_h200.json

MFU uses the FLOP count the peer harness states (matmuls of q/k/v/o, MLP and both lm_heads, causal attention
within documents), against the 790 TFLOP/s bf16 matmul rate measured on the H200. Like the peer, the step
computes the verifier's head over the draft vocab only; the verifier's full-vocab top-1 comes with the features
(extract computes it once), so the random batches carry one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import click
import torch
from harness import SHAPES, header, shape_option, timed, write_report

from expman.data.extract import default_aux_layers
from expman.devices import resolve_device
from expman.drafter.model import DrafterConfig, Eagle3Drafter
from expman.drafter.objective import Packed, VerifierHead
from expman.params import TrainParams
from expman.training.train import autocasts, compiles, new_optimizer, training_step

PEAK_BF16_FLOPS = 790e12
"""Dense bf16 matmul rate on random data measured on one H200 (the peer harness's PEAK)."""


GPU_CONFIGS = [("llama3-8b", 3), ("llama3-8b", 7), ("kimi-k2", 3)]


@dataclass(frozen=True)
class StepConfig:
    """What one measurement of the step runs: the verifier shape and TTT steps, the packed batch (``tokens`` in
    documents of ``document``), the draft vocab, and how many steps are timed after how many untimed ones."""

    shape: str
    ttt: int
    tokens: int
    document: int
    draft_vocab: int
    steps: int
    warmup: int


def harness_flops_per_token(shape: dict, draft_vocab: int, document: int, ttt: int) -> float:
    """Training FLOPs per token as the peer harness counts them (forward + backward, no verifier-head grad)."""
    hidden, inter = shape["hidden_size"], shape["intermediate_size"]
    kv_width = shape["num_key_value_heads"] * hidden // shape["num_attention_heads"]
    step_params = 2 * hidden * hidden + 2 * 2 * hidden * kv_width + hidden * hidden + 3 * hidden * inter
    step_params += hidden * draft_vocab
    attention = 4 * hidden * document / 2
    verifier_head = 2 * hidden * draft_vocab
    forward = 6 * hidden * hidden + sum(2 * step_params + attention * (1 + s) for s in range(ttt)) + verifier_head
    return forward + 2 * (forward - verifier_head)


def random_batch(shape: dict, tokens: int, document: int, generator: torch.Generator, device: str) -> Packed:
    """Random packed documents in the shard dtype (bf16 features), made on the device."""
    hidden, vocab = shape["hidden_size"], shape["vocab_size"]
    documents = []
    for _ in range(tokens // document):
        mask = torch.ones(document, dtype=torch.bool, device=device)
        mask[:32] = False
        documents.append(
            {
                "input_ids": torch.randint(0, vocab, (document,), generator=generator, device=device),
                "loss_mask": mask,
                "aux_hidden_states": torch.randn(
                    document, 3 * hidden, generator=generator, device=device, dtype=torch.bfloat16
                ),
                "final_hidden_states": torch.randn(
                    document, hidden, generator=generator, device=device, dtype=torch.bfloat16
                ),
                "verifier_top1": torch.randint(
                    0, vocab, (document,), generator=generator, device=device, dtype=torch.int32
                ),
            }
        )
    return Packed.of(documents).to(device)


def random_drafter(
    shape: dict, section: TrainParams, draft_vocab: int, device: str
) -> tuple[Eagle3Drafter, VerifierHead]:
    """A drafter for a verifier of ``shape`` and that verifier's head (the draft vocab's rows, as the train stage
    loads it), random but the same in every process (seed 0), set up as the train stage sets them up (dtype,
    flex attention on CUDA; training_step compiles the loss)."""
    torch.manual_seed(0)
    generator = torch.Generator(device=device).manual_seed(0)
    hidden, vocab = shape["hidden_size"], shape["vocab_size"]
    head = VerifierHead(
        torch.randn(vocab, hidden, generator=generator, device=device) * 0.02,
        torch.ones(hidden, device=device),
        shape["rms_norm_eps"],
        torch.randn(draft_vocab, hidden, generator=generator, device=device) * 0.02,
    ).to(device, torch.bfloat16 if autocasts(section, device) else None)
    config = DrafterConfig.from_verifier(shape, draft_vocab, default_aux_layers(shape["num_hidden_layers"]))
    drafter = Eagle3Drafter(config)
    with torch.no_grad():
        chosen = torch.randperm(vocab)[:draft_vocab].sort().values
        drafter.t2d[chosen] = True
        drafter.d2t.copy_(chosen - torch.arange(draft_vocab))
        drafter.lm_head.weight.copy_(head.lm_head)
    drafter = drafter.to(device)
    if compiles(section, device):
        drafter.use_flex_attention()
    return drafter, head


def measure(config: StepConfig, device: str, profile: Path | None = None) -> dict:
    """Time ``config.steps`` training steps after ``config.warmup`` (compilation happens there) on fresh random
    batches."""
    shape = SHAPES[config.shape]
    section = TrainParams(ttt_steps=config.ttt, max_tokens=config.tokens)
    drafter, head = random_drafter(shape, section, config.draft_vocab, device)
    optimizer, scheduler = new_optimizer(drafter, section, total_steps=config.warmup + config.steps)
    generator = torch.Generator(device=device).manual_seed(1)
    noise = torch.Generator(device=device).manual_seed(0)
    metrics = {}

    def draw() -> Packed:
        return random_batch(shape, config.tokens, config.document, generator, device)

    def step(batch: Packed) -> None:
        metrics.update(training_step(drafter, head, [batch], optimizer, scheduler, section, noise, device))

    timed(step, config.warmup, setup=draw, device=device)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = timed(step, config.steps, setup=draw, device=device)
    if profile is not None:
        batch = draw()
        _profile(lambda: step(batch), profile)
    flops = harness_flops_per_token(shape, config.draft_vocab, config.document, config.ttt)
    result = {
        "shape": config.shape,
        "ttt_steps": config.ttt,
        "tokens_per_step": config.tokens,
        "document_tokens": config.document,
        "draft_vocab": config.draft_vocab,
        "trainable_params": sum(p.numel() for p in drafter.parameters() if p.requires_grad),
        "step_s": times.summary(),
        "tok_per_s": config.tokens / times.median,
        "mfu_harness_count": config.tokens / times.median * flops / PEAK_BF16_FLOPS if device == "cuda" else None,
        "loss_last_step": float(metrics["loss"]),
    }
    if device == "cuda":
        result["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return result


def _profile(step, out: Path) -> None:
    """Two more steps under the torch profiler; the kernels by total CUDA time go to ``out`` as a table."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as profiler:
        for _ in range(2):
            step()
        torch.cuda.synchronize()
    out.write_text(profiler.key_averages().table(sort_by="cuda_time_total", row_limit=40, max_name_column_width=70))


def _measure_apart(config: StepConfig, device: str, profile: Path | None) -> dict:
    """One config in a fresh process, as the peer runs: no compile caches or allocator state carried over."""
    argv = [sys.executable, __file__, "--config", f"{config.shape}:{config.ttt}", "--out", os.devnull]
    options = asdict(config) | {"device": device, "profile": profile}
    for name, value in options.items():
        if value is not None and name not in ("shape", "ttt"):
            argv += [f"--{name.replace('_', '-')}", str(value)]
    done = subprocess.run(argv, capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith('{"shape"')]
    if done.returncode or not lines:
        return {"config": f"{config.shape}:{config.ttt}", "error": done.stderr[-1500:]}
    return json.loads(lines[-1])


def run_peer(peer: Path, shape: str, tokens: int, document: int, ttt: int) -> dict:
    """The peer harness at the same config, in a subprocess (its own CUDA context and allocator)."""
    config = f"{shape}:{tokens}:{document}:{ttt}:simple_flex_attention:eager"
    with tempfile.TemporaryDirectory() as out:
        done = subprocess.run(
            [sys.executable, str(peer), config], capture_output=True, text=True, env=os.environ | {"OUT": out}
        )
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode or not lines:
        return {"config": config, "error": (done.stderr or done.stdout)[-800:]}
    return json.loads(lines[-1]) | {"config": config}


@click.command()
@click.option("--gpu", is_flag=True, help="the peer harness's three configs on CUDA")
@click.option("--peer", type=click.Path(exists=True, path_type=Path), help="peer harness script (with --gpu)")
@shape_option("smollm2-135m")
@click.option("--tokens", default=1024, show_default=True, help="tokens per packed batch")
@click.option("--document", default=256, show_default=True, help="tokens per document")
@click.option("--ttt", default=3, show_default=True)
@click.option("--draft-vocab", default=8192, show_default=True)
@click.option("--warmup", default=2, show_default=True, help="untimed steps first (compilation on CUDA)")
@click.option("--steps", default=6, show_default=True, help="timed steps")
@click.option("--device", default="auto", show_default=True)
@click.option("--config", help="SHAPE:TTT, measured alone and printed as one JSON line (used by --gpu)")
@click.option("--profile", type=click.Path(path_type=Path), help="write a kernel table of two extra steps here")
@click.option("--out", type=click.Path(path_type=Path), required=True)
def main(
    gpu: bool,
    peer: Path | None,
    shape: str,
    tokens: int,
    document: int,
    ttt: int,
    draft_vocab: int,
    warmup: int,
    steps: int,
    device: str,
    config: str | None,
    profile: Path | None,
    out: Path,
) -> None:
    if config:
        shape, ttt = config.split(":")[0], int(config.split(":")[1])
        one = StepConfig(shape, ttt, tokens, document, draft_vocab, steps, warmup)
        click.echo(json.dumps(measure(one, resolve_device(device), profile)))
        return
    if gpu:
        device, tokens, document, draft_vocab, warmup, steps = "cuda", 8192, 2048, 32000, 4, 12
        configs = GPU_CONFIGS
    else:
        device, configs = resolve_device(device), [(shape, ttt)]
    results = []
    for index, (shape_name, steps_ttt) in enumerate(configs):
        one = StepConfig(shape_name, steps_ttt, tokens, document, draft_vocab, steps, warmup)
        ours = _measure_apart(one, device, profile.with_suffix(f".{index}.txt") if profile else None)
        row = {"expman": ours}
        if peer is not None:
            theirs = run_peer(peer, shape_name, tokens, document, steps_ttt)
            row["speculators"] = theirs
            if "tok_per_s" in theirs and "tok_per_s" in ours:
                row["tok_per_s_ratio"] = ours["tok_per_s"] / theirs["tok_per_s"]
                row["peak_memory_ratio"] = ours["peak_gib"] / theirs["peak_gib"]
        click.echo(json.dumps(row), err=True)
        results.append(row)
    report = header("train_throughput", device)
    report |= {"peak_bf16_flops": PEAK_BF16_FLOPS if device == "cuda" else None, "results": results}
    write_report(out, report)


if __name__ == "__main__":
    main()
