"""Assemble an engine from its three configs.

``build_engine_parts`` is the recipe; each step is a function below it, in order:

1. ``pick_device`` and ``read_model_source``: device and dtype; what ``--model`` names (its
   config, tokenizer, stop ids, sampling defaults), and whether its weights can fit the
   device (``engine/weight_memory.py``), before any weight is read.
2. ``load_model_shard``: the plain model (``load_model``), or this rank's shard of it.
3. ``attach_backend``: ``--quantization``, then the device's fast path
   (``engine/backends/``) and the cost model of a step on it.
4. ``plan_graphs``, ``size_kv_pool``, ``allocate_kv_cache``: the KV cache is sized last,
   from what the model, the draft and the CUDA graphs leave.
5. ``build_scheduler``, ``build_runner``, ``build_speculator``: the components the step
   drives, wired together.

``LLMEngine`` runs the step loop over what it returns. At the end it logs where the
process's memory went (``MemoryReport``).
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.attention import PagedAttention, resolve_backend
from engine.backends import ModelForward
from engine.backends.cpu import build_cpu_forward
from engine.config import (
    EngineConfig,
    KVCacheSettingError,
    ModelConfig,
    UnsupportedModelError,
)
from engine.cost import StepCostModel
from engine.cuda_graphs import DecodeGraphs, default_graph_sizes
from engine.generation_config import (
    SamplingDefaults,
    eos_token_ids,
    read_generation_config,
    sampling_defaults,
)
from engine.gpu_memory import check_graph_memory, gpu_kv_budget, memory_baseline
from engine.kv_calibration import CALIBRATION_TOKENS, calibrate_key_offsets, calibration_ids
from engine.llama import LlamaForCausalLM
from engine.loader import (
    ResolvedModel,
    fill_dummy_weights,
    load_state_dict,
    load_tokenizer,
    read_hf_config,
    resolve_model,
)
from engine.model_runner import ModelRunner
from engine.penalties import TokenCounts
from engine.prefill_graphs import PrefillGraphs, default_prefill_sizes
from engine.presets import preset
from engine.quantization import check_supported, quantize_model
from engine.rope import RotaryEmbedding
from engine.sampler import Sampler
from engine.spec_decode.config import SpeculativeConfig
from engine.spec_decode.draft_model import DraftModelProposer
from engine.spec_decode.policy import default_max_step_tokens, default_row_cost, ridge_rows_for
from engine.spec_decode.speculator import SpeculativeDecoder
from engine.step_predictor import StepTimePredictor
from engine.tensor_parallel import check_shardable, shard_model
from engine.tp_group import TensorParallelGroup, TensorParallelRunner
from engine.weight_memory import check_weights_fit
from kernels import cpu as cpu_kernels
from kernels._tuning_file import TuningTable
from kernels.settings import DECODE_ROWS, decode_matmul_env
from kvpool.config import KVPoolConfig
from kvpool.kv_dtype import QUANTIZED_KV_DTYPES
from kvpool.manager import KVCacheManager
from kvpool.storage import (
    DEFAULT_CPU_BUDGET_BYTES,
    KVCacheStorage,
    KVCapacity,
    size_kv_cache,
)
from scheduler.config import SchedulerConfig
from scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True, slots=True)
class MemoryReport:
    """Where the process's resident memory went at start-up, in bytes.

    ``rest`` is the resident set less the parts named: the Python interpreter, torch's and
    the other libraries' code and allocator pools, the tokenizer, and any freed memory the
    allocator has kept. ``rss_before`` (the resident set when the build began: the
    interpreter and the libraries imported so far) is most of it."""

    rss: int  # VmRSS; 0 where /proc/self/status cannot be read
    rss_before: int  # VmRSS when the engine's build began
    weights: int  # the model's parameters still held (float32 or the dtype in use)
    packed: int  # the cpu backend's panel copies
    blocks: int  # the cpu backend's GGUF or int8 blocks
    kv_cache: int
    dropped: int = 0  # plain weights the backend made unnecessary and freed

    @property
    def rest(self) -> int:
        return self.rss - self.weights - self.packed - self.blocks - self.kv_cache

    def describe(self) -> str:
        mb = 1e6
        parts = (
            f"weights {self.weights / mb:.0f} MB, packed copies {self.packed / mb:.0f} MB, "
            f"quantized blocks {self.blocks / mb:.0f} MB, KV cache {self.kv_cache / mb:.0f} MB"
        )
        dropped = f"; {self.dropped / mb:.0f} MB of plain weights no step reads were freed"
        if not self.rss:
            return f"memory: {parts}" + (dropped if self.dropped else "")
        return (
            f"memory: resident {self.rss / mb:.0f} MB = {parts}, the rest {self.rest / mb:.0f} "
            f"MB (interpreter, libraries, tokenizer, allocator pools; "
            f"{self.rss_before / mb:.0f} MB were resident before loading)"
            + (dropped if self.dropped else "")
        )


def release_freed_heap() -> None:
    """Return the heap pages that start-up freed to the OS, where the C library can.

    Loading makes temporary copies (the packed weights before they move into one buffer,
    the plain weights the cpu backend drops: ~0.5 GB for the default model), and glibc's
    malloc keeps freed blocks of that size in its heap for reuse instead of unmapping them:
    the process would keep them resident for its whole life. ``malloc_trim`` hands them
    back; elsewhere (no glibc) this does nothing."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return
    trim(0)


