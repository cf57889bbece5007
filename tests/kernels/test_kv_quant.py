"""The quantized KV cache (``--kv-cache-dtype int8|fp8``): every kernel against its reference.

Layout and arithmetic: ``kernels/kv_quant.py``. Written tolerances:

- **Stores** (reference, Triton ``store_kv`` / ``rope_and_store_``, C++ ``rope_and_store_``)
  evaluate the same float32 operations, so the cache bytes (values and scales) are equal bit
  for bit, under the interpreter and in C++. Compiled Triton divides with its own rounding:
  on a GPU a value may be one quantization step off at a rounding tie (checked there).
- **Quantization error** of the reference: per row, |x - dequantize(quantize(x))| is at most
  half a step, ``scale / 2`` for int8 and a relative 2**-4 of |x| (3 mantissa bits) for
  e4m3 values above its subnormals (plus ``scale * 2**-10`` below). Keys
  (``quantize_keys``: Hadamard-transformed first) come back within the same ``scale / 2``
  for int8: the transform's error is at most ``block * scale / 2`` per channel, divided by
  ``block`` on the way back.
- **Attention** over a quantized cache: the reference de-quantizes to float32 and attends
  exactly as over a float cache (bitwise), and the kernels (Triton, C++) fold the scales
  into the scores and probabilities instead: float32 queries within 2e-5 (abs and rel) of
  the reference, bf16 queries within bf16's own attention tolerance (2e-2).

The Triton kernels run on CPU under TRITON_INTERPRET=1 (tests/kernels/conftest.py) and on
CUDA when one is present; the C++ ones wherever the extension builds.
"""

from __future__ import annotations

import pytest
import torch

from kernels import kv_quant, reference
from kvpool import kv_dtype

QUANT_DTYPES = [torch.int8, torch.float8_e4m3fn]
ATTENTION_TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


def quantized_pair(num_blocks, block_size, num_kv_heads, head_dim, dtype, device):
    """A K and a V cache in the quantized layout, filled with garbage (0x7f bytes: values
    127 or NaN, scales float16 NaN) so that reading an unwritten row shows."""
    shape = (num_blocks, block_size, num_kv_heads, head_dim + kv_quant.SCALE_BYTES)
    raws = [torch.full(shape, 0x7F, dtype=torch.uint8, device=device).view(dtype) for _ in "kv"]
    return [kv_quant.quantized_cache(raw) for raw in raws]


def fill(key_cache, value_cache, seed=0):
    """Every slot written through the reference store (random K/V, one of them all zeros)."""
    g = torch.Generator().manual_seed(seed)
    nb, bs, kvh, d = key_cache.shape
    k = torch.randn(nb * bs, kvh, d, generator=g) * 3
    v = torch.randn(nb * bs, kvh, d, generator=g)
    k[5] = 0.0  # a zero row: scale 0, values 0
    slots = torch.arange(nb * bs)
    reference.store_kv(
        k.to(key_cache.device),
        v.to(key_cache.device),
        key_cache,
        value_cache,
        slots.to(key_cache.device),
    )


def raw_bytes(cache):
    return kv_quant.cache_rows(cache).contiguous().view(torch.uint8)


def assert_same_cache(got, want, device):
    """Bitwise under the interpreter; compiled (CUDA), the same scales and each de-quantized
    value within one quantization step (a division rounded the other way at a tie)."""
    if device.type == "cpu":
        assert torch.equal(raw_bytes(got), raw_bytes(want))
        return
    scale = kv_quant.cache_scales(want)
    # (rows no store wrote keep their 0x7f7f fill, a float16 NaN, in both)
    torch.testing.assert_close(kv_quant.cache_scales(got), scale, rtol=1e-6, atol=0, equal_nan=True)
    ref = kv_quant.dequantize(want, scale)
    deq = kv_quant.dequantize(got, scale)
    if got.dtype == torch.int8:
        step = scale[..., None].expand_as(ref)
    else:  # e4m3: 3 mantissa bits, subnormal steps of 2**-9 below 2**-6
        step = ref.abs() * 2**-3 + scale[..., None] * 2**-9
    # Rows no store wrote keep their garbage bytes (which de-quantize to inf or NaN): those
    # must be bitwise untouched; written rows must be within one step.
    untouched = (raw_bytes(got) == raw_bytes(want)).all(-1)
    close = ((deq - ref).abs() <= step * 1.001).all(-1)
    assert bool((untouched | close).all())


def test_scale_bytes_agree_with_kvpool():
    assert kv_dtype.SCALE_BYTES == kv_quant.SCALE_BYTES


