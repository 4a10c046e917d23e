"""The hf generate backend's two batchings on one workload: left-padded batches through ``generate`` against
transformers' continuous batching (``generate.hf_batching``), on the prepared verifier and the shipped train
prompts, at the project's generate settings (batch size, reply length, dtype, device).

Run it in a project whose prepare stage has run (on a GPU: ``preset: gpu``, or ``-S preset=gpu`` before it):

  python benchmarks/generate_backends.py --requests 2048 --out benchmarks/results/generate_backends_gpu.json

Each arm answers the same requests (the train prompts through the chat template, cycled to ``--requests``), sampled
at the stage's ``sample_temperature`` as the sampled copies are, from the same seed. Its time is one call of the
backend as the stage makes it per shard: padding, the continuous manager's start and its CUDA-graph warmup included,
the verifier's load not. ``--profile-steps N`` adds where a padded decode step's time goes. This is the backend in
isolation; the generate stage end to end is in the GPU graph's report (``quality_gpu.py``).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import click
from harness import arm_key, header, write_report


def _requests(project: Path, count: int) -> list[list[int]]:
    """The shipped train prompts' chat-template ids, cycled to ``count``."""
    from expman.data.conversations import read_dataset
    from expman.data.generate import HFBackend
    from expman.params import load_params

    params = load_params(project / "params.yaml")
    section = params.generate.model_copy(update={"hf_batching": "padded"})
    train = next(d for d in section.datasets if d.split == "train")
    conversations = read_dataset(train, project, 1)
    backend = HFBackend(project / "models/verifier", section)
    prompts = [backend._prompt_ids([{"role": "user", "content": c.user_turns[0]}]) for c in conversations]
    return [prompts[n % len(prompts)] for n in range(count)]


EXPLORATORY = ("padded-static", "padded-flex", "padded-static-flex")
"""Arms that are not stage settings: padded generate with transformers' static KV cache (which its generate
compiles), with flex attention (grouped key/value heads without copying them, under a padding mask), or both."""
CUDNN_ARMS = {"padded-cudnn": True, "padded-nocudnn": False}
"""Padded with ``generate.cudnn_attention`` set either way; plain ``padded`` takes the project's setting."""
PLAIN_SDPA = "padded-sdpa"
"""Padded with transformers' own SDPA attention, which copies grouped key/value heads under a padding mask: the
stage's attention before ``GROUPED_SDPA`` (plain ``padded``)."""


def _backend(project: Path, arm: str) -> Any:
    """The stage's hf backend for ``arm``: padded, continuous, or one of EXPLORATORY, optionally ``@batch_size``."""
    from expman.data.generate import HFBackend
    from expman.params import load_params

    arm, _, batch_size = arm.partition("@")
    section = load_params(project / "params.yaml").generate
    batching = "padded" if arm in (*EXPLORATORY, *CUDNN_ARMS, PLAIN_SDPA) else arm
    update = {"hf_batching": batching} | ({"batch_size": int(batch_size)} if batch_size else {})
    if arm in CUDNN_ARMS:
        update["cudnn_attention"] = CUDNN_ARMS[arm]
    section = section.model_copy(update=update)
    backend = HFBackend(project / "models/verifier", section)
    if arm.endswith("-flex"):
        backend.model.set_attn_implementation("flex_attention")
    if arm == PLAIN_SDPA:
        backend.model.set_attn_implementation("sdpa")
    if arm.startswith("padded-static"):
        sampling = backend._sampling

        def static_sampling(temperature: float, max_new_tokens: int) -> Any:
            config = sampling(temperature, max_new_tokens)
            config.cache_implementation = "static"
            return config

        backend._sampling = static_sampling
    return backend, section


def _arm(project: Path, arm: str, requests: list[list[int]], max_new_tokens: int) -> dict[str, Any]:
    """One backend call of ``requests`` with ``arm``: seconds, reply tokens, how replies ended, peak memory."""
    import torch

    backend, section = _backend(project, arm)
    if backend.device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    torch.manual_seed(section.seed)
    started = time.perf_counter()
    replies = backend.complete(requests, section.sample_temperature, [section.seed] * len(requests), max_new_tokens)
    if backend.device.startswith("cuda"):
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    tokens = sum(len(r.output_ids) for r in replies)
    peak = torch.cuda.max_memory_allocated() / 2**30 if backend.device.startswith("cuda") else None
    return {
        "seconds": seconds,
        "reply_tokens": tokens,
        "reply_tok_s": tokens / seconds,
        "mean_reply_tokens": tokens / len(replies),
        "stopped_at_limit": sum(r.finish_reason == "length" for r in replies),
        "peak_gpu_memory_gib": peak,
        "device": backend.device,
        "batch_size": section.batch_size,
    }


