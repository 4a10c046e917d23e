"""Data-parallel scaling of the train stage's step: N GPUs under torchrun (NCCL all-reduce, expman.training.parallel)
against one GPU at the same global batch.

  python benchmarks/train_scaling.py --gpus 2 --out benchmarks/results/train_scaling_h200x2.json
  python benchmarks/train_scaling.py --gpus 2 --fsdp --shape kimi-k2 --out benchmarks/results/train_fsdp_h200x2.json

The script starts itself under ``torchrun`` twice: one process with ``accumulate`` N, then N processes with
``accumulate`` 1. Both start from the same weights and see the same global batches (micro-batch i of step s is
drawn from seed (s, i) on whichever process takes it); TTT noise is off so that the inputs are identical and the
two loss curves may differ only by the order in which gradients are summed. Reported: the loss of every step
(mean over the global batch), the largest difference between the curves, step times, and scaling efficiency
t(1 GPU) / (N · t(N GPUs)) at equal work per GPU. With ``--fsdp`` the N processes shard the drafter (FSDP2) instead of
replicating it; each process's peak memory shows what the sharding saves.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import click
import torch
from harness import SHAPES, Timing, elapsed, header, shape_option, write_report
from train_throughput import StepConfig, random_batch, random_drafter

from expman.params import TrainParams
from expman.training.parallel import DataParallel
from expman.training.train import new_optimizer, training_step


def _worker(config: StepConfig, micro_batches: int, fsdp: bool) -> dict:
    parallel = DataParallel.from_env("cuda", fsdp)
    accumulate = micro_batches // parallel.world
    shape = SHAPES[config.shape]
    section = TrainParams(
        ttt_steps=config.ttt, max_tokens=config.tokens, noise_std=0.0, accumulate=accumulate, fsdp=fsdp
    )
    drafter, head = random_drafter(shape, section, config.draft_vocab, "cuda")
    drafter = parallel.shard(drafter, "cuda", torch.bfloat16)
    optimizer, scheduler = new_optimizer(drafter, section, total_steps=config.warmup + config.steps)
    noise = torch.Generator(device="cuda").manual_seed(parallel.rank)
    losses, times = [], []

    def draw(step: int) -> list:
        """This process's micro-batches of ``step``: micro-batch i of step s is drawn from seed (s, i)."""
        mine = range(parallel.rank * accumulate, (parallel.rank + 1) * accumulate)
        seeds = [torch.Generator("cuda").manual_seed(1000 * step + i) for i in mine]
        return [random_batch(shape, config.tokens, config.document, seed, "cuda") for seed in seeds]

    for step in range(config.warmup + config.steps):
        batches = draw(step)
        run = functools.partial(
            training_step, drafter, head, batches, optimizer, scheduler, section, noise, "cuda", micro_batches, parallel
        )
        seconds, metrics = elapsed(run, "cuda")
        if step >= config.warmup:
            times.append(seconds)
        losses.append(metrics["loss"].item())  # the global batch's mean (training_step sums it over processes)
    parallel.close()
    timing = Timing(times)
    return {
        "processes": parallel.world,
        "fsdp": parallel.sharded,
        "accumulate": accumulate,
        "step_s": timing.summary(),
        "tok_per_s": micro_batches * config.tokens / timing.median,
        "losses": losses,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
    }


def _launch(processes: int, options: dict) -> dict:
    argv = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={processes}",
        __file__,
        "--worker",
        "--out",
        os.devnull,
    ]
    for name, value in options.items():
        if isinstance(value, bool):
            argv += [f"--{name.replace('_', '-')}"] if value else []
        else:
            argv += [f"--{name.replace('_', '-')}", str(value)]
    done = subprocess.run(argv, capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith('{"processes"')]
    if done.returncode or not lines:
        raise click.ClickException(f"torchrun with {processes} processes failed:\n{done.stderr[-3000:]}")
    return json.loads(lines[0])


@click.command()
@click.option("--gpus", default=2, show_default=True)
@shape_option("llama3-8b")
@click.option("--ttt", default=3, show_default=True)
@click.option("--tokens", default=8192, show_default=True, help="tokens per micro-batch")
@click.option("--document", default=2048, show_default=True)
@click.option("--draft-vocab", default=32000, show_default=True)
@click.option(
    "--steps", default=30, show_default=True, help="timed steps, each on a global batch of --gpus micro-batches"
)
@click.option("--warmup", default=3, show_default=True, help="first steps, untimed (compilation); their loss is kept")
@click.option("--fsdp", is_flag=True, help="the N-GPU run shards weights, gradients and AdamW state (train.fsdp)")
@click.option("--worker", is_flag=True, hidden=True)
@click.option("--micro-batches", type=int, hidden=True)
@click.option("--out", type=click.Path(path_type=Path), required=True)
def main(
    gpus: int,
    shape: str,
    ttt: int,
    tokens: int,
    document: int,
    draft_vocab: int,
    steps: int,
    warmup: int,
    fsdp: bool,
    worker: bool,
    micro_batches: int | None,
    out: Path,
) -> None:
    config = StepConfig(shape, ttt, tokens, document, draft_vocab, steps, warmup)
    if worker:
        result = _worker(config, micro_batches, fsdp)
        if int(os.environ.get("RANK", "0")) == 0:
            click.echo(json.dumps(result))
        return
    options = asdict(config) | {"micro_batches": gpus}
    one, many = _launch(1, options), _launch(gpus, options | {"fsdp": fsdp})
    gaps = [abs(a - b) for a, b in zip(one["losses"], many["losses"], strict=True)]
    report = header("train_scaling") | {
        "device": f"{gpus} × {torch.cuda.get_device_name()}",
        "config": options | {"noise_std": 0.0},
        "one_gpu": one,
        "n_gpus": many,
        "loss_max_abs_diff": max(gaps),
        "loss_max_rel_diff": max(g / a for g, a in zip(gaps, one["losses"], strict=True)),
        "scaling_efficiency": one["step_s"]["median"] / (gpus * many["step_s"]["median"]),
        "speedup": many["tok_per_s"] / one["tok_per_s"],
    }
    write_report(out, report)


if __name__ == "__main__":
    main()
