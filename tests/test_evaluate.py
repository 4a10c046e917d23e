"""The reference evaluator: speculative decoding equals plain greedy, τ stays in [1, k+1], a drafter that copies
the verifier reaches k+1 and one that never agrees gets 1, the drafter's cached inference equals its TTT training
forward, rejection sampling is lossless, and the summary pools per-prompt counters as DESIGN.md defines them."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from expman.drafter.model import DrafterConfig, Eagle3Drafter
from expman.evaluation.decoder import (
    TIE_ULPS,
    DrafterSession,
    GreedyReference,
    _accept,
    greedy_decode,
    speculative_decode,
    summarize,
)
from expman.evaluation.evaluate import _decode_rows, select_prompts


@pytest.fixture(scope="module")
def verifier(tiny_verifier_source: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_verifier_source, dtype=torch.float32).eval()


def _drafter(verifier, draft_vocab: torch.Tensor, scale: float = 0.3, seed: int = 0) -> Eagle3Drafter:
    """A drafter over the verifier's shapes whose draft vocab is ``draft_vocab`` (sorted target ids)."""
    config = DrafterConfig.from_verifier(
        verifier.config.to_dict(), draft_vocab_size=len(draft_vocab), aux_layer_ids=[2, 4, 6]
    )
    torch.manual_seed(seed)
    drafter = Eagle3Drafter(config).eval()
    with torch.no_grad():
        for parameter in drafter.parameters():
            parameter.normal_(0, scale) if parameter.dim() == 2 else parameter.uniform_(0.5, 1.5)
        drafter.embed_tokens.weight.copy_(verifier.model.embed_tokens.weight)
        drafter.t2d.zero_()
        drafter.t2d[draft_vocab] = True
        drafter.d2t.copy_(draft_vocab - torch.arange(len(draft_vocab)))
    return drafter


def _prompts(count: int = 4) -> list[list[int]]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(3, 300, (int(n),), generator=generator).tolist() for n in torch.randint(5, 30, (count,))]


@pytest.mark.parametrize("k", [1, 2, 4])
def test_speculative_output_equals_greedy_and_tau_is_in_range(verifier, k: int) -> None:
    vocab = verifier.config.vocab_size
    drafter = _drafter(verifier, torch.arange(0, vocab, 2))
    eos = {verifier.config.eos_token_id}
    for prompt in _prompts():
        reference = greedy_decode(verifier, prompt, 24, eos)
        tokens, stats = speculative_decode(verifier, drafter, prompt, k, 24, eos)
        assert tokens == reference.tokens and reference.divergence(tokens) is None
        tau = (stats.accepted + stats.rounds) / stats.rounds
        assert 1.0 <= tau <= k + 1
        assert stats.drafted == k * stats.rounds
        assert stats.accepted_per_position == sorted(stats.accepted_per_position, reverse=True)
        assert sum(stats.accepted_per_position) == stats.accepted


def test_bf16_speculative_output_equals_greedy_up_to_ties(verifier) -> None:
    """In bf16 a forward over k + 1 tokens rounds differently from one over a single token; any divergence from
    plain greedy must still be at a tie, and the drafter runs in the verifier's dtype."""
    import copy

    model = copy.deepcopy(verifier).to(torch.bfloat16)
    drafter = _drafter(model, torch.arange(0, model.config.vocab_size, 2)).to(torch.bfloat16)
    eos = {model.config.eos_token_id}
    for prompt in _prompts():
        reference = greedy_decode(model, prompt, 24, eos)
        tokens, stats = speculative_decode(model, drafter, prompt, 3, 24, eos)
        divergence = reference.divergence(tokens)
        assert divergence is None or divergence["tie"], divergence
        assert stats.rounds > 0


