"""Where the verifier and the drafters run and in what precision: ``device: auto`` and ``dtype: auto`` resolved the
same way in every stage, and the speedup target named after the result.

``dtype: auto`` is bfloat16 where the hardware computes it natively (CUDA, and CPUs with AVX512-BF16 or AMX-BF16)
and float32 elsewhere: on an AVX2-only CPU bf16 matmuls are emulated, about 6x slower than fp32 (measured 7 against
45 GFLOP/s), while on an AVX512-BF16 CPU bf16 is the faster one (benchmarks/results/round_cost_cpu.json)."""

from __future__ import annotations

import contextlib
import functools
from pathlib import Path
from typing import Any

from expman.errors import ExpmanError

NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})
"""/proc/cpuinfo flags of a CPU that computes bf16 in hardware (x86: AVX512-BF16 or AMX-BF16)."""


@functools.cache
def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags as Linux reports them (empty where /proc/cpuinfo is absent: then fp32 is chosen)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    line = next((line for line in text.splitlines() if line.startswith("flags")), "")
    return frozenset(line.partition(":")[2].split())


def native_bf16() -> bool:
    """Whether this CPU computes bf16 in hardware."""
    return bool(NATIVE_BF16_FLAGS & cpu_flags())


def resolve_device(device: str) -> str:
    """auto → cuda when available, else cpu; an explicit cuda without a GPU is an error."""
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ExpmanError("device: cuda requested but torch sees no CUDA device")
    return device


def dtype_name(dtype: str, device: str) -> str:
    """The compute dtype ``dtype`` means on ``device``: auto → bfloat16 on CUDA and on a CPU with native bf16,
    float32 elsewhere; an explicit name stays as it is."""
    if dtype != "auto":
        return dtype
    return "bfloat16" if device == "cuda" or native_bf16() else "float32"


def compiles(setting: str | bool, device: str) -> bool:
    """Whether a ``compile`` setting (``train.compile``, ``benchmark.compile``) compiles on ``device``: auto → on
    CUDA only (on CPU the compile warmup outlasted the work it sped up); true or false as given."""
    return device == "cuda" if setting == "auto" else bool(setting)


def resolve_dtype(dtype: str, device: str) -> Any:
    """``dtype_name`` as a torch dtype."""
    import torch

    return getattr(torch, dtype_name(dtype, device))


def precision_facts(device: str, dtype: str) -> dict[str, str]:
    """What a manifest and an MLflow run record of a stage's resolved device and dtype (and, on CPU, why)."""
    facts = {"device": device, "dtype": dtype_name(dtype, device)}
    if device == "cpu":
        facts["cpu_bf16"] = ",".join(sorted(NATIVE_BF16_FLAGS & cpu_flags())) or "emulated"
    return facts


def speedup_target(device: str, dtype: str) -> str:
    """The target a speedup was measured on, as the promote gate names it: the device and the compute dtype
    (a bf16 speedup on CPU says nothing about fp32 serving there)."""
    return f"torch-{device}-{dtype_name(dtype, device)}-batch1"


def attention_kernels(cudnn: bool) -> contextlib.AbstractContextManager[Any]:
    """SDPA's kernels for decoding: torch's own choice (cuDNN on Hopper), or all but cuDNN. cuDNN builds a plan for
    each new shape and a decode step is one (the key length grows by one), so a decode that meets new shapes pays
    it at every step (``generate.cudnn_attention``, ``evaluate.cudnn_attention``; docs/performance.md "Generation")."""
    if cudnn:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])
