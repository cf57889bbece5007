"""The CPU fast path: a loaded model moved onto the C++ kernels of ``kernels.cpu``.

``build_cpu_forward(model, ops, gguf_path=...)`` transforms a float32 ``LlamaForCausalLM``
from outside and returns ``CpuForward``, which the runner calls in the model's place
(``engine/backends/__init__.py``). Building it:

1. packs every matmul's weight into the C++ matmul's column panels (``ops.pack_weight``,
   ``kernels/cpu/csrc/gemm.cpp``), which serve batches of up to ``max_packed_rows()`` (256)
   rows;
2. with a GGUF checkpoint, adds the file's own quantized blocks for every matmul where they
   de-quantize to its float32 weight bit for bit (``engine/gguf_blocks.py``); batches of up
   to ``max_quant_rows()`` rows read those, 6-9 bits a weight instead of 32; with
   ``--quantization int8`` (``engine/quantization.py``: the matmuls are ``QuantizedLinear``)
   their int8 weights packed as Q8 blocks take that part, and the panels hold the float32
   values ``q * scale`` (``_int8_blocks``);
3. lays each kind of copy end to end in one buffer on huge pages, in forward order
   (``gather``);
4. drops the plain float32 weights that no step reads any more: the decoder layers'
   (``CpuForward`` below runs every matmul of theirs on panels or blocks), and the head's
   when no step can give it more rows than the panels serve;
5. writes everything the fused stack reads into a ``StackSpec``: the weights in the order
   of the C++ enums ``Slot`` and ``HeadSlot`` (``kernels/cpu/csrc/decoder_layer.cpp``;
   checked against the source when the spec is made), eps, the softmax scale, the RoPE
   tables and head counts. The C++ side takes the spec and nothing from the model.

Owns: the packed panels, the GGUF blocks, the buffers they live in, and the C++ objects
made from them once (``StackWeights``, ``StackCaches``).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from engine.attention import per_token_plan
from engine.gguf_blocks import BlocksReport, exact_gguf_blocks
from engine.input_batch import InputBatch
from engine.llama import DecoderLayer, Linear, LlamaForCausalLM
from engine.quantization import QuantizedLinear
from kernels import cpu as cpu_kernels
from kvpool import host_memory

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Matmul:
    """One matmul's tensors as the C++ ``linear`` takes them; it picks the blocks, the
    panels or the library on ``w`` by the batch's rows (gemm.cpp, ``pick``)."""

    w: torch.Tensor  # [in, out]; a stride-0 stand-in of that shape once dropped
    packed: torch.Tensor | None
    quant: torch.Tensor | None
    bias: torch.Tensor | None  # [out]


@dataclass(frozen=True, slots=True)
class LayerSlots:
    """One decoder layer's tensors; fields in the order of decoder_layer.cpp's enum Slot."""

    input_norm: torch.Tensor  # [hidden]
    post_norm: torch.Tensor  # [hidden]
    qkv: Matmul
    o: Matmul
    gate_up: Matmul
    down: Matmul


@dataclass(frozen=True, slots=True)
class HeadSlots:
    """The model's own tensors after the layers; fields in the order of enum HeadSlot."""

    embed: torch.Tensor  # [vocab, hidden]
    final_norm: torch.Tensor  # [hidden]
    head: Matmul


def slot_names(cls: type) -> tuple[str, ...]:
    """The flat slot names of a slots dataclass: a ``Matmul`` field ``qkv`` gives
    ``qkv_w, qkv_packed, qkv_quant, qkv_bias``; in the C++ enums' spelling."""
    names: list[str] = []
    for f in dataclasses.fields(cls):
        if f.type in ("Matmul", Matmul):
            names += [f"{f.name}_{m.name}" for m in dataclasses.fields(Matmul)]
        else:
            names.append(f.name)
    return tuple(names)


def _flat(slots: LayerSlots | HeadSlots) -> list[torch.Tensor | None]:
    out: list[torch.Tensor | None] = []
    for f in dataclasses.fields(slots):
        value = getattr(slots, f.name)
        if isinstance(value, Matmul):
            out += [value.w, value.packed, value.quant, value.bias]
        else:
            out.append(value)
    return out


