"""The model forward of an extend batch in which some request reuses cached segments.

An AROUND hook on the decoder forwards of srt/model.py: such a batch runs core/blend's
blended prefill on the requests' chunk plans (srt/reuse.py); every other batch runs SGLang's
own forward. A chunk that starts a chunked prompt's blending first chooses for the whole
prompt (srt/prompt_selection.py, through srt/batch_reuse). Under mirror storage the rows read the
Masters' slots in place, at a shift (the
forest's `reads`) and carry the request's own slots for the reused
positions (`RequestRow.own`); after the forward the batch's reuse settles them (kept tokens keep
their own slots, the others' are freed). A batch the blended prefill cannot serve (input
embeddings, captured hidden states) runs SGLang's forward too: every reused position gets
its own slot back and SGLang computes every token, so the plans' reused tokens are counted
as recomputed.
"""

from __future__ import annotations


from sglang_tokendance.core.blend import blended_prefill
from sglang_tokendance.core.blend_types import RequestRow
from sglang_tokendance.srt.model import PoolKV, SGLangLayers


def model_forward(forest, original, model, input_ids, positions, forward_batch, *args, **kwargs):
    """AROUND hook body (srt/runtime binds the scheduler's forest; None: not built yet, or
    another radix cache): the blended prefill when some request of an extend batch reuses."""
    from sglang.srt.model_executor.forward_context import get_attn_backend, get_token_to_kv_pool

    plans = None
    if forest is not None and forward_batch.forward_mode.is_extend():
        plans = forest.batch.take_plans(forward_batch, blendable(forward_batch), get_attn_backend())
    if plans is None:
        return original(model, input_ids, positions, forward_batch, *args, **kwargs)

    layers = SGLangLayers(model, forward_batch)
    pool = PoolKV(get_token_to_kv_pool(), layers)
    planned = [plan for plan in plans if plan is not None]
    forest.batch.select_prompts(planned, layers, pool)
    req_to_token = forest.req_to_token_pool.req_to_token
    rows = [RequestRow(prefix, extend, req_to_token[pool_index, :prefix + extend]) if plan is None
            else plan.request_row(req_to_token[pool_index, :prefix + extend])
            for plan, prefix, extend, pool_index in zip(plans, forward_batch.extend_prefix_lens_cpu,
                                                        forward_batch.extend_seq_lens_cpu,
                                                        forward_batch.req_pool_indices_cpu.tolist())]
    hidden, stats = blended_prefill(layers, pool, input_ids, positions, rows,
                                    forest.blend, forest.rule, forest.reads)
    forest.batch.settle(planned, stats.kept, stats.adopted)
    return hidden


def blendable(forward_batch) -> bool:
    """Whether the blended prefill can stand in for the model's forward on this batch."""
    capture = getattr(forward_batch, "capture_hidden_mode", None)
    return forward_batch.input_embeds is None and not (capture is not None and capture.need_capture())
