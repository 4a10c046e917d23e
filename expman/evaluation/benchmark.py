"""benchmark: the evaluate stage's arms again in a serving engine, and the integration-fault verdict.

The prompts, output length and k are the reference evaluation's, so engine and reference numbers describe the
same work. The engine (``benchmark.engine``: vLLM's offline ``LLM`` or an SGLang server) is driven only through
``expman.engines.serving``. Per arm it runs greedy over all prompts in one batch; acceptance comes from the
engine's spec-decode counters of the timed batch, speedup from the no-speculation arm of the same run. A drafter
is marked ``integration_fault`` when its checkpoint tells the engine other aux layers than it was trained on (the
DESIGN.md failure: ids off by one between engines), or when the engine's τ falls below ``tau_ratio`` × the
reference τ or its position-0 rate below ``position0_ratio`` × the reference's, or when the engine's states at
the layers the checkpoint names differ from the states the drafter was trained on
(``expman.evaluation.state_parity``, on ``parity_prompts`` of the prompts; ``not measured`` in an engine that
returns no hidden states). Engine outputs are compared with the engine's own no-speculation outputs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from expman.data.generate import read_responses
from expman.errors import ExpmanError
from expman.params import Params
from expman.paths import BenchmarkPaths
from expman.provenance import atomic_write_json, read_manifest, upstream_entry
from expman.registry.tracking import stage_run

__all__ = ["benchmark", "contract_mismatch"]


def contract_mismatch(drafter_dir: Path) -> str | None:
    """Why an engine would feed this drafter other aux layers than it was trained on, or None.

    The checkpoint's ``eagle_aux_hidden_state_layer_ids`` is what an engine reads; the manifest of a drafter
    trained here records the capture contract of its features (an imported one has none to hold it to)."""
    from expman.drafter.checkpoint import read_checkpoint
    from expman.evaluation.evaluate import trained_aux_layers

    trained = trained_aux_layers(drafter_dir)
    served = list(read_checkpoint(drafter_dir)[1].aux_layer_ids)
    if trained is not None and served != trained:
        return f"{drafter_dir}/config.json serves aux layers {served}, the drafter was trained on {trained}"
    return None


def _engine_numbers(arm: Any, counters: Any, k: int, nospec: Any, nospec_tok_per_s: float | None) -> dict[str, Any]:
    """An arm's entry: the engine's acceptance (``counters`` of its timed batch), speed and outputs."""
    tok_per_s = sum(len(o) for o in arm.outputs) / arm.seconds
    rates = list(counters.per_position_rates)[:k]
    return {
        "tau": counters.tau,
        "acceptance_rate": counters.acceptance_rate,
        "per_position": rates + [0.0] * (k - len(rates)),
        "tok_per_s": tok_per_s,
        "speedup": tok_per_s / nospec_tok_per_s if nospec_tok_per_s else None,
        "outputs_equal_to_nospec": sum(a == b for a, b in zip(arm.outputs, nospec.outputs, strict=True)),
        "counters": {
            "drafts": counters.drafts,
            "draft_tokens": counters.draft_tokens,
            "accepted_tokens": counters.accepted_tokens,
            "accepted_per_position": list(counters.accepted_per_position),
        },
        "seconds": arm.seconds,
        "settings": arm.settings,
    }


@dataclass(frozen=True)
class _Work:
    """What the engine runs, read before the stage's run opens: the verifier, the reference evaluation, the ks, the
    evaluated prompts' token ids, each arm's drafter folder and its static fault (or None)."""

    verifier_manifest: dict[str, Any]
    evaluation: dict[str, Any]
    ks: list[int]
    prompts: list[list[int]]
    arms: dict[str, Path]
    static: dict[str, str | None]


def _read_inputs(section: Any, where: BenchmarkPaths) -> tuple[_Work, dict[str, Any]]:
    """The work and the upstream entries."""
    verifier_manifest = read_manifest(where.verifier / "manifest.json", "prepare")
    evaluate_manifest = read_manifest(where.evaluate / "manifest.json", "evaluate")
    evaluation = json.loads((where.evaluate / "evaluation.json").read_text())
    ks = section.ks or evaluation["ks"]
    missing = sorted(set(ks) - set(evaluation["ks"]))
    if missing:
        raise ExpmanError(f"benchmark.ks: {missing} were not evaluated (evaluate.ks is {evaluation['ks']})")
    upstream = {
        "prepare": upstream_entry(where.verifier / "manifest.json"),
        "evaluate": upstream_entry(where.evaluate / "manifest.json"),
    }
    split = evaluate_manifest["params"]["split"]
    by_id = {r["id"]: r for r in read_responses(where.generated, split)}
    prompts = [by_id[row["id"]]["input_ids"][: by_id[row["id"]]["prompt_tokens"]] for row in evaluation["prompts"]]
    arms = {name: Path(arm["path"]) for name, arm in evaluation["arms"].items()}
    static = {name: contract_mismatch(path) for name, path in arms.items()}
    return _Work(verifier_manifest, evaluation, ks, prompts, arms, static), upstream


def _measure_arm(
    run: Any, section: Any, work: _Work, name: str, engine_run: Any, nospec: Any, parity: dict[str, Any] | None
) -> dict[str, Any]:
    """One drafter at each k in the engine, against its reference numbers: the arm's entry of ``benchmark.json``."""
    from expman.evaluation.fault_gate import integration_fault

    static = work.static[name]
    entry: dict[str, Any] = {"path": str(work.arms[name]), "static_fault": static, "parity": parity, "k": {}}
    parity_reasons = list(parity.get("reasons", [])) if parity else []
    for k in work.ks:
        measured, counters = engine_run(drafter_dir=work.arms[name], k=k)
        nospec_tok_per_s = sum(len(o) for o in nospec.outputs) / nospec.seconds
        engine = _engine_numbers(measured, counters, k, nospec, nospec_tok_per_s)
        reference = work.evaluation["summary"][name][f"k{k}"]
        verdict = integration_fault(reference, engine, section.tau_ratio, section.position0_ratio)
        reasons = ([static] if static else []) + parity_reasons + list(verdict.reasons)
        entry["k"][str(k)] = {
            "engine": engine,
            "reference": {key: reference[key] for key in ("tau", "per_position", "speedup")},
            "tau_ratio": verdict.tau_ratio_measured,
            "integration_fault": bool(reasons),
            "reasons": reasons,
        }
        numbers = {
            f"{name}/k{k}/engine_tau": engine["tau"],
            f"{name}/k{k}/engine_speedup": engine["speedup"],
            f"{name}/k{k}/tau_ratio": verdict.tau_ratio_measured,
        }
        run.log_metrics({key: value for key, value in numbers.items() if value is not None})  # not measured: absent
    entry["integration_fault"] = any(v["integration_fault"] for v in entry["k"].values())
    return entry