def check_slot_order() -> None:
    """Assert that ``LayerSlots`` and ``HeadSlots`` list their tensors in the order the
    C++ stack reads them (its enums, read from the source it is built from)."""
    layer, head = cpu_kernels.stack_slots()
    assert slot_names(LayerSlots) == layer, (slot_names(LayerSlots), layer)
    assert slot_names(HeadSlots) == head, (slot_names(HeadSlots), head)


@dataclass(frozen=True, slots=True)
class StackSpec:
    """Everything the fused C++ stack reads, explicitly."""

    layers: tuple[LayerSlots, ...]
    head: HeadSlots
    eps: float  # every decoder layer's two norms
    final_eps: float  # the final norm
    scale: float  # softmax scale
    rope_cos: torch.Tensor  # [max_positions, head_dim] float32
    rope_sin: torch.Tensor  # [max_positions, head_dim] float32
    num_heads: int
    num_kv_heads: int

    @property
    def head_in_stack(self) -> bool:
        """Whether a decode-only step can end in the stack with the final norm and the head:
        it norms with one eps, the layers'."""
        return self.final_eps == self.eps

    def weights(self) -> list[torch.Tensor | None]:
        """The stack's ``weights`` list: every layer's slots, layer after layer, then the
        head's. Checks the slot order against the C++ source first."""
        check_slot_order()
        flat = [w for layer in self.layers for w in _flat(layer)]
        return flat + _flat(self.head)


@dataclass(frozen=True, slots=True)
class CpuMemory:
    """Bytes of the copies the cpu backend made, and of the plain weights it dropped."""

    packed_bytes: int
    block_bytes: int
    dropped_bytes: int