@pytest.mark.parametrize("cudnn", [True, False])
def test_decode_rows_run_under_evaluate_cudnn_attention(verifier, cudnn: bool) -> None:
    """Every verifier forward of the evaluator's decode, warm-up included, sees SDPA's cuDNN kernel as
    evaluate.cudnn_attention says, and torch's choice is back afterwards; the tokens do not depend on it."""
    from expman.params import EvaluateParams

    seen: list[bool] = []
    hook = verifier.register_forward_pre_hook(lambda *_: seen.append(torch.backends.cuda.cudnn_sdp_enabled()))
    before = torch.backends.cuda.cudnn_sdp_enabled()
    drafter = _drafter(verifier, torch.arange(0, verifier.config.vocab_size, 2))
    records = [
        {"id": str(n), "category": "c", "input_ids": p, "prompt_tokens": len(p)} for n, p in enumerate(_prompts(2))
    ]
    section = EvaluateParams(ks=[2], max_new_tokens=12, cudnn_attention=cudnn)
    try:
        loaded = (verifier, {verifier.config.eos_token_id}, {"candidate": drafter})
        rows = list(_decode_rows(section, loaded, records, timed=True))
    finally:
        hook.remove()
    assert seen and set(seen) == {before if cudnn else False}
    assert torch.backends.cuda.cudnn_sdp_enabled() == before
    assert [row["candidate"]["2"]["matches_greedy"] for row in rows] == [True, True]


def test_a_divergence_is_a_tie_only_within_tie_ulps() -> None:
    ulp = 2.0**-7 * 16  # bf16 at a top logit in [16, 32)
    values = torch.tensor([20.0, 20.0 - TIE_ULPS * ulp, 20.0 - (TIE_ULPS + 1) * ulp])
    reference = GreedyReference([5, 7, 9], [values] * 3, [torch.tensor([7, 8, 6])] * 3, 2.0**-7)
    assert reference.divergence([5, 7, 9]) is None
    assert reference.divergence([5, 8, 1]) == {"position": 1, "gap_ulps": TIE_ULPS, "tie": True}
    assert reference.divergence([5, 6, 9]) == {"position": 1, "gap_ulps": TIE_ULPS + 1, "tie": False}
    assert reference.divergence([5, 7, 4]) == {"position": 2, "gap_ulps": None, "tie": False}  # not in the top
    assert reference.divergence([5, 7]) == {"position": 2, "gap_ulps": None, "tie": False}


def _constant_verifier(verifier):
    """The tiny verifier with its final norm zeroed: every logit is 0, so greedy always emits token 0."""
    import copy

    constant = copy.deepcopy(verifier)
    with torch.no_grad():
        constant.model.norm.weight.zero_()
    return constant


def test_a_drafter_that_copies_the_verifier_reaches_k_plus_one(verifier) -> None:
    constant = _constant_verifier(verifier)
    drafter = _drafter(verifier, torch.arange(verifier.config.vocab_size), scale=0.0)  # zero weights: draft id 0
    eos = {verifier.config.eos_token_id}
    assert 0 not in eos
    for k in (1, 3):
        tokens, stats = speculative_decode(constant, drafter, _prompts(1)[0], k, 20, eos)
        assert tokens == [0] * 20 == greedy_decode(constant, _prompts(1)[0], 20, eos).tokens
        assert stats.accepted == k * stats.rounds  # τ = k + 1 exactly
        assert stats.accepted_per_position == [stats.rounds] * k


def test_a_drafter_that_never_agrees_gets_tau_one(verifier) -> None:
    constant = _constant_verifier(verifier)
    drafter = _drafter(verifier, torch.arange(1, 65), scale=0.0)  # draft id 0 is target 1, never the verifier's 0
    eos = {verifier.config.eos_token_id}
    tokens, stats = speculative_decode(constant, drafter, _prompts(1)[0], 3, 12, eos)
    assert tokens == [0] * 12
    assert stats.accepted == 0 and stats.rounds == 11  # one bonus token per round after the prefill's


def test_cached_inference_equals_the_ttt_training_forward(verifier) -> None:
    drafter = _drafter(verifier, torch.arange(0, 200))
    length, steps = 12, 3
    generator = torch.Generator().manual_seed(3)
    aux = torch.randn(1, length, 3 * drafter.config.layer["hidden_size"], generator=generator)
    ids = torch.randint(0, 200, (1, length + steps + 1), generator=generator)
    step_inputs = [ids[:, 1 + k : 1 + k + length] for k in range(steps)]
    with torch.no_grad():
        trained = drafter(aux, step_inputs, torch.arange(length)[None], torch.zeros(1, length, dtype=torch.long))
        for position in (0, 5, length - 1):
            session = DrafterSession(drafter)
            split = min(3, position)  # two extends where possible: the cached path, not only one prefill
            if split:
                session.extend(aux[0, :split], ids[0, 1 : split + 1].tolist())
            hidden = session.extend(aux[0, split : position + 1], ids[0, split + 1 : position + 2].tolist())
            for step in range(steps):
                torch.testing.assert_close(drafter.draft_logits(hidden)[0, -1], trained[step][0, position])
                if step + 1 < steps:
                    token = ids[:, position + 2 + step : position + 3 + step]
                    hidden = drafter.decode(hidden, token, torch.tensor([[position + step + 1]]), session.caches)


