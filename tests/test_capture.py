"""Hidden-state capture on a tiny random Llama: exactly HF's hidden_states at the configured ids, and targets
lm_head(norm(h)) that reproduce the verifier's logits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from expman.data.extract import CaptureHooks, default_aux_layers


@pytest.fixture(scope="module")
def model(tiny_verifier_source: Path):
    return AutoModelForCausalLM.from_pretrained(tiny_verifier_source, dtype=torch.float32).eval()


def _batch(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(5, vocab, (3, 17), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, 11:] = 0  # right padding, as extract batches
    mask[2, 5:] = 0
    return ids, mask


@pytest.mark.parametrize("aux_layers", [[2, 3, 4], [0, 1, 5], [5, 2, 1]])
def test_aux_states_equal_hf_hidden_states(model, aux_layers: list[int]) -> None:
    ids, mask = _batch(model.config.vocab_size)
    capture = CaptureHooks(model, aux_layers, "pre_norm")
    with torch.inference_mode():
        aux, _, _ = capture(ids, mask)
        reference = model(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
    capture.remove()
    hidden = model.config.hidden_size
    for slot, layer in enumerate(aux_layers):
        got = aux[..., slot * hidden : (slot + 1) * hidden]
        for row in range(ids.shape[0]):
            valid = mask[row].bool()
            torch.testing.assert_close(got[row, valid], reference[layer][row, valid], rtol=0, atol=1e-6)
            # the neighbouring index is a different state: an off-by-one would be caught
            assert not torch.allclose(got[row, valid], reference[layer + 1][row, valid], atol=1e-3)


def test_pre_norm_final_state_reproduces_logits(model) -> None:
    ids, mask = _batch(model.config.vocab_size)
    capture = CaptureHooks(model, default_aux_layers(model.config.num_hidden_layers), "pre_norm")
    with torch.inference_mode():
        _, final, top1 = capture(ids, mask)
        logits = model(input_ids=ids, attention_mask=mask).logits
        rebuilt = model.lm_head(model.model.norm(final))
        double_normed = model.lm_head(model.model.norm(model.model.norm(final)))
    capture.remove()
    valid = mask.bool()
    torch.testing.assert_close(rebuilt[valid], logits[valid], rtol=0, atol=1e-5)
    assert not torch.allclose(double_normed[valid], logits[valid], atol=1e-3)
    # the verifier's greedy token, from its own lm_head, at every real position of the padded batch
    assert top1.dtype == torch.int32
    assert torch.equal(top1[valid].long(), logits[valid].argmax(-1))


def test_post_norm_final_state_is_hf_last_hidden_state(model) -> None:
    ids, mask = _batch(model.config.vocab_size)
    capture = CaptureHooks(model, [1, 2, 3], "post_norm")
    with torch.inference_mode():
        _, final, _ = capture(ids, mask)
        reference = model(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states[-1]
        logits = model(input_ids=ids, attention_mask=mask).logits
    capture.remove()
    valid = mask.bool()
    torch.testing.assert_close(final[valid], reference[valid], rtol=0, atol=1e-6)
    with torch.inference_mode():
        relogits = model.lm_head(final)
    torch.testing.assert_close(relogits[valid], logits[valid], rtol=0, atol=1e-5)


def test_default_aux_layers_match_vllm_convention() -> None:
    assert default_aux_layers(30) == [2, 15, 27]
    assert default_aux_layers(32) == [2, 16, 29]
    assert default_aux_layers(61) == [2, 30, 58]


@pytest.mark.gpu
def test_capture_on_cuda_matches_cpu(tiny_verifier_source: Path) -> None:
    """fp32 on the GPU gives the CPU's states; bf16 (the GPU default) stays within bf16 noise of them."""
    cpu = AutoModelForCausalLM.from_pretrained(tiny_verifier_source, dtype=torch.float32).eval()
    ids, mask = _batch(cpu.config.vocab_size)
    layers = default_aux_layers(cpu.config.num_hidden_layers)
    valid = mask.bool()
    with torch.inference_mode():
        reference = [t[valid] for t in CaptureHooks(cpu, layers, "pre_norm")(ids, mask)]
        for dtype in (torch.float32, torch.bfloat16):
            gpu = AutoModelForCausalLM.from_pretrained(tiny_verifier_source, dtype=dtype).cuda().eval()
            *states, top1 = [t.cpu()[valid] for t in CaptureHooks(gpu, layers, "pre_norm")(ids.cuda(), mask.cuda())]
            for got, want in zip(states, reference[:2], strict=True):
                if dtype == torch.float32:
                    torch.testing.assert_close(got.float(), want, rtol=1e-4, atol=1e-4)
                else:
                    assert torch.nn.functional.cosine_similarity(got.float(), want, dim=-1).min() > 0.99
            # the greedy token: exact in fp32; in bf16 near-ties of a random model may flip a few
            agreement = (top1 == reference[2]).float().mean()
            assert agreement == 1.0 if dtype == torch.float32 else agreement > 0.9


