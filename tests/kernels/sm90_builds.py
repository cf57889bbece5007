"""The Triton kernels' sm_90 builds: what ``sm90_build_errors`` (tests/kernels/conftest.py)
compiles, and each kernel's ``test_compiles_for_sm90`` checks.

The kernels in a test process are interpreted, and ``triton.compile`` needs the real
``@triton.jit`` functions, so a child process compiles every build here for an H100 (sm_90).
Compiling needs no GPU (Triton ships ptxas), so CPU-only CI still proves that the GPU path
builds: each launch the engine makes, in each dtype, with the launch's compile options
(warps, stages, fp fusion). The launch parameters come from the launchers' own choice
functions (``DECODE_TUNING`` through ``tuned_launches``, ``quant_matmul.choose_launch``,
``rms_norm.choose_num_warps``, ``rope_and_store.COMPILE_OPTIONS``), so a retuned table is
compiled here without an edit.

A build names its kernel's argument types as Triton writes them (``"*bf16"``, ``"i32"``;
``stride_*`` default to ``"i64"``), its constexprs (strings ``"tl.<dtype>"`` become Triton
dtypes) and the options the launcher passes besides them. The compile specialises what the
JIT specialises at the engine's launches (tests/kernels/conftest.py): pointers as 16-byte
aligned and ``stride_*`` integers as divisible by 16, except the arguments a kernel opts out
of specialising, and the integers a build lists in ``divisible`` (a matmul's N and K at a
model's shapes); other integers stay unspecialised.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

import torch

from kernels import kv_quant, prefill_attention, quant_matmul, rms_norm, rope_and_store, silu_mul
from kernels._common import dot_precision
from kernels.paged_attention import DecodeLaunch, tuned_launches
from kernels.settings import next_power_of_2

__all__ = ["SM90_BUILDS", "Sm90Build", "build_specs", "builds_of"]


@dataclass(frozen=True)
class Sm90Build:
    """One ``triton.compile`` of one kernel for sm_90."""

    module: str  # the kernel's module, e.g. "kernels.store_kv"
    kernel: str  # the @triton.jit function's name in it
    signature: dict[str, str]  # argument -> Triton type (stride_* default to "i64")
    constexprs: dict[str, object]  # "tl.<dtype>" strings stand for Triton dtypes
    # triton.compile options, as the launcher passes them (num_warps, num_stages,
    # enable_fp_fusion, ...); absent ones take Triton's defaults, as at a launch
    options: dict[str, object] = field(default_factory=dict)
    # Text the sm_90 PTX must hold (an instruction the launch exists for), else the build fails
    ptx_contains: tuple[str, ...] = ()
    # Integer arguments besides strides that the launches pass as multiples of 16 (a model's
    # shapes), which the JIT then specialises as such: without it a weight row's address is
    # not known to be aligned and its loads compile to 2-byte scalars no GPU runs.
    divisible: tuple[str, ...] = ()
    # Texts whose first occurrences in the PTX must come in this order (a load issued before
    # a programmatic dependent launch's wait), else the build fails
    ptx_order: tuple[str, ...] = ()


# Triton's pointer type and constexpr dtype of each model dtype; the bf16 builds keep the
# unsuffixed names.
_PTR = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32"}
_TL = {torch.bfloat16: "tl.bfloat16", torch.float16: "tl.float16", torch.float32: "tl.float32"}
_SUFFIX = {torch.bfloat16: "", torch.float16: "_fp16", torch.float32: "_fp32"}
DTYPES = tuple(_PTR)
# Quantized KV caches (kernels/kv_quant.py): their pointer type and name.
_CACHE_PTR = {torch.int8: "*i8", torch.float8_e4m3fn: "*fp8e4nv"}
_CACHE_NAME = {torch.int8: "int8", torch.float8_e4m3fn: "fp8"}
# What a programmatic dependent launch's kernel must issue: the wait before reading what the
# kernel before wrote, and the signal that lets the next one launch.
_PDL_PTX = ("griddepcontrol.wait", "griddepcontrol.launch_dependents")
# SMs of an H100 (and an H200): what the launchers' split-K counts are sized for.
H100_SMS = 132
# Llama-3-8B: attention (32 query heads on 8 KV heads of 128) and its decode matmuls'
# (K, N): qkv, o, gate/up, down, LM head.
LLAMA3_GROUP, LLAMA3_HEAD_DIM = 4, 128
LLAMA3_MATMULS = ((4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096), (4096, 128256))


def _quant_store_args(cache: torch.dtype | None, head_dim: int) -> dict[str, object]:
    """A store kernel's quantization constexprs, compiled (kernels/_kv_quant_triton.quant_args)."""
    if cache is None:
        return dict(
            QUANTIZED=False, QMAX=0.0, ROUND_TO_INT=False, SOFT_FP8_ROUND=False, HADAMARD_BLOCK=1
        )
    return dict(
        QUANTIZED=True,
        QMAX=kv_quant.QMAX[cache],
        ROUND_TO_INT=cache == torch.int8,
        SOFT_FP8_ROUND=False,
        HADAMARD_BLOCK=kv_quant.hadamard_block(head_dim),
    )


