"""The C++ CPU kernels (``kernels.cpu``) against their PyTorch twins.

The extension is compiled on first use; these tests fail (rather than skip) when it cannot
be built, so a machine without a compiler is noticed here and not as a silent slowdown.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.llama import RMSNorm
from engine.rope import apply_rope
from kernels.reference import paged_attention_decode, store_kv


def _paged_case(num_seqs, num_heads, num_kv_heads, head_dim, seq_lens, block_size=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    max_blocks = max((n + block_size - 1) // block_size for n in seq_lens) + 1
    num_blocks = num_seqs * max_blocks + 3
    kc = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g)
    vc = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g)
    # Shuffled, non-contiguous blocks; the unused tail of each table is padding (block 0).
    tables = torch.randperm(num_blocks, generator=g)[: num_seqs * max_blocks]
    tables = tables.view(num_seqs, max_blocks).int()
    for i, n in enumerate(seq_lens):
        tables[i, (n + block_size - 1) // block_size :] = 0
    q = torch.randn(num_seqs, num_heads, head_dim, generator=g)
    return q, kc, vc, tables, torch.tensor(seq_lens, dtype=torch.int32)


@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim,seq_lens",
    [
        (9, 3, 64, [1, 15, 16, 17, 180]),  # SmolLM2's GQA shape, block boundaries
        (4, 4, 128, [33, 2]),  # MHA, head_dim 128
        (8, 1, 32, [300]),  # MQA, one long context
        (32, 8, 64, [5, 64, 129]),  # group 4
        (16, 1, 64, [40]),  # group 16: more query heads than one register pass holds
    ],
)
def test_decode_attention_matches_reference(ops, num_heads, num_kv_heads, head_dim, seq_lens):
    q, kc, vc, tables, lens = _paged_case(
        len(seq_lens), num_heads, num_kv_heads, head_dim, seq_lens
    )
    want = paged_attention_decode(q, kc, vc, tables, lens, head_dim**-0.5)
    got = ops.paged_attention_decode(q, kc, vc, tables, lens, head_dim**-0.5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("num_threads", [1, 2, 4])
@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim,seq_lens",
    [
        # Fewer (sequence, KV head) items than two a thread: the kernel cuts each context
        # into spans (one per thread at batch 1) and merges their partial softmaxes.
        # Contexts shorter than the span count leave empty spans.
        (9, 3, 64, [1]),
        (9, 3, 64, [3]),
        (9, 3, 64, [17]),
        (9, 3, 64, [180]),
        (9, 3, 64, [700, 2]),  # 2 sequences: split only with 4 threads
        (8, 1, 32, [300]),  # MQA: 1 item
        (4, 4, 128, [65]),
    ],
)
def test_few_decodes_split_along_the_context_match_reference(
    ops, threads, num_threads, num_heads, num_kv_heads, head_dim, seq_lens
):
    threads(num_threads)
    q, kc, vc, tables, lens = _paged_case(
        len(seq_lens), num_heads, num_kv_heads, head_dim, seq_lens, seed=len(seq_lens) + seq_lens[0]
    )
    # Large score spread: the merge must rescale each span by its own max.
    q = q * 4
    want = paged_attention_decode(q, kc, vc, tables, lens, head_dim**-0.5)
    got = ops.paged_attention_decode(q, kc, vc, tables, lens, head_dim**-0.5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _prefill_rows_case(chunks, num_heads, num_kv_heads, head_dim, block_size=16, seed=1):
    """Rows as the engine's per-token plan lays out a step: each (prior, new) chunk is `new`
    query rows of one sequence at positions prior..prior+new-1, all with that sequence's
    block table, context growing by one per row."""
    g = torch.Generator().manual_seed(seed)
    max_blocks = max((p + n + block_size - 1) // block_size for p, n in chunks) + 1
    num_blocks = len(chunks) * max_blocks + 3
    kc = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g)
    vc = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g)
    tables = torch.randperm(num_blocks, generator=g)[: len(chunks) * max_blocks]
    tables = tables.view(len(chunks), max_blocks).int()
    row_tables = torch.cat([tables[i].expand(n, -1) for i, (_, n) in enumerate(chunks)])
    lens = torch.cat([torch.arange(p + 1, p + n + 1) for p, n in chunks]).int()
    q = torch.randn(len(lens), num_heads, head_dim, generator=g)
    return q, kc, vc, row_tables.contiguous(), lens


@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim,chunks",
    [
        # SmolLM2's shape: a 128-token prompt (4 runs of 32 rows inside the kernel),
        # a chunk after 40 cached tokens, a decode row and a 2-row run in one step
        (9, 3, 64, [(0, 128), (40, 17), (200, 1), (5, 2)]),
        (4, 4, 128, [(0, 70), (33, 1)]),  # MHA, head_dim 128, a run of 70 rows
        (8, 1, 32, [(300, 5)]),  # MQA after a long context
        (16, 1, 64, [(0, 20), (0, 20)]),  # group 16 (several passes); two equal-length runs
        (32, 8, 64, [(15, 33)]),  # group 4, a chunk starting mid-block
        (9, 3, 64, [(0, 600)]),  # a long chunk: 16 runs of 38 rows (the last shorter)
        # a verification's 5 rows and a 9-row one (short runs: attend_rows_span), a decode
        (9, 3, 64, [(350, 5), (20, 1), (100, 9)]),
    ],
)
def test_decode_attention_matches_reference_on_prefill_rows(
    ops, num_heads, num_kv_heads, head_dim, chunks
):
    # Consecutive rows of one sequence go through the kernel's run path (a transposed K read
    # once per run); the reference attends row by row.
    q, kc, vc, tables, lens = _prefill_rows_case(chunks, num_heads, num_kv_heads, head_dim)
    want = paged_attention_decode(q, kc, vc, tables, lens, head_dim**-0.5)
    got = ops.paged_attention_decode(q, kc, vc, tables, lens, head_dim**-0.5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("num_threads", [1, 2])
@pytest.mark.parametrize("sliding_window", [1, 7, 40, 1000])
def test_sliding_window_matches_reference(ops, threads, num_threads, sliding_window):
    """The window moves each row's first key: decodes (split into spans at batch 1 with 2
    threads) and runs of prefill rows, against the reference."""
    threads(num_threads)
    q, kc, vc, tables, lens = _paged_case(1, 9, 3, 64, [180])
    want = paged_attention_decode(q, kc, vc, tables, lens, 0.125, sliding_window)
    got = ops.paged_attention_decode(q, kc, vc, tables, lens, 0.125, sliding_window=sliding_window)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    q, kc, vc, tables, lens = _prefill_rows_case([(0, 70), (40, 17), (200, 1)], 8, 2, 32)
    want = paged_attention_decode(q, kc, vc, tables, lens, 0.2, sliding_window)
    got = ops.paged_attention_decode(q, kc, vc, tables, lens, 0.2, sliding_window=sliding_window)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("num_threads", [1, 2, 3])
@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim,chunks",
    [
        # A verification's k + 1 rows for k = 1..8 (one read of the context for every row),
        # starting mid-block, at a block's end and at its start
        *[(9, 3, 64, [(350 + rows, rows)]) for rows in range(2, 10)],
        (9, 3, 64, [(15, 2)]),  # the run crosses a block boundary
        (9, 3, 64, [(16, 5)]),
        (9, 3, 64, [(0, 5)]),  # a short prompt: contexts 1..5, shorter than some spans
        (9, 3, 64, [(1, 16)]),  # the longest short run
        (32, 8, 64, [(40, 4)]),  # group 4
        (16, 1, 64, [(100, 3)]),  # group 16: several register passes over V
        (4, 4, 128, [(70, 6)]),  # MHA, head_dim 128
        (8, 1, 32, [(300, 5)]),  # MQA
        # several sequences' verifications beside decodes, and beside a long chunk
        (9, 3, 64, [(120, 5), (30, 1), (200, 3), (7, 1)]),
        (9, 3, 64, [(0, 40), (90, 5), (12, 1)]),
    ],
)
def test_short_runs_scored_together_match_reference(
    ops, threads, num_threads, num_heads, num_kv_heads, head_dim, chunks
):
    """Runs of at most 16 rows of one sequence: each context slot read once and scored
    against every row (row i sees its own causal prefix), in spans over the threads, merged."""
    threads(num_threads)
    q, kc, vc, tables, lens = _prefill_rows_case(chunks, num_heads, num_kv_heads, head_dim, seed=3)
    q = q * 4  # a large score spread: spans merge by their own maxima
    want = paged_attention_decode(q, kc, vc, tables, lens, head_dim**-0.5)
    got = ops.paged_attention_decode(q, kc, vc, tables, lens, head_dim**-0.5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("num_threads", [1, 2])
@pytest.mark.parametrize("sliding_window", [1, 3, 7, 40])
def test_short_runs_respect_the_sliding_window(ops, threads, num_threads, sliding_window):
    """Each row of a short run has its own window start (its length - window): a window
    shorter than the run leaves spans that hold none of a row's keys."""
    threads(num_threads)
    for chunks in ([(60, 5)], [(0, 9)], [(33, 2), (8, 1), (100, 4)]):
        q, kc, vc, tables, lens = _prefill_rows_case(chunks, 9, 3, 64, seed=4)
        want = paged_attention_decode(q, kc, vc, tables, lens, 0.125, sliding_window)
        got = ops.paged_attention_decode(
            q, kc, vc, tables, lens, 0.125, sliding_window=sliding_window
        )
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_decode_attention_reads_strided_queries(ops):
    # The engine passes Q as a view of the fused QKV projection (rows longer than Q).
    q, kc, vc, tables, lens = _paged_case(3, 9, 3, 64, [7, 20, 33])
    wide = torch.randn(3, 15, 64)
    wide[:, :9] = q
    got = ops.paged_attention_decode(wide[:, :9], kc, vc, tables, lens, 0.125)
    torch.testing.assert_close(got, paged_attention_decode(q, kc, vc, tables, lens, 0.125))


