"""Prompts the verifier writes itself (generate.self_prompts): the filters, the held-out guard, the stage's record
of what was dropped, and real prompts from SmolLM2 through vLLM CPU (slow)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from expman import paths
from expman.data.generate import generate, read_responses
from expman.data.self_prompts import DROP_REASONS, PromptFilter, WritingContexts, user_turn_prefix, write_prompts
from expman.data.verifier import prepare
from expman.engines.generation import GenOutput
from expman.errors import ExpmanError
from expman.params import SelfPromptParams, load_params
from expman.paths import GeneratePaths
from tests.conftest import real_smollm2_params, write_params

REPO = Path(__file__).resolve().parents[1]
HELDOUT = [json.loads(line)["prompt"] for line in (REPO / "data/prompts/heldout.jsonl").read_text().splitlines()]
SETTINGS = SelfPromptParams(count=100, min_words=3, max_words=40)
SELF_PROMPTS_WIDE = SelfPromptParams(count=100, min_words=3, max_words=400)


@pytest.mark.parametrize(
    "copy",
    [
        HELDOUT[0],
        HELDOUT[0].upper(),
        HELDOUT[0].replace("short", "brief"),  # one word changed
        f"Please help me with this. {HELDOUT[3]}",  # a held-out prompt inside a longer one
        HELDOUT[5].rstrip(".?!") + ", thanks!",
    ],
)
def test_no_heldout_prompt_nor_a_near_copy_is_kept(copy: str) -> None:
    prompt_filter = PromptFilter(SELF_PROMPTS_WIDE, HELDOUT)
    assert prompt_filter.reason(copy, stopped=True) == "heldout_near_copy"


def test_each_filter_names_its_reason_and_distinct_prompts_pass() -> None:
    known = ["What is the capital of France, and why did it become the capital?"]
    prompt_filter = PromptFilter(SETTINGS, HELDOUT, known)
    cases = {
        "   ": "empty",
        "Hi there": "too_short",
        " ".join(["word"] * 41): "too_long",
        "@@@@ #### $$$$ %%%% 1234": "not_text",
        "I'm sorry, but I cannot help with that request.": "refusal",
        "what is the CAPITAL of france and why did it become the capital": "exact_duplicate",
        "What is the capital of France, and why did it become a capital city?": "near_duplicate",
        "Explain how tides work to a ten year old who loves the beach.": None,
        "Give me three tips for keeping basil alive on a windowsill in winter.": None,
    }
    for text, reason in cases.items():
        assert prompt_filter.reason(text, stopped=True) == reason, text
    assert prompt_filter.reason("Explain how tides work to a ten year old who loves the beach.", True) == (
        "exact_duplicate"
    )
    assert prompt_filter.reason("A prompt that never ended its turn before the limit", stopped=False) == "too_long"


@dataclass
class ScriptedEngine:
    """Hands out a fixed list of continuations in order (the sampling is the real backends' business)."""

    texts: list[str]
    calls: int = 0

    def complete(self, prompts, temperature, seeds, max_new_tokens):  # noqa: ANN001, ANN201
        batch = self.texts[self.calls : self.calls + len(prompts)]
        self.calls += len(prompts)
        return [GenOutput(list(p), [1], t, "stop") for p, t in zip(prompts, batch, strict=False)]


def test_write_prompts_counts_every_candidate_and_stops_at_count() -> None:
    texts = [
        HELDOUT[10],
        "How do I fix a squeaky door hinge without buying anything?",
        "How do I fix a squeaky door hinge without buying anything new?",
        "",
        "Write a limerick about a goat that learns to play chess.",
        "Suggest a weekend itinerary for two days in Lisbon on a budget.",
        "Never reached",
    ]
    settings = SelfPromptParams(count=3, max_candidates=10)
    contexts = lambda i: ([1, 2], f"c{i}")  # noqa: E731
    report = write_prompts(ScriptedEngine(texts), contexts, PromptFilter(settings, HELDOUT), batch_size=6)
    assert report.prompts == [texts[1], texts[4], texts[5]]
    assert report.categories == ["c1", "c4", "c5"]
    assert report.candidates == 6
    assert report.dropped == {**dict.fromkeys(DROP_REASONS, 0), "heldout_near_copy": 1, "near_duplicate": 1, "empty": 1}


def test_user_turn_prefix_is_what_the_template_puts_before_a_user_message(project: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(project / "tiny-verifier")
    prefix = user_turn_prefix(tokenizer, {})
    assert tokenizer.decode(prefix) == "<|im_start|>user\n"


def test_examples_are_shipped_prompts_of_one_category_taken_in_turn(project: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(project / "tiny-verifier")
    shipped = {"math": ["What is 7 times 8?", "Is 91 prime?", "Halve 3/4."], "writing": ["Write a haiku about rain."]}
    contexts = WritingContexts(tokenizer, {}, SelfPromptParams(examples=2, seed=5), shipped)
    written = [contexts(i) for i in range(4)]
    assert [category for _, category in written] == ["self-math", "self-writing", "self-math", "self-writing"]
    first = tokenizer.decode(written[0][0])
    shown = [p for p in shipped["math"] if p in first]
    assert len(shown) == 2 and first.endswith("<|im_start|>user\n") and first.count("<|im_start|>user") == 3
    assert first.count("<|im_start|>assistant\nSure.<|im_end|>") == 2
    assert tokenizer.decode(written[1][0]).count("<|im_start|>user") == 2  # the one prompt a category has
    assert contexts(0) == written[0] and contexts(2) != written[0]  # seeded by the candidate's index
    bare = WritingContexts(tokenizer, {}, SelfPromptParams(), shipped)
    assert bare(3) == (user_turn_prefix(tokenizer, {}), "self")
    with pytest.raises(ExpmanError, match="generate.self_prompts.examples: no train prompt"):
        WritingContexts(tokenizer, {}, SelfPromptParams(examples=2), {})


def teach_user_turns(folder: Path, steps: int = 200) -> None:
    """Train the tiny random verifier a little on short ChatML user turns, so it writes text that ends its turn."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder)
    prompts = [json.loads(line)["prompt"] for line in (REPO / "data/prompts/train.jsonl").read_text().splitlines()]
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False) for p in prompts]
    rows = [ids for ids in tokenizer(texts, add_special_tokens=False)["input_ids"] if len(ids) <= 64]
    batch = torch.full((len(rows), 64), tokenizer.pad_token_id)
    for row, ids in zip(batch, rows, strict=True):
        row[: len(ids)] = torch.tensor(ids)
    labels = batch.masked_fill(batch == tokenizer.pad_token_id, -100)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    torch.manual_seed(0)
    for _ in range(steps):
        pick = torch.randint(len(rows), (16,))
        model(input_ids=batch[pick], labels=labels[pick]).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.save_pretrained(folder)


def test_generate_answers_the_prompts_it_wrote_and_records_what_it_dropped(project: Path) -> None:
    teach_user_turns(project / "tiny-verifier")
    params = yaml.safe_load((project / "params.yaml").read_text())
    params["generate"]["self_prompts"] = {"count": 3, "max_candidates": 64, "max_tokens": 64, "examples": 2}
    (project / "params.yaml").write_text(yaml.safe_dump(params))
    loaded = load_params("params.yaml")
    prepare(loaded, paths.VERIFIER)
    generate(loaded, GeneratePaths.default())
    manifest = json.loads((project / paths.GENERATED / "manifest.json").read_text())
    written = manifest["self_prompts"]
    assert written["settings"]["seed"] == 0 and written["settings"]["near_duplicate"] == 0.7
    assert set(written["dropped"]) == set(DROP_REASONS)
    assert written["kept"] == 3
    assert written["kept"] + sum(written["dropped"].values()) == written["candidates"]
    shipped = {json.loads(line)["category"] for line in (project / "prompts/train.jsonl").read_text().splitlines()}
    assert sum(written["kept_by_category"].values()) == 3
    assert {c.removeprefix("self-") for c in written["kept_by_category"]} <= shipped
    records = read_responses(project / paths.GENERATED, "train")
    self_written = [r for r in records if r["id"].startswith("self-")]
    assert len(self_written) == 3 and len(records) == 13
    heldout = [r["messages"][-2]["content"] for r in read_responses(project / paths.GENERATED, "heldout")]
    guard = PromptFilter(SelfPromptParams(), heldout)
    assert not any(guard.near_heldout(r["messages"][-2]["content"]) for r in self_written)
    first = (project / paths.GENERATED / "self_prompts/prompts.jsonl").read_bytes()
    (project / paths.GENERATE_STATE / "self_prompts/prompts.jsonl.done.json").unlink()
    generate(loaded, GeneratePaths.default())  # written again: the same seed gives the same prompts
    assert (project / paths.GENERATED / "self_prompts/prompts.jsonl").read_bytes() == first
    once_more = loaded.generate.self_prompts.model_copy(update={"sampled_responses": 1})  # the shipped ones: 0
    generate(
        loaded.model_copy(update={"generate": loaded.generate.model_copy(update={"self_prompts": once_more})}),
        GeneratePaths.default(),
    )
    copies = [r["id"] for r in read_responses(project / paths.GENERATED, "train") if "~s" in r["id"]]
    assert copies == [f"{r['id']}~s1" for r in self_written]

    import mlflow

    mlflow.set_tracking_uri(f"sqlite:///{project / 'mlflow.db'}")
    runs = mlflow.search_runs(search_all_experiments=True, output_format="list")
    run = next(r for r in runs if r.data.tags["expman.stage"] == "generate")
    assert run.data.metrics["self_prompts.kept"] == 3
    by_category = {k: v for k, v in run.data.metrics.items() if k.startswith("self_prompts.kept.self-")}
    assert sum(by_category.values()) == 3
    assert run.data.params["self_prompts.seed"] == "0"

    without = loaded.generate.model_copy(update={"self_prompts": SelfPromptParams(count=0)})
    generate(loaded.model_copy(update={"generate": without}), GeneratePaths.default())  # count back to 0
    assert sorted(p.name for p in (project / paths.GENERATED).iterdir() if p.is_dir()) == ["heldout", "train"]
    assert "self_prompts" not in json.loads((project / paths.GENERATED / "manifest.json").read_text())


@pytest.mark.slow
def test_smollm2_writes_prompts_through_vllm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The real verifier writes real user turns: most candidates pass, none is a held-out prompt's near copy."""
    pytest.importorskip("vllm")
    monkeypatch.chdir(tmp_path)
    params = real_smollm2_params(
        tmp_path,
        {"train": 4, "heldout": 96},
        datasets=[{"path": "prompts/train.jsonl"}, {"path": "prompts/heldout.jsonl", "split": "heldout"}],
        max_new_tokens=16,
        backend="vllm",
        self_prompts={"count": 24, "max_candidates": 96},
    )
    loaded = write_params(params)
    prepare(loaded, paths.VERIFIER)
    generate(loaded, GeneratePaths.default())
    written = json.loads((tmp_path / paths.GENERATED / "manifest.json").read_text())["self_prompts"]
    assert written["kept"] == 24, written
    records = read_responses(paths.GENERATED, "train")
    prompts = [r["messages"][-2]["content"] for r in records if r["category"] == "self"]
    assert len(set(prompts)) == 24
    guard = PromptFilter(SelfPromptParams(), HELDOUT)
    assert not any(guard.near_heldout(p) for p in prompts)
