"""Features together, where each was mostly tested alone: the combinations a vLLM or SGLang
user runs at once, on tiny random models, every step checked (``check_integrity``), every
request finished once with a valid reason and nothing after it, every block free at the end.

- Asynchronous scheduling x prefix caching (a shared system prompt, a prompt cached whole,
  so copy-on-write) x preemption in a tiny pool x chunked prompts x stop tokens x staggered
  arrivals: transformers' greedy tokens (tests/engine/parity.py's near-tie rule).
- The lossy modes (KV int8 / fp8, int8 weights) through asynchronous scheduling with
  preemption and prefix hits, and through speculative decoding (n-gram, draft): the tokens of
  the same lossy mode run plainly. Cached, recomputed and verified K/V come from other batch
  shapes, whose float32 rounding can move a value across a quantization step, so these too
  accept a divergence only at a reference near-tie (margins from the reference's logprobs).
- The CUDA decode and prefill graphs' CPU stand-ins x an int8 cache x prefix caching x
  preemption x speculative rows or asynchronous steps: the eager engine's tokens.
- The Triton kernels (interpreted on the CPU, compiled on CUDA) x an int8 cache x prefix
  caching (copy-on-write) x preemption x asynchronous steps: the torch reference's tokens.
- Structured output x asynchronous scheduling x preemption x stop tokens (and beside n-gram
  speculation): the synchronous engine's tokens, every output in its grammar.
- Tensor parallelism (2 gloo ranks) x an int8 cache x prefix caching (copy-on-write) x
  preemption x asynchronous scheduling: TP=1's tokens.

Covered elsewhere: batching modes x preemption x async (test_batching_modes.py), async x
seeds / penalties / logprobs / aborts / random traffic (test_async_scheduling.py), the
quantized cache x prefix caching x preemption synchronously (test_kv_cache_dtype.py),
speculative decoding x preemption / aborts / sampling (test_spec_decode.py), the HTTP
server's combinations (tests/server/), refused combinations (tests/server/test_config.py,
test_quantization.py, test_async_scheduling.py).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.outputs import RequestOutput
from scheduler import SchedulerOutput
from scheduler.request import PENDING_TOKEN, StructuredOutputParams
from tests.engine.conftest import make_tiny_llama
from tests.engine.graph_stand_ins import install_decode_stand_in, install_prefill_stand_in
from tests.engine.parity import Reference, assert_parity, hf_greedy
from tests.triton_devices import TRITON_DEVICES

pytestmark = pytest.mark.usefixtures("one_torch_thread")

DEVICE = {"device": "cpu", "dtype": "float32"}
EOS = 2

# (arrival step, prompt index, max_tokens). Prompt 5 is the first block (16 tokens) of the
# system prompt the first five share, cached whole by then: copy-on-write of that block.
ARRIVALS = [(0, 0, 12), (0, 1, 20), (0, 2, 9), (2, 3, 16), (4, 4, 14), (9, 5, 10), (9, 6, 8)]
STOP_AT = {1: 6, 4: 9}  # request -> the output index whose token becomes its stop token


class Outputs:
    """A step loop's outputs per request; an output after a request's final one, a pending
    token among them, or a final count that is not the tokens emitted fails the test."""

    def __init__(self) -> None:
        self.tokens: dict[str, list[int]] = {}
        self.logprobs: dict[str, list] = {}
        self.reasons: dict[str, str | None] = {}

    def add(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            rid = out.request_id
            assert rid not in self.reasons, f"{rid} emitted after it finished"
            assert PENDING_TOKEN not in out.new_token_ids
            self.tokens.setdefault(rid, []).extend(out.new_token_ids)
            self.logprobs.setdefault(rid, []).extend(out.new_logprobs or [])
            if out.finished:
                assert out.finish_reason in ("stop", "length"), out
                assert out.num_output_tokens == len(self.tokens[rid])
                self.reasons[rid] = out.finish_reason

    def reference(self, rid: str) -> Reference:
        """This run's tokens as a parity reference (it asked for the top-2 logprobs)."""
        return Reference(
            self.tokens[rid], [lp.top[0][1] - lp.top[1][1] for lp in self.logprobs[rid]]
        )