def _cache_ptr(dtype: torch.dtype, cache: torch.dtype | None) -> str:
    return _PTR[dtype] if cache is None else _CACHE_PTR[cache]


def _store_kv(
    dtype: torch.dtype, cache: torch.dtype | None, num_kv_heads: int, head_dim: int
) -> Sm90Build:
    """kernels.store_kv's launch; a quantized cache with a key offset."""
    c = _cache_ptr(dtype, cache)
    return Sm90Build(
        "kernels.store_kv", "_store_kv_kernel",
        dict(key_ptr=_PTR[dtype], value_ptr=_PTR[dtype], key_cache_ptr=c, value_cache_ptr=c,
             slot_mapping_ptr="*i64", key_offset_ptr=c if cache is None else "*fp32"),
        dict(NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
             KV_HEADS_PAD=next_power_of_2(num_kv_heads), HEAD_DIM_PAD=next_power_of_2(head_dim),
             BLOCK_SIZE=16, HAS_KEY_OFFSET=cache is not None,
             **_quant_store_args(cache, head_dim)),
    )  # fmt: skip


def _attention_args(dtype: torch.dtype, cache: torch.dtype | None) -> dict[str, str]:
    c = _cache_ptr(dtype, cache)
    return dict(query_ptr=_PTR[dtype], key_cache_ptr=c, value_cache_ptr=c,
                block_tables_ptr="*i32", seq_lens_ptr="*i32", qk_scale="fp32",
                sliding_window="i32")  # fmt: skip


def _attention_consts(
    dtype: torch.dtype, cache: torch.dtype | None, head_dim: int
) -> dict[str, object]:
    return dict(
        DOT_DTYPE=_TL[dtype],
        DOT_PRECISION=dot_precision(dtype),
        QUANTIZED=cache is not None,
        HADAMARD_BLOCK=1 if cache is None else kv_quant.hadamard_block(head_dim),
    )


def _decode(
    dtype: torch.dtype,
    cache: torch.dtype | None,
    group: int,
    head_dim: int,
    launch: DecodeLaunch,
) -> Sm90Build:
    """kernels.paged_attention_decode's first kernel at ``launch`` over a context of
    ``launch.num_splits`` tiles (so that the launcher's recount keeps that many splits)."""
    split = launch.num_splits > 1
    combine = split and launch.one_launch
    q = _PTR[dtype]
    option, ptx = _pdl(launch.pdl)
    return Sm90Build(
        "kernels.paged_attention", "_paged_attention_decode_kernel",
        dict(_attention_args(dtype, cache), out_ptr="*fp32" if split else q,
             lse_ptr="*fp32" if split else q, final_out_ptr=q, counters_ptr="*i32",
             tokens_per_split="i32", max_blocks_per_seq="i32"),
        dict(NUM_QUERIES_PER_KV=group, GROUP_PAD=max(16, next_power_of_2(group)),
             HEAD_DIM=head_dim, HEAD_DIM_PAD=max(16, next_power_of_2(head_dim)), BLOCK_SIZE=16,
             TILE_N=launch.tile_n, SPLIT=split, COMBINE=combine, EARLY_V=launch.early_v,
             PREFETCH_IDS=launch.prefetch_ids, PDL=launch.pdl,
             SPLITS_PAD=next_power_of_2(launch.num_splits) if combine else 1,
             **_attention_consts(dtype, cache, head_dim)),
        dict(num_warps=launch.num_warps, num_stages=launch.num_stages, **option),
        ptx,
    )  # fmt: skip