def _run_engine(run: Any, section: Any, where: BenchmarkPaths, work: _Work, result: dict[str, Any]) -> None:
    """No speculation, then every arm of the evaluation at each k, in the engine ``benchmark.engine`` names (through
    ``expman.engines.serving``); into ``result``."""
    from tqdm import tqdm

    from expman.devices import compiles
    from expman.engines.factory import serving_engine
    from expman.engines.serving import ArmSetup

    device, dtype = result["precision"]["device"], result["precision"]["dtype"]
    engine = serving_engine(section.engine)
    result["engine_version"] = engine.version()
    setup = ArmSetup(
        model_dir=where.verifier,
        prompts=work.prompts,
        max_new_tokens=work.evaluation["max_new_tokens"],
        device=device,
        dtype=dtype,
        seed=section.seed,
        trust_remote_code=work.verifier_manifest["trust_remote_code"],
        compile=compiles(section.compile, device),
    )
    bar = tqdm(total=1 + len(work.arms) * len(work.ks), desc="benchmark", unit="engine run")

    def counted(drafter_dir: Path | None, k: int) -> tuple[Any, Any]:
        """The arm and, with a drafter, the counters of its timed batch."""
        measured = engine.run_arm(setup, drafter_dir, k)
        bar.update()
        return measured, None if drafter_dir is None else engine.acceptance(measured)

    parity = _parity(engine, section, where, work, device, dtype)
    nospec, _ = counted(drafter_dir=None, k=0)
    nospec_tok_per_s = sum(len(o) for o in nospec.outputs) / nospec.seconds
    result["nospec"] = {"tok_per_s": nospec_tok_per_s, "seconds": nospec.seconds, "settings": nospec.settings}
    for name in work.arms:
        result["arms"][name] = _measure_arm(run, section, work, name, counted, nospec, parity.get(name))
    bar.close()


def _parity(engine: Any, section: Any, where: BenchmarkPaths, work: _Work, device: str, dtype: str) -> dict[str, Any]:
    """Hidden-state parity of every arm on the first ``parity_prompts`` prompts ({} when switched off)."""
    from expman.evaluation.state_parity import served_state_parity

    if not section.parity_prompts:
        return {}
    return served_state_parity(
        engine,
        where.verifier,
        work.arms,
        work.prompts[: section.parity_prompts],
        device,
        dtype,
        work.verifier_manifest["trust_remote_code"],
        section.parity_min_cosine,
    )


def _summary(result: dict[str, Any]) -> dict[str, Any]:
    """The metrics file: per arm the verdict and the engine's τ and speedup at each k (a speedup that could not be
    measured, with no no-speculation tokens to divide by, is left out)."""
    return {
        "engine": result["engine"],
        **({"nospec_tok_per_s": result["nospec"]["tok_per_s"]} if "nospec" in result else {}),
        **{
            name: {
                "integration_fault": arm["integration_fault"],
                **{
                    f"k{k}": {x: v["engine"][x] for x in ("tau", "speedup") if v["engine"][x] is not None}
                    for k, v in arm["k"].items()
                },
            }
            for name, arm in result["arms"].items()
        },
    }


def benchmark(params: Params, where: BenchmarkPaths) -> dict[str, Any]:
    """Run no speculation, baseline and candidate in the engine at the evaluation's ks; write ``benchmark.json``
    (engine numbers, reference numbers, verdicts) and ``manifest.json`` to ``where.out``, a summary to
    ``where.metrics``; the run logs engine against reference as ``figures/benchmark.png``."""
    from expman.devices import precision_facts, resolve_device
    from expman.plots import BENCHMARK_FIGURE, benchmark_figure

    section = params.benchmark
    work, upstream = _read_inputs(section, where)
    precision = precision_facts(resolve_device(section.device), section.dtype)
    result: dict[str, Any] = {"engine": section.engine, "ks": work.ks, "prompts": len(work.prompts), "arms": {}}
    result["precision"] = precision
    with stage_run("benchmark", section.model_dump() | {"resolved": precision}, upstream) as run:
        if section.engine == "none":
            result["skipped"] = "benchmark.engine is none: no engine numbers, no integration-fault verdict"
        else:
            _run_engine(run, section, where, work, result)
        atomic_write_json(where.out / "benchmark.json", result)
        run.log_artifact(where.out / "benchmark.json")
        figure = benchmark_figure(result)
        if figure is not None:
            run.log_figure(figure, BENCHMARK_FIGURE)
        summary = _summary(result)
        atomic_write_json(where.metrics, summary)
        return run.write_manifest(where.out / "manifest.json", {"engine": section.engine, "summary": summary})