def run(
    llm: LLM,
    requests: list[tuple[int, str, list[int], SamplingParams]],
    on_plan=None,  # noqa: ANN001 - called with every non-empty plan
) -> Outputs:
    """Add each request at its step, step until all finish; check integrity every step."""
    engine = llm.engine
    if on_plan is not None:
        schedule = engine.scheduler.schedule

        def watching(*args: object, **kwargs: object) -> SchedulerOutput:
            out = schedule(*args, **kwargs)  # type: ignore[arg-type]
            if not out.is_empty:
                on_plan(out)
            return out

        engine.scheduler.schedule = watching  # type: ignore[method-assign]
    collected = Outputs()
    last = max(at for at, *_ in requests)
    step = 0
    while step <= last or engine.has_unfinished_requests():
        for at, rid, prompt, params in requests:
            if at == step:
                engine.add_request(rid, prompt, params)
        collected.add(engine.step())
        engine.check_integrity()
        step += 1
        assert step < 1000, "the engine did not finish"
    assert set(collected.reasons) == {rid for _, rid, _, _ in requests}
    assert engine.num_free_blocks == engine.num_total_blocks
    return collected


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(17)
    system = torch.randint(3, 256, (20,), generator=g).tolist()
    out = [system + torch.randint(3, 256, (n,), generator=g).tolist() for n in (1, 16, 29, 5, 44)]
    return [*out, out[1][:16], [5, 6, 7, 8] * 6]  # cached whole; repetitive (n-gram drafts)


# ---------------------------------------------------------------- async x caching x preemption