class CpuForward:
    """``forward(batch, key_caches, value_caches) -> logits`` on the fused C++ stack.

    The stack looks up the embeddings and RoPE rows, runs every decoder layer of the step
    in one C++ call with the same kernels in the same order as one op at a time would, and
    in a decode-only step (every row is its sequence's last token) ends with the final norm
    and the head: each Python-level op costs tens of microseconds once the weights have
    streamed through the caches. Needs the cpu attention's per-token plan (every query row
    attends through its own block table row and context length).

    A step of more rows than the packed panels serve (``max_packed_rows()``: 256; a burst
    of prompts prefilled together, up to the 2,048-token budget) runs the stack in passes
    of at most that many rows, in token order, so that its matmuls run on the panels rather
    than the library, and the step keeps its shape (the scheduler's budget is unchanged).
    NOTE: that is exact attention, as chunked prefill is: a sequence's rows are consecutive
    and in position order, and a pass writes its rows' K/V of every layer before the next
    pass reads them::

        rows:    | d0 d1 d2 | p0 p0 p0 p0 p0 p0 | p1 p1 p1 p1 |
        passes:  |<------- pass 0 ------->|<---- pass 1 ---->|
                  p0's last two rows (pass 1) read its first four from the cache.

    ``rows_per_pass`` overrides the pass size (tests); a larger one keeps the plain weights,
    which the library's matmul of over 256 rows reads.
    """

    rows_per_pass: int | None = None

    def __init__(
        self,
        spec: StackSpec,
        ops: Any,
        memory: CpuMemory,
        blocks: BlocksReport | None,
        key_offset: Callable[[torch.Tensor], torch.Tensor | None] | None = None,
    ):
        """``key_offset``: a key cache's calibrated offset, which the stack's stores subtract
        (``PagedAttention.key_offset``); None: no offsets."""
        self.spec = spec
        self.ops = ops  # torch.ops.pagedserve_cpu
        self.memory = memory
        self.blocks = blocks  # None: no GGUF checkpoint, or float32 asked for
        self.panel_rows = int(ops.max_packed_rows())
        self.pass_rows = self.rows_per_pass or self.panel_rows
        assert self.pass_rows <= self.panel_rows or memory.dropped_bytes == 0
        # Converted to C++ once, not at every step: converting the list of hundreds of
        # optional tensors costs a few percent of a batch-1 step.
        self.stack_weights = torch.classes.pagedserve_cpu.StackWeights(spec.weights())
        # The KV cache's lists (kvpool's KVCacheStorage owns them; they never change) and
        # the C++ object holding them.
        self._caches: tuple[list[torch.Tensor], list[torch.Tensor], Any] | None = None
        self.key_offset = key_offset

    @property
    def uses_blocks(self) -> bool:
        return self.blocks is not None and bool(self.blocks.attached)

    def stack_caches(self, key_caches: list[torch.Tensor], value_caches: list[torch.Tensor]) -> Any:
        """The cache lists as the C++ stack's caches object, made once per pair of lists."""
        held = self._caches
        if held is None or held[0] is not key_caches or held[1] is not value_caches:
            obj = torch.classes.pagedserve_cpu.StackCaches(key_caches, value_caches)
            # Every layer's offset or none (PagedAttention.set_key_offsets names them all).
            offsets = [self.key_offset(c) for c in key_caches] if self.key_offset else []
            if any(o is not None for o in offsets):
                assert all(o is not None for o in offsets), "a key offset for some layers only"
                obj.set_key_offsets(offsets)
            held = self._caches = (key_caches, value_caches, obj)
        return held[2]

    @torch.inference_mode()
    def __call__(
        self,
        batch: InputBatch,
        key_caches: list[
            torch.Tensor
        ],  # per layer [num_blocks, block_size, num_kv_heads, head_dim]
        value_caches: list[torch.Tensor],
    ) -> torch.Tensor:  # [num_samples, vocab] float32
        spec, ops = self.spec, self.ops
        plan = per_token_plan(batch.attn)
        assert plan.row_block_tables is not None and plan.row_seq_lens is not None
        logits = batch.logits_are_all_rows and spec.head_in_stack
        args = (
            batch.input_ids,
            batch.positions,
            batch.slot_mapping,
            plan.row_block_tables,
            plan.row_seq_lens,
        )
        t, rows = batch.input_ids.shape[0], self.pass_rows
        # One pass (every decode step): the step's own tensors, no slicing.
        spans = (
            [args]
            if t <= rows
            else [tuple(a[i : i + rows] for a in args) for i in range(0, t, rows)]
        )
        passes = [self.stack(*span, key_caches, value_caches, logits=logits) for span in spans]
        if len(passes) == 1:
            x, residual = passes[0]
        else:
            x, residual = torch.cat([o for o, _ in passes]), torch.cat([r for _, r in passes])
        if logits:
            return x
        # Only the last token of each sampling request needs logits.
        head = spec.head
        if batch.logits_are_all_rows:
            x = ops.add_rms_norm_(x.contiguous(), residual, head.final_norm, spec.final_eps)
        else:
            last = batch.logits_indices
            x = ops.add_rms_norm_(
                x[last].contiguous(), residual[last], head.final_norm, spec.final_eps
            )
        m = head.head
        assert x.shape[0] <= self.panel_rows or m.w.stride() != (0, 0), "head weight dropped"
        return ops.linear(x, m.w, m.packed, m.quant, m.bias).float()

    def stack(
        self,
        input_ids: torch.Tensor,  # [rows] int64
        positions: torch.Tensor,  # [rows] int64
        slot_mapping: torch.Tensor,  # [rows] int64
        block_tables: torch.Tensor,  # [rows, max_num_blocks] int32: each row's sequence's
        seq_lens: torch.Tensor,  # [rows] int32: the context each row sees (position + 1)
        key_caches: list[torch.Tensor],
        value_caches: list[torch.Tensor],
        *,
        logits: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One pass of the C++ stack: ``(out, residual)``; ``out`` is the float32 logits of
        every row with ``logits``, else the last layer's output."""
        spec = self.spec
        return self.ops.decoder_layers(
            input_ids,
            positions,
            self.stack_weights,
            self.stack_caches(key_caches, value_caches),
            spec.rope_cos,
            spec.rope_sin,
            slot_mapping,
            block_tables,
            seq_lens,
            spec.num_heads,
            spec.num_kv_heads,
            spec.eps,
            spec.scale,
            logits,
        )


def build_cpu_forward(
    model: LlamaForCausalLM,
    ops: Any,
    *,
    gguf_path: Path | None = None,
    max_logit_rows: int | None = None,
) -> CpuForward:
    """Move a loaded float32 ``model`` onto the C++ kernels (module docstring, steps 1-5).

    Args:
        model: loaded, on the CPU, float32; the matmul weights that no step will read are
            dropped from it here (moved to the meta device, ``_drop_plain_weights``).
        ops: ``torch.ops.pagedserve_cpu`` (``kernels.cpu.load()``).
        gguf_path: the GGUF file ``model`` was converted from, to read its blocks; None
            for float32 matmuls only.
        max_logit_rows: the most rows the head can get in one step (the scheduler's
            ``max_num_seqs``: a step's logit rows are its sampling and padding rows, at
            most one per sequence); None: unbounded.
    """
    check_slot_order()  # before any work: a mismatch is a build error, not a wrong answer
    linears = {  # forward order
        n: m for n, m in model.named_modules() if isinstance(m, (Linear, QuantizedLinear))
    }
    # The float32 weight each matmul multiplies by: a quantized one's is q * scale.
    weights = {
        n: m.dequantize() if isinstance(m, QuantizedLinear) else m.weight.detach()
        for n, m in linears.items()
    }
    packed = {n: ops.pack_weight(w) for n, w in weights.items()}
    blocks: dict[str, torch.Tensor] = {}
    report = None
    quantized = {n: m for n, m in linears.items() if isinstance(m, QuantizedLinear)}
    if quantized:  # --quantization: the weights are no longer the GGUF file's, if any
        blocks, report = _int8_blocks(quantized, weights, ops)
    elif gguf_path is not None:
        blocks, report = exact_gguf_blocks(model, gguf_path, ops)
    packed = gather(packed)
    blocks = gather(blocks)
    panel_rows = int(ops.max_packed_rows())
    dropped = 0
    if (CpuForward.rows_per_pass or panel_rows) <= panel_rows:
        head_too = max_logit_rows is not None and max_logit_rows <= panel_rows
        dropped = _drop_plain_weights(model, head=head_too)

    def matmul(name: str) -> Matmul:
        linear = linears[name]
        w = weights.pop(name)
        if _plain_weight(linear).is_meta:  # dropped: the C++ side reads its shape only
            w = torch.zeros(1, 1, dtype=torch.float32).expand(w.shape)
        bias = None if linear.bias is None else linear.bias.detach()
        return Matmul(w, packed[name], blocks.get(name), bias)

    def layer_slots(i: int, layer: DecoderLayer) -> LayerSlots:
        return LayerSlots(
            input_norm=layer.input_norm.weight.detach(),
            post_norm=layer.post_attention_norm.weight.detach(),
            qkv=matmul(f"layers.{i}.qkv_proj"),
            o=matmul(f"layers.{i}.o_proj"),
            gate_up=matmul(f"layers.{i}.gate_up_proj"),
            down=matmul(f"layers.{i}.down_proj"),
        )

    layers = list(model.layers)
    assert all(isinstance(layer, DecoderLayer) for layer in layers)
    eps = {n.eps for layer in layers for n in (layer.input_norm, layer.post_attention_norm)}
    assert len(eps) == 1, f"the stack takes one eps for every layer norm, got {eps}"
    first: DecoderLayer = layers[0]
    spec = StackSpec(
        layers=tuple(layer_slots(i, layer) for i, layer in enumerate(layers)),
        head=HeadSlots(
            embed=model.embed_tokens.weight.detach(),
            final_norm=model.norm.weight.detach(),
            head=matmul("lm_head"),
        ),
        eps=eps.pop(),
        final_eps=model.norm.eps,
        scale=model.attention.scale,
        rope_cos=model.rope.cos,
        rope_sin=model.rope.sin,
        num_heads=first.num_heads,
        num_kv_heads=first.num_kv_heads,
    )
    memory = CpuMemory(
        packed_bytes=sum(_nbytes(t) for t in packed.values()),
        block_bytes=sum(_nbytes(t) for t in blocks.values()),
        dropped_bytes=dropped,
    )
    return CpuForward(spec, ops, memory, report, key_offset=model.attention.key_offset)


def gather(copies: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The same tensors, moved end to end into one buffer in the order given (forward
    order: layer by layer, q/k/v, o, gate/up, down, then the head), on huge pages where the
    OS gives them (``kvpool/host_memory.py``).

    Why: a batch-1 decode step streams every weight once, and the hardware prefetchers read
    one long run at a time. Copies allocated one by one land wherever the allocator puts
    them; in one buffer each matmul's weights start where the previous one's end. Costs the
    copies' size once more, for the moment of the move."""
    if not copies:
        return {}
    dtypes = {t.dtype for t in copies.values()}
    assert len(dtypes) == 1, f"copies of several dtypes: {dtypes}"
    buffer = host_memory.zeros((sum(t.numel() for t in copies.values()),), dtypes.pop())
    moved, offset = {}, 0
    for name, t in copies.items():
        moved[name] = buffer[offset : offset + t.numel()].view(t.shape).copy_(t)
        offset += t.numel()
    return moved


def _drop_plain_weights(model: LlamaForCausalLM, *, head: bool) -> int:
    """Move every decoder layer's matmul weight, and with ``head`` the head's, to the meta
    device; returns the bytes freed.

    Sound because a matmul of at most ``max_packed_rows()`` rows runs on its packed panels
    or its GGUF blocks, never on the plain weight (gemm.cpp, ``pick``): every pass of the
    stack is at most that many rows, and so is the head when the step's logit rows are
    (``max_logit_rows``). The model's Python forward cannot run afterwards (a meta tensor
    fails loudly), and nothing calls it."""
    linears = [
        linear
        for layer in model.layers
        for linear in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj)
    ]
    if head:
        linears.append(model.lm_head)
    freed = 0
    for linear in linears:
        w = _plain_weight(linear)
        freed += _nbytes(w)
        meta = nn.Parameter(torch.empty(w.shape, dtype=w.dtype, device="meta"), requires_grad=False)
        if isinstance(linear, QuantizedLinear):
            linear.qweight = meta
        else:
            linear.weight = meta
    return freed


def _plain_weight(linear: nn.Module) -> torch.Tensor:
    """The model's own weight tensor of a matmul (a quantized one's int8 values)."""
    return linear.qweight if isinstance(linear, QuantizedLinear) else linear.weight


def _int8_blocks(
    quantized: dict[str, QuantizedLinear], weights: dict[str, torch.Tensor], ops: Any
) -> tuple[dict[str, torch.Tensor], BlocksReport]:
    """The int8 weights of ``quantized`` as Q8 panels for ``ops.linear``'s small batches
    (``pack_int8``, gemm_q.cpp), each checked to de-quantize bit for bit to the float32
    weight in ``weights`` that the panels and the library multiply by at larger batches: one
    model whatever the batch. A matmul that fails the check (or whose input size is not
    whole 32-blocks) stays on its float32 panels, and the report says so."""
    report = BlocksReport(source="int8 blocks (--quantization int8)")
    found: dict[str, torch.Tensor] = {}
    for name, linear in quantized.items():
        w = weights[name]
        if linear.mode != "int8" or linear.in_features % 32 != 0:
            report.skipped[name] = f"{linear.mode}, {linear.in_features} inputs"
            continue
        panels = ops.pack_int8(linear.qweight.detach(), linear.scale.detach())
        if not torch.equal(ops.dequantize_panels(panels, linear.out_features), w):
            report.skipped[name] = "packed int8 blocks differ from q * scale"
            continue
        found[name] = panels
        report.attached["int8"] += 1
        if name == "lm_head":
            report.lm_head_block_bytes = panels.numel()
            report.lm_head_float32_bytes = _nbytes(w)
        else:
            report.body_float32_bytes += _nbytes(w)
            report.body_block_bytes += panels.numel()
    log.info("%s", report.summary())
    return found, report


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
