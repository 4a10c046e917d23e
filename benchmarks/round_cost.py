"""What one speculative round costs in the reference evaluator, against one plain decoding step, on this machine.

The evaluator's speedup is tau / (round cost / plain step): a round is the drafter's k steps plus one verifier
forward over k + 1 tokens plus the drafter's cache extension. This times those parts with the evaluator's own
classes (``expman.evaluation.decoder.VerifierSession`` and ``DrafterSession``) on a verifier shape with random weights
(the cost does not depend on the weights), after a context of ``--context`` tokens, for each ``--dtype`` (of verifier
and drafter alike, as in the evaluator), the parts in a round's order (draft, verify, extend). It reports each part in
ms, the round cost per k as a multiple of the plain step (the tau that k needs to break even), and the tau that k needs
for a speedup of 1.3 (the quality goal).

  python benchmarks/round_cost.py --out benchmarks/results/round_cost_cpu.json
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from pathlib import Path

import click
import torch
from harness import SHAPES, elapsed, header, shape_option, write_report

from expman.data.extract import default_aux_layers
from expman.drafter.model import DrafterConfig, Eagle3Drafter
from expman.evaluation.decoder import DrafterSession, VerifierSession


def _median_ms(parts: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median wall time of each part in ms. The parts take turns, one call each per repeat (after two warm-up
    turns), so a slow spell of the machine hits them alike."""
    times: dict[str, list[float]] = {name: [] for name in parts}
    for turn in range(repeats + 2):
        for name, run in parts.items():
            seconds, _ = elapsed(run)
            if turn >= 2:
                times[name].append(seconds)
    return {name: statistics.median(values) * 1e3 for name, values in times.items()}


def random_models(shape: dict, dtype: torch.dtype, draft_vocab: int) -> tuple[object, Eagle3Drafter]:
    """A verifier of ``shape`` with random weights (sdpa attention) and a drafter over it sharing its embedding,
    draft id i being target id i, both in ``dtype`` on the CPU."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**shape, tie_word_embeddings=True, attn_implementation="sdpa")
    model = LlamaForCausalLM(config).to(dtype).eval()
    aux_layers = default_aux_layers(shape["num_hidden_layers"])
    drafter = Eagle3Drafter(DrafterConfig.from_verifier(shape, draft_vocab, aux_layers)).eval()
    drafter.embed_tokens.weight.data = model.get_input_embeddings().weight.detach().float()
    drafter.t2d[:draft_vocab] = True  # d2t stays 0: draft id i is target id i
    return model, drafter.to(dtype)


@torch.inference_mode()
def measure(shape: dict, dtype: torch.dtype, draft_vocab: int, context: int, ks: list[int], repeats: int) -> dict:
    """Per-part costs in ms and the round cost per k, for one compute dtype of verifier and drafter."""
    torch.manual_seed(0)
    model, drafter = random_models(shape, dtype, draft_vocab)
    prompt = torch.randint(0, shape["vocab_size"], (context,)).tolist()
    verifier = VerifierSession(model, drafter.config.aux_layer_ids)
    _, aux = verifier.feed(prompt, with_aux=True, last_only=True)

    def forward(tokens: int, with_aux: bool) -> None:
        verifier.feed(prompt[:tokens], with_aux=with_aux)
        verifier.crop(context)

    session = DrafterSession(drafter)
    hidden = session.extend(aux, prompt[1:] + prompt[:1])

    def extend(tokens: int) -> None:
        session.extend(aux[:tokens], prompt[:tokens])
        session.length = context

    parts: dict[str, Callable[[], object]] = {"plain": lambda: forward(1, False)}
    for k in ks:  # in a round's order
        parts[f"draft {k}"] = lambda k=k: session.draft(hidden, k, 0.0, None)
        parts[f"verify {k + 1}"] = lambda k=k: forward(k + 1, True)
        # a round extends the drafter by accepted + 1 positions; k + 1 (all accepted) is the dearest
        parts[f"extend {k + 1}"] = lambda k=k: extend(k + 1)
    ms = _median_ms(parts, repeats)
    plain = ms["plain"]
    rounds = {}
    for k in ks:
        cost = (ms[f"verify {k + 1}"] + ms[f"draft {k}"] + ms[f"extend {k + 1}"]) / plain
        rounds[str(k)] = {"round_over_plain_step": cost, "tau_for_speedup_1_3": 1.3 * cost}
    return {
        "plain_step_ms": plain,
        "part_ms": {name: value for name, value in ms.items() if name != "plain"},
        "per_k": rounds,
    }


@click.command()
@shape_option("smollm2-135m")
@click.option("--dtype", "dtypes", multiple=True, default=["float32", "bfloat16"], show_default=True)
@click.option("--draft-vocab", type=int, default=8192, show_default=True)
@click.option("--context", type=int, default=160, show_default=True, help="tokens already in the KV cache")
@click.option("--k", "ks", type=int, multiple=True, default=[1, 2, 3, 4], show_default=True)
@click.option("--repeats", type=int, default=40, show_default=True)
@click.option("--out", type=click.Path(path_type=Path))
def main(
    shape: str, dtypes: tuple[str, ...], draft_vocab: int, context: int, ks: tuple[int, ...], repeats: int, out: Path
) -> None:
    report = header("round_cost", "cpu") | {
        "shape": shape,
        "draft_vocab": draft_vocab,
        "context": context,
        "repeats": repeats,
        "dtypes": {
            name: measure(SHAPES[shape], getattr(torch, name), draft_vocab, context, list(ks), repeats)
            for name in dtypes
        },
    }
    write_report(out, report)


if __name__ == "__main__":
    main()