def resident_bytes() -> int:
    """This process's VmRSS, or 0 where ``/proc/self/status`` is missing."""
    try:
        with open("/proc/self/status") as f:
            match = re.search(r"^VmRSS:\s+(\d+) kB", f.read(), re.M)
    except OSError:
        return 0
    return int(match.group(1)) * 1024 if match else 0


@dataclass(frozen=True, slots=True)
class ServedModel:
    """What the engine serves, fixed once it is built: which model, its shape and tokenizer,
    where requests stop, the device, dtype and kernels chosen, and where the memory went.
    The server reads these through the engine (engine/protocol.py); nothing changes them."""

    config: EngineConfig
    device: torch.device
    dtype: torch.dtype
    model_id: str
    model_config: ModelConfig
    max_model_len: int
    tokenizer: Any  # a transformers tokenizer, or None
    eos_token_id: int | None
    eos_token_ids: tuple[int, ...]  # every id a request stops at (eos_token_id among them)
    sampling_defaults: SamplingDefaults  # for fields a request leaves unset
    attention_backend: str
    # "gguf" when the cpu backend reads GGUF blocks, "int8"/"fp8" with --quantization, else
    # the serving dtype's name
    matmul_weights: str
    memory: MemoryReport


@dataclass(frozen=True, slots=True)
class EngineParts:
    """What ``LLMEngine`` runs: the components its step loop drives, built from the configs
    and wired together, and the ``ServedModel`` they serve."""

    served: ServedModel
    model: LlamaForCausalLM
    cost_model: StepCostModel
    kv_capacity: KVCapacity
    storage: KVCacheStorage
    kv_manager: KVCacheManager
    scheduler: Scheduler
    sampler: Sampler
    runner: ModelRunner
    # The step-time model the latency targets ask; None without targets.
    step_predictor: StepTimePredictor | None = None
    tp: TensorParallelGroup | None = None  # this process's tensor-parallel group
    speculator: SpeculativeDecoder | None = None  # speculative decoding, when configured
    # Whether steps are scheduled asynchronously (EngineConfig.async_scheduling_for).
    async_scheduling: bool = False


def pick_device(config: EngineConfig) -> tuple[torch.device, torch.dtype]:
    """The configured device and dtype, or CUDA with bfloat16 when present, else the CPU
    with float32. ValueError, in one line, where the machine lacks the device asked for."""
    config.check_device()
    device = torch.device(config.resolved_device())
    dtype = DTYPES[config.dtype or ("bfloat16" if device.type == "cuda" else "float32")]
    return device, dtype


def load_model(
    path: Path | None,
    model_config: ModelConfig,
    attention_backend: str,
    max_model_len: int,
    device: torch.device,
    dtype: torch.dtype,
    *,
    seed: int = 0,
) -> LlamaForCausalLM:
    """The plain model with the checkpoint at ``path`` loaded, in eval mode; with no path,
    random weights (``--load-format dummy``, ``fill_dummy_weights``)."""
    attention = PagedAttention(
        attention_backend,
        scale=model_config.softmax_scale,
        softcap=model_config.attn_logit_softcap,
        sliding_window=model_config.sliding_window,
    )
    rope = RotaryEmbedding(model_config, max_model_len, device)
    sliding_rope = None
    if model_config.sliding_rope_theta is not None:
        sliding_rope = RotaryEmbedding(model_config, max_model_len, device, sliding=True)
    # Built on the meta device, cast there, then materialised once in the serving dtype: no
    # time spent on random init, and no float32 copy of a bf16 model on the way.
    with torch.device("meta"):
        model = LlamaForCausalLM(model_config, attention, rope, sliding_rope)
    model = model.to(dtype).to_empty(device=device)
    if path is None:
        fill_dummy_weights(model, seed)
    else:
        model.load_hf_state_dict(load_state_dict(path))
    return model.eval()


