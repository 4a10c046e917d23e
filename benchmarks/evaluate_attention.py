"""The evaluate stage's batch-1 decode on a GPU with and without SDPA's cuDNN kernel (``evaluate.cudnn_attention``).

Each arm runs the stage's own ``_decode_rows`` (its warm-up, plain decoding, then the drafter at each k, under the
arm's kernels) in a process of its own, so no arm inherits another's cuDNN plans, on the same prompts: lengths drawn
from ``--min-prompt``..``--max-prompt``, every decode held to ``--new-tokens`` (no end-of-turn id). The verifier has
the shape's random weights and the drafter is random: this times a decode step and a speculative round, not tau (a
random drafter's drafts are rejected, so each round commits one token). One process; the stage on a GPU runs
``evaluate.workers`` of them side by side.

    python benchmarks/evaluate_attention.py --out benchmarks/results/evaluate_attention_gpu_h100.json
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click
from harness import SHAPES, arm_key, header, in_child, shape_option, write_report


def _one_arm(cudnn: bool, shape: str, prompts: int, lengths: tuple[int, int], new_tokens: int, ks: list[int]) -> dict:
    """Decode every prompt in this process as the stage does; per arm and k, seconds and ms per step or round."""
    import torch
    from round_cost import random_models

    from expman.evaluation.evaluate import _decode_rows
    from expman.params import EvaluateParams

    torch.manual_seed(0)
    model, drafter = random_models(SHAPES[shape], torch.bfloat16, 8192)
    model, drafter = model.to("cuda"), drafter.to("cuda")
    generator = torch.Generator().manual_seed(1)
    records = []
    for n in range(prompts):
        length = int(torch.randint(lengths[0], lengths[1] + 1, (1,), generator=generator))
        ids = torch.randint(3, SHAPES[shape]["vocab_size"], (length,), generator=generator).tolist()
        records.append({"id": str(n), "category": "random", "input_ids": ids, "prompt_tokens": length})
    section = EvaluateParams(ks=ks, max_new_tokens=new_tokens, cudnn_attention=cudnn)
    rows = list(_decode_rows(section, (model, set(), {"candidate": drafter}), records, timed=True))
    plain = sum(row["nospec"]["seconds"] for row in rows)
    result: dict[str, Any] = {
        "prompts": len(rows),
        "plain_seconds": plain,
        "plain_step_ms": plain / sum(row["nospec"]["tokens"] for row in rows) * 1e3,
    }
    for k in ks:
        seconds = sum(row["candidate"][str(k)]["seconds"] for row in rows)
        rounds = sum(row["candidate"][str(k)]["rounds"] for row in rows)
        result[f"k{k}_seconds"] = seconds
        result[f"k{k}_round_ms"] = seconds / rounds * 1e3
    result["prompt_seconds"] = plain + sum(result[f"k{k}_seconds"] for k in ks)
    return result


@click.command()
@shape_option("smollm2-135m")
@click.option("--prompts", type=int, default=8, show_default=True)
@click.option("--min-prompt", type=int, default=20, show_default=True)
@click.option("--max-prompt", type=int, default=140, show_default=True)
@click.option("--new-tokens", type=int, default=64, show_default=True, help="The gpu preset's evaluate.max_new_tokens.")
@click.option("--k", "ks", type=int, multiple=True, default=[1, 3], show_default=True)
@click.option("--one", type=bool, default=None, hidden=True, help="Run this arm here and print it (used by main).")
@click.option("--out", type=click.Path(path_type=Path), default=None)
def main(
    shape: str,
    prompts: int,
    min_prompt: int,
    max_prompt: int,
    new_tokens: int,
    ks: tuple[int, ...],
    one: bool | None,
    out: Path | None,
) -> None:
    lengths = (min_prompt, max_prompt)
    if one is not None:
        click.echo(json.dumps(_one_arm(one, shape, prompts, lengths, new_tokens, sorted(ks))))
        return
    report = header("evaluate_attention", "cuda") | {
        "shape": shape,
        "prompts": prompts,
        "prompt_lengths": list(lengths),
        "new_tokens": new_tokens,
        "ks": sorted(ks),
        "arms": {},
    }
    for arm, cudnn in (("cudnn", True), ("nocudnn", False)):
        args = ["--one", str(cudnn), "--shape", shape, "--prompts", str(prompts), "--new-tokens", str(new_tokens)]
        args += ["--min-prompt", str(min_prompt), "--max-prompt", str(max_prompt), *[f"--k={k}" for k in ks]]
        report["arms"][arm_key(report["arms"], arm)] = in_child(__file__, *args)
        write_report(out, report)
    arms = report["arms"]
    if all("prompt_seconds" in arms[arm] for arm in ("cudnn", "nocudnn")):
        report["nocudnn_speedup"] = arms["cudnn"]["prompt_seconds"] / arms["nocudnn"]["prompt_seconds"]
        write_report(out, report)


if __name__ == "__main__":
    main()
