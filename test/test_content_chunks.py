"""Content-defined chunks: they cover the prompt, respect their bounds, and the same text gives
the same chunks wherever it sits (core/content_chunks, Segmenter.content_chunks)."""

import random

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from sglang_tokendance.core.content_chunks import ChunkRule
from sglang_tokendance.core.segments import Segmenter, segment_hash

RULE = ChunkRule(min_tokens=16, spacing=8, window=2, max_tokens=64)
ids = st.lists(st.integers(0, 49_151), max_size=600)


@settings(max_examples=60, deadline=None)
@given(ids)
def test_chunks_cover_the_prompt_within_their_bounds(prompt):
    chunks = RULE.chunks(prompt)
    assert [start for start, _ in chunks] == [0, *(end for _, end in chunks[:-1])][:len(chunks)]
    assert (chunks[-1][1] if chunks else 0) == len(prompt)
    assert all(RULE.min_tokens <= end - start <= RULE.max_tokens for start, end in chunks[:-1])
    assert all(0 < end - start <= RULE.max_tokens for start, end in chunks)


@settings(max_examples=60, deadline=None)
@given(ids, ids, ids)
@example([], [5], [0, 0])  # a prompt of exactly one window has its candidate too
def test_cut_candidates_depend_on_content_alone(before_a, before_b, shared):
    """Past `window` tokens into the shared text, both prompts have the same candidates there."""
    a, b = before_a + shared, before_b + shared
    seen_a = [int(c) - len(before_a) for c in RULE.cuts(a) if c >= len(before_a) + RULE.window]
    seen_b = [int(c) - len(before_b) for c in RULE.cuts(b) if c >= len(before_b) + RULE.window]
    assert seen_a == seen_b


def test_the_same_text_after_other_text_is_mostly_the_same_chunks():
    """The chunks both prompts hold inside the shared text cover most of it: the text loses its
    ends (up to the first cut both choose, past the last one). Seeded random text, not an
    adversary: a run with no content cut, or cuts every few tokens in step with the minimum,
    can keep two prompts' chunks apart."""
    rng = random.Random(0)
    found = total = 0
    for _ in range(200):
        before_a, before_b, shared = ([rng.randrange(49_152) for _ in range(rng.randrange(n))] for n in (300, 300, 400))
        shared = shared + [rng.randrange(49_152) for _ in range(100)]
        a, b = before_a + shared, before_b + shared
        chunks_a = {tuple(a[s:e]) for s, e in RULE.chunks(a)}
        found += sum(e - max(s, len(before_b)) for s, e in RULE.chunks(b) if e > len(before_b)
                     and tuple(b[s:e]) in chunks_a)
        total += len(shared)
    assert found / total > 0.8


def test_a_forced_cut_at_max_tokens_still_finds_later_content_cuts():
    rule = ChunkRule(min_tokens=4, spacing=1024, window=2, max_tokens=8)  # hardly any content cuts
    prompt = list(range(100))
    assert RULE.chunks([]) == []
    assert all(end - start <= 8 for start, end in rule.chunks(prompt))


@pytest.mark.parametrize("bad", [dict(spacing=6), dict(spacing=0), dict(window=0), dict(window=20),
                                 dict(min_tokens=300)])
def test_bad_rules_are_refused(bad):
    with pytest.raises(ValueError):
        ChunkRule(**{"min_tokens": 16, "spacing": 8, "window": 2, "max_tokens": 256, **bad})


@settings(max_examples=60, deadline=None)
@given(ids)
def test_a_messages_chunks_cover_it_each_at_least_a_segment(message):
    """A message shorter than two chunks on average is one; a longer one is cut, every chunk
    (its last joined to the one before when short) at least `min_tokens` long."""
    chunks = RULE.message_chunks(message)
    assert [start for start, _ in chunks] == [0, *(end for _, end in chunks[:-1])]
    assert chunks[-1][1] == len(message)
    if len(message) < 2 * (RULE.spacing + RULE.min_tokens):
        assert chunks == [(0, len(message))]
    else:
        assert all(end - start >= RULE.min_tokens for start, end in chunks)
        assert chunks[:-1] == RULE.chunks(message)[:len(chunks) - 1]


class _Words:
    def encode(self, text, add_special_tokens=True):
        return [hash(w) % 1000 for w in text.split()]


def test_segmenter_hashes_each_chunk_by_content_and_caps_the_segments():
    rng = random.Random(0)
    prompt = [rng.randrange(1000) for _ in range(2000)]
    segmenter = Segmenter(_Words(), model_salt=b"m", vocab_size=1000, min_segment_tokens=16, max_segments=10)
    found = segmenter.content_chunks(prompt, RULE)
    assert found.input_ids == prompt and len(found.spans) == 10
    assert all(span.hash == segment_hash(prompt[span.start:span.end], b"m") for span in found.spans)
    assert all(span.end - span.start >= 16 for span in found.spans)
    assert [(s.start, s.end) for s in found.spans] == RULE.chunks(prompt)[:10]