def build_engine_parts(
    config: EngineConfig,
    kv_config: KVPoolConfig,
    scheduler_config: SchedulerConfig,
    *,
    tp: TensorParallelGroup | None = None,
) -> EngineParts:
    """The recipe: read what ``--model`` names, load the model (this rank's shard), hand it
    to the device's backend, size and allocate the KV cache last (it takes what the rest
    leaves), then wire the scheduler, sampler, runner and speculator over them.

    ``tp``: this process's tensor-parallel group, joined (engine/tp_launch.py); the model
    is sharded to its rank. Needed when ``config.tensor_parallel_size`` > 1."""
    rss_before = resident_bytes()
    device, dtype = pick_device(config)
    scheduler_config = scheduler_config.for_device(device.type)
    source = read_model_source(config)
    mc = source.model_config
    if config.quantization is not None:
        check_supported(config.quantization, device)  # one clear line before the model loads
    if tp is None:  # (a rank loads the whole model on the host, then keeps its shard)
        check_weights_fit(source.model_id, mc, device, dtype)  # one line, not an OOM kill
    baseline_free = gpu_memory_baseline(kv_config, device, tp)

    t0 = time.perf_counter()
    backend = resolve_backend(config.attention_backend, device, dtype, mc, kv_config.cache_dtype)
    model, device, num_kv_heads = load_model_shard(config, source, backend, device, dtype, tp)
    spec = config.speculative
    draft = None
    if spec is not None and spec.method == "draft":
        # Before the KV cache is sized: its pool shares the budget, its weights the memory.
        draft = load_draft(config, spec, mc, device, dtype, source.max_model_len, scheduler_config)
    attached = attach_backend(config, source, model, backend, scheduler_config, device, dtype, tp)
    logger.info(
        "loaded %s from %s: %.1fM parameters, %s on %s, %s attention, in %.1f s",
        source.model_id,
        source.checkpoint or "random weights (--load-format dummy)",
        mc.num_params / 1e6,
        str(dtype).removeprefix("torch."),
        device,
        backend,
        time.perf_counter() - t0,
    )

    plain = attached.forward is model
    graphs = plan_graphs(config, mc, scheduler_config, device, backend, tp, plain_forward=plain)
    capacity, graphs = size_kv_pool(
        config,
        kv_config,
        scheduler_config,
        model,
        draft,
        graphs,
        num_kv_heads,
        device,
        dtype,
        tp,
        source.max_model_len,
        baseline_free=baseline_free,
    )
    storage = allocate_kv_cache(
        kv_config, capacity, attached.forward, model, source, num_kv_heads, device, dtype
    )
    max_model_len = fit_context_to_pool(source.max_model_len, capacity)
    kv_manager, scheduler, step_predictor = build_scheduler(
        kv_config, scheduler_config, capacity, attached.cost_model, max_model_len
    )
    async_scheduling = config.async_scheduling_for(device.type, scheduler_config.batching)
    sampler, runner = build_runner(
        config, model, attached, storage, graphs, max_model_len, device, tp, async_scheduling
    )
    speculator = None
    if spec is not None:
        argmax = attached.cpu_ops.argmax_rows if attached.cpu_ops is not None else None
        speculator = build_speculator(
            spec, draft, capacity, attached.cost_model, device, dtype, config.seed, argmax,
            sampler.penalties,
        )
        runner.speculator = speculator

    if tp is not None:
        # Every rank is built once this returns; from then on an idle rank 0 sends
        # heartbeats (engine/tp_group.py).
        torch.distributed.barrier(group=tp.plan_group)
        if tp.rank == 0:
            tp.start_heartbeat()
    release_freed_heap()
    memory = MemoryReport(
        rss=resident_bytes() if device.type == "cpu" else 0,  # else the parts are on the GPU
        rss_before=rss_before,
        weights=sum(p.numel() * p.element_size() for p in model.parameters() if not p.is_meta),
        packed=attached.packed_bytes,
        blocks=attached.block_bytes,
        kv_cache=capacity.total_bytes + (speculator.draft_kv_bytes if speculator else 0),
        dropped=attached.dropped_bytes,
    )
    logger.info("%s", memory.describe())
    served = ServedModel(
        config=config,
        device=device,
        dtype=dtype,
        model_id=source.model_id,
        model_config=mc,
        max_model_len=max_model_len,
        tokenizer=source.tokenizer,
        eos_token_id=source.eos_token_id,
        eos_token_ids=source.eos_token_ids,
        sampling_defaults=source.sampling_defaults,
        attention_backend=backend,
        matmul_weights=attached.matmul_weights,
        memory=memory,
    )
    return EngineParts(
        served=served,
        model=model,
        cost_model=attached.cost_model,
        kv_capacity=capacity,
        storage=storage,
        kv_manager=kv_manager,
        scheduler=scheduler,
        sampler=sampler,
        runner=runner,
        step_predictor=step_predictor,
        tp=tp,
        speculator=speculator,
        async_scheduling=async_scheduling,
    )


@dataclass(frozen=True, slots=True)
class ModelSource:
    """What ``--model`` names, read before any weight is: the checkpoint (or a shape preset),
    its config, tokenizer, stop ids and sampling defaults."""

    model_id: str
    model_config: ModelConfig
    max_model_len: int  # the configured limit, capped at the model's positions
    checkpoint: Path | None  # the HF directory the weights load from; None: random weights
    gguf: Path | None  # the GGUF file the checkpoint was converted from, if any
    tokenizer: Any  # a transformers tokenizer, or None
    eos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    sampling_defaults: SamplingDefaults


def lacks_a_tokenizer(config: EngineConfig) -> bool:
    """Whether ``config`` names a model known to come without a tokenizer before anything is
    read: a shape preset with dummy weights and no ``--tokenizer`` (``read_model_source``
    finds none there). A checkpoint directory without tokenizer files is found out only by
    reading it."""
    return (
        config.tokenizer is None
        and config.load_format == "dummy"
        and preset(config.model) is not None
    )