@pytest.mark.parametrize("dtype", QUANT_DTYPES)
def test_reference_quantization_error_is_half_a_step(dtype):
    x = torch.randn(64, 4, 128) * torch.logspace(-3, 2, 64)[:, None, None]
    q, scale = kv_quant.quantize(x, dtype)
    err = (kv_quant.dequantize(q, scale) - x).abs()
    scale = scale.float()
    if dtype == torch.int8:
        bound = scale[..., None] / 2 * (1 + 1e-6)
    else:
        bound = x.abs() * 2**-4 + scale[..., None] * 2**-10
    assert bool((err <= bound).all())
    # absmax maps to +-QMAX exactly, so the whole range is used
    assert torch.equal(q.float().abs().amax(-1), torch.full_like(scale, kv_quant.QMAX[dtype]))
    zero_q, zero_scale = kv_quant.quantize(torch.zeros(3, 8), dtype)
    assert not zero_q.float().any() and not zero_scale.any()


@pytest.mark.parametrize("dtype", QUANT_DTYPES)
def test_float16_scales_stay_finite_and_in_range(dtype):
    """A scale past float16's range is clamped (values then clamp at +-QMAX), one below its
    subnormals rounds to 0 (and so do the row's values), and float16's rounding of a scale
    never puts a value past QMAX."""
    qmax = kv_quant.QMAX[dtype]
    huge = torch.tensor([[1e9, -3e8, 1.0]])
    q, scale = kv_quant.quantize(huge, dtype)
    assert scale.dtype == torch.float16 and float(scale) == kv_quant.SCALE_MAX
    assert q.float()[0, 0] == qmax and q.float()[0, 1] == -qmax
    tiny = torch.tensor([[1e-9, -2e-9, 0.0]])
    q, scale = kv_quant.quantize(tiny, dtype)
    assert float(scale) == 0.0 and not q.float().any()
    x = torch.randn(4096, 64) * torch.logspace(-2, 3, 4096)[:, None]
    q, scale = kv_quant.quantize(x, dtype)
    assert bool((q.float().abs() <= qmax).all()) and bool(torch.isfinite(scale).all())


def test_hadamard_is_the_block_diagonal_sylvester_matrix():
    sylvester = torch.ones(1, 1)
    while sylvester.shape[0] < 32:
        sylvester = torch.cat(
            [torch.cat([sylvester, sylvester], 1), torch.cat([sylvester, -sylvester], 1)], 0
        )
    eye = torch.eye(64)
    h = kv_quant.hadamard(eye, 32)  # row i: e_i transformed
    assert torch.equal(h, torch.block_diag(sylvester, sylvester))
    assert torch.equal(kv_quant.hadamard(h, 32), 32 * eye)  # H H = n I
    blocks = [kv_quant.hadamard_block(d) for d in (32, 64, 96, 128, 256, 80)]
    assert blocks == [16, 32, 16, 64, 128, 8]


