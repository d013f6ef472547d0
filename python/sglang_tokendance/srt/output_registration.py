"""Output registration: a finished request's generated text becomes a cached segment.

In an All-Gather round the next round's shared blocks are exactly this round's outputs, and
their KV already exists in each author's context. A request sent with
`"tokendance": {"register_output": true}` has its output's KV cached as a segment when it
finishes, before SGLang frees its slots: copied (K un-rotated) under dense storage, its own
slots referenced under mirror storage (zero copy).

No tokenizer runs in the scheduler: the segment is keyed by the hash of the generated ids
themselves (the stop token dropped: it is not in the text a client gets back). The next
round's prompt carries that text as a block, which the tokenizer manager tokenises alone with
the server's tokenizer; when those ids equal the generated ones (the usual case) the hashes
match and the block hits; when they do not, the block is simply a miss. Where content chunks
are on, a long answer is cached as its chunks too (srt/forest.register_output): a chat message
that quotes it is cut into the same chunks.
"""

from __future__ import annotations

from sglang.srt.managers.schedule_batch import FINISH_LENGTH, FINISH_MATCHED_TOKEN


def output_segment_ids(req, min_segment_tokens: int) -> list[int] | None:
    """The ids of the text a client gets back for a finished request, or None when they
    cannot be a segment: a stop string cuts the text inside the ids, an abort has no answer,
    and an output shorter than a segment stays private."""
    ids = list(req.output_ids)
    if isinstance(req.finished_reason, FINISH_MATCHED_TOKEN):
        ids = ids[:-1]  # the stop token (EOS) has no text
    elif not isinstance(req.finished_reason, FINISH_LENGTH):
        return None
    return ids if len(ids) >= min_segment_tokens else None


def output_kv_tokens(req, segment_len: int) -> int:
    """How many of the segment's tokens have KV: the last generated token was never fed back."""
    return min(segment_len, len(req.output_ids) - 1)
