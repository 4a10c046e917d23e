"""dtype: auto chosen by the hardware: bf16 where it is computed natively (CUDA, AVX512-BF16, AMX), fp32 on an
AVX2-only CPU; the choice recorded and named in the speedup target. The CPU's flags are faked to test both kinds."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import expman.devices
from expman.devices import attention_kernels, cpu_flags, dtype_name, precision_facts, resolve_dtype, speedup_target

AVX2_ONLY = frozenset({"sse4_2", "avx", "avx2", "fma"})
AVX512_BF16 = AVX2_ONLY | {"avx512f", "avx512bw", "avx512_bf16"}
AMX = AVX2_ONLY | {"avx512f", "amx_tile", "amx_bf16"}


@pytest.mark.parametrize(
    ("flags", "expected", "why"),
    [(AVX2_ONLY, "float32", "emulated"), (AVX512_BF16, "bfloat16", "avx512_bf16"), (AMX, "bfloat16", "amx_bf16")],
    ids=["avx2-only", "avx512-bf16", "amx"],
)
def test_auto_follows_the_cpus_bf16_support(
    monkeypatch: pytest.MonkeyPatch, flags: frozenset[str], expected: str, why: str
) -> None:
    monkeypatch.setattr(expman.devices, "cpu_flags", lambda: flags)
    assert dtype_name("auto", "cpu") == expected
    assert resolve_dtype("auto", "cpu") == getattr(torch, expected)
    assert precision_facts("cpu", "auto") == {"device": "cpu", "dtype": expected, "cpu_bf16": why}
    assert speedup_target("cpu", "auto") == f"torch-cpu-{expected}-batch1"
    assert dtype_name("auto", "cuda") == "bfloat16"  # every CUDA GPU the stages run on computes bf16
    assert dtype_name("float32", "cpu") == "float32" and dtype_name("bfloat16", "cpu") == "bfloat16"  # as asked


def test_the_speedup_target_always_names_the_dtype() -> None:
    assert speedup_target("cpu", "float32") == "torch-cpu-float32-batch1"
    assert speedup_target("cpu", "bfloat16") == "torch-cpu-bfloat16-batch1"
    assert speedup_target("cuda", "auto") == "torch-cuda-bfloat16-batch1"
    assert speedup_target("cuda", "float32") == "torch-cuda-float32-batch1"


def test_the_flags_are_this_machines() -> None:
    """Read from /proc/cpuinfo as the kernel reports them (where there is none, fp32 is the safe choice)."""
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.is_file():
        assert cpu_flags() == frozenset()
        return
    line = next(line for line in cpuinfo.read_text().splitlines() if line.startswith("flags"))
    assert cpu_flags() == frozenset(line.split(":", 1)[1].split())
    assert dtype_name("auto", "cpu") == ("bfloat16" if {"avx512_bf16", "amx_bf16"} & cpu_flags() else "float32")


@pytest.mark.parametrize("cudnn", [True, False])
def test_cudnn_attention_false_turns_only_sdpa_cudnn_off(cudnn: bool) -> None:
    """cudnn_attention: false (generate's padded generate, evaluate's decode) turns SDPA's cuDNN kernel off and
    flash and memory-efficient on; true leaves torch's choice as it is; both restore it afterwards."""
    cuda = torch.backends.cuda
    before = (cuda.cudnn_sdp_enabled(), cuda.flash_sdp_enabled(), cuda.mem_efficient_sdp_enabled())
    with attention_kernels(cudnn):
        inside = (cuda.cudnn_sdp_enabled(), cuda.flash_sdp_enabled(), cuda.mem_efficient_sdp_enabled())
    assert inside == (before if cudnn else (False, True, True))
    assert (cuda.cudnn_sdp_enabled(), cuda.flash_sdp_enabled(), cuda.mem_efficient_sdp_enabled()) == before
