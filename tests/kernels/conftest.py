"""Shared set-up for the kernel tests: interpreter switch, devices, tolerances, paged inputs.

Without CUDA the Triton kernels run under Triton's interpreter (numpy on the CPU). Triton
decides interpreter-or-compiler when a ``@triton.jit`` function is *defined*, i.e. when
``kernels.<kernel>`` is first imported, so ``TRITON_INTERPRET=1`` is set here, before any
test module of this folder imports a kernel.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# After the line above: the module reads TRITON_INTERPRET when imported.
from tests.triton_devices import INTERPRET, ON_COMPILED_CUDA, ON_INTERPRETED_CPU  # noqa: E402

# (atol, rtol) against the fp32 reference. fp16/bf16 outputs are rounded to the dtype (one
# ulp is 1e-3 / 8e-3 near 1.0) and the kernels round the softmax weights to the dtype before
# the P @ V product, as flash attention does.
TOLERANCES = {
    torch.float32: (2e-5, 1e-4),
    torch.float16: (4e-3, 4e-3),
    torch.bfloat16: (3e-2, 2e-2),
}


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture(autouse=True, scope="session")
def _checked_addresses():
    """Under the interpreter, every kernel load and store must stay inside the tensors it
    was given (tests/kernels/bounds.py): what would be an illegal memory access on a GPU,
    faulting a later test of the same process, fails the test that made it here."""
    if not INTERPRET:
        yield
        return
    from tests.kernels.bounds import checked_launches

    with checked_launches():
        yield


@pytest.fixture
def threads():
    """Sets torch's thread count for one test, then puts it back."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


@pytest.fixture(
    params=[
        pytest.param("cpu", marks=ON_INTERPRETED_CPU),
        pytest.param("cuda", marks=ON_COMPILED_CUDA),
    ]
)
def device(request: pytest.FixtureRequest) -> torch.device:
    """CPU under the interpreter, CUDA with compiled kernels; each skips where it cannot run."""
    if request.param == "cpu":
        from triton.runtime.interpreter import InterpretedFunction

        import kernels.paged_attention

        if not isinstance(
            kernels.paged_attention._paged_attention_decode_kernel, InterpretedFunction
        ):
            pytest.fail(
                "kernels.paged_attention was imported before TRITON_INTERPRET=1 was set, so its "
                "kernels are compiled and cannot take CPU tensors; set the variable earlier "
                "(tests/conftest.py) or in the environment"
            )
    return torch.device(request.param)


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Kernel output vs reference output, with the tolerance of the kernel's dtype."""
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert torch.isfinite(actual).all(), "kernel output has NaN/inf (read outside the context?)"
    atol, rtol = TOLERANCES[actual.dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=rtol)


@pytest.fixture
def close() -> Callable[[torch.Tensor, torch.Tensor], None]:
    return assert_close


@dataclass
class PagedKV:
    """One paged context per sequence, twice.

    The kernel copy lives at shuffled, non-contiguous block ids of a pool whose every other
    slot (unused blocks, the tail of each last block, block-table padding) holds NaN, so a
    kernel reading outside a context produces NaN. The reference copy holds the same values
    in a small NaN-free pool (the reference multiplies masked positions by zero weights, and
    0 * NaN is NaN).
    """

    key_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor  # [num_seqs, max_num_blocks_per_seq] int32
    ref_key_cache: torch.Tensor  # [num_used_blocks + 1, block_size, num_kv_heads, head_dim]
    ref_value_cache: torch.Tensor  # [num_used_blocks + 1, block_size, num_kv_heads, head_dim]
    ref_block_tables: torch.Tensor  # [num_seqs, max_num_blocks_per_seq] int32
    seq_lens: torch.Tensor  # [num_seqs] int32


