"""engine.spec_decode: speculative decoding inside continuous batching.

Ownership: ``SpeculativeDecoder`` (speculator.py) owns the proposers' state (the draft
model's KV pool and each request's progress in it, per-request acceptance records, the
current step's proposals) and the verification's random generators. The scheduler owns
which drafts run (``Scheduler.schedule(draft_token_ids=...)``) and what is accepted into a
request; kvpool gives rejected slots back (``KVCacheManager.rollback_slots``).

Only the config is re-exported here: importing it must not import torch (the server parses
flags with it).
"""

from engine.spec_decode.config import SPECULATIVE_METHODS, SpeculativeConfig

__all__ = ["SPECULATIVE_METHODS", "SpeculativeConfig"]