def read_model_source(config: EngineConfig) -> ModelSource:
    """Resolve ``config.model`` (converting a GGUF file once), read its config, tokenizer and
    generation config. With dummy weights ``--model`` may name a shape preset instead."""
    dummy = config.load_format == "dummy"
    shape = preset(config.model) if dummy else None
    resolved: ResolvedModel | None = None
    if shape is not None:
        model_id, hf_config = config.model, shape
    else:
        resolved = resolve_model(config.model)
        model_id, hf_config = resolved.model_id, read_hf_config(resolved.path)
    mc = ModelConfig.from_hf(hf_config)
    max_model_len = min(
        mc.max_position_embeddings, config.max_model_len or mc.max_position_embeddings
    )
    if config.max_model_len is not None and config.max_model_len > max_model_len:
        # RoPE tables and the model's training stop at its positions: capped, said once.
        logger.warning(
            "max_model_len %d exceeds the model's %d positions: capped",
            config.max_model_len,
            max_model_len,
        )
    tokenizer_dir = config.tokenizer or (resolved.path if resolved is not None else None)
    tokenizer = load_tokenizer(Path(tokenizer_dir)) if tokenizer_dir is not None else None
    eos_token_id = mc.eos_token_id
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        eos_token_id = tokenizer.eos_token_id
    generation = read_generation_config(resolved.path if resolved is not None else None)
    stop_ids = eos_token_ids(hf_config, generation, tokenizer)
    if eos_token_id is None and stop_ids:
        eos_token_id = stop_ids[0]
    defaults = sampling_defaults(generation, config.generation_config)
    logger.info(
        "EOS ids %s; sampling defaults from generation_config.json: %s",
        list(stop_ids),
        defaults.as_dict() or "none",
    )
    checkpoint = None if dummy or resolved is None else resolved.path
    return ModelSource(
        model_id=model_id,
        model_config=mc,
        max_model_len=max_model_len,
        checkpoint=checkpoint,
        gguf=resolved.gguf if checkpoint is not None and resolved is not None else None,
        tokenizer=tokenizer,
        eos_token_id=eos_token_id,
        eos_token_ids=stop_ids,
        sampling_defaults=defaults,
    )


def load_model_shard(
    config: EngineConfig,
    source: ModelSource,
    backend: str,
    device: torch.device,
    dtype: torch.dtype,
    tp: TensorParallelGroup | None,
) -> tuple[LlamaForCausalLM, torch.device, int]:
    """The model on ``device``; under tensor parallelism, this rank's shard of it, on the
    rank's own CUDA device. Returns the model, its device and the KV heads it computes."""
    mc, max_model_len = source.model_config, source.max_model_len
    if config.tensor_parallel_size > 1 or tp is not None:
        check_shardable(mc)
        if tp is None:
            raise ValueError("tensor_parallel_size > 1 needs the group: engine/tp_launch.py")
        if device.type == "cuda":
            device = torch.device("cuda", tp.local_rank)
            torch.cuda.set_device(device)
    if tp is None:
        model = load_model(
            source.checkpoint, mc, backend, max_model_len, device, dtype, seed=config.seed
        )
        return model, device, mc.num_kv_heads
    # Loaded whole on the host, sharded, and only the shard moves to the device.
    host = torch.device("cpu")
    model = load_model(source.checkpoint, mc, backend, max_model_len, host, dtype, seed=config.seed)
    layout = shard_model(model, tp.device_group)
    if device.type != "cpu":
        model = model.to(device)
        model.rope = RotaryEmbedding(mc, max_model_len, device)
        if model.sliding_rope is not None:
            model.sliding_rope = RotaryEmbedding(mc, max_model_len, device, sliding=True)
    if tp.rank == 0:
        logger.info("%s", layout.describe())
    return model, device, layout.num_local_kv_heads


@dataclass(frozen=True, slots=True)
class AttachedBackend:
    """The loaded model as its device's backend runs it, and what a step costs there."""

    # The model's own forward, or the cpu backend's fused C++ stack (engine/backends/cpu.py).
    forward: ModelForward
    cpu_ops: Any  # ``kernels.cpu.load()`` with the cpu attention backend, else None
    cost_model: StepCostModel
    # "gguf" when the cpu backend reads GGUF blocks, "int8"/"fp8" with --quantization, else
    # the serving dtype's name
    matmul_weights: str
    packed_bytes: int = 0  # the cpu backend's panel copies
    block_bytes: int = 0  # the cpu backend's GGUF or int8 blocks
    dropped_bytes: int = 0  # plain weights the backend made unnecessary and freed