def build_paged_kv(
    seq_lens: Sequence[int],
    *,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
    num_blocks: int | None = None,
) -> PagedKV:
    """Random K/V contexts of ``seq_lens`` tokens, paged through shuffled block tables.

    With ``num_blocks`` given (a pool too large to fill), the used blocks sit at shuffled ids
    near the top of the pool and only those blocks are ever written, so a multi-GiB pool
    costs only the memory of the blocks touched (untouched pages are never committed).
    """
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_used = sum(blocks_per_seq)
    # One padding column, so every table row ends with padding the kernels must not read.
    max_blocks = max(blocks_per_seq) + 1
    shape_tail = (block_size, num_kv_heads, head_dim)

    # Compact, NaN-free pool for the reference: block 0 is the padding block, sequence i
    # owns the consecutive blocks [first, first + blocks_per_seq[i]).
    ref_k = torch.zeros((num_used + 1, *shape_tail), dtype=dtype, device=device)
    ref_v = torch.zeros_like(ref_k)
    ref_tables = torch.zeros((len(seq_lens), max_blocks), dtype=torch.int32, device=device)
    # Which slots of each compact block hold context; the others are garbage in the kernel pool.
    valid = torch.zeros((num_used + 1, block_size), dtype=torch.bool, device=device)
    first = 1
    for i, n in enumerate(seq_lens):
        last = first + blocks_per_seq[i]
        ref_tables[i, : last - first] = torch.arange(first, last, dtype=torch.int32)
        ref_k[first:last].view(-1, num_kv_heads, head_dim)[:n] = torch.randn(
            (n, num_kv_heads, head_dim), dtype=dtype, device=device
        )
        ref_v[first:last].view(-1, num_kv_heads, head_dim)[:n] = torch.randn(
            (n, num_kv_heads, head_dim), dtype=dtype, device=device
        )
        valid[first:last].view(-1)[:n] = True
        first = last

    # Kernel pool: compact block c (0 = padding) lives at pool block id_map[c], shuffled.
    if num_blocks is None:
        num_blocks = 2 * (num_used + 1) + 3
        key_cache = torch.full((num_blocks, *shape_tail), float("nan"), dtype=dtype, device=device)
        value_cache = torch.full_like(key_cache, float("nan"))
        id_map = torch.randperm(num_blocks, device=device)[: num_used + 1]
    else:
        try:
            key_cache = torch.empty((num_blocks, *shape_tail), dtype=dtype, device=device)
            value_cache = torch.empty_like(key_cache)
        except (RuntimeError, MemoryError) as e:  # e.g. vm.overcommit_memory=2
            pytest.skip(f"cannot reserve a {num_blocks}-block pool here: {e}")
        id_map = num_blocks - 1 - torch.randperm(4 * (num_used + 1), device=device)[: num_used + 1]
    garbage = ~valid[:, :, None, None]  # [num_used + 1, block_size, 1, 1]
    key_cache[id_map] = torch.where(garbage, float("nan"), ref_k)
    value_cache[id_map] = torch.where(garbage, float("nan"), ref_v)
    block_tables = id_map[ref_tables.long()].to(torch.int32)
    return PagedKV(
        key_cache=key_cache,
        value_cache=value_cache,
        block_tables=block_tables,
        ref_key_cache=ref_k,
        ref_value_cache=ref_v,
        ref_block_tables=ref_tables,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
    )