def test_keys_come_back_within_half_a_step_and_with_less_error_than_plain_rows():
    """The Hadamard transform spreads an outlier channel (as post-RoPE keys carry) over its
    block, so the row's scale follows its RMS: the keys' error falls well below a plain
    absmax quantization of the same rows."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 2, 64, generator=g)
    x[..., 23] *= 8.0  # an outlier channel
    q, scale = kv_quant.quantize_keys(x, torch.int8)
    err = (kv_quant.dequantize_keys(q, scale) - x).abs()
    assert bool((err <= scale.float()[..., None] / 2 * (1 + 1e-5)).all())
    pq, pscale = kv_quant.quantize(x, torch.int8)
    plain = (kv_quant.dequantize(pq, pscale) - x).abs()
    assert float(err.pow(2).mean()) < 0.5 * float(plain.pow(2).mean())


@pytest.mark.parametrize("dtype", QUANT_DTYPES)
def test_reference_attention_over_a_quantized_cache_is_attention_over_its_dequantized_values(
    dtype,
):
    kc, vc = quantized_pair(9, 8, 2, 64, dtype, torch.device("cpu"))
    fill(kc, vc)
    fk = kv_quant.dequantize_keys(kc, kv_quant.cache_scales(kc))
    fv = kv_quant.dequantize(vc, kv_quant.cache_scales(vc))
    block_tables = torch.stack([torch.randperm(9)[:5] for _ in range(3)]).int()
    seq_lens = torch.tensor([1, 17, 40], dtype=torch.int32)
    q = torch.randn(3, 6, 64)
    got = reference.paged_attention_decode(q, kc, vc, block_tables, seq_lens, 0.125)
    assert torch.equal(
        got, reference.paged_attention_decode(q, fk, fv, block_tables, seq_lens, 0.125)
    )
    qsl = torch.tensor([0, 1, 5, 12], dtype=torch.int32)
    qq = torch.randn(12, 6, 64)
    got = reference.paged_attention_prefill(qq, kc, vc, block_tables, qsl, seq_lens, 0.125)
    want = reference.paged_attention_prefill(qq, fk, fv, block_tables, qsl, seq_lens, 0.125)
    assert torch.equal(got, want)


# ---- key offsets (kv_quant.py: keys stored less a calibrated offset) ---------------------------


def offset_keys(n, num_kv_heads, head_dim, seed=0):
    """Keys with a large part common to every token, as post-RoPE keys have (a few
    channels with a near-constant offset several times the others), and that part."""
    g = torch.Generator().manual_seed(seed)
    common = torch.randn(num_kv_heads, head_dim, generator=g) * 0.5
    common[:, [head_dim // 2 - 1, head_dim - 1, head_dim - 3]] += torch.tensor([14.0, -9.0, 6.0])
    return torch.randn(n, num_kv_heads, head_dim, generator=g) + common, common


@pytest.mark.parametrize("dtype", QUANT_DTYPES)
def test_a_key_offset_is_subtracted_before_quantizing_and_zero_changes_no_byte(dtype):
    cpu = torch.device("cpu")
    keys, _ = offset_keys(30, 3, 64)
    offset = keys.mean(0)
    value = torch.randn(30, 3, 64)
    slots = torch.randperm(4 * 8)[:30]
    slots[::7] = -1
    caches = [quantized_pair(4, 8, 3, 64, dtype, cpu) for _ in range(4)]
    reference.store_kv(keys, value, *caches[0], slots)
    reference.store_kv(keys, value, *caches[1], slots, torch.zeros(3, 64))
    reference.store_kv(keys, value, *caches[2], slots, offset)
    reference.store_kv(keys - offset, value, *caches[3], slots)
    for a, b in ((caches[0], caches[1]), (caches[2], caches[3])):
        assert torch.equal(raw_bytes(a[0]), raw_bytes(b[0]))
        assert torch.equal(raw_bytes(a[1]), raw_bytes(b[1]))  # values never offset
    assert not torch.equal(raw_bytes(caches[0][0]), raw_bytes(caches[2][0]))
    with pytest.raises(AssertionError, match="quantized cache only"):
        float_cache = torch.zeros(4, 8, 3, 64)
        reference.store_kv(keys, value, float_cache, float_cache.clone(), slots, offset)


@pytest.mark.parametrize("dtype", QUANT_DTYPES)
def test_attention_over_offset_keys_is_attention_over_the_keys(dtype):
    """Softmax invariance: one vector less on every key of a head shifts each query's scores
    by one constant. Over float caches the outputs agree to float32 rounding (2e-5). Over a
    quantized cache whose values quantize exactly (integers, each row's largest QMAX: scale
    1), so that the error is the keys' alone: storing the keys less their mean keeps the
    attention output within a relative 1e-3 of the float one (measured over seeds:
    1.8e-4 to 2.9e-4 int8, 2.8e-4 to 3.4e-4 e4m3) and under 3/4 of the error of storing them
    as they are (0.4-0.6x int8, 0.3-0.6x e4m3)."""
    cpu = torch.device("cpu")
    nb, bs, kvh, d, h = 10, 16, 2, 64, 6
    keys, _ = offset_keys(nb * bs, kvh, d, seed=3)
    value = torch.randint(-16, 17, (nb * bs, kvh, d)).float()  # e4m3 holds these exactly
    value[..., 0] = kv_quant.QMAX[dtype]
    offset = keys.mean(0)
    slots = torch.arange(nb * bs)
    block_tables = torch.stack([torch.randperm(nb)[:8] for _ in range(3)]).int()
    seq_lens = torch.tensor([5, 70, 128], dtype=torch.int32)
    q = torch.randn(3, h, d) * 0.3

    def attend(k, v):
        return reference.paged_attention_decode(q, k, v, block_tables, seq_lens, d**-0.5)

    fk, fv = torch.zeros(nb, bs, kvh, d), torch.zeros(nb, bs, kvh, d)
    reference.store_kv(keys, value, fk, fv, slots)
    want = attend(fk, fv)
    reference.store_kv(keys - offset, value, fk, fv, slots)
    tol = ATTENTION_TOL[torch.float32]
    torch.testing.assert_close(attend(fk, fv), want, rtol=tol, atol=tol)

    def rel_error(key_offset):
        kc, vc = quantized_pair(nb, bs, kvh, d, dtype, cpu)
        reference.store_kv(keys, value, kc, vc, slots, key_offset)
        assert torch.equal(kv_quant.dequantize(vc, kv_quant.cache_scales(vc)), fv)  # exact
        return float((attend(kc, vc) - want).norm() / want.norm())

    with_offset, without = rel_error(offset), rel_error(None)
    assert with_offset < 1e-3
    assert with_offset < 0.75 * without, (with_offset, without)


# ---- Triton -----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", QUANT_DTYPES)
@pytest.mark.parametrize(
    ("src_dtype", "head_dim"), [(torch.float32, 64), (torch.bfloat16, 64), (torch.float32, 96)]
)  # 96: padded to 128, Hadamard blocks of 16
def test_triton_store_kv_quantizes_like_the_reference(device, dtype, src_dtype, head_dim):
    from kernels.store_kv import store_kv

    kc, vc = quantized_pair(12, 16, 3, head_dim, dtype, device)
    rk, rv = quantized_pair(12, 16, 3, head_dim, dtype, device)
    key = (torch.randn(40, 3, head_dim) * 5).to(src_dtype).to(device)
    value = torch.randn(40, 3, head_dim).to(src_dtype).to(device)
    key[7] = 0.0
    slots = torch.randperm(12 * 16)[:40]
    slots[::5] = -1  # padding: writes nothing
    slots = slots.to(device)
    store_kv(key, value, kc, vc, slots)
    reference.store_kv(key, value, rk, rv, slots)
    assert_same_cache(kc, rk, device)
    assert_same_cache(vc, rv, device)


@pytest.mark.parametrize("dtype", QUANT_DTYPES)
@pytest.mark.parametrize(
    ("src_dtype", "head_dim"), [(torch.float32, 64), (torch.bfloat16, 64), (torch.float32, 96)]
)  # 96: halves of 48 padded to 64, Hadamard blocks of 16
def test_triton_rope_and_store_quantizes_like_the_reference(device, dtype, src_dtype, head_dim):
    from kernels.rope_and_store import rope_and_store_

    num_heads, num_kv_heads, n = 8, 2, 21
    kc, vc = quantized_pair(6, 8, num_kv_heads, head_dim, dtype, device)
    rk, rv = quantized_pair(6, 8, num_kv_heads, head_dim, dtype, device)
    qkv = torch.randn(n, (num_heads + 2 * num_kv_heads) * head_dim).to(src_dtype).to(device)
    cos = torch.randn(n, head_dim).to(src_dtype).to(device)
    sin = torch.randn(n, head_dim).to(src_dtype).to(device)
    slots = torch.randperm(48)[:n]
    slots[::4] = -1
    slots = slots.to(device)
    q = rope_and_store_(qkv.clone(), cos, sin, kc, vc, slots, num_heads, num_kv_heads)
    want_q = reference.rope_and_store_(
        qkv.clone(), cos, sin, rk, rv, slots, num_heads, num_kv_heads
    )
    if device.type == "cpu":  # the rotation is bitwise torch's (test_rope_and_store.py)
        assert torch.equal(q, want_q)
    assert_same_cache(kc, rk, device)
    assert_same_cache(vc, rv, device)


@pytest.mark.parametrize("dtype", QUANT_DTYPES)
def test_triton_stores_subtract_the_key_offset_like_the_reference(device, dtype):
    from kernels.rope_and_store import rope_and_store_
    from kernels.store_kv import store_kv

    keys, _ = offset_keys(24, 3, 64, seed=4)
    offset = keys.mean(0).to(device)
    kc, vc = quantized_pair(4, 16, 3, 64, dtype, device)
    rk, rv = quantized_pair(4, 16, 3, 64, dtype, device)
    value = torch.randn(24, 3, 64).to(device)
    slots = torch.randperm(4 * 16)[:24]
    slots[::5] = -1
    slots = slots.to(device)
    store_kv(keys.to(device), value, kc, vc, slots, offset)
    reference.store_kv(keys.to(device), value, rk, rv, slots, offset)
    assert_same_cache(kc, rk, device)
    assert_same_cache(vc, rv, device)

    num_heads, num_kv_heads, n = 6, 3, 24  # rows of Q and K heads; K less its offset
    qkv = torch.cat((torch.randn(n, num_heads * 64), keys.flatten(1), value.cpu().flatten(1)), 1)
    qkv = qkv.to(device)
    cos, sin = torch.randn(n, 64).to(device), torch.randn(n, 64).to(device)
    kc, vc = quantized_pair(4, 16, num_kv_heads, 64, dtype, device)
    rk, rv = quantized_pair(4, 16, num_kv_heads, 64, dtype, device)
    rope_and_store_(qkv.clone(), cos, sin, kc, vc, slots, num_heads, num_kv_heads, offset)
    reference.rope_and_store_(qkv.clone(), cos, sin, rk, rv, slots, num_heads, num_kv_heads, offset)
    assert_same_cache(kc, rk, device)
    assert_same_cache(vc, rv, device)


def _attention_case(dtype, device, query_dtype, d=64):
    torch.manual_seed(1)
    nb, bs, kvh, h = 14, 16, 2, 6
    kc, vc = quantized_pair(nb, bs, kvh, d, dtype, device)
    fill(kc, vc)
    block_tables = torch.stack([torch.randperm(nb)[:7] for _ in range(4)]).int().to(device)
    seq_lens = torch.tensor([1, 16, 17, 100], dtype=torch.int32, device=device)
    return kc, vc, block_tables, seq_lens, h, d


@pytest.mark.parametrize("dtype", QUANT_DTYPES)
@pytest.mark.parametrize("query_dtype", [torch.float32, torch.bfloat16])
def test_triton_decode_dequantizes_like_the_reference(device, dtype, query_dtype):
    from kernels.paged_attention import paged_attention_decode

    kc, vc, block_tables, seq_lens, h, d = _attention_case(dtype, device, query_dtype)
    q = torch.randn(4, h, d).to(query_dtype).to(device)
    want = reference.paged_attention_decode(q, kc, vc, block_tables, seq_lens, d**-0.5)
    tol = ATTENTION_TOL[query_dtype]
    for splits in (1, 3):
        got = paged_attention_decode(q, kc, vc, block_tables, seq_lens, d**-0.5, num_splits=splits)
        assert got.dtype == query_dtype
        torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


def test_triton_attention_at_head_dim_96(device):
    """Padded to 128 columns, the query's Hadamard blocks of 16 leave the padding zeros."""
    from kernels.paged_attention import paged_attention_decode
    from kernels.prefill_attention import paged_attention_prefill

    kc, vc, block_tables, seq_lens, h, d = _attention_case(torch.int8, device, torch.float32, 96)
    q = torch.randn(4, h, d).to(device)
    args = (q, kc, vc, block_tables, seq_lens, d**-0.5)
    tol = ATTENTION_TOL[torch.float32]
    want = reference.paged_attention_decode(*args)
    torch.testing.assert_close(paged_attention_decode(*args), want, rtol=tol, atol=tol)
    qsl = torch.tensor([0, 1, 2, 3, 4], dtype=torch.int32, device=device)
    args = (q, kc, vc, block_tables, qsl, seq_lens, d**-0.5)
    got = paged_attention_prefill(*args)
    torch.testing.assert_close(got, reference.paged_attention_prefill(*args), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", QUANT_DTYPES)
@pytest.mark.parametrize("query_dtype", [torch.float32, torch.bfloat16])
def test_triton_prefill_dequantizes_like_the_reference(device, dtype, query_dtype):
    from kernels.prefill_attention import paged_attention_prefill

    kc, vc, block_tables, seq_lens, h, d = _attention_case(dtype, device, query_dtype)
    query_start_loc = torch.tensor([0, 1, 9, 26, 60], dtype=torch.int32, device=device)
    q = torch.randn(60, h, d).to(query_dtype).to(device)
    args = (q, kc, vc, block_tables, query_start_loc, seq_lens, d**-0.5)
    got = paged_attention_prefill(*args)
    want = reference.paged_attention_prefill(*args)
    tol = ATTENTION_TOL[query_dtype]
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize(
    "build",
    [f"{kernel}_{name}" for kernel in ("store_kv", "rope_and_store", "decode", "prefill")
     for name in ("int8", "fp8")],
)  # fmt: skip
def test_quantized_kernels_compile_for_sm90(sm90_build_errors, build):
    assert sm90_build_errors[build] is None, sm90_build_errors[build]


# ---- C++ --------------------------------------------------------------------------------------


def codes(cache):
    """A quantized cache's values as integers one apart per quantization step: int8's own,
    e4m3's sign and magnitude bits (whose order is the values' order; +0 and -0 both 0)."""
    if cache.dtype == torch.int8:
        return cache.int()
    bits = cache.view(torch.uint8).int()
    return (bits & 0x7F) * (1 - 2 * (bits >> 7))


# head_dim 96: Hadamard blocks of 16 (kv_quant.hadamard_block)
@pytest.mark.parametrize("dtype", QUANT_DTYPES)
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"),
                         [(9, 3, 64), (8, 8, 32), (16, 4, 128), (8, 2, 96)])  # fmt: skip