def test_rejection_sampling_keeps_the_verifier_distribution() -> None:
    generator = torch.Generator().manual_seed(0)
    vocab = 6
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, 0.3], [0.0] * vocab])
    t2d = torch.tensor([True, False, True, True, False, True])
    q = torch.tensor([0.1, 0.6, 0.2, 0.1])  # over draft ids 0, 2, 3, 5: far from p on purpose
    counts = torch.zeros(vocab)
    trials = 20000
    for _ in range(trials):
        draft_id = int(torch.multinomial(q, 1, generator=generator))
        token = int(torch.nonzero(t2d).flatten()[draft_id])
        accepted, bonus = _accept([token], [q], logits, t2d, 1.0, generator)
        counts[token if accepted else bonus] += 1
    expected = torch.softmax(logits[0], dim=-1)
    assert torch.allclose(counts / trials, expected, atol=0.012), (counts / trials, expected)


def test_select_prompts_round_robin_over_categories() -> None:
    records = [{"id": f"{c}-{i}", "category": c} for c in ("b", "a") for i in range(3)]
    chosen = select_prompts(records, 3)
    assert [r["id"] for r in chosen] == ["a-0", "b-0", "a-1"]
    assert len(select_prompts(records, None)) == 6


def test_summary_pools_counters_as_designed(tmp_path: Path) -> None:
    def arm(rounds, accepted, per_position, tokens, seconds, equal=True):
        return {
            "rounds": rounds,
            "accepted": accepted,
            "drafted": 2 * rounds,
            "accepted_per_position": per_position,
            "tokens": tokens,
            "seconds": seconds,
            "matches_greedy": equal,
        }

    prompts = [
        {
            "id": "p1",
            "category": "x",
            "nospec": {"tokens": 10, "seconds": 1.0},
            "candidate": {"2": arm(4, 6, [4, 2], 10, 0.5)},
        },
        {
            "id": "p2",
            "category": "y",
            "nospec": {"tokens": 30, "seconds": 3.0},
            "candidate": {"2": arm(16, 4, [3, 1], 20, 2.5, False)},
        },
    ]
    summary = summarize(prompts, ["candidate"], [2])
    pooled = summary["candidate"]["k2"]
    assert pooled["tau"] == pytest.approx((10 + 20) / 20)
    assert pooled["acceptance_rate"] == pytest.approx(10 / 40)
    assert pooled["per_position"] == pytest.approx([7 / 20, 3 / 20])
    assert pooled["speedup"] == pytest.approx((30 / 3.0) / (40 / 4.0))
    assert pooled["greedy_mismatches"] == 1
    assert summary["by_category"]["x"]["candidate"]["k2"]["tau"] == pytest.approx(2.5)
    json.dumps(summary)  # JSON-ready

    # without a baseline arm (evaluate.baseline: null) its plot columns are nan, which Vega leaves out (an empty cell
    # would be drawn as 0), and the figure draws the candidate alone
    from expman.plots import evaluation_figure, evaluation_tables, read_table, write_tables

    evaluation = {"ks": [2], "prompts": prompts, "target": "torch-cpu-float32-batch1", "summary": summary}
    write_tables(tmp_path, evaluation_tables(evaluation))
    assert (tmp_path / "tau.csv").read_text() == "k,baseline,candidate\n2,nan,1.5\n"
    assert read_table(tmp_path / "per_position.csv")[1] == {
        "position": 2,
        "baseline": pytest.approx(math.nan, nan_ok=True),
        "candidate": 0.15,
    }
    assert [row["label"] for row in read_table(tmp_path / "by_category.csv")] == ["x · candidate", "y · candidate"]
    evaluation_figure(evaluation).savefig(tmp_path / "evaluate.png")