# The compiled (non-interpreted) kernels, built for an H100 (sm_90) in one child process: the
# kernels in this process are interpreted, and triton.compile needs the real @triton.jit
# functions. Compiling needs no GPU (Triton ships ptxas), so CPU-only CI still proves that the
# GPU path builds. Arg types use Triton's names; stride_* default to i64; "tl.<dtype>"
# constexprs become Triton dtypes.
_BF16_ATTENTION_ARGS = dict(
    query_ptr="*bf16",
    key_cache_ptr="*bf16",
    value_cache_ptr="*bf16",
    block_tables_ptr="*i32",
    seq_lens_ptr="*i32",
    qk_scale="fp32",
    sliding_window="i32",
)
# The quantized KV cache's constexprs (kernels/_kv_quant_triton.quant_args) per cache type.
_NOT_QUANTIZED = dict(
    QUANTIZED=False, QMAX=0.0, ROUND_TO_INT=False, SOFT_FP8_ROUND=False, HADAMARD_BLOCK=1
)
_QUANTIZED = {
    "int8": ("*i8", dict(QUANTIZED=True, QMAX=127.0, ROUND_TO_INT=True, SOFT_FP8_ROUND=False)),
    "fp8": ("*fp8e4nv", dict(QUANTIZED=True, QMAX=448.0, ROUND_TO_INT=False, SOFT_FP8_ROUND=False)),
}
# kv_quant.hadamard_block of the builds' head dims (64 for store_kv, 128 for rope_and_store)
_HADAMARD = {64: dict(HADAMARD_BLOCK=32), 128: dict(HADAMARD_BLOCK=64)}
SM90_BUILDS: dict[str, tuple[str, str, dict[str, str], dict[str, object]]] = {
    "store_kv": (
        "kernels.store_kv", "_store_kv_kernel",
        dict(key_ptr="*bf16", value_ptr="*bf16", key_cache_ptr="*bf16", value_cache_ptr="*bf16",
             slot_mapping_ptr="*i64", key_offset_ptr="*bf16"),
        dict(NUM_KV_HEADS=3, HEAD_DIM=64, KV_HEADS_PAD=4, HEAD_DIM_PAD=64, BLOCK_SIZE=16,
             HAS_KEY_OFFSET=False, **_NOT_QUANTIZED),
    ),
    **{
        f"store_kv_{name}": (
            "kernels.store_kv", "_store_kv_kernel",
            dict(key_ptr="*bf16", value_ptr="*bf16", key_cache_ptr=ptr, value_cache_ptr=ptr,
                 slot_mapping_ptr="*i64", key_offset_ptr="*fp32"),
            dict(NUM_KV_HEADS=3, HEAD_DIM=64, KV_HEADS_PAD=4, HEAD_DIM_PAD=64, BLOCK_SIZE=16,
                 HAS_KEY_OFFSET=True, **quant, **_HADAMARD[64]),
        )
        for name, (ptr, quant) in _QUANTIZED.items()
    },
    # decode: unsplit, split with the second merge kernel, split merged in the same launch
    # (atomic arrival counters; at the Llama-3-8B shape too)
    **{
        f"decode_{mode}": (
            "kernels.paged_attention", "_paged_attention_decode_kernel",
            dict(_BF16_ATTENTION_ARGS, out_ptr="*fp32" if split else "*bf16", lse_ptr="*fp32",
                 final_out_ptr="*bf16", counters_ptr="*i32", tokens_per_split="i32"),
            dict(NUM_QUERIES_PER_KV=group, GROUP_PAD=16, HEAD_DIM=head_dim,
                 HEAD_DIM_PAD=head_dim, BLOCK_SIZE=16, TILE_N=64, SPLIT=split, COMBINE=combine,
                 SPLITS_PAD=8 if combine else 1, DOT_DTYPE="tl.bfloat16",
                 DOT_PRECISION="tf32", QUANTIZED=False, HADAMARD_BLOCK=1),
        )
        for mode, split, combine, group, head_dim in (
            ("split=False", False, False, 3, 64), ("split=True", True, False, 3, 64),
            ("one_launch", True, True, 3, 64), ("one_launch_llama3", True, True, 4, 128),
        )
    },
    **{
        f"decode_{name}{suffix}": (
            "kernels.paged_attention", "_paged_attention_decode_kernel",
            dict(_BF16_ATTENTION_ARGS, key_cache_ptr=ptr, value_cache_ptr=ptr,
                 out_ptr="*fp32" if combine else "*bf16", lse_ptr="*fp32",
                 final_out_ptr="*bf16", counters_ptr="*i32", tokens_per_split="i32"),
            dict(NUM_QUERIES_PER_KV=3, GROUP_PAD=16, HEAD_DIM=64, HEAD_DIM_PAD=64, BLOCK_SIZE=16,
                 TILE_N=64, SPLIT=combine, COMBINE=combine, SPLITS_PAD=8 if combine else 1,
                 DOT_DTYPE="tl.bfloat16",
                 DOT_PRECISION="tf32", QUANTIZED=True, **_HADAMARD[64]),
        )
        for name, (ptr, _) in _QUANTIZED.items()
        for suffix, combine in (("", False), ("_one_launch", True))
    },
    **{
        name: (
            "kernels.rms_norm", "_rms_norm_kernel",
            dict(out_ptr="*bf16", x_ptr="*bf16", residual_ptr="*bf16", weight_ptr="*bf16",
                 eps="fp32"),
            dict(HIDDEN_SIZE=576, HIDDEN_PAD=1024, HAS_RESIDUAL=has_residual,
                 DTYPE="tl.bfloat16", SOFT_BF16_ROUND=False),
        )
        for name, has_residual in (("rms_norm", False), ("add_rms_norm", True))
    },
    "silu_mul": (
        "kernels.silu_mul", "_silu_mul_kernel",
        dict(out_ptr="*bf16", gate_up_ptr="*bf16"),
        dict(INTERMEDIATE_SIZE=1536, BLOCK=1024, DTYPE="tl.bfloat16", SOFT_BF16_ROUND=False),
    ),
    **{
        f"quant_matmul_{mode}": (
            "kernels.quant_matmul", "_quant_matmul_kernel",
            dict(out_ptr="*bf16", x_ptr="*bf16", weight_ptr="*i8" if mode == "int8" else "*u8",
                 scale_ptr="*fp32", bias_ptr="*bf16", M="i32", N="i32", K="i32"),
            dict(HAS_BIAS=bias, FP8=mode == "fp8", BLOCK_M=block[0], BLOCK_N=block[1],
                 BLOCK_K=block[2], DTYPE="tl.bfloat16", DOT_DTYPE="tl.bfloat16",
                 DOT_PRECISION="tf32"),
        )
        # the decode tiles (kernels.quant_matmul.tile_shape) and the larger batches'
        for mode, bias, block in (("int8", False, (16, 32, 128)), ("fp8", True, (64, 64, 64)))
    },
    # the split-K decode kernel (kernels.quant_matmul.choose_launch): one row without tl.dot,
    # finished in the same kernel; a few rows on tl.dot into partials; a broadcast tile of
    # 4 rows at 8 warps (the sweep's shapes); the partials' reduction
    **{
        f"quant_matmul_split_k_{name}": (
            "kernels.quant_matmul", "_quant_matmul_split_k_kernel",
            dict(out_ptr="*bf16", partial_ptr="*fp32" if split else "*bf16", x_ptr="*bf16",
                 weight_ptr="*i8" if mode == "int8" else "*u8", scale_ptr="*fp32",
                 bias_ptr="*bf16", M="i32", N="i32", K="i32", k_per_split="i32"),
            dict(HAS_BIAS=bias, FP8=mode == "fp8", SPLIT=split, DOT=dot, BLOCK_M=block[0],
                 BLOCK_N=block[1], BLOCK_K=block[2], NUM_STAGES=3, DTYPE="tl.bfloat16",
                 DOT_DTYPE="tl.bfloat16", DOT_PRECISION="tf32"),
        )
        for name, mode, bias, split, dot, block in (
            ("int8_row", "int8", True, False, False, (1, 256, 64)),
            ("int8_dot", "int8", False, True, True, (16, 128, 64)),
            ("fp8_row", "fp8", False, True, False, (1, 256, 32)),
            ("fp8_dot", "fp8", True, False, True, (16, 64, 128)),
            ("int8_rows4", "int8", False, True, False, (4, 128, 32)),
        )
    },
    "quant_matmul_reduce_splits": (
        "kernels.quant_matmul", "_reduce_splits_kernel",
        dict(out_ptr="*bf16", partial_ptr="*fp32", scale_ptr="*fp32", bias_ptr="*bf16",
             M="i32", N="i32", num_splits="i32"),
        dict(HAS_BIAS=True, SPLITS_PAD=16, BLOCK_N=256, DTYPE="tl.bfloat16"),
    ),
    **{
        name: (
            "kernels.rope_and_store", "_rope_and_store_kernel",
            dict(qkv_ptr="*bf16", cos_ptr="*bf16", sin_ptr="*bf16", key_cache_ptr="*bf16",
                 value_cache_ptr="*bf16", slot_mapping_ptr="*i64", key_offset_ptr="*bf16"),
            dict(NUM_HEADS=32, NUM_KV_HEADS=8, HEAD_DIM=128, HALF_PAD=64, BLOCK_H=block_h,
                 BLOCK_SIZE=16, DTYPE="tl.bfloat16", SOFT_BF16_ROUND=False,
                 HAS_KEY_OFFSET=False, **_NOT_QUANTIZED),
        )
        # the default tile (32 heads) and the benchmark's alternative (8)
        for name, block_h in (("rope_and_store", 32), ("rope_and_store_h8", 8))
    },
    **{
        f"rope_and_store_{name}": (
            "kernels.rope_and_store", "_rope_and_store_kernel",
            dict(qkv_ptr="*bf16", cos_ptr="*bf16", sin_ptr="*bf16", key_cache_ptr=ptr,
                 value_cache_ptr=ptr, slot_mapping_ptr="*i64", key_offset_ptr="*fp32"),
            dict(NUM_HEADS=32, NUM_KV_HEADS=8, HEAD_DIM=128, HALF_PAD=64, BLOCK_H=32,
                 BLOCK_SIZE=16, DTYPE="tl.bfloat16", SOFT_BF16_ROUND=False, HAS_KEY_OFFSET=True,
                 **quant, **_HADAMARD[128]),
        )
        for name, (ptr, quant) in _QUANTIZED.items()
    },
    "reduce_splits": (
        "kernels.paged_attention", "_reduce_splits_kernel",
        dict(out_ptr="*bf16", partial_out_ptr="*fp32", lse_ptr="*fp32", num_splits="i32"),
        dict(SPLITS_PAD=8, HEAD_DIM=128, HEAD_DIM_PAD=128),
    ),
    # num_seqs is not specialised (kernels/prefill_attention.py), so one variant serves
    # every batch, one sequence included.
    "prefill": (
        "kernels.prefill_attention", "_paged_attention_prefill_kernel",
        dict(_BF16_ATTENTION_ARGS, out_ptr="*bf16", query_start_loc_ptr="*i32", num_seqs="i32"),
        dict(NUM_QUERIES_PER_KV=3, GROUP_PAD=4, BLOCK_Q=16, BLOCK_M=64, HEAD_DIM=64,
             HEAD_DIM_PAD=64, BLOCK_SIZE=16, TILE_N=64, DOT_DTYPE="tl.bfloat16",
             DOT_PRECISION="tf32", QUANTIZED=False, HADAMARD_BLOCK=1),
    ),
    **{
        f"prefill_{name}": (
            "kernels.prefill_attention", "_paged_attention_prefill_kernel",
            dict(_BF16_ATTENTION_ARGS, key_cache_ptr=ptr, value_cache_ptr=ptr, out_ptr="*bf16",
                 query_start_loc_ptr="*i32", num_seqs="i32"),
            dict(NUM_QUERIES_PER_KV=3, GROUP_PAD=4, BLOCK_Q=16, BLOCK_M=64, HEAD_DIM=64,
                 HEAD_DIM_PAD=64, BLOCK_SIZE=16, TILE_N=64, DOT_DTYPE="tl.bfloat16",
                 DOT_PRECISION="tf32", QUANTIZED=True, **_HADAMARD[64]),
        )
        for name, (ptr, _) in _QUANTIZED.items()
    },
}  # fmt: skip