def attach_backend(
    config: EngineConfig,
    source: ModelSource,
    model: LlamaForCausalLM,
    backend: str,
    scheduler_config: SchedulerConfig,
    device: torch.device,
    dtype: torch.dtype,
    tp: TensorParallelGroup | None,
) -> AttachedBackend:
    """Quantize the model's matmuls (``--quantization``), then hand it to its device's fast
    path: the fused C++ stack on the CPU, fused layer ops for Triton on CUDA."""
    mc = source.model_config
    spec = config.speculative
    # The cpu attention backend brings the fused C++ stack along (engine/backends/cpu.py);
    # every other one runs the model's own forward.
    forward: ModelForward = model
    # --quantization: the model's matmuls become QuantizedLinear (engine/quantization.py).
    quant = None if config.quantization is None else quantize_model(model, config.quantization)
    cost_model = StepCostModel.from_config(mc, dtype.itemsize)
    matmul_weights = str(dtype).removeprefix("torch.")  # "gguf" when GGUF blocks serve
    packed_bytes = block_bytes = dropped_bytes = 0
    cpu_ops = cpu_kernels.load() if backend == "cpu" else None
    if cpu_ops is not None and tp is not None and tp.rank == 0:
        logger.info(
            "tensor parallel on the CPU: the fused C++ decoder stack runs a whole layer in "
            "one call, with no point for the all-reduce between attention and MLP, so each "
            "rank runs the model's own layers (torch matmuls, C++ paged attention)"
        )
    # The fused stack computes Llama's layer; another family runs its own forward with the
    # C++ attention kernel (engine/attention.py).
    if cpu_ops is not None and tp is None and mc.is_plain_llama:
        gguf = source.gguf if config.matmul_weights == "gguf" else None
        # A speculative row needs logits at each of its 1 + k positions; the step's
        # speculative rows hold at most the auto-disable rule's tokens (an upper bound of
        # it: the device default without the GGUF cap, which is only known further down).
        spec_rows = 0
        if spec is not None:
            spec_rows = spec.max_step_tokens or default_max_step_tokens(device.type, 0)
        cpu = build_cpu_forward(
            model,
            cpu_ops,
            gguf_path=gguf,
            max_logit_rows=scheduler_config.max_num_seqs + spec_rows,
        )
        forward = cpu
        packed_bytes, block_bytes = cpu.memory.packed_bytes, cpu.memory.block_bytes
        dropped_bytes = cpu.memory.dropped_bytes
        if cpu.uses_blocks:
            assert cpu.blocks is not None
            matmul_weights = "gguf" if quant is None else quant.mode
            # What a step reads of those, from its plan (MBU/MFU; engine/cost.py).
            cost_model = cost_model.with_blocks(
                cpu_ops.max_quant_rows(),
                body_saved_bytes=cpu.blocks.body_saved_bytes,
                lm_head_block_bytes=cpu.blocks.lm_head_block_bytes,
            )
    if quant is not None and not (cpu_ops is not None and forward is not model):
        # Every step reads the quantized weights (the Triton kernel or the reference).
        matmul_weights = quant.mode
        cost_model = cost_model.with_blocks(
            2**62,
            body_saved_bytes=quant.body_saved_bytes,
            lm_head_block_bytes=quant.lm_head_quant_bytes,
        )
    if device.type == "cuda" and backend == "triton":
        from engine.backends.cuda import fuse_layer_ops

        triton_matmuls = decode_matmul_env() == "triton"
        fuse_layer_ops(model, triton_matmuls=triton_matmuls)
        if triton_matmuls:
            logger.info(
                "decode matmuls (<= %d rows) on the split-K Triton kernel "
                "(PAGEDSERVE_DECODE_MATMUL=triton)", DECODE_ROWS,
            )  # fmt: skip
        _log_matmul_tuning(device, triton_matmuls or quant is not None)
    _log_attention_tuning(device, device.type == "cuda" and backend == "triton")
    return AttachedBackend(
        forward=forward,
        cpu_ops=cpu_ops,
        cost_model=cost_model,
        matmul_weights=matmul_weights,
        packed_bytes=packed_bytes,
        block_bytes=block_bytes,
        dropped_bytes=dropped_bytes,
    )


@dataclass(frozen=True, slots=True)
class GraphPlan:
    """The CUDA graphs the runner will capture, by step size; empty: those steps run eagerly."""

    decode_sizes: list[int]  # decode steps, by number of rows
    prefill_sizes: list[int]  # short steps with prefill tokens, by number of tokens
    # How those steps replay (EngineConfig.cuda_graph_prefill_mode: "full" captures
    # whole-forward graphs besides the pieces), over at most this many sequences.
    prefill_mode: str = "piecewise"
    max_num_seqs: int = 1
    # What the KV cache's budget left for the steps' activations and the graphs, once it
    # is measured (``size_kv_pool``, on CUDA); None: not measured (a budget was given).
    reserve_bytes: int | None = None


def _log_matmul_tuning(device: torch.device, triton_matmuls: bool) -> None:
    """Say which swept launches the Triton matmuls take (PAGEDSERVE_MATMUL_TUNING), and
    where the table cannot apply: no matmul of this engine runs the Triton kernels, or it
    was swept on another device."""
    from kernels.matmul_tuning import MATMUL_TUNING_ENV, matmul_tuning_env

    _log_tuning(
        MATMUL_TUNING_ENV, matmul_tuning_env(), device, triton_matmuls,
        what="decode matmul launches", where="where it has the shape",
        unused="no matmul here runs the split-K Triton kernel (it needs "
        "PAGEDSERVE_DECODE_MATMUL=triton or --quantization)",
    )  # fmt: skip


def _log_attention_tuning(device: torch.device, triton_attention: bool) -> None:
    """The same for the decode attention kernel's table (PAGEDSERVE_ATTENTION_TUNING)."""
    from kernels.attention_tuning import ATTENTION_TUNING_ENV, attention_tuning_env

    _log_tuning(
        ATTENTION_TUNING_ENV, attention_tuning_env(), device, triton_attention,
        what="decode attention launches", where="before DECODE_TUNING's rows",
        unused="decode attention here is not the Triton kernel on a GPU",
    )  # fmt: skip


def _log_tuning(
    env: str, table: TuningTable | None, device: torch.device, applies: bool, *, what: str,
    where: str, unused: str,
) -> None:  # fmt: skip
    """Log the tuning ``table`` ``env`` names (None: unset): what it is, or a warning where
    it changes nothing (``applies`` is False) or was swept on another device."""
    if table is None:
        return
    if not applies:
        logger.warning("%s is set but %s: it changes nothing", env, unused)
        return
    logger.info(
        "%s from %s=%s %s: %d entries, swept on %s",
        what, env, table.source, where, len(table), table.device,
    )  # fmt: skip
    here = torch.cuda.get_device_name(device)
    if table.device != here:
        logger.warning(
            "%s was swept on %s, not this %s: its launches run, but are not known fastest here",
            table.source, table.device, here,
        )  # fmt: skip