@pytest.fixture(scope="module")
def references(tiny_llama_cpu_shapes: Path, prompts: list[list[int]]) -> dict[str, Reference]:
    """transformers' greedy tokens per request, cut after its stop token if it has one."""
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(tiny_llama_cpu_shapes).eval()
    refs = {}
    for _, i, max_tokens in ARRIVALS:
        ref = hf_greedy(hf, prompts[i], max_tokens, eos_token_id=EOS)
        if i in STOP_AT:
            n = ref.token_ids.index(ref.token_ids[STOP_AT[i]]) + 1
            ref = Reference(ref.token_ids[:n], ref.margins[:n])
        refs[f"r{i}"] = ref
    return refs


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"async_scheduling": True},
        # A minimum chunk below the 32-token budget and targets below any step of the tiny
        # model, so that the targets bind whatever the machine's speed.
        {"async_scheduling": True, "target_itl_ms": 0.01, "min_prefill_chunk_tokens": 4},
        {"target_tpot_ms": 0.01, "target_ttft_ms": 50.0, "min_prefill_chunk_tokens": 4},
        # A relative target 1% over the decodes' own step: any prompt chunk overruns it.
        {"async_scheduling": True, "target_itl_ratio": 1.01, "min_prefill_chunk_tokens": 4},
    ],
    ids=["sync", "async", "async-itl-target", "sync-tpot-ttft-targets", "async-itl-ratio"],
)
def test_prefix_caching_preemption_and_stops_match_transformers(
    tiny_llama_cpu_shapes: Path,
    prompts: list[list[int]],
    references: dict[str, Reference],
    kwargs: dict[str, object],
) -> None:
    """With latency targets too (an ITL target; a TPOT target, whose credit carries from
    step to step, with a TTFT target that may widen a step's prompt share; a relative ITL
    target, whose budget follows the predicted decode-only step), which cap each
    step's prompt tokens by measured step times (so the plans vary from run to run; the
    tokens may not)."""
    requests = [
        (at, f"r{i}", prompts[i], SamplingParams(
            max_tokens=m, temperature=0.0,
            stop_token_ids=(references[f"r{i}"].token_ids[-1],) if i in STOP_AT else (),
        ))
        for at, i, m in ARRIVALS
    ]  # fmt: skip
    llm = LLM(
        str(tiny_llama_cpu_shapes), block_size=16, num_kv_blocks=8, max_num_seqs=4,
        max_num_batched_tokens=32, **DEVICE, **kwargs,  # type: ignore[arg-type]
    )  # fmt: skip
    copies, decisions = [], []

    def on_plan(plan: SchedulerOutput) -> None:
        copies.extend(plan.blocks_to_copy)
        decisions.append(plan.target)

    got = run(llm, requests, on_plan)
    for rid, ref in references.items():
        if assert_parity(got.tokens[rid], ref, f"{rid}") is None:
            reason = "stop" if int(rid[1:]) in STOP_AT or ref.token_ids[-1] == EOS else "length"
            assert got.reasons[rid] == reason, rid
    engine = llm.engine
    assert engine.scheduler.num_preemptions_total > 0
    assert engine.kv_manager.stats().prefix_cache_hits > 0
    assert copies, "the prompt cached whole copies its last block"
    targeted = any(key.startswith("target_") for key in kwargs)
    assert all((d is not None) == targeted for d in decisions)
    if targeted:
        # The targets bound: some step planned beside decodes had its prompt tokens capped
        # below the 32-token budget, or (where measured step times made a queued prompt miss
        # the TTFT target) had its share widened by that target instead.
        assert any(
            d is not None and d.sized and (d.prefill_cap < 32 or d.ttft_boost)
            for d in decisions
        ), decisions


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_prompt_aborted_mid_prefill_leaves_valid_cached_blocks(
    tiny_llama_cpu_shapes: Path, references: dict[str, Reference], prompts: list[list[int]],
    async_scheduling: bool,
) -> None:  # fmt: skip
    """A long prompt chunked over steps and aborted after two chunks (with asynchronous
    steps, while its next chunk is on the device): the blocks its chunks filled stay cached,
    and the same prompt sent again starts from them and gets transformers' tokens."""
    prompt, ref = prompts[4], references["r4"]  # 64 tokens: 4 chunks of 16
    params = SamplingParams(max_tokens=len(ref.token_ids), temperature=0.0)
    llm = LLM(
        str(tiny_llama_cpu_shapes), block_size=8, num_kv_blocks=32, max_num_batched_tokens=16,
        async_scheduling=async_scheduling, **DEVICE,
    )  # fmt: skip
    engine = llm.engine
    engine.add_request("first", prompt, params)
    outputs = Outputs()
    for _ in range(2):
        outputs.add(engine.step())
        engine.check_integrity()
    assert "first" not in outputs.tokens  # still prefilling
    (aborted,) = engine.abort_request(["first"])
    assert (aborted.finish_reason, aborted.num_output_tokens) == ("abort", 0)
    while engine.has_unfinished_requests():  # the chunk in flight, if any, is read
        assert engine.step() == []
    engine.check_integrity()
    assert engine.num_free_blocks == engine.num_total_blocks
    again = run(llm, [(0, "again", prompt, params)])
    assert engine.kv_manager.stats().prefix_cache_hits >= 16
    assert_parity(again.tokens["again"], ref, "sent again")


# ----------------------------------------------------------------------------- lossy modes

LOSSY = {
    "kv-int8": {"kv_cache_dtype": "int8"},
    "kv-fp8": {"kv_cache_dtype": "fp8"},
    "weights-int8": {"quantization": "int8"},
}


@pytest.fixture(scope="module")
def draft_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A one-layer draft with the target's vocabulary (its own random weights)."""
    return make_tiny_llama(
        tmp_path_factory.mktemp("combo-draft"), num_kv_heads=2, seed=9, hidden_size=128,
        intermediate_size=256, num_hidden_layers=1,
    )  # fmt: skip


