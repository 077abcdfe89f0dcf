"""One validated, read-only config dataclass per component (STYLE.md §5).

CLI flags map one to one onto these fields (``--max-model-len`` -> ``max_model_len``).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import subprocess
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

# NOTE: torch is imported where a dtype or the device is needed, not here: the sentinel and
# the API process read configs without touching torch (its import is seconds on a loaded
# host, paid in series down the process tree at every start).

logger = logging.getLogger(__name__)


class ConfigError(ValueError):
    """A configuration that cannot work; the message says what would be accepted.

    A user error: ``bastion`` prints its message as one line and exits with status 2."""


# dtype names -> the torch dtype's attribute name
_DTYPES = {"float32": "float32", "float16": "float16", "bfloat16": "bfloat16",
           "fp32": "float32", "fp16": "float16", "bf16": "bfloat16",
           "half": "float16", "float": "float32"}


def dtype_name(name: str, device: str) -> str:
    """The torch dtype a ``dtype`` setting means, by name: ``auto`` is bfloat16 on a GPU and
    float32 on the CPU."""
    if name == "auto":
        return "bfloat16" if device == "cuda" else "float32"
    if name not in _DTYPES:
        raise ConfigError(f"dtype must be one of auto, {', '.join(_DTYPES)}; got {name!r}")
    return _DTYPES[name]


def parse_dtype(name: str, device: str) -> torch.dtype:
    import torch

    return getattr(torch, dtype_name(name, device))


def default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


@dataclass(frozen=True)
class ModelConfig:
    """Which weights to run and how.

    ``model`` is a GGUF file, a Hugging Face folder (config.json + safetensors), or ``None`` for
    the embedded SmolLM2-135M-Instruct GGUF. ``load_format="dummy"`` builds random weights from
    the folder's config.json alone.

    ``served_model_name``: the names clients may send as ``model`` (the first is the one answers
    and ``/metrics`` carry); empty: a name derived from the model. ``chat_template``: a file, or
    the template itself (vLLM's rule: text with ``{``, ``}`` or a newline is a template).
    ``generation_config`` (vLLM's semantics): ``auto`` takes default sampling parameters from
    the model's generation_config.json, ``vllm`` ignores it, a folder names where to read it.

    ``quantization`` (a GGUF file on the CPU): ``gguf`` keeps its quantized weights quantized
    (int4/int8 weight-only matmuls, layers/quantization.py), ``none`` dequantizes them into
    ``dtype`` at load, ``auto`` is ``gguf`` unless ``dtype`` names float32 or float16 (float32 is
    the exact path the parity tests take) or the CPU lacks native bfloat16. ``dtype`` remains the
    activations' dtype: ``auto`` on the CPU is float32.
    """

    model: str | None = None
    tokenizer: str | None = None
    load_format: str = "auto"  # auto | gguf | hf | dummy
    dtype: str = "auto"
    device: str = field(default_factory=default_device)
    quantization: str = "auto"  # auto | gguf | none
    max_model_len: int | None = None  # None: the model's own limit
    seed: int = 0
    served_model_name: tuple[str, ...] = ()
    chat_template: str | None = None
    generation_config: str = "auto"
    skip_tokenizer_init: bool = False
    enforce_eager: bool = False  # no CUDA graphs (debugging, or collectives graphs cannot hold)
    hf_overrides: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.load_format not in ("auto", "gguf", "hf", "dummy"):
            raise ConfigError(f"load_format must be auto, gguf, hf or dummy; got {self.load_format!r}")
        if self.device not in ("cpu", "cuda"):
            raise ConfigError(f"device must be cpu or cuda; got {self.device!r}")
        dtype_name(self.dtype, self.device)
        if self.quantization not in ("auto", "gguf", "none"):
            raise ConfigError(f"quantization must be auto, gguf or none; got {self.quantization!r}")
        if self.quantization == "gguf" and self.device != "cpu":
            raise ConfigError("quantization=gguf runs on the CPU only (on a GPU GGUF weights are "
                              "dequantized into dtype); use auto or none")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ConfigError(f"max_model_len must be positive; got {self.max_model_len}")
        if self.model is not None and not os.path.exists(self.model):
            raise ConfigError(f"model path {self.model!r} does not exist (bastion never downloads "
                              "weights: pass a GGUF file or a Hugging Face folder)")
        if self.tokenizer is not None and not os.path.exists(self.tokenizer):
            raise ConfigError(f"tokenizer path {self.tokenizer!r} does not exist (pass a folder "
                              "holding tokenizer.json / tokenizer_config.json)")
        names = self.served_model_name
        names = (names,) if isinstance(names, str) else tuple(names or ())
        if any(not name for name in names):
            raise ConfigError("served_model_name must not be empty")
        object.__setattr__(self, "served_model_name", names)
        if self.chat_template is not None and not is_inline_template(self.chat_template) \
                and not os.path.isfile(self.chat_template):
            raise ConfigError(f"chat_template {self.chat_template!r} is neither a file nor a "
                              "template (a template holds '{', '}' or a newline)")
        if self.generation_config not in ("auto", "vllm") and not os.path.isdir(
                self.generation_config):
            raise ConfigError("generation_config must be auto, vllm or a folder holding "
                              f"generation_config.json; got {self.generation_config!r}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return parse_dtype(self.dtype, self.device)


def is_inline_template(value: str) -> bool:
    """vLLM's test for ``--chat-template``: Jinja text, not a path."""
    return any(c in value for c in "{}\n")


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache. ``kv_cache_memory_bytes`` overrides ``gpu_memory_utilization``
    (on the CPU it is the budget, default 1 GiB). ``num_gpu_blocks_override`` fixes the pool size
    (tests use it to force preemption)."""

    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None
    num_gpu_blocks_override: int | None = None
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128, 256):
            raise ConfigError(f"block_size must be a power of two up to 256; got {self.block_size}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError("gpu_memory_utilization must be in (0, 1]; "
                              f"got {self.gpu_memory_utilization}")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 1:
            raise ConfigError("num_gpu_blocks_override must be positive")
        if self.kv_cache_dtype != "auto":
            # NOTE: an FP8 cache would change outputs and memory, so it is refused, not ignored.
            raise ConfigError(f"kv_cache_dtype {self.kv_cache_dtype!r} is not supported (the KV "
                              "cache is kept in the model's dtype); use auto")


@dataclass(frozen=True)
class SchedulerConfig:
    """``max_num_batched_tokens`` None: ``build_engine_config`` picks vLLM's default for the
    device and the entry point (``default_max_num_batched_tokens``)."""

    max_num_batched_tokens: int | None = None
    max_num_seqs: int = 256
    enable_chunked_prefill: bool = True
    policy: str = "fcfs"  # fcfs | priority
    async_scheduling: bool = True  # schedule step N+1 while step N runs (off: --no-async-scheduling)

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ConfigError("max_num_batched_tokens must be positive")
        if self.max_num_seqs < 1:
            raise ConfigError("max_num_seqs must be positive")
        if self.policy not in ("fcfs", "priority"):
            raise ConfigError(f"scheduling policy must be fcfs or priority; got {self.policy!r}")


@dataclass(frozen=True)
class ParallelConfig:
    """``cpu_threads``: torch threads per worker on the CPU; None: ``cpu_threads_per_worker``'s
    share of the cores this process may use. ``distributed_executor_backend`` (offline ``LLM``,
    as vLLM's): ``uni`` runs the one worker in the engine's process, ``mp`` runs worker
    processes; None: ``uni`` for one device, ``mp`` for more. A server always runs worker
    processes."""

    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    data_parallel_rank: int | None = None  # set: external load-balancer mode, one rank per server
    data_parallel_address: str = "127.0.0.1"
    data_parallel_rpc_port: int = 29550
    enable_expert_parallel: bool = False
    distributed_timeout_s: float = 30.0
    cpu_threads: int | None = None
    distributed_executor_backend: str | None = None

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1 or self.data_parallel_size < 1:
            raise ConfigError("tensor_parallel_size and data_parallel_size must be positive")
        if self.distributed_executor_backend not in (None, "uni", "mp"):
            raise ConfigError(f"distributed_executor_backend must be 'uni' or 'mp'; got "
                              f"{self.distributed_executor_backend!r}")
        if self.distributed_executor_backend == "uni" and self.tensor_parallel_size > 1:
            raise ConfigError("distributed_executor_backend 'uni' runs one worker; "
                              f"tensor_parallel_size is {self.tensor_parallel_size}")
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise ConfigError(f"cpu_threads must be positive; got {self.cpu_threads}")
        if self.data_parallel_rank is not None and not (
                0 <= self.data_parallel_rank < self.data_parallel_size):
            raise ConfigError(f"data_parallel_rank must be in [0, {self.data_parallel_size}); "
                              f"got {self.data_parallel_rank}")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.data_parallel_size

    @property
    def is_dp_coupled(self) -> bool:
        """The DP engines step in lockstep (MoE with expert parallelism over the DP ranks), so
        they pause and recover as one group; dense DP engines share nothing."""
        return self.data_parallel_size > 1 and self.enable_expert_parallel


def cpu_threads_per_worker(parallel: ParallelConfig) -> int:
    """Torch threads of one worker process: ``parallel.cpu_threads``, else the cores this
    process may use (its affinity, not the host's count: a container or ``taskset`` gives
    fewer) less one for the API, engine and sentinel processes, split over the workers.

    # NOTE: on a 2-core host two OpenMP threads per worker made a served step ~20x slower once
    the API got busy. (The offline ``LLM`` runs its model in the caller's process and leaves
    its thread pool alone unless ``cpu_threads`` is given.)
    """
    if parallel.cpu_threads is not None:
        return parallel.cpu_threads
    cores = len(os.sched_getaffinity(0))
    return max(1, (cores - 1) // parallel.world_size)


MAX_WARM_SPARES = 4


@dataclass(frozen=True)
class FaultToleranceConfig:
    """Sentinels: detection bounds and the recovery policy."""

    ft_auto_recovery: bool = True  # sentinels run retry/reinit themselves
    ft_max_attempts: int = 3  # recovery attempts per fault before the group is declared dead
    ft_backoff_s: float = 1.0  # wait before attempt k is backoff * 2**(k-1)
    ft_recovery_timeout_s: float = 120.0  # one attempt (pause, restart, regroup) must fit in it
    ft_hang_timeout_s: float = 30.0  # no heartbeat progress for this long is a hang
    ft_inflight: str = "resume"  # resume | abort: what happens to in-flight requests on a fault
    # Warm spare engines per sentinel (each with a worker spare per rank), promoted on a
    # restart; 0 starts a replacement from nothing. Two cover a second fault that comes while
    # the spare replacing the first one still warms up, at twice the spares' memory.
    ft_warm_spares: int = 1

    def __post_init__(self) -> None:
        if self.ft_inflight not in ("resume", "abort"):
            raise ConfigError(f"ft_inflight must be resume or abort; got {self.ft_inflight!r}")
        if not 0 <= self.ft_warm_spares <= MAX_WARM_SPARES:
            raise ConfigError(f"ft_warm_spares must be 0 to {MAX_WARM_SPARES}; got "
                              f"{self.ft_warm_spares}")
        if self.ft_max_attempts < 1:
            raise ConfigError("ft_max_attempts must be at least 1")
        if self.ft_hang_timeout_s <= 0 or self.ft_recovery_timeout_s <= 0:
            raise ConfigError("ft_hang_timeout_s and ft_recovery_timeout_s must be positive")


_SPEC_METHODS = ("ngram", "draft_model")
@dataclass(frozen=True)
class LoRAConfig:
    """Multi-LoRA (vLLM's flags). ``max_loras``: adapters one batch may mix (device slots);
    ``max_lora_rank``: the largest rank an adapter may have (slots are this wide);
    ``max_cpu_loras``: adapters kept in host memory (None: ``max_loras``); ``lora_modules``:
    adapters to load at start-up, each ``name=path`` or vLLM's JSON
    ``{"name": ..., "path": ...}`` (served by the API under ``name``)."""

    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    lora_modules: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ConfigError(f"max_loras must be at least 1; got {self.max_loras}")
        if self.max_lora_rank not in _LORA_RANKS:
            raise ConfigError(f"max_lora_rank must be one of {', '.join(map(str, _LORA_RANKS))}; "
                              f"got {self.max_lora_rank}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ConfigError(f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras "
                              f"({self.max_loras})")
        if self.lora_modules and not self.enable_lora:
            raise ConfigError("--lora-modules needs --enable-lora")

    @property
    def num_cpu_loras(self) -> int:
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras


_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's accepted max_lora_rank values


_SPEC_KEYS = {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
              "model"}


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding, from vLLM's ``--speculative-config`` JSON.

    ``ngram`` drafts ``num_speculative_tokens`` tokens by prompt lookup: the longest suffix of
    ``prompt_lookup_min`` to ``prompt_lookup_max`` tokens that occurred earlier in the sequence
    proposes the tokens that followed it. ``draft_model`` (a smaller model with the same
    vocabulary, a GGUF file or a Hugging Face folder) drafts with that model.
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    model: str | None = None

    def __post_init__(self) -> None:
        if self.method not in _SPEC_METHODS:
            raise ConfigError(f"speculative_config method must be one of "
                              f"{', '.join(_SPEC_METHODS)}; got {self.method!r}")
        if not isinstance(self.num_speculative_tokens, int) or not (
                1 <= self.num_speculative_tokens <= 16):
            raise ConfigError("speculative_config num_speculative_tokens must be an integer in "
                              f"[1, 16]; got {self.num_speculative_tokens!r}")
        if self.method == "ngram":
            if self.model is not None:
                raise ConfigError("speculative_config: 'model' is for method draft_model, not "
                                  "ngram")
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi):
                raise ConfigError("speculative_config needs 1 <= prompt_lookup_min <= "
                                  f"prompt_lookup_max (integers); got {lo!r} and {hi!r}")
        else:
            if self.model is None:
                raise ConfigError("speculative_config method draft_model needs 'model' (the "
                                  "path of a smaller model with the target's vocabulary)")
            if not os.path.exists(self.model):
                raise ConfigError(f"speculative_config model path {self.model!r} does not "
                                  "exist (a GGUF file or a Hugging Face folder)")

    @classmethod
    def parse(cls, value: str | dict[str, Any] | SpeculativeConfig | None
              ) -> SpeculativeConfig | None:
        """From the JSON text of ``--speculative-config`` or the dict of ``LLM(...)``."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            import json

            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"--speculative-config must be a JSON object: {exc}") from None
        if not isinstance(value, dict):
            raise ConfigError("speculative_config must be a JSON object such as "
                              '{"method": "ngram", "num_speculative_tokens": 4}; '
                              f"got {value!r}")
        unknown = sorted(set(value) - _SPEC_KEYS)
        if unknown:
            raise ConfigError(f"speculative_config: unknown key(s) {', '.join(unknown)}; "
                              f"accepted: {', '.join(sorted(_SPEC_KEYS))}")
        if "method" not in value:
            raise ConfigError("speculative_config needs 'method' (ngram or draft_model)")
        return cls(**value)


@dataclass(frozen=True)
class EngineConfig:
    """Everything one engine core needs; built once, validated, then read-only."""

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    fault_tolerance: FaultToleranceConfig = field(default_factory=FaultToleranceConfig)
    speculative: SpeculativeConfig | None = None
    lora: LoRAConfig = field(default_factory=LoRAConfig)

    def __post_init__(self) -> None:
        if self.lora.enable_lora and self.speculative is not None:
            raise ConfigError("LoRA adapters and speculative decoding cannot be combined yet; "
                              "drop --enable-lora or --speculative-config")
        if self.lora.enable_lora and self.model.quantization != "none":
            # NOTE: the adapters add to dense base layers; GGUF weights kept quantized on the
            # CPU (issue #26) have no dense weight for them yet.
            if self.model.quantization == "gguf":
                raise ConfigError("LoRA adapters need dense base weights; drop --enable-lora "
                                  "or run with --quantization none")
            object.__setattr__(self, "model",
                               dataclasses.replace(self.model, quantization="none"))
        if self.speculative is None:
            return
        par = self.parallel
        if par.tensor_parallel_size > 1 or (par.data_parallel_size > 1
                                            and par.enable_expert_parallel):
            raise ConfigError("speculative decoding does not support tensor parallelism or "
                              "expert-parallel data parallelism yet; drop --speculative-config "
                              "or run with --tensor-parallel-size 1 and without EP")

    def async_scheduling_off_reason(self) -> str | None:
        """Why async scheduling cannot run with this config (None: it can, when asked for)."""
        if self.parallel.is_dp_coupled:
            # NOTE: a coupled group's engines must run the same number of forwards (their
            # expert collectives pair up), which a step queue that drains at different times
            # would break.
            return "a coupled (expert-parallel) DP group steps in lockstep"
        return None

    @property
    def is_async_spec(self) -> bool:
        """Speculation (ngram or a draft model) under async scheduling: the scheduler reserves
        each decode row's draft slots (placeholders) and a draft model's lookahead slots ahead,
        and the worker, which holds the accepted tokens, drafts and fills them itself."""
        return (self.speculative is not None and self.scheduler.async_scheduling
                and self.async_scheduling_off_reason() is None)

    def replace(self, **changes: Any) -> EngineConfig:
        return dataclasses.replace(self, **changes)


ENTRY_POINTS = ("llm", "serve")  # vLLM's usage contexts LLM_CLASS and OPENAI_API_SERVER


def default_max_num_batched_tokens(device: str, entry_point: str, world_size: int = 1
                                   ) -> tuple[int, str]:
    """vLLM V1's default token budget per step (``EngineArgs.get_batch_defaults``), and why.

    A GPU with at least 70 GiB that is not an A100 (H100, H200, MI300X): 16384 offline, 8192
    for the API server; other GPUs: 8192 / 2048; the CPU: 4096 / 2048 per rank. The API server
    takes less because a smaller prefill chunk keeps the inter-token latency of the running
    decodes low; offline, only throughput counts."""
    if entry_point not in ENTRY_POINTS:
        raise ConfigError(f"entry_point must be one of {', '.join(ENTRY_POINTS)}")
    offline = entry_point == "llm"
    if device != "cuda":
        return (4096 if offline else 2048) * world_size, "the CPU"
    name, total_memory = gpu_name_and_memory()
    big = total_memory >= 70 * 2**30 and "a100" not in name.lower()
    where = f"{name} ({total_memory / 2**30:.0f} GiB)"
    if big:
        return (16384 if offline else 8192), where
    return (8192 if offline else 2048), where


def gpu_name_and_memory() -> tuple[str, int]:
    """The first visible GPU's name and memory in bytes.

    NOTE: asked of nvidia-smi where it exists, so that the API process, which runs no model,
    does not initialise CUDA (and hold a context on the GPU) just to pick a default."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total",
                              "--format=csv,noheader,nounits", "-i", visible or "0"],
                             check=True, capture_output=True, text=True, timeout=10).stdout
        name, mib = out.splitlines()[0].rsplit(",", 1)
        return name.strip(), int(mib) * 2**20
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        import torch

        props = torch.cuda.get_device_properties(0)
        return props.name, props.total_memory


def build_engine_config(entry_point: str = "llm", **kwargs: Any) -> EngineConfig:
    """Route flat keyword arguments (as the CLI and ``LLM(...)`` take them) to their component.

    ``entry_point`` (``llm`` or ``serve``) picks the default ``max_num_batched_tokens``."""
    classes = {"model": ModelConfig, "cache": CacheConfig, "scheduler": SchedulerConfig,
               "parallel": ParallelConfig, "fault_tolerance": FaultToleranceConfig,
               "lora": LoRAConfig}
    speculative = SpeculativeConfig.parse(kwargs.pop("speculative_config", None))
    parts: dict[str, dict[str, Any]] = {part: {} for part in classes}
    owners = {f.name: part for part, cls in classes.items() for f in dataclasses.fields(cls)}
    for key, value in kwargs.items():
        if key not in owners:
            raise ConfigError(f"unknown engine option {key!r}")
        parts[owners[key]][key] = value
    if isinstance(parts["lora"].get("lora_modules"), list):
        parts["lora"]["lora_modules"] = tuple(parts["lora"]["lora_modules"])
    config = EngineConfig(**{part: classes[part](**vals) for part, vals in parts.items()},
                          speculative=speculative)
    if config.scheduler.max_num_batched_tokens is None:
        budget, where = default_max_num_batched_tokens(
            config.model.device, entry_point, config.parallel.tensor_parallel_size)
        logger.info("max_num_batched_tokens=%d: vLLM's default for %s on %s "
                    "(--max-num-batched-tokens overrides it)", budget,
                    "the API server" if entry_point == "serve" else "offline LLM", where)
        config = config.replace(scheduler=dataclasses.replace(
            config.scheduler, max_num_batched_tokens=budget))
    return config