def plan_graphs(
    config: EngineConfig,
    mc: ModelConfig,
    scheduler_config: SchedulerConfig,
    device: torch.device,
    backend: str,
    tp: TensorParallelGroup | None,
    *,
    plain_forward: bool,
) -> GraphPlan:
    """Which step sizes get CUDA graphs: decided before the KV cache is sized, since on
    CUDA the graphs' memory is measured first. ``plain_forward``: steps run the model's own
    forward, not a backend's replacement."""
    # Decode graphs would capture the collectives too; TP steps run eagerly for now.
    # The torch reference backend plans attention with host reads: not capturable.
    use_graphs = (
        device.type == "cuda" and not config.enforce_eager and tp is None and backend == "triton"
    )
    if use_graphs and mc.num_experts:
        # engine/moe.py splits a step by expert on the host: not capturable.
        logger.info("a mixture of experts runs eagerly: no CUDA graphs")
        use_graphs = False
    if not use_graphs:
        return GraphPlan([], [])
    graph_sizes = [
        size
        for size in config.cuda_graph_sizes or default_graph_sizes(scheduler_config.max_num_seqs)
        if size <= scheduler_config.max_num_seqs
    ] or [1]
    # Prefill graphs replay the plain model's layers: not a backend's replacement forward.
    prefill_sizes = (
        default_prefill_sizes(
            min(config.cuda_graph_max_prefill_tokens, scheduler_config.max_num_batched_tokens)
        )
        if plain_forward
        else []
    )
    return GraphPlan(
        graph_sizes,
        prefill_sizes,
        prefill_mode=config.cuda_graph_prefill_mode,
        max_num_seqs=scheduler_config.max_num_seqs,
    )


def gpu_memory_baseline(
    kv_config: KVPoolConfig, device: torch.device, tp: TensorParallelGroup | None
) -> int | None:
    """With ``--gpu-memory-utilization`` on CUDA (and no explicit KV budget), the bytes free
    on this rank's GPU before anything loads (``engine.gpu_memory.memory_baseline``, which
    refuses a share more than is free); None elsewhere. On the CPU the flag is said to do
    nothing."""
    share = kv_config.gpu_memory_utilization
    if share is None or kv_config.memory_bytes is not None or kv_config.num_blocks is not None:
        return None
    if device.type != "cuda":
        logger.warning(
            "--gpu-memory-utilization applies on CUDA; on %s the KV cache takes "
            "--kv-cache-memory (1 GiB by default)",
            device.type,
        )
        return None
    rank_device = torch.device("cuda", tp.local_rank) if tp is not None else device
    return memory_baseline(rank_device, share)


def fit_context_to_pool(max_model_len: int, capacity: KVCapacity) -> int:
    """The context a request may reach: at most what the whole KV pool holds, since a longer
    sequence could never run. Capped with a warning rather than refused (SGLang's choice;
    vLLM refuses to start): the server then advertises, and fills a request that leaves
    ``max_tokens`` unset up to, a length it can serve."""
    if capacity.num_tokens >= max_model_len:
        return max_model_len
    logger.warning(
        "max_model_len %d is more than the whole KV cache holds (%d tokens): capped to %d. "
        "Give the cache more memory (--kv-cache-memory, --gpu-memory-utilization, "
        "--num-kv-blocks) to serve the full context",
        max_model_len,
        capacity.num_tokens,
        capacity.num_tokens,
    )
    return capacity.num_tokens