def _greedy_requests(prompts: list[list[int]]) -> list[tuple[int, str, list[int], SamplingParams]]:
    return [
        (at, f"r{i}", prompts[i], SamplingParams(
            max_tokens=m, temperature=0.0, ignore_eos=True, logprobs=2,
        ))
        for at, i, m in ARRIVALS
    ]  # fmt: skip


@pytest.mark.parametrize("mode", list(LOSSY))
def test_lossy_modes_keep_their_tokens_through_async_preemption_and_speculation(
    tiny_llama_cpu_shapes: Path, draft_model: Path, prompts: list[list[int]], mode: str
) -> None:
    requests = _greedy_requests(prompts)
    common = {"block_size": 16, "max_num_seqs": 4, **LOSSY[mode], **DEVICE}
    plain = LLM(
        str(tiny_llama_cpu_shapes), num_kv_blocks=64, max_num_batched_tokens=64,
        enable_prefix_caching=False, **common,
    )  # fmt: skip
    ref = run(plain, requests)
    tiny = {"num_kv_blocks": 8, "max_num_batched_tokens": 32}
    variants = {
        "async": {"async_scheduling": True, **tiny},
        "ngram": {"speculative_method": "ngram", "num_speculative_tokens": 4, **tiny},
        "draft": {"speculative_method": "draft", "speculative_model": str(draft_model),
                  "num_speculative_tokens": 3, "num_kv_blocks": 64},
    }  # fmt: skip
    for label, kwargs in variants.items():
        llm = LLM(str(tiny_llama_cpu_shapes), **{**common, **kwargs})  # type: ignore[arg-type]
        got = run(llm, requests)
        for rid in ref.tokens:
            assert_parity(got.tokens[rid], ref.reference(rid), f"{mode} {label} {rid}")
        engine = llm.engine
        if label != "draft":
            assert engine.scheduler.num_preemptions_total > 0, label
            assert engine.kv_manager.stats().prefix_cache_hits > 0, label


# ------------------------------------------------------------------- CUDA graphs' stand-ins


@pytest.mark.parametrize(
    "kwargs",
    [{"async_scheduling": True}, {"speculative_method": "ngram", "num_speculative_tokens": 3}],
    ids=["async", "ngram"],
)
def test_graph_stand_ins_with_an_int8_cache_preemption_and_cached_prefixes(
    tiny_llama_gqa: Path, prompts: list[list[int]], kwargs: dict[str, object]
) -> None:
    """The decode graphs and the prefill graphs (run eagerly through their buffers and
    padding, as on CUDA) serve an int8 cache, cached and copied blocks, recomputed requests
    and speculative rows or steps fed on the device: the eager engine's tokens."""
    requests = _greedy_requests(prompts)
    common = {"block_size": 8, "max_num_seqs": 8, "max_num_batched_tokens": 24,
              "kv_cache_dtype": "int8", "attention_backend": "torch", **DEVICE}  # fmt: skip
    ref = run(LLM(str(tiny_llama_gqa), num_kv_blocks=64, enable_prefix_caching=False, **common),
              requests)  # fmt: skip
    llm = LLM(str(tiny_llama_gqa), num_kv_blocks=14, **common, **kwargs)  # type: ignore[arg-type]
    engine = llm.engine
    decode_graphs = install_decode_stand_in(engine, [1, 2, 4, 8])
    prefill_graphs = install_prefill_stand_in(engine, [8, 16, 24])
    decode_replays = 0
    replay = decode_graphs.run

    def counting(batch):  # noqa: ANN001, ANN202
        nonlocal decode_replays
        decode_replays += 1
        return replay(batch)

    decode_graphs.run = counting  # type: ignore[method-assign]
    got = run(llm, requests)
    for rid in ref.tokens:
        assert_parity(got.tokens[rid], ref.reference(rid), f"graphs {kwargs} {rid}")
    # The torch backend plans a mixed step's decodes apart (pieces); prefill-only steps
    # replay whole.
    assert decode_replays > 0
    assert prefill_graphs.replays["whole"] > 0 and prefill_graphs.replays["pieces"] > 0
    assert engine.scheduler.num_preemptions_total > 0
    assert engine.kv_manager.stats().prefix_cache_hits > 0


