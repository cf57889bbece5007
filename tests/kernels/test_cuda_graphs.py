"""The CUDA launchers under CUDA-graph capture (GPU only): a decode step's kernels are
captured once and replayed with new tensor *values* (positions, slots, context lengths), as
the engine's graph runner does. A launcher that read a tensor on the host, or sized its grid
or buffers from values, fails to capture or replays stale work, and the outputs diverge
from the reference run on the new values.
"""

from __future__ import annotations

import pytest
import torch

from kernels import reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.mark.parametrize("pdl", ["0", "1"])
def test_decode_step_kernels_replay_with_new_values(paged_kv, monkeypatch, pdl):
    """With PAGEDSERVE_PDL=1 every kernel of the chain is a programmatic dependent launch
    (each waits for the one before: attention reads the query RoPE just wrote, the split-K
    matmul the product SiLU·mul just wrote, its first weight tiles loaded before that)."""
    from kernels._triton_common import PDL_ENV, pdl_supported
    from kernels.paged_attention import paged_attention_decode
    from kernels.quant_matmul import dense_matmul
    from kernels.rms_norm import add_rms_norm_
    from kernels.rope_and_store import rope_and_store_
    from kernels.silu_mul import silu_mul

    device = torch.device("cuda")
    if pdl == "1" and not pdl_supported(device):
        pytest.skip("programmatic dependent launch needs compute capability >= 9.0")
    monkeypatch.setenv(PDL_ENV, pdl)
    dtype = torch.bfloat16
    num_seqs, num_heads, num_kv_heads, head_dim, hidden, inter = 2, 32, 8, 128, 512, 1024
    block_size, max_blocks = 16, 64
    kv = paged_kv([1000, 700], block_size=block_size, num_kv_heads=num_kv_heads,
                  head_dim=head_dim, dtype=dtype, device=device)  # fmt: skip
    key_cache, value_cache = kv.ref_key_cache.clone(), kv.ref_value_cache.clone()
    block_tables = torch.zeros(num_seqs, max_blocks, dtype=torch.int32, device=device)
    block_tables[:, : kv.ref_block_tables.shape[1]] = kv.ref_block_tables
    seq_lens = kv.seq_lens.clone()
    qkv = torch.randn(num_seqs, (num_heads + 2 * num_kv_heads) * head_dim, device=device).to(dtype)
    cos = torch.rand(num_seqs, head_dim, device=device).to(dtype)
    sin = torch.rand(num_seqs, head_dim, device=device).to(dtype)
    slots = torch.tensor([-1, -1], device=device)  # replays write at slots set later
    x = torch.randn(num_seqs, hidden, device=device).to(dtype)
    residual = torch.randn(num_seqs, hidden, device=device).to(dtype)
    weight = torch.rand(hidden, device=device).to(dtype)
    gate_up = torch.randn(num_seqs, 2 * inter, device=device).to(dtype)
    down = (torch.randn(inter, hidden, device=device) / inter**0.5).to(dtype)
    scale = head_dim**-0.5
    static_in = (qkv, cos, sin, slots, x, residual, gate_up, seq_lens)

    def step():
        q = rope_and_store_(qkv, cos, sin, key_cache, value_cache, slots, num_heads, num_kv_heads)
        attn = paged_attention_decode(q, key_cache, value_cache, block_tables, seq_lens, scale,
                                      max_context_len=1024)  # fmt: skip
        normed = add_rms_norm_(x, residual, weight, 1e-5)
        return attn, normed, dense_matmul(silu_mul(gate_up), down)

    originals = [t.clone() for t in static_in]
    step()  # compile outside the capture
    for t, o in zip(static_in, originals, strict=True):
        t.copy_(o)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()

    for trial in range(2):
        new = [torch.randn_like(t.float()).to(t.dtype) for t in static_in[:3]]
        for t, n in zip(static_in[:3], new, strict=True):
            t.copy_(n)
        new_lens = torch.tensor([1 + 300 * trial, 1000], dtype=torch.int32, device=device)
        new_slots = (block_tables[torch.arange(2), (new_lens - 1) // block_size].long()
                     * block_size + (new_lens - 1) % block_size)  # fmt: skip
        slots.copy_(new_slots)
        seq_lens.copy_(new_lens)
        x.copy_(torch.randn_like(x))
        gate_up.copy_(torch.randn_like(gate_up))
        ref_residual = residual.clone()
        ref_qkv, ref_k, ref_v = qkv.clone(), key_cache.clone(), value_cache.clone()
        graph.replay()
        torch.cuda.synchronize()

        ref_q = reference.rope_and_store_(ref_qkv, cos, sin, ref_k, ref_v, slots, num_heads,
                                          num_kv_heads)  # fmt: skip
        assert torch.equal(key_cache, ref_k) and torch.equal(value_cache, ref_v)
        expected_attn = reference.paged_attention_decode(ref_q, ref_k, ref_v, block_tables,
                                                         seq_lens, scale)  # fmt: skip
        torch.testing.assert_close(outs[0].float(), expected_attn.float(), atol=3e-2, rtol=2e-2)
        expected_norm = reference.add_rms_norm_(x, ref_residual, weight, 1e-5)
        assert torch.equal(residual, ref_residual)
        torch.testing.assert_close(outs[1].float(), expected_norm.float(), atol=1e-2, rtol=2e-2)
        expected_down = reference.dense_matmul(reference.silu_mul(gate_up), down)
        torch.testing.assert_close(outs[2].float(), expected_down.float(), atol=2e-2,
                                   rtol=2e-2)  # fmt: skip