_COMPILE_SCRIPT = r"""
import importlib, json, sys, traceback
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

results = {}
for name, (module, kernel, signature, constexprs) in json.loads(sys.argv[1]).items():
    try:
        fn = getattr(importlib.import_module(module), kernel)
        constexprs = {k: getattr(tl, v[3:]) if isinstance(v, str) and v.startswith("tl.") else v
                      for k, v in constexprs.items()}
        names = fn.arg_names
        full = {n: "constexpr" if n in constexprs else
                signature.get(n, "i64" if n.startswith("stride_") else None) for n in names}
        missing = [n for n, t in full.items() if t is None]
        assert not missing, f"no type for {missing}"
        src = ASTSource(fn=fn, signature=full,
                        constexprs={(names.index(k),): v for k, v in constexprs.items()})
        triton.compile(src, target=GPUTarget("cuda", 90, 32))
        results[name] = None
    except Exception:
        results[name] = traceback.format_exc()[-3000:]
print(json.dumps(results))
"""


@pytest.fixture(scope="session")
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as /proc/cpuinfo lists them (empty where there is none): what
    a ``-march=native`` build of the C++ kernels compiles for."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


@pytest.fixture(scope="session")
def sm90_build_errors() -> dict[str, str | None]:
    """``SM90_BUILDS`` name -> None if it compiled for sm_90, else the error text."""
    pytest.importorskip("triton.backends.nvidia", reason="Triton without its CUDA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-c", _COMPILE_SCRIPT, json.dumps(SM90_BUILDS)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture
def paged_kv() -> Callable[..., PagedKV]:
    """Factory fixture: ``paged_kv(seq_lens, block_size=..., ...)`` -> ``PagedKV``."""
    return build_paged_kv