# ------------------------------------------------------------------------ Triton kernels

@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graph-stand-ins"])
@pytest.mark.parametrize("device", TRITON_DEVICES)
def test_triton_with_an_int8_cache_cached_prefixes_preemption_and_async(
    tiny_llama_gqa: Path, device: str, graphs: bool
) -> None:
    """The GPU's path: the Triton store, decode and prefill kernels over an int8 cache, with
    prompts that start from cached (and copied) blocks, recomputed after preemption, and
    decodes fed on the device: the torch reference backend's tokens over the same cache,
    near-ties aside. With ``graphs``, steps run through the decode graphs' and prefill
    graphs' buffers (their CPU stand-ins, as on CUDA without the capture): mixed steps
    replay whole."""
    g = torch.Generator().manual_seed(5)
    system = torch.randint(3, 256, (16,), generator=g).tolist()
    prompts = [system + torch.randint(3, 256, (n,), generator=g).tolist() for n in (3, 9, 14)]
    requests = [
        (at, f"r{i}", prompt, SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True,
                                             logprobs=2))
        for i, (at, prompt, m) in enumerate(
            [(0, prompts[0], 8), (0, prompts[1], 10), (0, prompts[2], 6), (5, system, 8)]
        )
    ]  # fmt: skip
    common = {"block_size": 8, "max_num_seqs": 4, "max_num_batched_tokens": 16,
              "kv_cache_dtype": "int8", "device": device, "dtype": "float32"}  # fmt: skip
    ref = run(LLM(str(tiny_llama_gqa), attention_backend="torch", num_kv_blocks=64,
                  enable_prefix_caching=False, **common), requests)  # fmt: skip
    llm = LLM(
        str(tiny_llama_gqa), attention_backend="triton", num_kv_blocks=9,
        async_scheduling=True, **common,
    )  # fmt: skip
    engine = llm.engine
    assert engine.attention_backend == "triton"
    if graphs and device == "cpu":  # on CUDA the engine captured its own
        install_decode_stand_in(engine, [1, 2, 4])
        install_prefill_stand_in(engine, [8, 16])
    elif not graphs and device == "cuda":
        engine.runner.graphs = engine.runner.prefill_graphs = None
    prefill_graphs = engine.runner.prefill_graphs
    copies = []
    got = run(llm, requests, lambda plan: copies.extend(plan.blocks_to_copy))
    for rid in ref.tokens:
        assert_parity(got.tokens[rid], ref.reference(rid), f"triton {rid}")
    assert engine.scheduler.num_preemptions_total > 0
    assert copies, "the system prompt alone is cached whole"
    if graphs:
        assert prefill_graphs is not None and prefill_graphs.replays["whole"] > 0


# ---------------------------------------------------------------------- structured output