@click.command()
@click.option("--project", type=click.Path(exists=True, file_okay=False, path_type=Path), default=Path("."))
@click.option("--requests", "count", type=int, default=2048, show_default=True)
@click.option("--max-new-tokens", type=int, default=None, help="Default: generate.max_new_tokens.")
@click.option(
    "--arms",
    default="continuous:16,padded,continuous",
    show_default=True,
    help="arm[@batch_size][:requests] in order, arm one of padded, continuous, padded-static, padded-flex, "
    "padded-static-flex, padded-cudnn, padded-nocudnn, padded-sdpa; @batch_size overrides generate.batch_size. "
    "The first continuous call of a process pays its one-time costs (as the stage's first shard does): a small one "
    "first shows them and keeps them out of the full arm. The report is rewritten after each arm; an arm that "
    "fails records its error.",
)
@click.option(
    "--profile-steps",
    type=int,
    default=0,
    help="After the arms, profile the padded arm for this many new tokens with torch's profiler: the operators "
    "that took the most device time (CPU time on a CPU) go into the report under profile.",
)
@click.option("--out", type=click.Path(path_type=Path), default=None)
def main(
    project: Path, count: int, max_new_tokens: int | None, arms: str, profile_steps: int, out: Path | None
) -> None:
    from expman.devices import resolve_device
    from expman.params import load_params

    section = load_params(project / "params.yaml").generate
    length = max_new_tokens or section.max_new_tokens
    requests = _requests(project, count)
    report = header("generate_backends", resolve_device(section.device)) | {
        "requests": count,
        "prompt_tokens": sum(len(r) for r in requests),
        "max_new_tokens": length,
        "temperature": section.sample_temperature,
        "batch_size": section.batch_size,
        "dtype": section.dtype,
        "arms": {},
    }
    for arm in arms.split(","):
        name, _, size = arm.partition(":")
        key = arm_key(report["arms"], arm)
        try:
            report["arms"][key] = _arm(project, name, requests[: int(size or count)], length)
        except Exception as err:  # an exploratory arm the installed torch cannot compile: record it, go on
            report["arms"][key] = {"error": f"{type(err).__name__}: {str(err).strip().splitlines()[0][:300]}"}
        print(key, report["arms"][key], flush=True)
        _summarize(report)
        write_report(out, report)
    if profile_steps:
        report["profile"] = _profile(project, requests, profile_steps)
        write_report(out, report)


def _profile(project: Path, requests: list[list[int]], steps: int, top: int = 20) -> dict[str, Any]:
    """The padded arm's ``steps`` new tokens under torch's profiler (after an unprofiled warm-up call): its
    ``top`` operators by self time on the device, each with calls and milliseconds."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    backend, section = _backend(project, "padded")
    on_gpu = backend.device.startswith("cuda")
    backend.complete(requests[:8], section.sample_temperature, [section.seed] * 8, 2)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    torch.manual_seed(section.seed)
    with profile(activities=activities) as prof:
        backend.complete(requests, section.sample_temperature, [section.seed] * len(requests), steps)
        if on_gpu:
            torch.cuda.synchronize()
    field = "self_device_time_total" if on_gpu else "self_cpu_time_total"
    events = sorted(prof.key_averages(), key=lambda e: getattr(e, field), reverse=True)
    total_ms = sum(getattr(e, field) for e in events) / 1e3
    return {
        "new_tokens": steps,
        "requests": len(requests),
        "batch_size": section.batch_size,
        "clock": "device" if on_gpu else "cpu",
        "self_ms_total": total_ms,
        "top": [{"op": e.key, "calls": e.count, "self_ms": getattr(e, field) / 1e3} for e in events[:top]],
    }


def _summarize(report: dict[str, Any]) -> None:
    """The full continuous arm's tokens/s over the full padded arm's."""
    done = report["arms"]
    if {"padded", "continuous"} <= done.keys():
        report["continuous_over_padded_tok_s"] = done["continuous"]["reply_tok_s"] / done["padded"]["reply_tok_s"]


if __name__ == "__main__":
    main()
