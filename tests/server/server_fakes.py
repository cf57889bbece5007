"""A deterministic stand-in for ``engine.LLMEngine`` and a tiny real tokenizer, for fast tests.

``FakeEngine`` has the engine's API and its observable rules (add/abort/step outputs, EOS and
stop-token handling, max_tokens, KV blocks held per request and returned on finish or abort,
at most ``max_num_seqs`` running) but no model: greedy requests "generate" the tokens of a
fixed continuation text, sampled ones draw from a seeded RNG. That makes the server's text
handling checkable exactly (stop strings, multi-byte characters split across tokens).

The tokenizer is a byte-level BPE trained in a few milliseconds on a small corpus: like the
real model's, it splits multi-byte characters into several tokens and has a chat template.
"""

from __future__ import annotations

import functools
import math
import random
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from engine.generation_config import SamplingDefaults
from engine.outputs import EngineOccupancy, RequestOutput, StepStats, TokenLogprob
from kvpool.storage import KVCapacity
from scheduler.request import SamplingParams

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "hello world the quick brown fox jumps over the lazy dog",
    "one two three four five six seven eight nine ten",
    "stop here STOP there END of the story",
]


@functools.cache
def tiny_tokenizer() -> Any:
    """A byte-level BPE tokenizer (about 330 tokens) with ChatML special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 20, trainer)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", bos_token="<|im_start|>"
    )
    hf.chat_template = CHAT_TEMPLATE
    return hf


@dataclass
class FakeModelConfig:
    vocab_size: int


@dataclass
class _FakeRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    rng: random.Random
    output_token_ids: list[int] = field(default_factory=list)
    num_blocks: int = 0


class FakeEngine:
    """Engine API, scripted tokens. Not thread-safe, like the real one (and it checks).

    Args:
        continuation: the text greedy requests generate, token by token, repeated.
        eos_after: emit EOS as the n-th output token (unless ignore_eos); None = never.
        max_model_len, num_blocks, block_size, max_num_seqs: the limits the real engine has.
        step_delay_s: sleep per step, standing in for the model's forward pass.
    """

    def __init__(
        self,
        continuation: str = " the quick brown fox jumps over the lazy dog.",
        *,
        eos_after: int | None = None,
        max_model_len: int = 256,
        num_blocks: int = 64,
        block_size: int = 4,
        max_num_seqs: int = 8,
        step_delay_s: float = 0.0,
    ) -> None:
        self.tokenizer = tiny_tokenizer()
        self.model_id = "fake-model"
        self.model_config = FakeModelConfig(vocab_size=len(self.tokenizer))
        self.max_model_len = max_model_len
        self.eos_token_id: int | None = self.tokenizer.eos_token_id
        self.sampling_defaults = SamplingDefaults()
        self.continuation_ids: list[int] = self.tokenizer.encode(continuation)
        self.eos_after = eos_after
        self.block_size = block_size
        self._num_blocks = num_blocks
        self._free_blocks = num_blocks
        # What /health reports of the pool (a float32 cache of a 2-layer, 64-wide model).
        self.kv_capacity = KVCapacity(num_blocks, block_size, bytes_per_token=2 * 2 * 64 * 4)
        self.max_num_seqs = max_num_seqs
        self.step_delay_s = step_delay_s
        self.waiting: list[_FakeRequest] = []
        self.running: list[_FakeRequest] = []
        self.last_step_stats: StepStats | None = None
        self.num_steps = 0
        self.added: list[str] = []
        self.added_params: dict[str, SamplingParams] = {}
        self.aborted: list[str] = []
        # Test hooks: raise from the next step / call a function before each step.
        self.fail_next_step: Exception | None = None
        self.before_step: Callable[[FakeEngine], None] | None = None
        self._owner: int | None = None

    # ---- the engine's API ------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return self._free_blocks

    @property
    def num_total_blocks(self) -> int:
        return self._num_blocks

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
    ) -> None:
        self._check_thread()
        if len(prompt_token_ids) + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt ({len(prompt_token_ids)}) + max_tokens ({params.max_tokens}) exceeds "
                f"max_model_len {self.max_model_len}"
            )
        if self._blocks_for(len(prompt_token_ids) + 1) > self._num_blocks:
            raise ValueError("the prompt does not fit in the KV pool even alone")
        seed = params.seed if params.seed is not None else random.randrange(2**32)
        self.waiting.append(
            _FakeRequest(request_id, list(prompt_token_ids), params, random.Random(seed))
        )
        self.added.append(request_id)
        self.added_params[request_id] = params

    def abort_request(self, request_ids: Iterable[str]) -> list[RequestOutput]:
        self._check_thread()
        ids = set(request_ids)
        outputs = []
        for queue in (self.waiting, self.running):
            for request in [r for r in queue if r.request_id in ids]:
                queue.remove(request)
                self._release(request)
                self.aborted.append(request.request_id)
                outputs.append(self._output(request, [], "abort"))
        return outputs

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    fatal_error: str | None = None

    def check_integrity(self) -> None:
        used = sum(r.num_blocks for r in self.running)
        assert used + self._free_blocks == self._num_blocks, (used, self._free_blocks)

    def check_idle(self) -> None:
        self.check_integrity()

    def occupancy(self) -> EngineOccupancy:
        used = self._num_blocks - self._free_blocks
        return EngineOccupancy(len(self.running), len(self.waiting), used, self._num_blocks,
                               0, 0, 0.0)  # fmt: skip

    def step(self) -> list[RequestOutput]:
        self._check_thread()
        if self.before_step is not None:
            self.before_step(self)
        if self.fail_next_step is not None:
            error, self.fail_next_step = self.fail_next_step, None
            raise error
        start = time.perf_counter()
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        while self.waiting and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            need = self._blocks_for(len(request.prompt_token_ids) + 1)
            if need > self._free_blocks:
                break
            self.waiting.pop(0)
            request.num_blocks = need
            self._free_blocks -= need
            self.running.append(request)
        outputs = []
        for request in list(self.running):
            outputs.append(self._generate_one(request))
        self.num_steps += 1
        self.last_step_stats = StepStats(
            step_time_s=time.perf_counter() - start,
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            num_prefill_tokens=0,
            num_decode_tokens=len(outputs),
            num_preemptions=0,
            num_kv_blocks_used=self._num_blocks - self._free_blocks,
            num_kv_blocks_total=self._num_blocks,
        )
        return outputs

    # ---- internals -------------------------------------------------------------------------

    def _check_thread(self) -> None:
        """The real engine is not thread-safe: fail loudly if two threads ever call in."""
        me = threading.get_ident()
        if self._owner is None:
            self._owner = me
        assert self._owner == me, "FakeEngine called from two threads"

    def _blocks_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.block_size)

    def _release(self, request: _FakeRequest) -> None:
        self._free_blocks += request.num_blocks
        request.num_blocks = 0

    def next_token(self, request: _FakeRequest) -> int:
        """The scripted token: the continuation for greedy, a seeded draw otherwise."""
        k = len(request.output_token_ids)
        p = request.params
        if self.eos_after is not None and k + 1 == self.eos_after and not p.ignore_eos:
            assert self.eos_token_id is not None
            return self.eos_token_id
        if p.temperature == 0:
            return self.continuation_ids[k % len(self.continuation_ids)]
        return request.rng.choice(self.continuation_ids)

    def _logprob(self, token_id: int, top_n: int) -> TokenLogprob:
        # A fixed, valid distribution: the chosen token is the most likely one.
        others = [t for t in range(3, 3 + top_n + 1) if t != token_id][: max(top_n - 1, 0)]
        top = ([(token_id, -0.25)] + [(t, -2.0 - i) for i, t in enumerate(others)])[:top_n]
        return TokenLogprob(token_id, -0.25, top)

    def _generate_one(self, request: _FakeRequest) -> RequestOutput:
        token_id = self.next_token(request)
        request.output_token_ids.append(token_id)
        num_tokens = len(request.prompt_token_ids) + len(request.output_token_ids)
        grow = self._blocks_for(num_tokens + 1) - request.num_blocks
        if grow > 0:  # the fake never runs out: tests size the pool
            self._free_blocks -= grow
            request.num_blocks += grow
        p = request.params
        reason = None
        stop_token = None
        if (token_id == self.eos_token_id and not p.ignore_eos) or token_id in p.stop_token_ids:
            reason, stop_token = "stop", token_id
        elif len(request.output_token_ids) >= p.max_tokens or num_tokens >= self.max_model_len:
            reason = "length"
        lps = [self._logprob(token_id, p.logprobs)] if p.logprobs is not None else None
        if reason is not None:
            self.running.remove(request)
            self._release(request)
        output = self._output(request, [token_id], reason, lps, stop_token)
        if p.prompt_logprobs is not None and len(request.output_token_ids) == 1:
            output.prompt_logprobs = [None] + [
                self.prompt_logprob(t, p.prompt_logprobs) for t in request.prompt_token_ids[1:]
            ]
        return output

    @staticmethod
    def prompt_logprob(token_id: int, top_n: int) -> TokenLogprob:
        """A prompt token's scripted logprob: -1.5, second to token 3 (-0.5) unless it is 3."""
        top = [(3, -0.5), (4, -1.0), (5, -1.25)][:top_n]
        rank = 1 if token_id == 3 else 2
        return TokenLogprob(token_id, -0.5 if token_id == 3 else -1.5, top, rank=rank)

    @staticmethod
    def _output(
        request: _FakeRequest,
        new_token_ids: list[int],
        reason: str | None,
        logprobs: list[TokenLogprob] | None = None,
        stop_token_id: int | None = None,
    ) -> RequestOutput:
        return RequestOutput(
            request_id=request.request_id,
            new_token_ids=new_token_ids,
            new_logprobs=logprobs,
            finished=reason is not None,
            finish_reason=reason,
            num_prompt_tokens=len(request.prompt_token_ids),
            num_output_tokens=len(request.output_token_ids),
            stop_token_id=stop_token_id,
        )