def test_constrained_requests_under_preemption_async_and_speculation(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """Constrained requests (greedy and seeded) beside plain ones with stop tokens, in a pool
    that preempts: asynchronous steps give the synchronous steps' tokens (the same pool runs
    the same steps), n-gram speculation beside them changes no greedy request but at a
    near-tie, and every constrained output that ends on EOS is in its grammar."""
    from tests.server.server_fakes import tiny_tokenizer

    tok = tiny_tokenizer()
    path = make_tiny_llama(
        tmp_path_factory.mktemp("combo-structured"), num_kv_heads=2, seed=4,
        vocab_size=len(tok) + 8, eos_token_id=tok.eos_token_id,
    )  # fmt: skip
    tok.save_pretrained(path)
    regex = StructuredOutputParams("regex", "(hello|stop) [a-z]{2,6}")
    choice = StructuredOutputParams("choice", '["one two", "lazy", "hello there"]')
    texts = ["the quick brown fox " * 3, "one two " * 5, "hello", "the lazy dog " * 3]
    plain = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    alone = LLM(str(path), num_kv_blocks=16, **DEVICE).generate([texts[3]], plain)[0].token_ids
    specs: list[tuple[str, SamplingParams]] = [
        (texts[0], SamplingParams(max_tokens=14, temperature=0, ignore_eos=True, logprobs=2)),
        (texts[1], SamplingParams(max_tokens=12, temperature=0, structured=choice)),
        (texts[2], SamplingParams(max_tokens=14, temperature=0.9, seed=3, structured=regex)),
        (texts[3], SamplingParams(max_tokens=16, temperature=0, stop_token_ids=(alone[5],),
                                  ignore_eos=True, logprobs=2)),
        (texts[1], SamplingParams(max_tokens=12, temperature=0, structured=regex)),
        (texts[0], SamplingParams(max_tokens=10, temperature=0.8, seed=5, logprobs=1,
                                  ignore_eos=True)),
    ]  # fmt: skip
    requests = [(i % 2, f"c{i}", list(tok.encode(t)), p) for i, (t, p) in enumerate(specs)]
    pool = {"block_size": 8, "num_kv_blocks": 6, "max_num_seqs": 6, "max_num_batched_tokens": 16}
    outs = {}
    for label, kwargs in {
        "sync": {}, "async": {"async_scheduling": True},
        "ngram": {"speculative_method": "ngram", "num_speculative_tokens": 3},
    }.items():  # fmt: skip
        llm = LLM(str(path), **pool, **DEVICE, **kwargs)  # type: ignore[arg-type]
        outs[label] = run(llm, requests)
        assert llm.engine.scheduler.num_preemptions_total > 0, label
        assert llm.engine.structured is not None and llm.engine.structured.num_constrained == 0
    sync = outs["sync"]
    assert (outs["async"].tokens, outs["async"].reasons) == (sync.tokens, sync.reasons)
    for rid in ("c0", "c3"):  # verified rows batch differently: the near-tie rule
        assert_parity(outs["ngram"].tokens[rid], sync.reference(rid), f"ngram {rid}")
    for i, (_, params) in enumerate(specs):
        for label in ("sync", "ngram"):
            tokens = outs[label].tokens[f"c{i}"]
            if params.structured is None or tokens[-1] != tok.eos_token_id:
                continue
            text = tok.decode(tokens[:-1])
            if params.structured is regex:
                assert re.fullmatch(regex.spec, text), (label, text)
            else:
                assert text in ("one two", "lazy", "hello there"), (label, text)
    assert sync.reasons["c3"] == "stop"


# ------------------------------------------------------------------- tensor parallelism


def test_tp2_with_an_int8_cache_prefix_caching_and_preemption(
    tiny_llama_cpu_shapes: Path, prompts: list[list[int]]
) -> None:
    """Two gloo ranks, each quantizing its own KV heads (per-row scales, so the same bytes as
    one rank's), asynchronous steps, a pool that preempts, blocks cached and copied (the
    workers run the copies the plan names): TP=1's tokens, near-ties aside (the all-reduces
    sum in another order)."""
    requests = _greedy_requests(prompts)
    common = {"block_size": 16, "max_num_seqs": 4, "max_num_batched_tokens": 32,
              "kv_cache_dtype": "int8", **DEVICE}  # fmt: skip
    ref = run(LLM(str(tiny_llama_cpu_shapes), num_kv_blocks=64, enable_prefix_caching=False,
                  **common), requests)  # fmt: skip
    llm = LLM(
        str(tiny_llama_cpu_shapes), tensor_parallel_size=2, num_kv_blocks=8,
        async_scheduling=True, **common,
    )  # fmt: skip
    try:
        copies = []
        got = run(llm, requests, lambda plan: copies.extend(plan.blocks_to_copy))
        for rid in ref.tokens:
            assert_parity(got.tokens[rid], ref.reference(rid), f"TP=2 {rid}")
        assert llm.engine.scheduler.num_preemptions_total > 0
        assert copies
    finally:
        llm.shutdown()