def test_cpu_decode_over_a_quantized_cache_matches_reference(
    ops, dtype, num_heads, num_kv_heads, head_dim
):
    torch.manual_seed(2)
    nb, bs = 40, 16
    kc, vc = quantized_pair(nb, bs, num_kv_heads, head_dim, dtype, torch.device("cpu"))
    fill(kc, vc)
    # decodes of ragged lengths, then a prefill chunk's rows (one sequence, consecutive
    # positions: the kernel's run path with a transposed K)
    lens = [1, 15, 16, 17, 130] + list(range(200, 264))
    tables = [torch.randperm(nb)[:17].int() for _ in range(5)]
    chunk = torch.randperm(nb)[:17].int()
    block_tables = torch.stack(tables + [chunk] * 64)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    q = torch.randn(len(lens), num_heads, head_dim)
    got = ops.paged_attention_decode(q, kc, vc, block_tables, seq_lens, head_dim**-0.5)
    want = reference.paged_attention_decode(q, kc, vc, block_tables, seq_lens, head_dim**-0.5)
    tol = ATTENTION_TOL[torch.float32]
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    # batch 1: the context split in spans and merged
    got = ops.paged_attention_decode(q[4:5], kc, vc, block_tables[4:5], seq_lens[4:5], 0.1)
    want = reference.paged_attention_decode(q[4:5], kc, vc, block_tables[4:5], seq_lens[4:5], 0.1)
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