def test_decode_attention_rejects_what_it_does_not_cover(ops):
    q, kc, vc, tables, lens = _paged_case(1, 4, 4, 48, [5])
    with pytest.raises(RuntimeError, match="head_dim"):
        ops.paged_attention_decode(q, kc, vc, tables, lens, 0.1)
    with pytest.raises(RuntimeError, match="float32"):
        ops.paged_attention_decode(q.double(), kc, vc, tables, lens, 0.1)


def _norm(hidden: int) -> RMSNorm:
    norm = RMSNorm(hidden, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(hidden) + 0.5)
    return norm


@pytest.mark.parametrize("rows", [1, 16, 70])
def test_norms_match_torch(ops, rows):
    norm = _norm(576)
    x, res = torch.randn(rows, 576), torch.randn(rows, 576)
    torch.testing.assert_close(ops.rms_norm(x, norm.weight, norm.eps), norm(x))
    res_cpu, res_torch = res.clone(), res.clone()
    got = ops.add_rms_norm_(x, res_cpu, norm.weight, norm.eps)
    want = norm.add_norm_(x, res_torch)
    assert torch.equal(res_cpu, res_torch)  # the residual stream itself is bit-exact
    torch.testing.assert_close(got, want)


def test_silu_mul_matches_torch_including_extremes(ops):
    gate_up = torch.randn(5, 2 * 1536) * 6
    gate_up[0, :8] = torch.tensor([-1e4, -100.0, -88.0, -87.0, 0.0, 50.0, 89.0, 1e4])
    got = ops.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    want = F.silu(gate) * up
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-30)