@pytest.mark.gpu
def test_pinned_shard_path_on_cuda_equals_cpu(tiny_verifier_source: Path) -> None:
    """extract_shard on CUDA (asynchronous copies into pinned host memory, event-ordered) writes exactly the rows the
    synchronous CPU path writes, for samples of different lengths in several batches."""
    from expman.data.extract import extract_shard
    from expman.params import ExtractParams

    generator = torch.Generator().manual_seed(2)
    samples = [
        {"id": f"s{k}", "ids": torch.randint(5, 100, (n,), generator=generator).tolist(), "prompt_tokens": 2}
        for k, n in enumerate([40, 33, 33, 20, 7])
    ]
    section = ExtractParams(batch_tokens=80)  # several batches, padded rows
    shards = {}
    for device in ("cpu", "cuda"):
        model = AutoModelForCausalLM.from_pretrained(tiny_verifier_source, dtype=torch.float32).to(device).eval()
        capture = CaptureHooks(model, default_aux_layers(model.config.num_hidden_layers), "pre_norm")
        tensors, copied = extract_shard(capture, samples, section, device)
        assert (copied is None) == (device == "cpu")
        if copied is not None:
            assert tensors["aux_hidden_states"].is_pinned()
            copied.synchronize()
        shards[device] = tensors
    for name, want in shards["cpu"].items():
        torch.testing.assert_close(shards["cuda"][name].float(), want.float(), rtol=1e-2, atol=1e-2, msg=name)


@pytest.mark.parametrize("gpus", [2, 3])
def test_layer_split_places_every_weight_and_spreads_the_layers_in_order(tiny_verifier_source: Path, gpus: int):
    """extract.gpus: every weight of the verifier falls under one entry of the map; the 8 layers go to the GPUs in
    order and evenly; the embedding sits on the first GPU, the (untied) lm_head on the last."""
    from expman.data.verifier import layer_split

    device_map = layer_split(tiny_verifier_source, gpus, trust_remote_code=False)
    model = AutoModelForCausalLM.from_pretrained(tiny_verifier_source)
    for name, _ in model.named_parameters():
        owners = [key for key in device_map if name.startswith(key + ".")]
        assert len(owners) == 1, name
    layers = [device_map[f"model.layers.{i}"] for i in range(8)]
    assert layers == sorted(layers) and set(layers) == set(range(gpus))
    assert max(layers.count(g) for g in range(gpus)) - min(layers.count(g) for g in range(gpus)) <= 1
    assert device_map["model.embed_tokens"] == 0 and device_map["lm_head"] == gpus - 1


def test_more_gpus_than_visible_is_refused_before_loading(tiny_verifier_source: Path, tmp_path: Path) -> None:
    from expman.data.verifier import load_verifier
    from expman.errors import ExpmanError

    (tmp_path / "manifest.json").write_text('{"stage": "prepare", "trust_remote_code": false}')
    with pytest.raises(ExpmanError, match=r"extract.gpus: 64 GPUs asked for, \d+ visible"):
        load_verifier(tmp_path, "cuda" if torch.cuda.is_available() else "cpu", torch.float32, gpus=64)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_verifier_split_over_two_gpus_extracts_what_one_gpu_does(tiny_verifier_source: Path) -> None:
    """extract.gpus: 2: the states of layers on different GPUs are gathered on one, and the event that guards the
    pinned host copies is recorded on that GPU's stream, so the shard equals the one-GPU shard exactly."""
    from expman.data.extract import extract_shard
    from expman.data.verifier import layer_split
    from expman.params import ExtractParams

    generator = torch.Generator().manual_seed(2)
    samples = [
        {"id": f"s{k}", "ids": torch.randint(5, 100, (n,), generator=generator).tolist(), "prompt_tokens": 2}
        for k, n in enumerate([40, 33, 33, 20, 7])
    ]
    section = ExtractParams(batch_tokens=80)
    placements = {"one": {"device_map": {"": 0}}, "two": {"device_map": layer_split(tiny_verifier_source, 2, False)}}
    shards = {}
    for name, placement in placements.items():
        model = AutoModelForCausalLM.from_pretrained(tiny_verifier_source, dtype=torch.float32, **placement).eval()
        capture = CaptureHooks(model, [1, 4, 7], "pre_norm")  # aux layers on both GPUs
        tensors, copied = extract_shard(capture, samples, section, "cuda")
        copied.synchronize()
        shards[name] = tensors
    assert {p.device.index for p in model.parameters()} == {0, 1}
    for name, want in shards["one"].items():
        assert torch.equal(shards["two"][name], want), name
