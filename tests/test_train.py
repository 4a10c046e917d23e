"""train on the tiny verifier: outputs and MLflow curves, a refused bad input, and bit-identical resume."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from expman import paths
from expman.drafter.checkpoint import load_drafter
from expman.drafter.objective import VerifierHead
from expman.errors import ExpmanError
from expman.params import load_params
from expman.paths import TrainPaths
from expman.plots import read_table
from expman.training import train as train_module
from expman.training.train import train
from tests.test_pipeline import run_until


def run_train() -> dict:
    return train(load_params("params.yaml").train, TrainPaths.default())


def test_train_outputs_and_curves(project: Path) -> None:
    run_until("vocab")
    manifest = run_train()
    assert sorted(p.name for p in (project / paths.DRAFTER).iterdir()) == [
        "config.json",
        "manifest.json",
        "model.safetensors",
    ]
    drafter = load_drafter(project / paths.DRAFTER)
    assert drafter.config.aux_layer_ids == (2, 4, 5) and drafter.config.draft_vocab_size == 64
    metrics = json.loads((project / paths.TRAIN_METRICS).read_text())
    assert metrics["val_samples"] > 0 and 1.0 <= metrics["sim_tau_k3"] <= 4.0
    assert metrics == manifest["metrics"]

    import mlflow
    from mlflow import MlflowClient

    mlflow.set_tracking_uri(f"sqlite:///{project / 'mlflow.db'}")
    runs = mlflow.search_runs(search_all_experiments=True, output_format="list")
    by_stage = {r.data.tags["expman.stage"]: r for r in runs}
    train_run = by_stage["train"]
    history = MlflowClient().get_metric_history(train_run.info.run_id, "train/loss")
    assert len(history) >= 2  # a curve, not a single point
    for name in ("train/cond_acc_2", "train/sim_tau_k3", "lr", "tok_per_s", "val/acc_0", "val/sim_tau_k1", "val/loss"):
        assert name in train_run.data.metrics, name
    assert [a.path for a in MlflowClient().list_artifacts(train_run.info.run_id, "figures")] == ["figures/train.png"]
    waits = MlflowClient().get_metric_history(train_run.info.run_id, "epoch_input_wait")
    assert sorted(m.step for m in waits) == [0, 1] and all(0.0 <= m.value < 1.0 for m in waits)

    assert train_run.data.tags["expman.upstream.extract.run_id"] == by_stage["extract"].info.run_id
    assert train_run.data.tags["expman.upstream.vocab.run_id"] == by_stage["vocab"].info.run_id

    # the curves dvc plots draws: one row per logging window (log_every 2, and the last step), one per epoch
    steps = read_table(project / paths.TRAIN_PLOTS / "steps.csv")
    heldout = read_table(project / paths.TRAIN_PLOTS / "heldout.csv")
    total = metrics["steps"]
    assert [row["step"] for row in steps] == sorted({*range(2, total + 1, 2), total})
    assert list(steps[0]) == ["step", "loss", "acc_0", "acc_1", "acc_2", "sim_tau_k1", "sim_tau_k2", "sim_tau_k3"]
    logged = [m.value for m in sorted(history, key=lambda m: m.step)]
    assert [row["loss"] for row in steps] == pytest.approx(logged, rel=1e-5)
    assert len(heldout) == 2 and heldout[-1]["step"] == total
    assert heldout[-1]["acc_0"] == pytest.approx(metrics["acc_0"], rel=1e-5)
    assert heldout[-1]["loss"] == pytest.approx(metrics["loss"], rel=1e-5)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_train_records_each_gpus_peak_memory(project: Path, device: str) -> None:
    """On CUDA the stage records what each process's GPU had to hold (manifest ``gpu_peak_gib`` by rank, and
    ``gpu<rank>/peak_gib`` in MLflow): the number that tells a team whether the drafter needs FSDP. None on CPU."""
    from mlflow import MlflowClient

    run_until("vocab")
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    eager = {"device": device, "compile": False}  # on CUDA flex attention needs heads of 16+; the tiny verifier's are 8
    manifest = train(load_params("params.yaml").train.model_copy(update=eager), TrainPaths.default())
    metrics = MlflowClient(f"sqlite:///{project / 'mlflow.db'}").get_run(manifest["provenance"]["mlflow_run_id"])
    recorded = {k: v for k, v in metrics.data.metrics.items() if k.endswith("/peak_gib")}
    if device == "cpu":
        assert "gpu_peak_gib" not in manifest and not recorded
        return
    peaks = manifest["gpu_peak_gib"]
    assert len(peaks) == 1 and 0 < peaks[0] <= torch.cuda.max_memory_allocated() / 2**30
    assert recorded == {"gpu0/peak_gib": pytest.approx(peaks[0])}


def test_a_slow_feed_shows_as_input_wait(project: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """epoch_input_wait: the share of an epoch the steps spent waiting for batches; a feed held back 250 ms a batch
    (far longer than a tiny step, even on a loaded 2-core machine, where 50 ms was not) fills most of it."""
    import time

    from mlflow import MlflowClient

    run_until("vocab")
    real_feed = train_module._feed

    class HeldBack:
        def __init__(self, feed) -> None:
            self.feed = feed

        def __iter__(self):
            for batch in self.feed:
                time.sleep(0.25)
                yield batch

        def close(self) -> None:
            self.feed.close()

    monkeypatch.setattr(train_module, "_feed", lambda *args, **kwargs: HeldBack(real_feed(*args, **kwargs)))
    manifest = run_train()
    waits = MlflowClient().get_metric_history(manifest["provenance"]["mlflow_run_id"], "epoch_input_wait")
    assert len(waits) == 2 and all(m.value > 0.5 for m in waits)


@pytest.mark.parametrize("crash_at", [5, 9])  # objective calls: in epoch 0, and in epoch 1 past a checkpoint
def test_train_resumes_bit_identical(project: Path, monkeypatch: pytest.MonkeyPatch, crash_at: int) -> None:
    run_until("vocab")
    manifest = run_train()
    assert manifest["metrics"]["steps"] >= 8
    uninterrupted = load_file(str(project / paths.DRAFTER / "model.safetensors"))
    curves = {name: (project / paths.TRAIN_PLOTS / name).read_bytes() for name in ("steps.csv", "heldout.csv")}
    shutil.rmtree(project / paths.DRAFTER)
    shutil.rmtree(project / paths.TRAIN_STATE)
    shutil.rmtree(project / paths.TRAIN_PLOTS)

    real = train_module.ttt_loss
    calls = []

    def crash(*args, **kwargs):
        calls.append(1)
        if len(calls) == crash_at:  # states are saved every 3 steps
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(train_module, "ttt_loss", crash)
    with pytest.raises(KeyboardInterrupt):
        run_train()
    assert not (project / paths.DRAFTER).exists()
    monkeypatch.setattr(train_module, "ttt_loss", real)
    run_train()
    resumed = load_file(str(project / paths.DRAFTER / "model.safetensors"))
    assert resumed.keys() == uninterrupted.keys()
    for name, tensor in uninterrupted.items():
        assert torch.equal(resumed[name], tensor), name
    for name, content in curves.items():  # the whole curve, the part before the crash and its open window too
        assert (project / paths.TRAIN_PLOTS / name).read_bytes() == content, name


def test_noise_std_changes_the_training(project: Path) -> None:
    """train.noise_std reaches the loss: the same run without noise ends with other weights."""
    run_until("vocab")
    trained = {}
    for noise_std in (0.0, 0.05):
        shutil.rmtree(project / paths.DRAFTER, ignore_errors=True)
        shutil.rmtree(project / paths.TRAIN_STATE, ignore_errors=True)
        params = yaml.safe_load((project / "params.yaml").read_text())
        params["train"].update(noise_std=noise_std, epochs=1)
        (project / "params.yaml").write_text(yaml.safe_dump(params))
        run_train()
        trained[noise_std] = load_file(str(project / paths.DRAFTER / "model.safetensors"))["fc.weight"]
    assert (trained[0.05] - trained[0.0]).abs().max() > 1e-6


def test_fc_init_top_aux_passes_the_highest_captured_layer_through(project: Path) -> None:
    """train.fc_init: top_aux starts fc as the identity on the highest aux layer, wherever the list puts it."""
    params = yaml.safe_load((project / "params.yaml").read_text())
    params["extract"]["aux_layers"] = [5, 1, 3]
    (project / "params.yaml").write_text(yaml.safe_dump(params))
    run_until("vocab")
    section = load_params("params.yaml").train
    contract = json.loads((project / paths.EXTRACT / "manifest.json").read_text())["contract"]
    vocab = load_file(str(project / paths.VOCAB / "vocab.safetensors"))
    head = VerifierHead.load(paths.VERIFIER, vocab["t2d"])
    drafters = {
        init: train_module._new_drafter(
            paths.VERIFIER, head, contract, vocab, section.model_copy(update={"fc_init": init})
        )
        for init in ("random", "top_aux")
    }
    hidden = drafters["random"].fc.out_features
    aux = torch.randn(4, 3 * hidden)
    with torch.no_grad():
        assert torch.equal(drafters["top_aux"].fc(aux), aux[:, :hidden])  # layer 5 is listed first
        assert not torch.allclose(drafters["random"].fc(aux), aux[:, :hidden], atol=1e-2)


def test_bfloat16_on_cpu_trains_under_autocast_with_fp32_weights(
    project: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """train.dtype: bfloat16 runs the CPU matmuls in bf16 (autocast); auto does so only on a CPU with native bf16
    (the CPU's flags faked here: AVX2 only, then AVX512-BF16). Weights stay fp32; the manifest records the choice."""
    import expman.devices

    run_until("vocab")
    seen: dict[str, set] = {}
    real = train_module.training_step

    def recording(drafter, *args, **kwargs):
        hook = drafter.fc.register_forward_hook(lambda _m, _i, out: seen[case].add(out.dtype))
        try:
            return real(drafter, *args, **kwargs)
        finally:
            hook.remove()

    monkeypatch.setattr(train_module, "training_step", recording)
    cases = {"auto/avx2": ("auto", {"avx2"}), "auto/bf16": ("auto", {"avx512_bf16"})}
    cases["bf16/avx2"] = ("bfloat16", {"avx2"})
    for case, (dtype, flags) in cases.items():
        monkeypatch.setattr(expman.devices, "cpu_flags", lambda flags=flags: frozenset(flags))
        seen[case] = set()
        shutil.rmtree(project / paths.DRAFTER, ignore_errors=True)
        shutil.rmtree(project / paths.TRAIN_STATE, ignore_errors=True)
        params = yaml.safe_load((project / "params.yaml").read_text())
        params["train"].update(dtype=dtype, epochs=1, device="cpu")
        (project / "params.yaml").write_text(yaml.safe_dump(params))
        manifest = run_train()
        assert 1.0 <= manifest["metrics"]["sim_tau_k3"] <= 4.0
        assert manifest["precision"]["dtype"] == str(next(iter(seen[case]))).removeprefix("torch.")
        weights = load_file(str(project / paths.DRAFTER / "model.safetensors"))
        assert {w.dtype for w in weights.values() if w.is_floating_point()} == {torch.float32}
    assert seen == {"auto/avx2": {torch.float32}, "auto/bf16": {torch.bfloat16}, "bf16/avx2": {torch.bfloat16}}


def test_features_from_another_verifier_are_refused(project: Path) -> None:
    run_until("vocab")
    manifest_path = project / paths.EXTRACT / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["contract"]["verifier"]["hidden_size"] = 64
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(ExpmanError, match="features were captured from another verifier"):
        run_train()
    assert not (project / paths.DRAFTER).exists()


def _use_finetune(project: Path, source: str) -> None:
    params = yaml.safe_load((project / "params.yaml").read_text())
    params["train"]["finetune_from"] = source
    (project / "params.yaml").write_text(yaml.safe_dump(params))


def test_finetune_starts_from_a_compatible_drafter(project: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run_until("vocab")
    run_train()
    shutil.copytree(project / paths.DRAFTER, project / "base-drafter")
    base = load_file(str(project / "base-drafter/model.safetensors"))
    _use_finetune(project, "base-drafter")
    seen = []
    real = train_module.training_step
    monkeypatch.setattr(
        train_module,
        "training_step",
        lambda drafter, *a: (seen.append(drafter.fc.weight.detach().clone()), real(drafter, *a))[1],
    )
    manifest = run_train()
    assert torch.equal(seen[0], base["fc.weight"])  # the first step starts from the base weights
    assert manifest["upstream"]["finetune_from"]["manifest"] == "base-drafter"


def test_finetune_from_weights_split_over_two_files(project: Path) -> None:
    """A drafter whose weights are split over several safetensors files (as exported checkpoints often are) is an
    input like any other: it loads, and the manifest names it by the digest of all its files."""
    from safetensors.torch import save_file

    from expman.drafter.checkpoint import weights_sha256

    run_until("vocab")
    run_train()
    source = project / "split-drafter"
    shutil.copytree(project / paths.DRAFTER, source)
    tensors = load_file(str(source / "model.safetensors"))
    (source / "model.safetensors").unlink()
    names = sorted(tensors)
    for index, part in enumerate((names[::2], names[1::2]), start=1):
        save_file({name: tensors[name] for name in part}, str(source / f"model-0000{index}-of-00002.safetensors"))
    shutil.rmtree(project / paths.DRAFTER)
    _use_finetune(project, "split-drafter")
    manifest = run_train()
    entry = manifest["upstream"]["finetune_from"]
    assert entry == {"manifest": "split-drafter", "manifest_sha256": weights_sha256(source)}
    assert len(entry["manifest_sha256"]) == 64


def test_incompatible_finetune_source_is_refused_naming_the_differences(project: Path) -> None:
    run_until("vocab")
    run_train()
    source = project / "other-drafter"
    shutil.copytree(project / paths.DRAFTER, source)
    config = json.loads((source / "config.json").read_text())
    config["eagle_aux_hidden_state_layer_ids"] = [3, 4, 5]
    (source / "config.json").write_text(json.dumps(config))
    tensors = load_file(str(source / "model.safetensors"))
    chosen = torch.nonzero(tensors["t2d"]).flatten()
    unused = torch.nonzero(~tensors["t2d"]).flatten()[:1]
    moved = torch.cat([chosen[1:], unused]).sort().values  # one draft id now maps to another token
    tensors["t2d"] = torch.zeros_like(tensors["t2d"])
    tensors["t2d"][moved] = True
    tensors["d2t"] = moved - torch.arange(len(moved))
    from safetensors.torch import save_file

    save_file(tensors, str(source / "model.safetensors"))
    shutil.rmtree(project / paths.DRAFTER)
    _use_finetune(project, "other-drafter")
    with pytest.raises(ExpmanError) as caught:
        run_train()
    message = str(caught.value)
    assert message.startswith("train.finetune_from: other-drafter is incompatible: d2t maps ")
    assert "aux_layer_ids [3, 4, 5] != [2, 4, 5]" in message
    assert not (project / paths.DRAFTER).exists()


def test_missing_finetune_source_is_refused_before_training(project: Path) -> None:
    run_until("vocab")
    _use_finetune(project, "no-such-drafter")
    with pytest.raises(ExpmanError, match=r"^train.finetune_from: no-such-drafter: not a drafter checkpoint folder"):
        run_train()
    assert not (project / paths.DRAFTER).exists()


TORCHRUN = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
TRAIN_SCRIPT = Path(__file__).resolve().parents[1] / "stages/train.py"


def _train_process(
    project: Path, accumulate: int, launcher: list[str], fsdp: bool = False, script: Path = TRAIN_SCRIPT, **keys
) -> dict[str, torch.Tensor]:
    """Run the train stage's ``script`` from scratch with ``train.accumulate`` (and ``keys``) under ``launcher``;
    its weights."""
    _set_train(project, accumulate=accumulate, noise_std=0.0, fsdp=fsdp, **keys)
    done = _run(launcher, script, project)
    assert done.returncode == 0, done.stderr[-3000:]
    return load_file(str(project / paths.DRAFTER / "model.safetensors"))


def _set_train(project: Path, **keys) -> None:
    """params.yaml's train section updated with ``keys``; no output or resume state left from an earlier run."""
    for folder in (paths.DRAFTER, paths.TRAIN_STATE):
        shutil.rmtree(project / folder, ignore_errors=True)
    params = yaml.safe_load((project / "params.yaml").read_text())
    params["train"] = {k: v for k, v in params["train"].items() if k not in ("gpus", "nodes", "rdzv_endpoint")}
    params["train"].update(keys)
    (project / "params.yaml").write_text(yaml.safe_dump(params))


def _run(launcher: list[str], script: Path, project: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *launcher, str(script)], capture_output=True, text=True, cwd=project)


@pytest.mark.integration
def test_train_gpus_2_starts_itself_under_torchrun_and_matches_one_process(project: Path) -> None:
    """``train.gpus: 2`` (gloo processes on CPU) with accumulate 1: the stage starts itself under torchrun, makes
    the same updates as 1 process with accumulate 2, logs the same curves (the global batch's metrics, not the
    first process's share) and leaves one model, one manifest and one MLflow run."""
    run_until("vocab")
    single = _train_process(project, 2, [])
    steps = json.loads((project / paths.TRAIN_METRICS).read_text())["steps"]
    curves = read_table(project / paths.TRAIN_PLOTS / "steps.csv")
    pair = _train_process(project, 1, [], gpus=2)
    manifest = json.loads((project / paths.DRAFTER / "manifest.json").read_text())
    assert json.loads((project / paths.TRAIN_METRICS).read_text())["steps"] == steps
    pair_curves = read_table(project / paths.TRAIN_PLOTS / "steps.csv")
    assert [row["step"] for row in pair_curves] == [row["step"] for row in curves]
    for name in ("loss", "acc_0", "acc_2"):
        assert [row[name] for row in pair_curves] == pytest.approx([row[name] for row in curves], rel=1e-4), name
    assert manifest["params"]["gpus"] == 2
    assert single.keys() == pair.keys()
    moved = single["fc.weight"] - _train_process(project, 1, [])["fc.weight"]
    assert moved.abs().max() > 1e-4  # a different global batch trains differently: the comparison can fail
    for name, tensor in single.items():
        torch.testing.assert_close(pair[name], tensor, rtol=1e-4, atol=1e-5, msg=name)

    import mlflow

    mlflow.set_tracking_uri(f"sqlite:///{project / 'mlflow.db'}")
    runs = mlflow.search_runs(search_all_experiments=True, output_format="list")
    train_runs = [r for r in runs if r.data.tags["expman.stage"] == "train"]
    assert sorted(r.data.params["gpus"] for r in train_runs) == ["1", "1", "2"]  # one run per stage execution


@pytest.mark.integration
def test_two_hosts_meet_at_a_rendezvous_and_match_one_process(project: Path) -> None:
    """``train.nodes: 2``: two stage processes ("hosts", here both on localhost) meet at the c10d rendezvous of
    ``rdzv_endpoint``; the global batch spans both, as one process with accumulate 2."""
    import socket

    run_until("vocab")
    single = _train_process(project, 2, [])
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    _set_train(project, accumulate=1, noise_std=0.0, fsdp=False, nodes=2, rdzv_endpoint=f"127.0.0.1:{port}")
    hosts = [
        subprocess.Popen(
            [sys.executable, str(TRAIN_SCRIPT)], cwd=project, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    for host in hosts:
        _, err = host.communicate(timeout=600)
        assert host.returncode == 0, err[-3000:]
    pair = load_file(str(project / paths.DRAFTER / "model.safetensors"))
    for name, tensor in single.items():
        torch.testing.assert_close(pair[name], tensor, rtol=1e-4, atol=1e-5, msg=name)


CRASHING_TRAIN = """
import runpy, sys
from expman.training import train
real, calls = train.ttt_loss, []
def crash(*args, **kwargs):
    calls.append(1)
    if len(calls) == {crash_at}:
        sys.exit(3)  # as a kill would: no output, only the last checkpoint's state
    return real(*args, **kwargs)
train.ttt_loss = crash
runpy.run_path({script!r}, run_name="__main__")
"""


@pytest.mark.integration
def test_fsdp_matches_one_process_and_resumes_after_a_kill(project: Path, tmp_path: Path) -> None:
    """FSDP over 2 processes (gloo on CPU), accumulate 1: the same updates as 1 process with accumulate 2, also
    in a step where one process has no batch of its own; killed past a checkpoint, it resumes to the same end."""
    run_until("vocab")
    params = yaml.safe_load((project / "params.yaml").read_text())
    params["train"].update(epochs=3)  # odd micro-batch counts: some epoch ends in a step of one micro-batch
    (project / "params.yaml").write_text(yaml.safe_dump(params))
    # in fp32: under bf16 autocast FSDP gathers the weights in bf16, which one process does not (README, FSDP)
    single = _train_process(project, 2, [], dtype="float32")
    sharded = _train_process(project, 1, TORCHRUN, fsdp=True, dtype="float32")
    assert single.keys() == sharded.keys()
    for name, tensor in single.items():
        torch.testing.assert_close(sharded[name], tensor, rtol=1e-4, atol=1e-5, msg=name)

    crashing = tmp_path / "crashing_train.py"
    crashing.write_text(CRASHING_TRAIN.format(crash_at=9, script=str(TRAIN_SCRIPT)))
    shutil.rmtree(project / paths.DRAFTER)
    shutil.rmtree(project / paths.TRAIN_STATE)
    assert _run(TORCHRUN, crashing, project).returncode != 0
    assert not (project / paths.DRAFTER).exists()
    assert torch.load(project / paths.TRAIN_STATE / "state.pt", weights_only=True)["step"] >= 3
    done = _run(TORCHRUN, TRAIN_SCRIPT, project)
    assert done.returncode == 0, done.stderr[-3000:]
    resumed = load_file(str(project / paths.DRAFTER / "model.safetensors"))
    for name, tensor in sharded.items():
        assert torch.equal(resumed[name], tensor), name


def test_norm_before_residual_is_a_recipe_choice_the_export_records(project: Path) -> None:
    run_until("vocab")
    params = yaml.safe_load((project / "params.yaml").read_text())
    params["train"].update(norm_before_residual=True, epochs=1)
    (project / "params.yaml").write_text(yaml.safe_dump(params))
    run_train()
    assert json.loads((project / paths.DRAFTER / "config.json").read_text())["norm_before_residual"] is True
    assert load_drafter(project / paths.DRAFTER).config.norm_before_residual


def test_an_eagle_baseline_without_norm_before_residual_imports_as_the_engines_read_it(project: Path) -> None:
    """An AQ-MedAI-style EAGLE baseline (no norm_before_residual, no recorded convention): imported as False, the
    value vLLM and SGLang read for that format, written out and recorded on the registered version."""
    from expman.drafter.checkpoint import export_eagle
    from expman.registry.reader import open_registry
    from expman.training.baseline import baseline

    run_until("vocab")
    params = yaml.safe_load((project / "params.yaml").read_text())
    params["train"].update(norm_before_residual=True, epochs=1)  # stated True; the import must not keep it
    (project / "params.yaml").write_text(yaml.safe_dump(params))
    run_train()
    export_eagle(load_drafter(project / paths.DRAFTER), project / "aq", "vllm")
    config = json.loads((project / "aq/config.json").read_text())
    del config["norm_before_residual"], config["expman_layer_convention"]
    (project / "aq/config.json").write_text(json.dumps(config))
    params["baseline"].update(source="aq", layer_convention="vllm")
    (project / "params.yaml").write_text(yaml.safe_dump(params))
    made = baseline(load_params("params.yaml"), TrainPaths.baseline())
    assert json.loads((project / paths.BASELINE / "config.json").read_text())["norm_before_residual"] is False
    registered = made["provenance"]["registered"]
    tags = open_registry().version(registered["name"], registered["version"]).tags
    assert tags["expman.import.norm_before_residual"] == "false"
    assert tags["expman.import.norm_before_residual_defaulted"] == "true"
