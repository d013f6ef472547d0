"""Kept Mirrors: a finished row, kept in SGLang's radix tree for the prompt that continues it.

A request that holds approximate KV (it reused segments) is kept whole when it finishes
(mirror storage), so that its next prompt -- the agent's next round, which extends the same
private text and often the same blocks -- reads exactly the KV this one read and decoded,
instead of computing the blocks it reused approximately all over again (stock SGLang's tree
would serve them exactly, ours never holds approximate KV). Two namespaces:

* a request that names its agent (`"tokendance": {"agent": ...}`) is kept under
  `(KEPT_NAMESPACE, agent, extra_key)`, which only that agent's requests match;
* any other is kept under `(KEPT_NAMESPACE, None, extra_key)`, which every request that
  carries segments matches (a request without segments never reads approximate KV: it is
  served as stock SGLang would). Found by exact token ids, as the tree finds a prefix: a
  prompt only takes the row whose whole text it repeats (an agent's own notes, its last
  prompt), the way its agent would (`--no-tokendance-keep-rows`: named agents only).

A kept row holding more approximate positions (read from Masters at a shift) than the
request's fidelity budget allows is not taken: its blocks are computed again. Those it takes
count against the budget of the blocks it reuses past the row.

Both are tuples, which no client can send as an `extra_key`. The row's slots -- its exact
prefix (the shared tree's), the Master slots it read in place, its diff, its output -- each
take one more reference; nothing is copied. A request matches its kept namespace and the
shared tree and takes the kept row when it covers more of its prompt. The forest keeps such a
request out of the shared tree (srt/reuse: `RequestReuse.of(agent_prefix=...)`). Kept rows
are ordinary tree leaves to eviction.
"""

from __future__ import annotations

from typing import Callable

import torch
from sglang.srt.mem_cache.base_prefix_cache import InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey, TreeNode

from sglang_tokendance.srt.request import RequestOptions
from sglang_tokendance.srt.reuse import is_lora, may_reuse

KEPT_NAMESPACE = "tokendance-kept"  # extra_key[0] of an agent's kept Mirrors


def kept_namespace(agent: str | None, extra_key) -> tuple:
    """The radix namespace of an agent's kept Mirrors (None: those of unnamed requests) inside
    SGLang's namespace `extra_key`."""
    return (KEPT_NAMESPACE, agent, extra_key)


def is_kept(node) -> bool:
    """Whether a tree node is part of an agent's kept Mirror."""
    extra_key = None if node is None else node.key.extra_key
    return isinstance(extra_key, tuple) and extra_key[0] == KEPT_NAMESPACE


class KeptMirrors:
    """The kept rows of one radix tree (mirror storage), held in its own kept namespaces: the
    forest calls `match` from its `match_prefix` and `keep_for_agent` when a row finishes.
    Calls only SGLang's RadixCache methods on the tree."""

    def __init__(self, tree: RadixCache, options: Callable[[object], RequestOptions], keeps_unnamed: bool = True,
                 max_approximate: int | None = None):
        self.tree = tree
        self.options = options  # each request's options, parsed once
        self.keeps_unnamed = keeps_unnamed  # rows of requests naming no agent are kept too
        self.max_approximate = max_approximate  # the server's fidelity budget
        self.rows = 0  # finished rows kept for their continuation

    def keep_for_agent(self, req, agent: str | None, up_to: int) -> TreeNode | None:
        """The finished row's first `up_to` positions stay in the tree for `agent` (None: for
        any request with segments that repeats them), one more reference on each slot the
        path does not hold yet. A row whose tokens the namespace already keeps with other
        slots (another computation of the same tokens) is not kept, so every kept path is one
        computation. Returns the kept path's last node (None: not kept)."""
        tree = self.tree
        key = RadixKey(req.full_untruncated_fill_ids[:up_to], kept_namespace(agent, req.extra_key),
                       cache_salt=req.cache_salt)
        row = tree.req_to_token_pool.req_to_token[req.kv.req_pool_idx, :up_to].to(torch.int64, copy=True)
        held = RadixCache.match_prefix(tree, MatchPrefixParams(key=key))
        if not torch.equal(tree.path_device_indices(held.last_device_node), row[:held.device_prefix_len]):
            return None
        inserted = tree.insert(InsertParams(key=key, value=row, priority=req.priority or 0))
        tree.token_to_kv_pool_allocator.share(row[inserted.prefix_len:])
        self.rows += 1
        return inserted.last_device_node

    def keeps(self, options: RequestOptions) -> bool:
        """Whether a finished row of a request with these options is kept."""
        return options.agent is not None or self.keeps_unnamed

    def match(self, params: MatchPrefixParams, result):
        """SGLang's match `result` of `params`, or, for a request that reads kept rows, its kept
        namespace's row when that covers more of its prompt."""
        if not self._reads_kept(params.req):
            return result
        key = params.key
        options = self.options(params.req)
        kept = RadixCache.match_prefix(self.tree, MatchPrefixParams(key=RadixKey(
            key.token_ids, kept_namespace(options.agent, key.extra_key), is_bigram=key.is_bigram,
            limit=key.limit, cache_salt=key.cache_salt)))
        if kept.device_prefix_len <= result.device_prefix_len:
            return result
        budget = self.max_approximate if options.max_approximate_tokens is None else options.max_approximate_tokens
        if budget is not None and self.approximate_positions(kept.last_device_node) > budget:
            return result  # more approximate KV than its fidelity budget allows: computed again instead
        return kept

    def approximate_positions(self, node) -> int:
        """Positions of the path to `node` that read a Master's slot at a shift: the
        approximate tokens a request continuing it holds (its kept and exact ones are at their
        own positions)."""
        slots = self.tree.path_device_indices(node).to(torch.int64)
        return int(self.tree.token_to_kv_pool_allocator.frames.shifts(slots).count_nonzero())

    def _reads_kept(self, req) -> bool:
        """A request naming its agent reads that agent's kept rows; an unnamed one, those of
        unnamed requests when it carries segments and the blended prefill may serve it."""
        if req is None or self.tree.disable or is_lora(req):
            return False
        options = self.options(req)
        return options.agent is not None or (self.keeps_unnamed and bool(options.spans) and may_reuse(req))