def _decode_reduce(
    dtype: torch.dtype, head_dim: int, splits_pad: int, pdl: bool = False
) -> Sm90Build:
    """kernels.paged_attention's second kernel (the two-launch split-K merge)."""
    return Sm90Build(
        "kernels.paged_attention",
        "_reduce_splits_kernel",
        dict(out_ptr=_PTR[dtype], partial_out_ptr="*fp32", lse_ptr="*fp32", num_splits="i32"),
        dict(SPLITS_PAD=splits_pad, HEAD_DIM=head_dim, HEAD_DIM_PAD=next_power_of_2(head_dim),
             PDL=pdl),
        *_pdl(pdl),
    )  # fmt: skip


def _tuned_decode(
    dtype: torch.dtype, cache: torch.dtype | None, group: int, head_dim: int
) -> dict[str, Sm90Build]:
    """Every variant ``DECODE_TUNING`` launches (``tuned_launches``) at this shape: the
    decode kernel per (warps, stages, tile, split, merge) and the merge kernel per split
    count's power of two."""
    prefix = f"decode{'_' + _CACHE_NAME[cache] if cache else ''}{_SUFFIX[dtype]}"
    builds: dict[str, Sm90Build] = {}
    for launch in tuned_launches():
        split = launch.num_splits > 1
        pad = next_power_of_2(launch.num_splits)
        name = f"{prefix}_g{group}_d{head_dim}_w{launch.num_warps}s{launch.num_stages}"
        name += f"t{launch.tile_n}" + ("v" if launch.early_v else "")
        name += ("i" if launch.prefetch_ids else "") + ("_pdl" if launch.pdl else "")
        if split:
            name += f"_one_launch{pad}" if launch.one_launch else "_split"
        builds[name] = _decode(dtype, cache, group, head_dim, launch)
        if split and not launch.one_launch and cache is None:
            reduce = f"reduce_splits{_SUFFIX[dtype]}_d{head_dim}_p{pad}"
            reduce += "_pdl" if launch.pdl else ""
            builds[reduce] = _decode_reduce(dtype, head_dim, pad, launch.pdl)
    return builds


