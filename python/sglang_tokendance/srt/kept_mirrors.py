"""Kept Mirrors: an agent's finished row, kept in SGLang's radix tree for that agent alone.

A request that names its agent (`"tokendance": {"agent": ...}`, mirror storage) and holds
approximate KV (it reused segments) is kept whole when it finishes, under the radix namespace
`(KEPT_NAMESPACE, agent, extra_key)`: a tuple, which no client can send as an `extra_key`. The
row's slots -- its exact prefix (the shared tree's), the Master slots it read in place, its
diff, its output -- each take one more reference; nothing is copied. A request naming the same
agent matches both namespaces and takes the kept row when it covers more of its prompt, so an
agent whose next prompt extends its last one reads exactly the KV its decode read. The forest
keeps such a request out of the shared tree (srt/reuse: `RequestReuse.of(agent_prefix=...)`).
Kept rows are ordinary tree leaves to eviction.
"""

from __future__ import annotations

from typing import Callable

import torch
from sglang.srt.mem_cache.base_prefix_cache import InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.radix_cache import RadixKey

from sglang_tokendance.srt.request import RequestOptions
from sglang_tokendance.srt.reuse import is_lora
from sglang_tokendance.srt.shared_slot_tree import SharedSlotTree

KEPT_NAMESPACE = "tokendance-kept"  # extra_key[0] of an agent's kept Mirrors


def kept_namespace(agent: str, extra_key) -> tuple:
    """The radix namespace of an agent's kept Mirrors inside SGLang's namespace `extra_key`."""
    return (KEPT_NAMESPACE, agent, extra_key)


def is_kept(node) -> bool:
    """Whether a tree node is part of an agent's kept Mirror."""
    extra_key = None if node is None else node.key.extra_key
    return isinstance(extra_key, tuple) and extra_key[0] == KEPT_NAMESPACE


class KeptMirrors(SharedSlotTree):
    kept_rows: int = 0  # finished rows kept for their agent
    options: Callable[[object], RequestOptions]  # each request's options, parsed once (set by the forest)

    def keep_for_agent(self, req, agent: str, up_to: int) -> None:
        """The finished row's first `up_to` positions stay in the tree for `agent`, one more
        reference on each slot the agent's path does not hold yet. A row whose tokens the
        agent already keeps with other slots (another computation of the same tokens) is not
        kept, so every kept path is one computation."""
        key = RadixKey(req.full_untruncated_fill_ids[:up_to], kept_namespace(agent, req.extra_key),
                       cache_salt=req.cache_salt)
        row = self.req_to_token_pool.req_to_token[req.kv.req_pool_idx, :up_to].to(torch.int64, copy=True)
        held = super().match_prefix(MatchPrefixParams(key=key))
        if not torch.equal(self.path_device_indices(held.last_device_node), row[:held.device_prefix_len]):
            return
        inserted = self.insert(InsertParams(key=key, value=row, priority=req.priority or 0))
        self.token_to_kv_pool_allocator.share(row[inserted.prefix_len:])
        self.kept_rows += 1

    def match_prefix(self, params: MatchPrefixParams):
        """SGLang's match; a request naming its agent (mirror storage) takes the agent's kept
        Mirror instead when that covers more of its prompt."""
        result = super().match_prefix(params)
        agent = self._agent_of(params.req)
        if agent is None:
            return result
        key = params.key
        kept = super().match_prefix(MatchPrefixParams(key=RadixKey(
            key.token_ids, kept_namespace(agent, key.extra_key), is_bigram=key.is_bigram, limit=key.limit,
            cache_salt=key.cache_salt)))
        return kept if kept.device_prefix_len > result.device_prefix_len else result

    def _agent_of(self, req) -> str | None:
        if req is None or not self.zero_copy or self.disable or is_lora(req):
            return None
        return self.options(req).agent
