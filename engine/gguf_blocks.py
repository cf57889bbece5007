"""Attach a GGUF checkpoint's own quantized blocks to the model's matmuls, where they
reproduce its float32 weights exactly.

Owns: the mapping from each ``Linear`` of ``engine/llama.py`` (fused q/k/v and gate/up
included, through ``checkpoint_sources``) to the GGUF tensors it came from, and the check
that makes the fast path safe. The cpu backend (``engine/backends/cpu.py``) asks for the
blocks and keeps them beside the model; the model itself never holds them.

Why: the engine runs on the float32 values ``transformers`` de-quantizes a GGUF file to
(``engine/loader.py``), so a one-row decode step streams 32 bits a weight. The file's blocks
hold the same values in 4.5 (Q4_0), 5 (Q4_1) or 8.5 (Q8_0) bits; the C++ matmul
(``kernels/cpu/csrc/gemm_q.cpp``) de-quantizes them in registers, exactly. Packed with
float32 scales they take 6 (Q4) or 9 (Q8) bits a weight: a decode step of the default model
reads 112 MB instead of 538 MB, 4.8x fewer bytes. Greedy output stays token-identical to
``transformers`` because the weights are bitwise the same (only the summation order differs,
as between any two matmul kernels).

The invariant: a ``Linear`` gets blocks only if ``dequantize_panels(blocks)`` equals its
float32 ``weight`` bit for bit. Anything else (another block type, rows ``transformers``
reordered in a way not found, a tensor missing) leaves that matmul on float32 and is logged.
Row orders are found by content, not by knowing each converter's permutation: ``transformers``
un-permutes Llama's q/k rows that ``convert_hf_to_gguf`` permuted for its RoPE layout.
"""

from __future__ import annotations

import logging
import struct
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.config import ModelConfig
from engine.llama import Linear, LlamaForCausalLM, checkpoint_sources

log = logging.getLogger(__name__)

# ggml type ids the C++ matmul reads (kernels/cpu/csrc/gemm_q.cpp).
SUPPORTED_TYPES = {2: "Q4_0", 3: "Q4_1", 8: "Q8_0"}


@dataclass(slots=True)
class BlocksReport:
    """What ``exact_gguf_blocks`` found, for the load log and tests."""

    attached: Counter[str] = field(default_factory=Counter)  # ggml type name -> matmuls
    skipped: dict[str, str] = field(default_factory=dict)  # matmul name -> why float32
    # Sizes of the matmuls that got blocks: the decoder layers' and the LM head's.
    body_float32_bytes: int = 0
    body_block_bytes: int = 0
    lm_head_block_bytes: int | None = None  # None: the LM head stays float32
    lm_head_float32_bytes: int = 0
    # What the blocks are, for the log (engine/backends/cpu.py reuses this for int8 blocks).
    source: str = "the checkpoint's GGUF blocks"

    @property
    def body_saved_bytes(self) -> int:
        """Bytes a small-batch step no longer reads in the decoder layers."""
        return self.body_float32_bytes - self.body_block_bytes

    def summary(self) -> str:
        got = ", ".join(f"{n} x{c}" for c, n in sorted((c, n) for n, c in self.attached.items()))
        text = (
            f"{sum(self.attached.values())} matmuls read {self.source} "
            f"({got or 'none'}): "
            f"{(self.body_block_bytes + (self.lm_head_block_bytes or 0)) / 1e6:.0f} MB instead of "
            f"{(self.body_float32_bytes + self.lm_head_float32_bytes) / 1e6:.0f} MB of float32"
        )
        if self.skipped:
            text += f"; {len(self.skipped)} stay float32 (e.g. {next(iter(self.skipped.items()))})"
        return text


@dataclass(frozen=True, slots=True)
class _TensorInfo:
    qtype: int
    shape: tuple[int, ...]  # GGUF order: ne0 (the contiguous, input dimension) first
    offset: int  # from the start of the file


# GGUF metadata value types -> struct format of the fixed-size ones (8: string, 9: array).
_SCALARS = {
    0: "B",
    1: "b",
    2: "H",
    3: "h",
    4: "I",
    5: "i",
    6: "f",
    7: "?",
    10: "Q",
    11: "q",
    12: "d",
}


def read_tensor_index(path: Path) -> tuple[str, dict[str, _TensorInfo]]:
    """A GGUF file's architecture name and tensor directory, without reading the metadata
    values into objects: gguf-py's reader builds one numpy view per vocabulary string
    (8 s for the default model's 49k tokens and merges); skipping them takes milliseconds."""
    data = np.memmap(path, dtype=np.uint8, mode="r")
    buf = memoryview(data)
    pos = 0

    def take(fmt: str) -> Any:
        nonlocal pos
        (value,) = struct.unpack_from("<" + fmt, buf, pos)
        pos += struct.calcsize(fmt)
        return value

    def string() -> str:
        nonlocal pos
        n = take("Q")
        pos += n
        return bytes(buf[pos - n : pos]).decode("utf-8", "replace")

    def skip(vtype: int) -> Any:
        nonlocal pos
        if vtype == 8:
            return string()
        if vtype == 9:
            itype, count = take("I"), take("Q")
            if itype in _SCALARS:
                pos += count * struct.calcsize(_SCALARS[itype])
            else:
                for _ in range(count):
                    skip(itype)
            return None
        return take(_SCALARS[vtype])

    if bytes(buf[:4]) != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file")
    pos = 4
    _version, n_tensors, n_kv = take("I"), take("Q"), take("Q")
    meta: dict[str, Any] = {}
    for _ in range(n_kv):
        key = string()
        meta[key] = skip(take("I"))
    infos = []
    for _ in range(n_tensors):
        name = string()
        shape = tuple(take("Q") for _ in range(take("I")))
        infos.append((name, take("I"), shape, take("Q")))
    align = int(meta.get("general.alignment") or 32)
    start = (pos + align - 1) // align * align
    index = {n: _TensorInfo(t, shape, start + off) for n, t, shape, off in infos}
    return str(meta["general.architecture"]), index