def test_baseline_train_and_evaluate_stages_on_the_tiny_project(project: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import dataclasses

    import yaml
    from mlflow import MlflowClient

    from expman import paths
    from expman.evaluation.evaluate import evaluate
    from expman.params import load_params
    from expman.paths import EvaluatePaths, TrainPaths
    from expman.registry.reader import open_registry
    from expman.registry.tracking import VIEW_TAG
    from expman.training.baseline import baseline
    from expman.training.train import train
    from tests.test_pipeline import run_until

    run_until("vocab")
    params = yaml.safe_load((project / "params.yaml").read_text())
    params["train"]["finetune_from"] = "models/baseline"
    (project / "params.yaml").write_text(yaml.safe_dump(params))
    loaded = load_params("params.yaml")
    made = baseline(loaded, TrainPaths.baseline())
    registered = made["provenance"]["registered"]
    assert registered["alias"] == "baseline"
    assert open_registry().alias(registered["name"], "baseline") == registered["version"]
    base = json.loads((project / paths.BASELINE_METRICS).read_text())
    trained = train(loaded.train, TrainPaths.default())
    assert trained["metrics"]["train_samples"] > base["train_samples"]  # the baseline saw a share of the samples
    assert trained["upstream"]["finetune_from"]["manifest"] == "models/baseline"

    manifest = evaluate(loaded, EvaluatePaths.default())
    evaluation = json.loads((project / paths.EVALUATE / "evaluation.json").read_text())
    assert set(evaluation["arms"]) == {"baseline", "candidate"}
    assert len(evaluation["prompts"]) == 4 and manifest["prompts"] == 4
    for row in evaluation["prompts"]:
        assert row["nospec"]["tokens"] > 0
        for arm in ("baseline", "candidate"):
            for k in ("1", "3"):
                assert row[arm][k]["matches_greedy"] is True
                assert row[arm][k]["tokens"] == row["nospec"]["tokens"]
    for arm in ("baseline", "candidate"):
        for k in (1, 3):
            pooled = evaluation["summary"][arm][f"k{k}"]
            assert 1.0 <= pooled["tau"] <= k + 1 and pooled["speedup"] > 0 and pooled["greedy_mismatches"] == 0
    assert set(manifest["upstream"]) == {"prepare", "generate", "baseline", "candidate"}
    client = MlflowClient()  # expman ui's runs table shows each arm's tau and speedup beside the stage
    experiment_id = client.get_run(manifest["provenance"]["mlflow_run_id"]).info.experiment_id
    columns = json.loads(client.get_experiment(experiment_id).tags[VIEW_TAG])["selectedColumns"]
    shown = {
        f"metrics.`{arm}/k{k}/{name}`"
        for arm in ("baseline", "candidate")
        for k in (1, 3)
        for name in ("tau", "speedup")
    }
    assert shown | {"tags.`expman.stage`"} <= set(columns)

    # two worker processes (evaluate.workers) decode the same rows in the same order; only the timings differ, and
    # the first two prompts (evaluate.timed_prompts) are left to this process, decoded alone after the workers: the
    # speedup is theirs only
    parallel = loaded.evaluate.model_copy(update={"workers": 2, "timed_prompts": 2})
    separate = dataclasses.replace(
        EvaluatePaths.default(),
        out=Path("data/evaluate-2"),
        metrics=Path("metrics/evaluate-2.json"),
        plots=Path("plots/evaluate-2"),
    )
    evaluate(loaded.model_copy(update={"evaluate": parallel}), separate)

    def untimed(value: Any) -> Any:
        if isinstance(value, dict):
            return {key: untimed(item) for key, item in value.items() if key not in ("seconds", "timed")}
        return [untimed(item) for item in value] if isinstance(value, list) else value

    evaluated_in_workers = json.loads((project / "data/evaluate-2/evaluation.json").read_text())
    assert evaluated_in_workers["workers"] == 2
    assert untimed(evaluated_in_workers["prompts"]) == untimed(evaluation["prompts"])
    assert [row["timed"] for row in evaluated_in_workers["prompts"]] == [True, True, False, False]
    assert all(row["timed"] for row in evaluation["prompts"])  # one process: every prompt timed as decoded
    timed_rows, summary = evaluated_in_workers["prompts"][:2], evaluated_in_workers["summary"]

    def tok_per_s(parts: list[dict]) -> float:
        return sum(part["tokens"] for part in parts) / sum(part["seconds"] for part in parts)

    nospec = tok_per_s([row["nospec"] for row in timed_rows])
    assert summary["timed_prompts"] == 2 and summary["nospec"]["tok_per_s"] == pytest.approx(nospec)
    speedup = tok_per_s([row["candidate"]["3"] for row in timed_rows]) / nospec
    assert summary["candidate"]["k3"]["speedup"] == pytest.approx(speedup)
    assert json.loads((project / paths.EVALUATE_METRICS).read_text())["candidate"]["k3"]["tau"] >= 1.0

    # Ctrl-C at the third prompt, then the same evaluation again: it decodes only the prompts it had not reached
    from expman.evaluation import evaluate as evaluation_module

    decoded: list[str] = []
    decode_row = evaluation_module._prompt_row

    def row_until_interrupted(*args: Any) -> dict:
        if interrupt_at is not None and len(decoded) == interrupt_at:
            raise KeyboardInterrupt
        decoded.append(args[2]["id"])
        return decode_row(*args)

    monkeypatch.setattr(evaluation_module, "_prompt_row", row_until_interrupted)
    resumed = dataclasses.replace(separate, out=Path("data/evaluate-3"), metrics=Path("metrics/evaluate-3.json"))
    interrupt_at: int | None = 2
    with pytest.raises(KeyboardInterrupt):
        evaluate(loaded, resumed)
    assert not (project / "data/evaluate-3/evaluation.json").exists()
    [state] = list((project / paths.EVALUATE_STATE).iterdir())
    assert sum(len(part.read_text().splitlines()) for part in state.glob("*.jsonl")) == 2
    interrupt_at = None
    evaluate(loaded, resumed)
    every_prompt = [row["id"] for row in evaluation["prompts"]]
    assert sorted(decoded) == sorted(every_prompt) and len(decoded) == 4  # 2 before the interrupt, 2 after it
    evaluated_again = json.loads((project / "data/evaluate-3/evaluation.json").read_text())
    assert evaluated_again["resumed_prompts"] == 2 and evaluation["resumed_prompts"] == 0
    assert untimed(evaluated_again["prompts"]) == untimed(evaluation["prompts"])
    assert not state.exists()

    # Ctrl-C in the timing pass (workers done, the second prompt being timed alone): the workers' rows and the first
    # timed row are kept (3 resumed); the same evaluation again starts no worker and times only the second prompt
    timed_pass = dataclasses.replace(separate, out=Path("data/evaluate-4"), metrics=Path("metrics/evaluate-4.json"))
    decoded.clear()  # the workers are spawned: only this process's decodes, the timing pass's, are seen here
    interrupt_at = 1
    with pytest.raises(KeyboardInterrupt):
        evaluate(loaded.model_copy(update={"evaluate": parallel}), timed_pass)
    interrupt_at = None
    evaluate(loaded.model_copy(update={"evaluate": parallel}), timed_pass)
    assert decoded == every_prompt[:2]
    timed_again = json.loads((project / "data/evaluate-4/evaluation.json").read_text())
    assert [row["timed"] for row in timed_again["prompts"]] == [True, True, False, False]
    assert timed_again["resumed_prompts"] == 3 and timed_again["summary"]["timed_prompts"] == 2

    # the tables dvc plots draws, and the same pictures in the run
    from expman.plots import read_table

    summary = evaluation["summary"]
    names = ("tau", "speedup", "per_position", "by_category")
    tables = {name: read_table(project / paths.EVALUATE_PLOTS / f"{name}.csv") for name in names}
    assert tables["tau"] == [
        {"k": k, **{arm: pytest.approx(summary[arm][f"k{k}"]["tau"], rel=1e-5) for arm in ("baseline", "candidate")}}
        for k in (1, 3)
    ]
    assert [row["candidate"] for row in tables["speedup"]] == pytest.approx(
        [summary["candidate"][f"k{k}"]["speedup"] for k in (1, 3)], rel=1e-5
    )
    assert [row["position"] for row in tables["per_position"]] == [1, 2, 3]
    assert [row["baseline"] for row in tables["per_position"]] == pytest.approx(
        summary["baseline"]["k3"]["per_position"], rel=1e-5, abs=1e-9
    )
    categories = summary["by_category"]
    assert {(row["category"], row["arm"]): row["tau"] for row in tables["by_category"]} == {
        (category, arm): pytest.approx(block[arm]["k3"]["tau"], rel=1e-5)
        for category, block in categories.items()
        for arm in ("baseline", "candidate")
    }
    import mlflow

    run_id = manifest["provenance"]["mlflow_run_id"]
    assert [a.path for a in mlflow.MlflowClient().list_artifacts(run_id, "figures")] == ["figures/evaluate.png"]
