"""The model forward of an extend batch in which some request reuses cached segments.

An AROUND hook on the decoder forwards of srt/model.py: such a batch runs core/blend's
blended prefill on the requests' chunk plans (srt/reuse.py); every other batch runs SGLang's
own forward. The blended prefill reads and writes K in the pool's form (the forest's
`PoolKeys`: under mirror storage un-rotated, and rotated on read). Under mirror storage the
rows read the Masters' slots in place and carry the request's own slots for the reused
positions (`RequestRow.own`); after the forward the forest settles them (kept tokens keep
their own slots, the others' are freed). A batch the blended prefill cannot serve (input
embeddings, captured hidden states) runs SGLang's forward too: every reused position gets
its own slot back and SGLang computes every token, so the plans' reused tokens are counted
as recomputed.
"""

from __future__ import annotations

import torch

from sglang_tokendance.core.blend import RequestRow, blended_prefill
from sglang_tokendance.srt import forest
from sglang_tokendance.srt.model import PoolKV, SGLangLayers


def model_forward(original, model, input_ids, positions, forward_batch, *args, **kwargs):
    active = forest.ACTIVE
    plans = None
    if active is not None and forward_batch.forward_mode.is_extend():
        plans = active.take_plans(forward_batch)
    if plans is None:
        return original(model, input_ids, positions, forward_batch, *args, **kwargs)
    if not blendable(forward_batch):
        for plan in filter(None, plans):
            active.compute_in_full(plan)
        return original(model, input_ids, positions, forward_batch, *args, **kwargs)
    from sglang.srt.model_executor.forward_context import get_token_to_kv_pool

    req_to_token = active.req_to_token_pool.req_to_token
    rows = [RequestRow(prefix, extend, req_to_token[pool_index, :prefix + extend],
                       reused=plan.extend_runs() if plan is not None else (),
                       group=plan.group if plan is not None else None,
                       own=plan.own if plan is not None else None)
            for plan, prefix, extend, pool_index in zip(plans, forward_batch.extend_prefix_lens_cpu,
                                                        forward_batch.extend_seq_lens_cpu,
                                                        forward_batch.req_pool_indices_cpu.tolist())]
    layers = SGLangLayers(model, forward_batch)
    hidden, stats = blended_prefill(layers, PoolKV(get_token_to_kv_pool(), layers), input_ids, positions, rows,
                                    active.blend, active.rule, active.keys.rope_on_read)
    reusing = [plan for plan in plans if plan is not None]
    if stats.kept is None:  # ratio 0: nothing recomputed
        masks, counts = [None] * len(reusing), [(0, 0)] * len(reusing)
    else:  # masks over the batch's reused tokens in batch order; one host sync for the batch
        sizes = [p.reused_tokens for p in reusing]
        masks = stats.kept.split(sizes)
        adopted = stats.adopted if stats.adopted is not None else torch.zeros_like(stats.kept)
        counts = torch.stack([torch.stack([kept.sum(), took.sum()])
                              for kept, took in zip(masks, adopted.split(sizes))]).tolist()
    for plan, mask, (recomputed, adopted_tokens) in zip(reusing, masks, counts):
        active.settle(plan, mask)
        active.record_recomputed(plan, recomputed, adopted_tokens)
    return hidden


def blendable(forward_batch) -> bool:
    """Whether the blended prefill can stand in for the model's forward on this batch."""
    capture = getattr(forward_batch, "capture_hidden_mode", None)
    return forward_batch.input_embeds is None and not (capture is not None and capture.need_capture())