def test_cpu_decode_reads_every_e4m3_byte_as_torch_does(ops):
    """The kernel's e4m3 decode (a half-to-float conversion, kv_quant.h) against torch's
    cast for all 256 bytes, NaN included: queries over V rows built from every byte (K all
    zero, one position: weight 1), so the output is the byte's value times the row's
    scale."""
    head_dim, num_heads = 32, 1
    kc, vc = quantized_pair(8, 32, 1, head_dim, torch.float8_e4m3fn, torch.device("cpu"))
    kv_quant.cache_rows(kc).view(torch.uint8).zero_()  # values 0, scales 0.0
    rows = kv_quant.cache_rows(vc).view(torch.uint8)
    rows[..., :head_dim] = torch.arange(256, dtype=torch.uint8).view(8, 1, 1, head_dim)
    rows[..., head_dim:] = torch.tensor([1.0], dtype=torch.float16).view(torch.uint8)
    values = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    q = torch.zeros(8, num_heads, head_dim)
    block_tables = torch.arange(8, dtype=torch.int32)[:, None]
    seq_lens = torch.ones(8, dtype=torch.int32)  # position 0 of block i: bytes 32 i ...
    got = ops.paged_attention_decode(q, kc, vc, block_tables, seq_lens, 1.0)
    torch.testing.assert_close(got.flatten(), values, rtol=0, atol=0, equal_nan=True)
    # A NaN byte in a K row (scale 1): that row's score is NaN, as in the reference (the
    # kernel checks each row for NaN bytes instead of selecting per vector).
    keys = kv_quant.cache_rows(kc).view(torch.uint8)
    keys[3, 0, 0, 7] = 0xFF
    keys[3, 0, 0, head_dim:] = torch.tensor([1.0], dtype=torch.float16).view(torch.uint8)
    q = torch.randn(8, num_heads, head_dim)
    got = ops.paged_attention_decode(q, kc, vc, block_tables, seq_lens, 1.0)
    want = reference.paged_attention_decode(q, kc, vc, block_tables, seq_lens, 1.0)
    assert bool(got[3].isnan().all()) and not bool(got[:3].isnan().any())
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6, equal_nan=True)