def size_kv_pool(
    config: EngineConfig,
    kv_config: KVPoolConfig,
    scheduler_config: SchedulerConfig,
    model: LlamaForCausalLM,
    draft: DraftModel | None,
    graphs: GraphPlan,
    num_kv_heads: int,
    device: torch.device,
    dtype: torch.dtype,
    tp: TensorParallelGroup | None,
    max_model_len: int,
    *,
    baseline_free: int | None = None,
) -> tuple[KVCapacity, GraphPlan]:
    """How many blocks the KV cache gets: the budget (on CUDA, what the largest step and the
    graphs leave, within ``--gpu-memory-utilization`` where given: ``baseline_free`` is
    ``gpu_memory_baseline``'s), less the draft model's share, and under tensor parallelism
    the smallest count any rank can hold. Returns it and ``graphs`` with the memory reserved
    for them (``reserve_bytes``) where it was measured."""
    mc = model.config
    if device.type == "cuda" and kv_config.memory_bytes is None and kv_config.num_blocks is None:
        # The KV cache takes what is left after the largest step's activations and the
        # decode graphs, measured here, so neither runs out of memory later.
        gpu_budget = gpu_kv_budget(
            model,
            device,
            max_tokens=scheduler_config.max_num_batched_tokens,
            graph_sizes=graphs.decode_sizes,
            max_blocks_per_seq=-(-max_model_len // kv_config.block_size),
            prefill_sizes=graphs.prefill_sizes,
            prefill_whole=graphs.prefill_mode == "full",
            block_size=kv_config.block_size,
            utilization=kv_config.gpu_memory_utilization,
            baseline_free=baseline_free,
        )
        kv_config = dataclasses.replace(kv_config, memory_bytes=gpu_budget.kv_bytes)
        graphs = dataclasses.replace(graphs, reserve_bytes=gpu_budget.reserve_bytes)
    if draft is not None and kv_config.num_blocks is None:
        # Target and draft pools hold the same tokens and split the budget by bytes/token.
        budget = kv_config.memory_bytes
        if budget is None and device.type == "cpu":
            budget = DEFAULT_CPU_BUDGET_BYTES
        if budget is not None:
            per_target = mc.kv_bytes_per_token(dtype.itemsize)
            per_draft = draft.model_config.kv_bytes_per_token(dtype.itemsize)
            kv_config = dataclasses.replace(
                kv_config, memory_bytes=budget * per_target // (per_target + per_draft)
            )
    try:
        capacity = size_kv_cache(
            kv_config,
            num_layers=mc.num_layers,
            num_kv_heads=num_kv_heads,
            head_dim=mc.head_dim,
            dtype=dtype,
            device=device,
        )
    except ValueError as exc:  # kvpool's checks of the settings against this model
        raise KVCacheSettingError(str(exc)) from exc
    if tp is not None:
        # Rank 0's scheduler hands out block ids for every rank's pool: all pools get the
        # smallest count any rank can hold.
        count = torch.tensor([capacity.num_blocks], dtype=torch.int64)
        torch.distributed.all_reduce(count, torch.distributed.ReduceOp.MIN, group=tp.plan_group)
        if int(count) != capacity.num_blocks:
            capacity = dataclasses.replace(capacity, num_blocks=int(count))
    return capacity, graphs


def allocate_kv_cache(
    kv_config: KVPoolConfig,
    capacity: KVCapacity,
    forward: ModelForward,
    model: LlamaForCausalLM,
    source: ModelSource,
    num_kv_heads: int,
    device: torch.device,
    dtype: torch.dtype,
) -> KVCacheStorage:
    """The KV tensors for ``capacity``, with the keys' calibrated offsets when asked for
    (``--kv-key-offsets``), handed to the model's attention."""
    mc = source.model_config
    key_offsets = None
    if kv_config.key_offsets and kv_config.cache_dtype not in QUANTIZED_KV_DTYPES:
        logger.warning(
            "key offsets apply to a quantized KV cache only (--kv-cache-dtype %s): ignored",
            "|".join(QUANTIZED_KV_DTYPES),
        )
    elif kv_config.key_offsets:
        # Before the pool exists, from the float model (engine/kv_calibration.py).
        num_tokens = min(CALIBRATION_TOKENS, source.max_model_len)
        key_offsets = calibrate_key_offsets(
            forward,
            calibration_ids(source.tokenizer, mc.vocab_size, num_tokens),
            num_layers=mc.num_layers,
            num_kv_heads=num_kv_heads,
            head_dim=mc.head_dim,
            dtype=dtype,
            device=device,
            block_size=kv_config.block_size,
        )
    storage = KVCacheStorage(
        capacity,
        num_layers=mc.num_layers,
        num_kv_heads=num_kv_heads,
        head_dim=mc.head_dim,
        dtype=dtype,
        device=device,
        key_offsets=key_offsets,
    )
    model.attention.set_key_offsets(storage.key_caches, storage.key_offsets)
    return storage


def build_scheduler(
    kv_config: KVPoolConfig,
    scheduler_config: SchedulerConfig,
    capacity: KVCapacity,
    cost_model: StepCostModel,
    max_model_len: int,
) -> tuple[KVCacheManager, Scheduler, StepTimePredictor | None]:
    """The block manager over the pool, and the scheduler over it; with latency targets,
    the step-time model the scheduler sizes prefill with."""
    kv_manager = KVCacheManager(
        capacity.num_blocks,
        capacity.block_size,
        enable_prefix_caching=kv_config.enable_prefix_caching,
    )
    logger.info(
        "prefix caching: %s",
        "on (full blocks, sha256 hash chain, LRU eviction)"
        if kv_config.enable_prefix_caching
        else "off",
    )
    step_predictor = None
    if scheduler_config.has_latency_targets:
        step_predictor = StepTimePredictor(cost_model, capacity.bytes_per_token)
    scheduler = Scheduler(
        scheduler_config, kv_manager, max_model_len, step_time_predictor=step_predictor
    )
    return kv_manager, scheduler, step_predictor


def build_runner(
    config: EngineConfig,
    model: LlamaForCausalLM,
    attached: AttachedBackend,
    storage: KVCacheStorage,
    graphs: GraphPlan,
    max_model_len: int,
    device: torch.device,
    tp: TensorParallelGroup | None,
    async_scheduling: bool,
) -> tuple[Sampler, ModelRunner]:
    """The sampler, and the runner over the backend's forward and the KV cache (rank 0's
    wraps it to broadcast each plan under tensor parallelism), with its CUDA graphs
    captured."""
    cpu_ops = attached.cpu_ops
    sampler = Sampler(config.seed, device, cpu_ops.argmax_rows if cpu_ops is not None else None)
    runner = ModelRunner(
        attached.forward,
        storage,
        sampler,
        device,
        experts_touched=model.experts_touched if model.config.num_experts else None,
    )
    if tp is not None and tp.rank == 0:
        runner = TensorParallelRunner(runner, tp, shares_picks=async_scheduling)
    max_blocks_per_seq = -(-max_model_len // storage.block_size)
    if graphs.decode_sizes:
        runner.graphs = DecodeGraphs(
            attached.forward,
            storage,
            graphs.decode_sizes,
            max_blocks_per_seq,
            device,
            capture=True,
        )
        runner.graphs.capture_all()
    if graphs.prefill_sizes:
        runner.prefill_graphs = PrefillGraphs(
            model,
            storage,
            graphs.prefill_sizes,
            device,
            capture=True,
            mode=graphs.prefill_mode,
            max_num_seqs=graphs.max_num_seqs,
            max_blocks_per_seq=max_blocks_per_seq,
        )
        runner.prefill_graphs.capture_all()
    if graphs.reserve_bytes is not None and (graphs.decode_sizes or graphs.prefill_sizes):
        # What capturing took (its eager runs included) against what sizing the KV cache
        # left for it: a miss there is a later out-of-memory step.
        captured = sum(
            g.pool_bytes for g in (runner.graphs, runner.prefill_graphs) if g is not None
        )
        check_graph_memory(captured, graphs.reserve_bytes)
    return sampler, runner


@dataclass(frozen=True, slots=True)
class DraftModel:
    """The draft model of ``--speculative-method draft``, loaded and on its backend."""

    model_config: ModelConfig
    model: LlamaForCausalLM
    forward: ModelForward
    weight_bytes: int


def load_draft(
    config: EngineConfig,
    spec: SpeculativeConfig,
    target: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
    max_model_len: int,
    scheduler_config: SchedulerConfig,
) -> DraftModel:
    """Load the draft model as the target is loaded: same dtype, device, attention backend
    choice and (on the CPU) the C++ stack.

    Raises:
        UnsupportedModelError: its vocabulary differs from the target's.
    """
    assert spec.model is not None
    dummy = spec.draft_load_format == "dummy"
    shape = preset(spec.model) if dummy else None
    resolved = None if shape is not None else resolve_model(spec.model)
    dmc = ModelConfig.from_hf(shape if resolved is None else read_hf_config(resolved.path))
    if dmc.vocab_size != target.vocab_size:
        raise UnsupportedModelError(
            f"the speculative model's vocabulary has {dmc.vocab_size} tokens and the "
            f"target's {target.vocab_size}: a draft model must share the target's tokenizer"
        )
    backend = resolve_backend(config.attention_backend, device, dtype, dmc)
    checkpoint = None if resolved is None else resolved.path
    # Drafts reach k positions past the known tokens.
    draft_len = max_model_len + spec.num_speculative_tokens
    model = load_model(checkpoint, dmc, backend, draft_len, device, dtype, seed=config.seed + 1)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    forward: ModelForward = model
    cpu_ops = cpu_kernels.load() if backend == "cpu" else None
    if cpu_ops is not None:
        gguf = None
        if config.matmul_weights == "gguf" and resolved is not None:
            gguf = resolved.gguf
        forward = build_cpu_forward(
            model, cpu_ops, gguf_path=gguf, max_logit_rows=scheduler_config.max_num_seqs
        )
    logger.info(
        "draft model %s: %.1fM parameters, %s attention",
        spec.model,
        dmc.num_params / 1e6,
        backend,
    )
    return DraftModel(dmc, model, forward, weight_bytes)


def build_speculator(
    spec: SpeculativeConfig,
    draft: DraftModel | None,
    capacity: KVCapacity,
    cost_model: StepCostModel,
    device: torch.device,
    dtype: torch.dtype,
    seed: int,
    argmax: Any,
    penalties: TokenCounts,
) -> SpeculativeDecoder:
    """The speculative decoder; for a draft model, its K/V pool holds as many tokens as the
    target's (the budget was split between them before the target's pool was sized).
    ``penalties``: the sampler's token counts, which verification reads."""
    proposer = None
    if draft is not None:
        dmc = draft.model_config
        draft_capacity = KVCapacity(
            capacity.num_blocks, capacity.block_size, dmc.kv_bytes_per_token(dtype.itemsize)
        )
        logger.info("draft model's pool, beside the target's:")
        storage = KVCacheStorage(
            draft_capacity,
            num_layers=dmc.num_layers,
            num_kv_heads=dmc.num_kv_heads,
            head_dim=dmc.head_dim,
            dtype=dtype,
            device=device,
        )
        proposer = DraftModelProposer(
            draft.forward, storage, device, argmax if argmax is not None else _torch_argmax
        )
    ridge_rows = None
    if device.type == "cuda":
        name, dtype_name = torch.cuda.get_device_name(device), str(dtype).removeprefix("torch.")
        ridge_rows = ridge_rows_for(cost_model, name, dtype_name)
    max_step_tokens = spec.max_step_tokens or default_max_step_tokens(
        device.type, cost_model.block_rows, ridge_rows
    )
    row_cost = spec.row_cost if spec.row_cost is not None else default_row_cost(device.type)
    # A draft token costs a draft step: about the draft's weights over the target's.
    proposal_cost = 0.0
    if draft is not None:
        target_params = cost_model.body_matmul_params + cost_model.lm_head_params
        proposal_cost = draft.model_config.num_params / max(1, target_params)
    logger.info(
        "speculative decoding: %s, up to %d tokens per request, while a step's decodes and "
        "drafts stay within %d tokens; drafts by acceptance at %.2f of a decode step a row "
        "(+ %.2f to propose)",
        spec.method if draft is None else f"draft model {spec.model}",
        spec.num_speculative_tokens,
        max_step_tokens,
        row_cost,
        proposal_cost,
    )
    return SpeculativeDecoder(
        spec,
        max_step_tokens,
        seed=seed,
        row_cost=row_cost,
        proposal_cost=proposal_cost,
        device=device,
        argmax=argmax if argmax is not None else _torch_argmax,
        penalties=penalties,
        draft=proposer,
    )


def _torch_argmax(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(dim=-1)