@pytest.mark.parametrize("n", [1, 15, 16, 17, 49152, 49155])  # whole vectors and tails
def test_argmax_rows_is_torch_argmax_including_ties_and_nan(ops, n):
    g = torch.Generator().manual_seed(n)
    x = torch.randn(4, n, generator=g)
    cases = {
        "random": x,
        "ties": x.round(),  # many equal maxima: the first index wins
        "all -inf": torch.full((3, n), -float("inf")),
        "all equal": torch.zeros(2, n),
    }
    y = x.clone()
    y[:, n // 2] = float("nan")
    y[1, -1] = float("nan")
    cases["nan"] = y  # a NaN counts as the largest; the first NaN wins
    y = x.clone()
    y[:, -1] = y[:, 0] = float("inf")
    cases["inf at both ends"] = y
    y = torch.full((2, n), -float("inf"))
    y[:, -1] = 3.0
    cases["max at the end"] = y
    for name, logits in cases.items():
        assert torch.equal(ops.argmax_rows(logits), logits.argmax(dim=-1)), name


def test_rope_and_store_matches_torch(ops):
    num_heads, num_kv_heads, head_dim, tokens = 9, 3, 64, 6
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=g)
    angles = torch.rand(tokens, 1, head_dim // 2, generator=g) * 6
    emb = torch.cat([angles, angles], dim=-1)
    rope = (emb.cos(), emb.sin())
    slots = torch.tensor([5, 17, -1, 0, 31, 8])  # -1: padding, not stored
    caches = [torch.zeros(2, 16, num_kv_heads, head_dim) for _ in range(4)]
    # The model's own formula: Q and K heads rotated together, K/V stored by the reference.
    qk, v = qkv.split([(num_heads + num_kv_heads) * head_dim, num_kv_heads * head_dim], -1)
    qk = apply_rope(qk.reshape(tokens, num_heads + num_kv_heads, head_dim), *rope)
    q_torch, k = qk.split([num_heads, num_kv_heads], dim=1)
    store_kv(k, v.reshape(tokens, num_kv_heads, head_dim), caches[0], caches[1], slots)
    qkv_cpu = qkv.clone()
    cos, sin = (r.view(tokens, head_dim) for r in rope)
    ops.rope_and_store_(qkv_cpu, cos, sin, caches[2], caches[3], slots, num_heads, num_kv_heads)
    q_cpu = qkv_cpu[:, : num_heads * head_dim].view(tokens, num_heads, head_dim)
    torch.testing.assert_close(q_cpu, q_torch)
    torch.testing.assert_close(caches[2], caches[0])
    torch.testing.assert_close(caches[3], caches[1])
    assert caches[2].view(-1, num_kv_heads, head_dim)[[1, 2, 3, 4]].abs().sum() == 0


@pytest.mark.parametrize("num_threads", [2, 3, 5])
@pytest.mark.parametrize(
    "k,n,bias",
    # One row gives each thread an equal share of the weight bytes, so a panel at a share's
    # edge is split along K between two threads (or more: 2 panels on 3 or 5 threads, 1 panel)
    # and their partial rows summed: 9 panels = 4.5 + 4.5 on 2 threads, 15, an odd K (7, 33:
    # unequal pieces), and 768 panels, which 2 threads split at a panel edge.
    [
        (576, 576, True),
        (1536, 576, False),
        (576, 960, True),
        (7, 100, True),
        (33, 64, False),
        (96, 200, True),
        (576, 49152, False),
    ],
)
def test_one_row_equal_shares_match_matmul(ops, threads, num_threads, k, n, bias):
    threads(num_threads)
    g = torch.Generator().manual_seed(k + n)
    w, x = torch.randn(k, n, generator=g), torch.randn(1, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    packed = ops.pack_weight(w)
    want = x @ w if b is None else torch.addmm(b, x, w)
    for _ in range(2):  # the second call reuses the partial rows' buffer
        torch.testing.assert_close(ops.packed_linear(x, packed, n, b), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 6, 16, 25, 64, 70, 256])
@pytest.mark.parametrize(
    "k,n,bias",
    # With 64-column panels, 960, 64 and 1287 columns are odd panel counts (15, 1, 21), which
    # 2 threads share by rows from 24 rows up (25: a short second share). 1287 columns = 21
    # panels (the last ragged): with 2 threads, each thread's run is long enough for the
    # one-row path's 8 lockstep streams plus leftover panels.
    [(576, 960, False), (130, 100, True), (1536, 64, False), (64, 1287, True)],
)
def test_packed_linear_matches_matmul(ops, rows, k, n, bias):
    g = torch.Generator().manual_seed(rows)
    w, x = torch.randn(k, n, generator=g), torch.randn(rows, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    got = ops.packed_linear(x, ops.pack_weight(w), n, b)
    want = x @ w if b is None else torch.addmm(b, x, w)
    assert got.shape == (rows, n)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_kernels_between_solo_steps_split_as_a_parallel_region(ops, threads):
    """While the fused stack runs solo (beside a busy neighbour: contention.h; forced here),
    a kernel called outside it (a prefill step's head and final norm, the sampler's argmax)
    runs at::parallel_for's chunks one after another on its caller (team.h: solo_split):
    bitwise what the parallel region gives. 3 threads and 10 panels: the 64-row matmul
    splits its rows, the one-row matmul shares panels, the attention of a prefill run cuts
    it into pieces."""
    threads(3)
    g = torch.Generator().manual_seed(33)
    w = torch.randn(576, 640, generator=g)
    packed = ops.pack_weight(w)
    x, x1 = torch.randn(64, 576, generator=g), torch.randn(1, 576, generator=g)
    norm_w = torch.randn(576, generator=g)
    q, kc, vc, tables, lens = _paged_case(40, 9, 3, 64, [90] * 40, seed=3)
    tables = tables[:1].expand(40, -1).contiguous()
    lens = torch.arange(51, 91, dtype=torch.int32)  # one prompt's rows, a prefill chunk

    def run():
        residual = x.clone()
        return [
            ops.packed_linear(x, packed, 640, None),
            ops.packed_linear(x1, packed, 640, None),
            ops.add_rms_norm_(x.clone(), residual, norm_w, 1e-5),
            residual,
            ops.argmax_rows(x),
            ops.paged_attention_decode(q, kc, vc, tables, lens, 0.125),
        ]

    before = ops.set_stack_active_threads(3)
    try:
        region = run()
        ops.set_stack_active_threads(1)
        solo = run()
    finally:
        ops.set_stack_active_threads(before)
    for a, b in zip(region, solo, strict=True):
        assert torch.equal(a, b)