@pytest.mark.parametrize("dtype", QUANT_DTYPES)
@pytest.mark.parametrize("rows", [2, 9])
@pytest.mark.parametrize("sliding_window", [None, 4])
def test_cpu_short_runs_over_a_quantized_cache_match_reference(
    ops, threads, dtype, rows, sliding_window
):
    """A verification's rows over a quantized cache (each slot read once for every row, the
    per-slot scales applied to each score and weight), split over 2 threads."""
    threads(2)
    torch.manual_seed(5)
    nb, bs, num_heads, num_kv_heads, head_dim = 40, 16, 9, 3, 64
    kc, vc = quantized_pair(nb, bs, num_kv_heads, head_dim, dtype, torch.device("cpu"))
    fill(kc, vc)
    table = torch.randperm(nb)[:30].int()
    lens = torch.arange(200, 200 + rows, dtype=torch.int32)
    block_tables = table.expand(rows, -1).contiguous()
    q = torch.randn(rows, num_heads, head_dim)
    kwargs = {} if sliding_window is None else {"sliding_window": sliding_window}
    got = ops.paged_attention_decode(q, kc, vc, block_tables, lens, head_dim**-0.5, **kwargs)
    want = reference.paged_attention_decode(
        q, kc, vc, block_tables, lens, head_dim**-0.5, sliding_window
    )
    tol = ATTENTION_TOL[torch.float32]
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", QUANT_DTYPES)
def test_cpu_rope_and_store_quantizes_like_the_reference(ops, dtype):
    num_heads, num_kv_heads, head_dim, n = 9, 3, 64, 13
    kc, vc = quantized_pair(4, 8, num_kv_heads, head_dim, dtype, torch.device("cpu"))
    rk, rv = quantized_pair(4, 8, num_kv_heads, head_dim, dtype, torch.device("cpu"))
    qkv = torch.randn(n, (num_heads + 2 * num_kv_heads) * head_dim)
    qkv[3] = 0.0
    cos, sin = torch.randn(n, head_dim), torch.randn(n, head_dim)
    slots = torch.randperm(32)[:n]
    slots[::6] = -1
    got_qkv = qkv.clone()
    ops.rope_and_store_(got_qkv, cos, sin, kc, vc, slots, num_heads, num_kv_heads)
    want_q = reference.rope_and_store_(
        qkv.clone(), cos, sin, rk, rv, slots, num_heads, num_kv_heads
    )
    q = got_qkv[:, : num_heads * head_dim].view(n, num_heads, head_dim)
    torch.testing.assert_close(q, want_q, rtol=1e-6, atol=1e-6)  # C++ may fuse multiply-adds
    for got, want in ((kc, rk), (vc, rv)):
        # the rotated K can differ in its last bit (FMA), so the bytes are equal where it did
        # not and one step apart at most where it did
        diff = (codes(got) - codes(want)).abs()
        assert diff.max() <= 1
        assert (diff > 0).float().mean() < 0.01
        # (unwritten rows keep their 0x7f7f fill: a float16 NaN in both)
        torch.testing.assert_close(
            kv_quant.cache_scales(got),
            kv_quant.cache_scales(want),
            rtol=1e-6,
            atol=0,
            equal_nan=True,
        )


