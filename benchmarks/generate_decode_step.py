"""Where the hf backend's padded decode step goes on a GPU: transformers ``generate`` on the verifier's shape
(random weights: the cost of a step, not its text), greedy, every row held to ``--new-tokens``.

Each arm runs in its own process (a fresh cuDNN plan cache, a fresh allocator) over ``batches`` batches of prompt
lengths drawn from ``--min-prompt``..``--max-prompt``, sorted and cut into batches as the stage does:

- ``padded-<attention>``: left-padded batches under their padding mask, the stage's path. With a mask transformers
  copies the grouped key/value heads to every query head before attention (``repeat_kv``) each step, every layer.
- ``equal-<attention>``: every prompt of one length, so no mask: grouped heads go to attention as they are
  (``enable_gqa``). A bound on what a varlen or paged kernel could reach, not a stage setting.

``<attention>``: ``cudnn`` (torch's own SDPA choice, ``generate.cudnn_attention: true``: cuDNN on Hopper, which
builds a plan for each new shape, and every decode step is one: the first batch pays it, later batches reuse what
fits), ``nocudnn`` (``generate.cudnn_attention: false``: flash or memory-efficient kernels), ``eager``, or
``grouped`` (the verifier's ``GROUPED_SDPA``: no cuDNN, and the grouped heads folded into the query length instead
of copied under the mask). ``cudnn`` and ``nocudnn`` are transformers' own SDPA. The
report gives, per batch, seconds and the decode step's milliseconds: (whole call - a 1-token call) / (new tokens -
1). CUDA only.

    python benchmarks/generate_decode_step.py --out benchmarks/results/generate_decode_step_gpu_h100.json
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import click
from harness import SHAPES, arm_key, header, in_child, shape_option, write_report

ARMS = "padded-cudnn:2,padded-nocudnn:2,padded-grouped:2,padded-eager:2,equal-cudnn:1,equal-nocudnn:1"


def _batches(arm: str, batch: int, count: int, shortest: int, longest: int) -> list[list[int]]:
    """Prompt lengths per batch: drawn, sorted and cut in ``batch`` rows; for ``equal`` all the mean length."""
    import torch

    if arm.startswith("equal"):
        return [[(shortest + longest) // 2] * batch for _ in range(count)]
    generator = torch.Generator().manual_seed(0)
    lengths = sorted(torch.randint(shortest, longest + 1, (batch * count,), generator=generator).tolist())
    return [lengths[n * batch : (n + 1) * batch] for n in range(count)]


def _inputs(lengths: list[int], vocab: int, pad: int) -> tuple[Any, Any]:
    """Left-padded random token ids and their mask, on the GPU."""
    import torch

    width = max(lengths)
    ids = torch.full((len(lengths), width), pad, dtype=torch.long)
    mask = torch.zeros((len(lengths), width), dtype=torch.long)
    generator = torch.Generator().manual_seed(1)
    for row, length in enumerate(lengths):
        ids[row, width - length :] = torch.randint(3, vocab, (length,), generator=generator)
        mask[row, width - length :] = 1
    return ids.cuda(), mask.cuda()


def _one_arm(arm: str, shape: str, batch: int, count: int, new_tokens: int, prompts: tuple[int, int]) -> dict:
    """Run one arm in this process: per batch, a 1-token call and a full call, each timed on the GPU."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from expman.data.verifier import use_grouped_sdpa
    from expman.devices import attention_kernels

    _, attention = arm.split("-")
    config = LlamaConfig(**SHAPES[shape], bos_token_id=1, eos_token_id=2, pad_token_id=2, tie_word_embeddings=True)
    config._attn_implementation = "eager" if attention == "eager" else "sdpa"
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to("cuda", torch.bfloat16).eval()
    if attention == "grouped":
        use_grouped_sdpa(model)

    def generate(ids: Any, mask: Any, tokens: int) -> float:
        torch.cuda.synchronize()
        started = time.perf_counter()
        with torch.inference_mode(), attention_kernels(attention not in ("nocudnn", "grouped")):
            model.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False
            )
        torch.cuda.synchronize()
        return time.perf_counter() - started

    generate(*_inputs([8] * 4, config.vocab_size, 2), 2)  # CUDA context, cuBLAS handles: outside every batch
    torch.cuda.reset_peak_memory_stats()
    rows = []
    for lengths in _batches(arm, batch, count, *prompts):
        ids, mask = _inputs(lengths, config.vocab_size, 2)
        first = generate(ids, mask, 1)
        seconds = generate(ids, mask, new_tokens)
        step_ms = (seconds - first) / (new_tokens - 1) * 1e3
        rows.append(
            {
                "rows": len(lengths),
                "prompt_width": ids.shape[1],
                "seconds": seconds,
                "one_token_seconds": first,
                "decode_step_ms": step_ms,
                "decode_us_per_row_step": step_ms * 1e3 / len(lengths),
            }
        )
    total = sum(r["seconds"] for r in rows)
    return {
        "attention": attention,
        "padding_mask": arm.startswith("padded"),
        "batches": rows,
        "seconds": total,
        "row_tokens_per_s": batch * count * new_tokens / total,
        "peak_gpu_memory_gib": torch.cuda.max_memory_allocated() / 2**30,
    }


@click.command()
@shape_option("smollm2-135m")
@click.option("--arms", default=ARMS, show_default=True, help="arm:batches in order, arm padded|equal-<attention>.")
@click.option("--batch-size", type=int, default=2048, show_default=True, help="The gpu preset's generate.batch_size.")
@click.option("--new-tokens", type=int, default=384, show_default=True, help="The gpu preset's max_new_tokens.")
@click.option("--min-prompt", type=int, default=20, show_default=True)
@click.option("--max-prompt", type=int, default=140, show_default=True)
@click.option("--one", default=None, hidden=True, help="Run this arm here and print its result (used by main).")
@click.option("--out", type=click.Path(path_type=Path), default=None)
def main(
    shape: str,
    arms: str,
    batch_size: int,
    new_tokens: int,
    min_prompt: int,
    max_prompt: int,
    one: str | None,
    out: Path | None,
) -> None:
    prompts = (min_prompt, max_prompt)
    if one:
        arm, _, count = one.partition(":")
        click.echo(json.dumps(_one_arm(arm, shape, batch_size, int(count), new_tokens, prompts)))
        return
    report = header("generate_decode_step", "cuda") | {
        "shape": shape,
        "batch_size": batch_size,
        "new_tokens": new_tokens,
        "prompt_lengths": list(prompts),
        "arms": {},
    }
    for arm in arms.split(","):
        args = ["--one", arm, "--shape", shape, "--batch-size", str(batch_size), "--new-tokens", str(new_tokens)]
        args += ["--min-prompt", str(min_prompt), "--max-prompt", str(max_prompt)]
        report["arms"][arm_key(report["arms"], arm)] = in_child(__file__, *args)
        _summarize(report)
        write_report(out, report)


def _summarize(report: dict[str, Any]) -> None:
    """Each arm's decode step over the padded cuDNN arm's, batch by batch (the first batch builds cuDNN plans)."""
    arms = report["arms"]
    base = next((r["batches"] for a, r in arms.items() if a.startswith("padded-cudnn") and "batches" in r), None)
    if base is None:
        return
    report["step_ms_over_padded_cudnn"] = {
        arm: [b["decode_step_ms"] / ref["decode_step_ms"] for b, ref in zip(result["batches"], base, strict=False)]
        for arm, result in arms.items()
        if "batches" in result
    }


if __name__ == "__main__":
    main()
