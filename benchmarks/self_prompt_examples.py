"""Prompts the verifier writes itself, with and without shipped examples in front (``generate.self_prompts.examples``):
how many candidates pass the filters, what each filter drops, how long writing takes, and sample prompts per category.

Run in a project whose verifier is prepared (``dvc repro prepare``). Each setting writes the same number of candidates
with the generate stage's own backend, filters and held-out guard (the project's params.yaml; ``--backend`` overrides
generate.backend), seeded alike, in one process, so the machine is the same for all:

  python benchmarks/self_prompt_examples.py --candidates 256 --out benchmarks/results/self_prompt_examples_cpu.json
"""

from __future__ import annotations

import time
from pathlib import Path

import click
import torch
from harness import header, write_report

from expman.data.generate import _make_backend, _prompt_pools, _read_conversations
from expman.data.self_prompts import PromptFilter, WritingContexts, write_prompts
from expman.data.verifier import load_tokenizer
from expman.devices import precision_facts, resolve_device
from expman.params import load_params
from expman.paths import VERIFIER

SAMPLES_PER_CATEGORY = 2


@click.command()
@click.option("--examples", "settings", multiple=True, type=int, default=[0, 3], show_default=True)
@click.option("--candidates", type=int, default=256, show_default=True)
@click.option("--backend", type=click.Choice(["hf", "vllm"]), default=None, help="Default: the project's.")
@click.option("--params", "params_file", type=click.Path(exists=True, path_type=Path), default="params.yaml")
@click.option("--out", type=click.Path(path_type=Path), default=None)
def main(settings: tuple[int, ...], candidates: int, backend: str | None, params_file: Path, out: Path | None) -> None:
    params = load_params(params_file)
    writing = params.generate.self_prompts.model_copy(update={"count": candidates, "max_candidates": candidates})
    # the engine as the stage builds it for self prompts (on CPU vLLM: whole prefills, which seeded sampling needs)
    chosen = backend or params.generate.backend
    section = params.generate.model_copy(update={"backend": chosen, "self_prompts": writing})
    conversations, _ = _read_conversations(section)
    heldout, known, shipped = _prompt_pools(conversations)
    device = resolve_device(section.device)
    engine = _make_backend(VERIFIER, section)
    tokenizer = load_tokenizer(VERIFIER)
    rows = {}
    for examples in settings:
        wanted = section.self_prompts.model_copy(update={"examples": examples})
        contexts = WritingContexts(tokenizer, section.chat_template_kwargs, wanted, shipped)
        torch.manual_seed(wanted.seed)  # as the stage does: the hf backend samples from the global generator
        started = time.perf_counter()
        report = write_prompts(engine, contexts, PromptFilter(wanted, heldout, known), section.batch_size)
        seconds = time.perf_counter() - started
        samples: dict[str, list[str]] = {}
        for prompt, category in zip(report.prompts, report.categories, strict=True):
            if len(samples.setdefault(category, [])) < SAMPLES_PER_CATEGORY:
                samples[category].append(prompt)
        rows[f"examples_{examples}"] = {**report.facts(wanted), "seconds": seconds, "samples": samples}
    engine.close()
    result = {
        **header("self_prompt_examples", device),
        "backend": section.backend,
        "precision": precision_facts(device, section.dtype),
        "candidates": candidates,
        "settings": rows,
    }
    write_report(out, result)


if __name__ == "__main__":
    main()