def _sources(config: ModelConfig, linears: list[str]) -> dict[str, list[str]]:
    """Each matmul's module name -> the HF tensor names (without ``.weight``) concatenated,
    in order, into its weight (the model's own checkpoint mapping)."""
    sources = checkpoint_sources(config)
    return {
        name: [s.removesuffix(".weight") for s in sources[f"{name}.weight"]] for name in linears
    }


def _row_order(raw: np.ndarray, qtype: int, target: torch.Tensor) -> np.ndarray | None:
    """Indices ``p`` such that ``raw[p]`` de-quantizes to ``target`` ([out, in]), or None.
    Matches rows by content with gguf-py's de-quantizer (slow; only for a matmul whose blocks
    in file order failed the check)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    rows = dequantize(raw, GGMLQuantizationType(qtype)).astype(np.float32, copy=False)
    want = target.numpy()
    if rows.shape != want.shape:
        return None
    index = {rows[i].tobytes(): i for i in range(len(rows))}
    order = [index.get(want[i].tobytes(), -1) for i in range(len(want))]
    return None if -1 in order else np.asarray(order)


def _exact_panels(
    raws: list[np.ndarray], qtype: int, weight: torch.Tensor, ops: Any
) -> torch.Tensor | None:
    """The parts' blocks packed for the kernel, if they de-quantize to ``weight`` bit for bit."""
    panels = ops.pack_gguf(torch.from_numpy(np.concatenate(raws)), qtype, weight.shape[0])
    return panels if torch.equal(ops.dequantize_panels(panels, weight.shape[1]), weight) else None


def exact_gguf_blocks(
    model: LlamaForCausalLM, gguf_path: Path, ops: Any
) -> tuple[dict[str, torch.Tensor], BlocksReport]:
    """Every matmul of ``model`` whose GGUF source blocks are exact, with its packed blocks.

    ``model`` is a float32 ``LlamaForCausalLM`` already loaded from the checkpoint
    ``transformers`` converted ``gguf_path`` to; it is read, not changed.

    Returns:
        Matmul module name (``layers.0.qkv_proj``, ``lm_head``) -> its blocks packed for
        ``ops.quant_linear``, for the matmuls that passed the check; and the report.
    """
    import gguf

    arch_name, tensors = read_tensor_index(gguf_path)
    arch = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[arch_name]
    names = gguf.get_tensor_name_map(arch, model.config.num_layers)
    linears = {n: m for n, m in model.named_modules() if isinstance(m, Linear)}
    report = BlocksReport()
    found: dict[str, torch.Tensor] = {}
    for name, parts in _sources(model.config, list(linears)).items():
        weight = linears[name].weight.detach()  # [in, out]
        in_features = weight.shape[0]
        raws, types, why = [], set(), None
        for part in parts:
            gname = names.get_name(part)
            t = tensors.get(f"{gname}.weight") if gname else None
            if t is None:
                why = f"no GGUF tensor for {part}"
                break
            qtype = t.qtype
            if qtype not in SUPPORTED_TYPES or len(t.shape) != 2 or t.shape[0] != in_features:
                why = f"{part} is ggml type {qtype}, shape {t.shape}"
                break
            block_len, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(qtype)]
            row_bytes = in_features // block_len * block_bytes
            raws.append(
                np.array(np.memmap(gguf_path, np.uint8, "r", t.offset, (t.shape[1], row_bytes)))
            )
            types.add(qtype)
        if why is None and (len(types) != 1 or sum(len(r) for r in raws) != weight.shape[1]):
            why = "parts of different block types" if len(types) != 1 else "row count differs"
        if why is not None:
            report.skipped[name] = why
            continue
        (qtype,) = types
        # The blocks in file order first: one pack and one check. Only if that fails, each
        # part's rows are matched by content (Llama's q/k after transformers un-permuted them).
        panels = _exact_panels(raws, qtype, weight, ops)
        if panels is None:
            offsets = np.cumsum([0] + [len(r) for r in raws])
            orders = [
                _row_order(raw, qtype, weight[:, lo:hi].t().contiguous())
                for raw, lo, hi in zip(raws, offsets[:-1], offsets[1:], strict=True)
            ]
            if any(order is None for order in orders):
                report.skipped[name] = "its blocks do not de-quantize to its float32 rows"
                continue
            panels = _exact_panels(
                [r[o] for r, o in zip(raws, orders, strict=True)], qtype, weight, ops
            )
            if panels is None:
                report.skipped[name] = "packed blocks differ from the float32 weight"
                continue
        found[name] = panels
        report.attached[SUPPORTED_TYPES[qtype]] += 1
        if name == "lm_head":
            report.lm_head_block_bytes = panels.numel()
            report.lm_head_float32_bytes = weight.numel() * weight.element_size()
        else:
            report.body_float32_bytes += weight.numel() * weight.element_size()
            report.body_block_bytes += panels.numel()
    log.info("%s", report.summary())
    return found, report
