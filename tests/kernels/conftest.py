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


def assert_counters_zero(device: torch.device) -> None:
    """The one-launch path leaves its whole scratch zeroed for the next launch."""
    from kernels import _triton_common

    # Keyed by the tensors' device: "cuda:0", which torch.device("cuda") does not equal.
    buffers = _triton_common._ARRIVAL_COUNTERS.get(torch.empty(0, device=device).device, [])
    assert buffers, "no one-launch call ran on this device"
    assert all(int(b.count_nonzero()) == 0 for b in buffers)


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


# Compiles the builds in the JSON file argv[1] (name -> tests/kernels/sm90_builds.py's Sm90Build
# as a dict), each specialised as the JIT specialises the engine's launches: pointers 16-byte
# aligned and `stride_*` integers divisible by 16 (every stride of the built shapes is a
# multiple of 16 elements). That is the variant a GPU runs: without the strides' divisibility
# a K/V row's address is not known to be 16-byte aligned, the loads are scalar and no loop is
# software-pipelined (cp.async moves 4-16 bytes). A build's `divisible` integers (a matmul's
# N and K at a model's shapes) are specialised the same way. It prints name -> None or the
# error text (or, for a build that lists `ptx_contains` or `ptx_order`, what its PTX lacks),
# as JSON. Options a build names that Triton's CUDA backend does not know are an error
# (triton.compile would drop them silently).
_COMPILE_SCRIPT = r"""
import importlib, json, sys, traceback
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import CUDAOptions
from triton.compiler import ASTSource

results = {}
for name, build in json.load(open(sys.argv[1])).items():
    try:
        fn = getattr(importlib.import_module(build["module"]), build["kernel"])
        constexprs = {k: getattr(tl, v[3:]) if isinstance(v, str) and v.startswith("tl.") else v
                      for k, v in build["constexprs"].items()}
        names = fn.arg_names
        unknown = sorted(set(constexprs).union(build["signature"]) - set(names))
        assert not unknown, f"{build['kernel']} has no arguments {unknown}"
        full = {n: "constexpr" if n in constexprs else
                build["signature"].get(n, "i64" if n.startswith("stride_") else None)
                for n in names}
        missing = [n for n, t in full.items() if t is None]
        assert not missing, f"no type for {missing}"
        options = build["options"]
        unknown = sorted(set(options) - set(CUDAOptions.__dataclass_fields__))
        assert not unknown, f"not triton.compile options: {unknown}"
        # Pointers and strides as the launcher meets them (16-byte-aligned tensor data,
        # strides of 16 elements or more): the JIT's divisibility attribute, except where
        # the kernel opts out of specialising.
        unspecialised = {names[i] if isinstance(i, int) else i
                         for i in (*fn.do_not_specialize, *fn.do_not_specialize_on_alignment)}
        divisible = set(build["divisible"])
        attrs = {(names.index(n),): [["tt.divisibility", 16]] for n, t in full.items()
                 if (t.startswith("*") or n.startswith("stride_") or n in divisible)
                 and n not in unspecialised}
        src = ASTSource(fn=fn, signature=full,
                        constexprs={(names.index(k),): v for k, v in constexprs.items()},
                        attrs=attrs)
        compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
        ptx = compiled.asm["ptx"]
        lacking = [text for text in build["ptx_contains"] if text not in ptx]
        order = [ptx.find(text) for text in build["ptx_order"]]
        if lacking:
            results[name] = f"the PTX lacks {lacking}"
        elif -1 in order or order != sorted(order):
            results[name] = f"the PTX lacks {build['ptx_order']} in that order"
        else:
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
def sm90_build_errors(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str | None]:
    """tests/kernels/sm90_builds.py's ``SM90_BUILDS`` name -> None if it compiled for
    sm_90, else the error text.

    The builds are dealt round-robin to one child process per CPU this process may use
    (at most 4): a compile runs on one thread, and neighbouring builds (one kernel in
    several dtypes or launches) cost alike, so the children get like shares.
    """
    pytest.importorskip("triton.backends.nvidia", reason="Triton without its CUDA backend")
    from tests.kernels.sm90_builds import build_specs

    specs = list(build_specs().items())
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    num_children = max(1, min(4, cpus or 1, len(specs)))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    folder = tmp_path_factory.mktemp("sm90")
    children = []
    for i in range(num_children):
        builds, out, err = (folder / f"{i}.{ext}" for ext in ("json", "out", "err"))
        builds.write_text(json.dumps(dict(specs[i::num_children])))
        with out.open("w") as stdout, err.open("w") as stderr:
            command = [sys.executable, "-c", _COMPILE_SCRIPT, str(builds)]
            children.append((subprocess.Popen(command, stdout=stdout, stderr=stderr, env=env),
                             out, err))  # fmt: skip
    errors: dict[str, str | None] = {}
    try:
        for child, out, err in children:
            returncode = child.wait(timeout=600)
            assert returncode == 0, err.read_text()[-4000:]
            errors.update(json.loads(out.read_text().strip().splitlines()[-1]))
    finally:
        for child, _, _ in children:
            if child.poll() is None:
                child.kill()
                child.wait()
    return errors


@pytest.fixture
def paged_kv() -> Callable[..., PagedKV]:
    """Factory fixture: ``paged_kv(seq_lens, block_size=..., ...)`` -> ``PagedKV``."""
    return build_paged_kv