def _prefill(dtype: torch.dtype, cache: torch.dtype | None, group: int, head_dim: int) -> Sm90Build:
    """kernels.paged_attention_prefill's launch (Triton's default warps and stages); the
    number of sequences is not specialised, so one variant serves every batch."""
    group_pad = next_power_of_2(group)
    block_q = max(1, prefill_attention.BLOCK_M // group_pad)
    return Sm90Build(
        "kernels.prefill_attention", "_paged_attention_prefill_kernel",
        dict(_attention_args(dtype, cache), out_ptr=_PTR[dtype], query_start_loc_ptr="*i32",
             num_seqs="i32"),
        dict(NUM_QUERIES_PER_KV=group, GROUP_PAD=group_pad, BLOCK_Q=block_q,
             BLOCK_M=block_q * group_pad, HEAD_DIM=head_dim,
             HEAD_DIM_PAD=max(16, next_power_of_2(head_dim)), BLOCK_SIZE=16,
             TILE_N=prefill_attention.TILE_N, **_attention_consts(dtype, cache, head_dim)),
    )  # fmt: skip


def _pdl(pdl: bool) -> tuple[dict[str, object], tuple[str, ...]]:
    """A PDL-capable kernel's launch option and required PTX (kernels/_triton_common.pdl_args)."""
    return ({"launch_pdl": True}, _PDL_PTX) if pdl else ({}, ())


def _rms_norm(
    dtype: torch.dtype,
    hidden_size: int,
    has_residual: bool,
    num_warps: int | None = None,
    pdl: bool = False,
) -> Sm90Build:
    """kernels.rms_norm's launch, at the warps it picks for ``hidden_size`` unless
    ``num_warps``."""
    if num_warps is None:
        num_warps = rms_norm.choose_num_warps(hidden_size)
    p = _PTR[dtype]
    option, ptx = _pdl(pdl)
    return Sm90Build(
        "kernels.rms_norm", "_rms_norm_kernel",
        dict(out_ptr=p, x_ptr=p, residual_ptr=p, weight_ptr=p, eps="fp32"),
        dict(HIDDEN_SIZE=hidden_size, HIDDEN_PAD=next_power_of_2(hidden_size),
             HAS_RESIDUAL=has_residual, DTYPE=_TL[dtype], SOFT_BF16_ROUND=False, PDL=pdl),
        dict(num_warps=num_warps, **option),
        ptx,
        # a dependent launch loads the weight while the kernel before still runs
        ptx_order=("ld.global", "griddepcontrol.wait") if pdl else (),
    )  # fmt: skip


def _silu_mul(dtype: torch.dtype, intermediate_size: int, pdl: bool = False) -> Sm90Build:
    option, ptx = _pdl(pdl)
    return Sm90Build(
        "kernels.silu_mul", "_silu_mul_kernel",
        dict(out_ptr=_PTR[dtype], gate_up_ptr=_PTR[dtype]),
        dict(INTERMEDIATE_SIZE=intermediate_size, BLOCK=silu_mul.BLOCK, DTYPE=_TL[dtype],
             SOFT_BF16_ROUND=False, PDL=pdl),
        option,
        ptx,
    )  # fmt: skip


def _rope(
    dtype: torch.dtype,
    cache: torch.dtype | None,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_h: int | None = None,
    pdl: bool = False,
) -> Sm90Build:
    """kernels.rope_and_store_'s launch with its compile options (no fp fusion); its
    default tile unless ``block_h``; a quantized cache with a key offset."""
    p, c = _PTR[dtype], _cache_ptr(dtype, cache)
    if block_h is None:
        block_h = rope_and_store.choose_block_h(num_heads + num_kv_heads, head_dim)
    option, ptx = _pdl(pdl)
    return Sm90Build(
        "kernels.rope_and_store", "_rope_and_store_kernel",
        dict(qkv_ptr=p, cos_ptr=p, sin_ptr=p, key_cache_ptr=c, value_cache_ptr=c,
             slot_mapping_ptr="*i64", key_offset_ptr=c if cache is None else "*fp32"),
        dict(NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
             HALF_PAD=next_power_of_2(head_dim // 2), BLOCK_H=block_h, BLOCK_SIZE=16,
             DTYPE=_TL[dtype], SOFT_BF16_ROUND=False, HAS_KEY_OFFSET=cache is not None,
             PDL=pdl, **_quant_store_args(cache, head_dim)),
        dict(rope_and_store.COMPILE_OPTIONS, **option),
        ptx,
        # a dependent launch loads cos, sin and the slot while the kernel before still runs
        ptx_order=("ld.global", "griddepcontrol.wait") if pdl else (),
    )  # fmt: skip


def _weight_ptr(fp8: bool) -> str:
    return "*u8" if fp8 else "*i8"  # the launcher passes an fp8 weight as its bytes


# A split-K build's weight: "int8", "fp8", or "dense" (the activations' dtype, dense_matmul).
_WEIGHTS = ("int8", "fp8", "dense")


def _tiled(
    dtype: torch.dtype, fp8: bool, bias: bool, launch: quant_matmul.TiledLaunch
) -> Sm90Build:
    """kernels.quant_matmul's tiled kernel (Triton's default warps and stages)."""
    p = _PTR[dtype]
    return Sm90Build(
        "kernels.quant_matmul", "_quant_matmul_kernel",
        dict(out_ptr=p, x_ptr=p, weight_ptr=_weight_ptr(fp8), scale_ptr="*fp32", bias_ptr=p,
             M="i32", N="i32", K="i32"),
        dict(HAS_BIAS=bias, FP8=fp8, BLOCK_M=launch.block_m, BLOCK_N=launch.block_n,
             BLOCK_K=launch.block_k, DTYPE=_TL[dtype], DOT_DTYPE=_TL[dtype],
             DOT_PRECISION=dot_precision(dtype)),
    )  # fmt: skip


def _split_k(
    dtype: torch.dtype,
    weight: str,
    bias: bool,
    split: bool,
    launch: quant_matmul.SplitKLaunch,
    pdl: bool = False,
    model_shape: bool = False,
    splits_pad: int = 1,
) -> Sm90Build:
    """kernels.quant_matmul's split-K kernel at ``launch`` (``split``: after the launcher's
    recount, more than one split, writing float32 partials) on a ``weight`` of
    ``_WEIGHTS``; a PDL launch loads its first weight tile before the wait.
    ``model_shape``: N and K (and so each split's K rows) are multiples of 16. A split
    ``launch.one_launch`` sums its ``splits_pad`` (padded) splits in the same launch."""
    assert weight in _WEIGHTS, weight
    p = _PTR[dtype]
    dense = weight == "dense"
    combine = split and launch.one_launch
    option, ptx = _pdl(pdl)
    return Sm90Build(
        "kernels.quant_matmul", "_quant_matmul_split_k_kernel",
        dict(out_ptr=p, partial_ptr="*fp32" if split else p,
             counters_ptr="*i32" if combine else "*fp32" if split else p, x_ptr=p,
             weight_ptr=p if dense else _weight_ptr(weight == "fp8"),
             scale_ptr=p if dense else "*fp32", bias_ptr=p, M="i32", N="i32", K="i32",
             k_per_split="i32"),
        dict(HAS_BIAS=bias, FP8=weight == "fp8", DENSE=dense, SPLIT=split, COMBINE=combine,
             SPLITS_PAD=splits_pad if combine else 1, DOT=launch.dot,
             PREFETCH=launch.prefetch or pdl, PDL=pdl, BLOCK_M=launch.block_m,
             BLOCK_N=launch.block_n, BLOCK_K=launch.block_k, NUM_STAGES=launch.num_stages,
             DTYPE=_TL[dtype], DOT_DTYPE=_TL[dtype], DOT_PRECISION=dot_precision(dtype)),
        dict(num_warps=launch.num_warps, num_stages=launch.num_stages, **option,
             **({"maxnreg": launch.maxnreg} if launch.maxnreg else {})),
        # the one-launch sum: a ticket that releases the partials, read past L1; a register
        # cap as the kernel's .maxnreg
        ptx + (("atom.global.gpu.acq_rel.add", "ld.global.cg") if combine else ())
        + ((f".maxnreg {launch.maxnreg}",) if launch.maxnreg else ()),
        ("N", "K", "k_per_split") if model_shape else (),
        # the first weight tile's 16-byte loads, then the wait for x
        ("ld.global.v4.b32", "griddepcontrol.wait") if pdl and model_shape else (),
    )  # fmt: skip


def _matmul_reduce(
    dtype: torch.dtype, bias: bool, splits_pad: int, dense: bool = False, pdl: bool = False
) -> Sm90Build:
    """kernels.quant_matmul's reduction of split-K partials."""
    p = _PTR[dtype]
    option, ptx = _pdl(pdl)
    return Sm90Build(
        "kernels.quant_matmul", "_reduce_splits_kernel",
        dict(out_ptr=p, partial_ptr="*fp32", scale_ptr=p if dense else "*fp32", bias_ptr=p,
             M="i32", N="i32", num_splits="i32"),
        dict(HAS_BIAS=bias, DENSE=dense, PDL=pdl, SPLITS_PAD=splits_pad,
             BLOCK_N=quant_matmul.REDUCE_BLOCK_N, DTYPE=_TL[dtype]),
        option,
        ptx,
    )  # fmt: skip


def _chosen_matmuls(dtype: torch.dtype, weight: str, pdl: bool = False) -> dict[str, Sm90Build]:
    """Every launch ``quant_matmul.choose_launch`` makes on an H100 for Llama-3-8B's
    decode matmuls at 1 and 16 rows on a ``weight`` of ``_WEIGHTS`` (as programmatic
    dependent launches if ``pdl``), and for the quantized weights the tiled launches of
    17..LIBRARY_ROWS rows (dense ones take the library's matmul there)."""
    prefix = f"quant_matmul_{weight}{_SUFFIX[dtype]}" + ("_pdl" if pdl else "")
    dense = weight == "dense"
    builds: dict[str, Sm90Build] = {}
    for rows in (1, quant_matmul.DECODE_ROWS):
        for k, n in LLAMA3_MATMULS:
            launch = quant_matmul.choose_launch(rows, n, k, H100_SMS)
            assert isinstance(launch, quant_matmul.SplitKLaunch), launch
            _, num_splits = quant_matmul.split_k_rows(k, launch.block_k, launch.num_splits)
            split = num_splits > 1
            tile = f"m{launch.block_m}n{launch.block_n}k{launch.block_k}"
            name = f"{prefix}_split_k_{tile}_w{launch.num_warps}s{launch.num_stages}"
            name += ("_dot" if launch.dot else "_broadcast") + ("_split" if split else "")
            builds[name] = _split_k(dtype, weight, False, split, launch, pdl, model_shape=True)
            if split and dense:  # the sweep's one-launch alternative to the reduction
                summed = replace(launch, one_launch=True)
                pad = next_power_of_2(num_splits)
                builds[f"{name}_one_launch"] = _split_k(
                    dtype, weight, False, split, summed, pdl, model_shape=True, splits_pad=pad
                )
                regs = quant_matmul.two_programs_regs(launch.num_warps)
                if regs < 255:  # stage D's capped one: two programs an SM
                    builds[f"{name}_one_launch_r{regs}"] = _split_k(
                        dtype, weight, False, split, replace(summed, maxnreg=regs), pdl,
                        model_shape=True, splits_pad=pad,
                    )  # fmt: skip
            if split:
                pad = next_power_of_2(num_splits)
                reduce = f"quant_matmul_reduce{_SUFFIX[dtype]}" + ("_dense" if dense else "")
                builds[f"{reduce}{'_pdl' if pdl else ''}_p{pad}"] = _matmul_reduce(
                    dtype, False, pad, dense, pdl
                )
    if dense:
        return builds
    for rows in range(quant_matmul.DECODE_ROWS + 1, quant_matmul.LIBRARY_ROWS + 1):
        launch = quant_matmul.choose_launch(rows, 4096, 4096, H100_SMS)
        assert isinstance(launch, quant_matmul.TiledLaunch), launch
        tile = f"m{launch.block_m}n{launch.block_n}k{launch.block_k}"
        builds[f"{prefix}_tiled_{tile}"] = _tiled(dtype, weight == "fp8", False, launch)
    return builds


_INT8, _FP8 = torch.int8, torch.float8_e4m3fn
_BF16 = torch.bfloat16
# The small shapes: SmolLM2-135M (9 query heads on 3 KV heads of 64, hidden 576,
# intermediate 1536).
SM90_BUILDS: dict[str, Sm90Build] = {
    # -- store_kv: bf16, the other dtypes, the quantized caches
    **{f"store_kv{_SUFFIX[d]}": _store_kv(d, None, 3, 64) for d in DTYPES},
    **{f"store_kv_{_CACHE_NAME[c]}": _store_kv(_BF16, c, 3, 64) for c in (_INT8, _FP8)},
    # -- decode at the default launch: unsplit, split with the second merge kernel, split
    # merged in the same launch (atomic arrival counters; at the Llama-3-8B shape too)
    "decode_split=False": _decode(_BF16, None, 3, 64, DecodeLaunch()),
    "decode_split=True": _decode(_BF16, None, 3, 64, DecodeLaunch(num_splits=2)),
    "decode_one_launch": _decode(_BF16, None, 3, 64, DecodeLaunch(5, one_launch=True)),
    # each tile's V load beside its K load (the sweep's stage D), at the tuned rows'
    # launches without a software pipeline and with one
    **{
        f"decode_early_v_g4_d128_w{w}s{st}t{t}": _decode(
            _BF16, None, LLAMA3_GROUP, LLAMA3_HEAD_DIM, DecodeLaunch(4, False, w, st, t, True)
        )
        for w, st, t in ((4, 1, 64), (8, 1, 128), (4, 2, 32))
    },
    # the first tile's block ids loaded beside the sequence's length, alone and under a
    # programmatic dependent launch (the sweep's stage E), at the same three launches; the
    # merge kernel launched as a dependent; a sliding window's tiles start with the split's
    **{
        f"decode_{kind}_g4_d128_w{w}s{st}t{t}": _decode(
            _BF16,
            None,
            LLAMA3_GROUP,
            LLAMA3_HEAD_DIM,
            DecodeLaunch(4, False, w, st, t, True, prefetch_ids=True, pdl=kind == "pdl"),
        )
        for w, st, t in ((4, 1, 64), (8, 1, 128), (4, 2, 32))
        for kind in ("prefetch_ids", "pdl")
    },
    "decode_pdl_one_launch": _decode(
        _BF16, None, 3, 64, DecodeLaunch(5, one_launch=True, prefetch_ids=True, pdl=True)
    ),
    "decode_prefetch_ids_int8": _decode(_BF16, _INT8, 3, 64, DecodeLaunch(prefetch_ids=True)),
    **{f"reduce_splits_pdl_p{p}": _decode_reduce(_BF16, 128, p, True) for p in (4, 16)},
    "decode_one_launch_llama3": _decode(
        _BF16, None, LLAMA3_GROUP, LLAMA3_HEAD_DIM, DecodeLaunch(5, one_launch=True)
    ),
    **{
        f"decode_{_CACHE_NAME[c]}{suffix}": _decode(_BF16, c, 3, 64, launch)
        for c in (_INT8, _FP8)
        for suffix, launch in (("", DecodeLaunch()), ("_one_launch", DecodeLaunch(5, True)))
    },
    # -- decode at every tuned launch, Llama-3-8B shape: each dtype (fp32 multiplies in
    # "ieee"), and over the quantized caches
    **{
        name: build
        for d in DTYPES
        for name, build in _tuned_decode(d, None, LLAMA3_GROUP, LLAMA3_HEAD_DIM).items()
    },
    **{
        name: build
        for c in (_INT8, _FP8)
        for name, build in _tuned_decode(_BF16, c, LLAMA3_GROUP, LLAMA3_HEAD_DIM).items()
    },
    # -- prefill: each dtype at both shapes, the quantized caches
    **{f"prefill{_SUFFIX[d]}": _prefill(d, None, 3, 64) for d in DTYPES},
    **{
        f"prefill_llama3{_SUFFIX[d]}": _prefill(d, None, LLAMA3_GROUP, LLAMA3_HEAD_DIM)
        for d in DTYPES
    },
    **{f"prefill_{_CACHE_NAME[c]}": _prefill(_BF16, c, 3, 64) for c in (_INT8, _FP8)},
    # -- rms_norm, alone and fused with the residual add: each dtype at hidden 576, and at
    # the warps the launcher picks for Llama-3-8B (4,096) and 70B (8,192)
    **{
        f"{'add_' if residual else ''}rms_norm{_SUFFIX[d]}{size}": _rms_norm(d, hidden, residual)
        for d in DTYPES
        for size, hidden in (("", 576), ("_4096", 4096), ("_8192", 8192))
        for residual in (False, True)
    },
    # ... and the other warps benchmarks.kernels --fused times at 4,096
    **{f"add_rms_norm_4096_w{w}": _rms_norm(_BF16, 4096, True, w) for w in (4, 16)},
    # -- each fused layer op as a programmatic dependent launch (PAGEDSERVE_PDL=1), Llama-3-8B
    "add_rms_norm_4096_pdl": _rms_norm(_BF16, 4096, True, pdl=True),
    "rms_norm_4096_pdl": _rms_norm(_BF16, 4096, False, pdl=True),
    "silu_mul_14336_pdl": _silu_mul(_BF16, 14336, pdl=True),
    "rope_and_store_d128_pdl": _rope(_BF16, None, 32, 8, 128, pdl=True),
    # -- silu_mul: each dtype, SmolLM2's and Llama-3-8B's intermediate sizes
    **{f"silu_mul{_SUFFIX[d]}": _silu_mul(d, 1536) for d in DTYPES},
    **{f"silu_mul_14336{_SUFFIX[d]}": _silu_mul(d, 14336) for d in DTYPES},
    # -- rope_and_store: Llama-3-8B at the benchmark's tile (8 heads); each dtype at the
    # default tile at head dims 64 (SmolLM2), 128 (Llama-3-8B) and 256 (Gemma: 8 on 4 heads)
    "rope_and_store_h8": _rope(_BF16, None, 32, 8, 128, block_h=8),
    **{
        f"rope_and_store_d{head_dim}{_SUFFIX[d]}": _rope(d, None, heads, kv_heads, head_dim)
        for d in DTYPES
        for heads, kv_heads, head_dim in ((9, 3, 64), (32, 8, 128), (8, 4, 256))
    },
    **{f"rope_and_store_{_CACHE_NAME[c]}": _rope(_BF16, c, 32, 8, 128) for c in (_INT8, _FP8)},
    # -- quant_matmul: the tiled kernel at the old decode tile (the sweep's baseline) and
    # the larger batches'; the split-K kernel at the sweep's other shapes, with a bias
    "quant_matmul_int8": _tiled(_BF16, False, False, quant_matmul.TiledLaunch(16, 32, 128)),
    "quant_matmul_fp8": _tiled(_BF16, True, True, quant_matmul.TiledLaunch(64, 64, 64)),
    **{
        f"quant_matmul_split_k_{name}": _split_k(
            _BF16,
            weight,
            bias,
            split,
            quant_matmul.SplitKLaunch(*block, num_warps=warps, dot=dot, prefetch=prefetch),
        )
        for name, weight, bias, split, dot, block, warps, prefetch in (
            ("int8_row", "int8", True, False, False, (1, 256, 64), 8, False),
            ("fp8_row", "fp8", False, True, False, (1, 256, 32), 8, False),
            ("fp8_dot", "fp8", True, False, True, (16, 64, 128), 4, False),
            ("int8_rows4", "int8", False, True, False, (4, 128, 32), 8, False),
            ("dense_row_bias_prefetch", "dense", True, False, False, (1, 256, 64), 8, True),
            ("dense_dot_bias", "dense", True, True, True, (16, 128, 64), 4, False),
        )
    },  # fmt: skip
    "quant_matmul_reduce_splits": _matmul_reduce(_BF16, True, 16),
    # -- quant_matmul at every launch choose_launch makes (Llama-3-8B), int8 and fp8, bf16
    # and float32 activations (fp32 multiplies in "ieee")
    **{
        name: build
        for d in (_BF16, torch.float32)
        for weight in ("int8", "fp8")
        for name, build in _chosen_matmuls(d, weight).items()
    },
    # -- dense_matmul (PAGEDSERVE_DECODE_MATMUL=triton) at every launch choose_launch makes
    # for Llama-3-8B in bf16, plain and as programmatic dependent launches (PAGEDSERVE_PDL=1:
    # the first weight tile loaded before griddepcontrol.wait)
    **{
        name: build
        for pdl in (False, True)
        for name, build in _chosen_matmuls(_BF16, "dense", pdl).items()
    },
}


def builds_of(module: str) -> list[str]:
    """The names of the builds of ``kernels.<module>``'s kernels."""
    return [name for name, build in SM90_BUILDS.items() if build.module == f"kernels.{module}"]


def build_specs() -> dict[str, dict[str, object]]:
    """``SM90_BUILDS`` as JSON-ready dicts, for the compiling child process."""
    return {name: asdict(build) for name, build in SM90_BUILDS.items()}