def edge_rows(num_kv_heads, head_dim, dtype):
    """K or V rows [n, num_kv_heads, head_dim] at the quantization's edges: all zeros, one
    huge value (a scale clamped to float16's 65504, the rest flushed to 0), an absmax landing
    on or near +-QMAX, rows too small for a float16 scale, and rows whose absmax is QMAX
    (scale 1, so values are quantized as they are): rounding ties of both formats (halves;
    e4m3's between 8 and 16) and e4m3's subnormal grid (steps of 2**-9 below 2**-6) with its
    ties. fp8 also gets an infinity and a NaN (an infinite key is NaN after the Hadamard
    transform; int8's C++ absmax skips a NaN, so its rows would differ there)."""
    qmax = kv_quant.QMAX[dtype]
    g = torch.Generator().manual_seed(7)
    rows = torch.randn(12, num_kv_heads, head_dim, generator=g)
    rows[0] = 0.0
    rows[1, :, 5] = 1e30
    rows[3] = rows[3] / rows[3].abs().amax(-1, keepdim=True) * qmax
    rows[4] = rows[4] / rows[4].abs().amax(-1, keepdim=True) * -(qmax - 0.1)
    rows[5, :, 1:] *= 2.0**-16  # channel 0 sets the scale, the rest come out subnormal in e4m3
    rows[6] *= 1e-9  # amax / QMAX under float16's smallest subnormal: scale 0, values 0
    rows[7] = torch.arange(head_dim) * 0.5 - 16.0
    rows[8] = (torch.arange(head_dim) % 33 - 16.0) * 2.0**-10
    rows[7:9, :, 0] = qmax
    if dtype == torch.float8_e4m3fn:
        rows[2, :, 7] = float("inf")
        rows[9, :, 3] = float("nan")
    return rows


@pytest.mark.parametrize("dtype", QUANT_DTYPES)
def test_cpu_rope_and_store_writes_the_reference_bytes_at_the_edges(ops, dtype):
    """With an exact rotation (cos 1, sin 0) the C++ store's bytes are the reference's bit
    for bit, keys and values, at the edges of the format (edge_rows)."""
    num_heads, num_kv_heads, head_dim = 2, 2, 64
    fp8 = dtype == torch.float8_e4m3fn
    keys = edge_rows(num_kv_heads, head_dim, dtype)
    values = edge_rows(num_kv_heads, head_dim, dtype).flip(0)
    n = keys.shape[0]
    qkv = torch.cat((torch.randn(n, num_heads * head_dim), keys.flatten(1), values.flatten(1)), 1)
    cos, sin = torch.ones(n, head_dim), torch.zeros(n, head_dim)
    slots = torch.randperm(16)[:n]
    kc, vc = quantized_pair(2, 8, num_kv_heads, head_dim, dtype, torch.device("cpu"))
    rk, rv = quantized_pair(2, 8, num_kv_heads, head_dim, dtype, torch.device("cpu"))
    ops.rope_and_store_(qkv.clone(), cos, sin, kc, vc, slots, num_heads, num_kv_heads)
    reference.rope_and_store_(qkv.clone(), cos, sin, rk, rv, slots, num_heads, num_kv_heads)
    assert torch.equal(raw_bytes(kc), raw_bytes(rk))
    assert torch.equal(raw_bytes(vc), raw_bytes(rv))
    if fp8:  # the edges were reached: saturated values, subnormal codes, scales clamped
        stored = kv_quant.cache_rows(vc).view(torch.uint8)[..., :head_dim]
        assert bool(((stored & 0x7F) == 0x7E).any())  # +-448
        assert bool((((stored & 0x78) == 0) & ((stored & 0x07) != 0)).any())  # subnormals
        assert bool((kv_quant.cache_scales(vc) == 65504).any())


@pytest.mark.parametrize("dtype", QUANT_DTYPES)
def test_cpu_rope_and_store_subtracts_the_key_offset_like_the_reference(ops, dtype):
    num_heads, num_kv_heads, head_dim, n = 9, 3, 64, 13
    keys, _ = offset_keys(n, num_kv_heads, head_dim, seed=2)
    offset = keys.mean(0)
    value = torch.randn(n, num_kv_heads * head_dim)
    qkv = torch.cat((torch.randn(n, num_heads * head_dim), keys.flatten(1), value), 1)
    # cos 1, sin 0: the rotation is exact, so the bytes are the reference's bit for bit
    cos, sin = torch.ones(n, head_dim), torch.zeros(n, head_dim)
    slots = torch.randperm(32)[:n]
    slots[::6] = -1
    kc, vc = quantized_pair(4, 8, num_kv_heads, head_dim, dtype, torch.device("cpu"))
    rk, rv = quantized_pair(4, 8, num_kv_heads, head_dim, dtype, torch.device("cpu"))
    ops.rope_and_store_(qkv.clone(), cos, sin, kc, vc, slots, num_heads, num_kv_heads, offset)
    reference.rope_and_store_(qkv.clone(), cos, sin, rk, rv, slots, num_heads, num_kv_heads, offset)
    assert torch.equal(raw_bytes(kc), raw_bytes(rk))
    assert torch.equal(raw_bytes(vc), raw_bytes(rv))
    plain_k, plain_v = (torch.zeros(4, 8, num_kv_heads, head_dim) for _ in "kv")
    with pytest.raises(RuntimeError, match="quantized .* cache only"):
        ops.rope_and_store_(qkv, cos, sin, plain_k, plain_v, slots, num_heads, num_kv_heads, offset)
    with pytest.raises(RuntimeError, match="key_offset must be"):
        ops.rope_and_store_(qkv, cos, sin, kc, vc, slots, num_heads, num_kv_heads, offset[:2])


@pytest.mark.parametrize("dtype", QUANT_DTYPES)
def test_cpu_kernels_refuse_a_plain_8_bit_tensor(ops, dtype):
    cache = torch.zeros(4, 8, 2, 64, dtype=dtype)  # no room for the scales
    q = torch.randn(1, 2, 64)
    tables = torch.zeros(1, 1, dtype=torch.int32)
    lens = torch.ones(1, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="caches must be the values view"):
        ops.paged_attention_decode(q, cache, cache, tables, lens, 0.1)
