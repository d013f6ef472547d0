"""Hostile input to the round-aware parser, property-based (hypothesis): markers in every
position, broken and confusable markers, empty and huge pieces, token ids out of range,
special tokens cut by a marker. Every input is either refused with a SegmentError (a 400 at
the server) or accepted with spans that round-trip: the ids are the concatenation of each
piece's own tokens, every span covers exactly its piece's ids, and its hash is theirs."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sglang_tokendance.core.segments import DEFAULT_SEPARATOR as SEP
from sglang_tokendance.core.segments import SegmentError, Segmenter, segment_hash

SALT = b"properties"
VOCAB = 49152
WORDS = ["the mill", " flooded", "\n", "Ada:", " 42", "é", "日本", "\u200b", " ,", "<|im_start|>",
         "<|im_end|>", "tokendance", "<|tokendance", "sep|>", "<|tokendance_sep|", "＜|tokendance_sep|＞",
         "<|TOKENDANCE_SEP|>", "\x00", "\ud7ff", "  "]


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_path)


def segmenter_of(tokenizer, **kw) -> Segmenter:
    return Segmenter(tokenizer, model_salt=SALT, vocab_size=VOCAB, special_tokens=tokenizer.all_special_tokens,
                     min_segment_tokens=kw.pop("min_segment_tokens", 2), **kw)


texts = st.lists(st.one_of(st.sampled_from(WORDS), st.text(max_size=12)), max_size=8).map("".join)
id_lists = st.lists(st.integers(min_value=-3, max_value=VOCAB + 3), min_size=0, max_size=20)
pieces = st.lists(st.one_of(texts, id_lists), min_size=1, max_size=12)
PROPERTIES = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def expected_ids(tokenizer, piece, first: bool) -> list[int]:
    if isinstance(piece, list):
        return piece
    return [] if not piece and not first else tokenizer.encode(piece, add_special_tokens=first)


def assert_round_trips(tokenizer, segmenter: Segmenter, given_pieces, out) -> None:
    per_piece = [expected_ids(tokenizer, p, i == 0) for i, p in enumerate(given_pieces)]
    assert out.input_ids == [t for ids in per_piece for t in ids]
    starts, at = [], 0
    for ids in per_piece:
        starts.append(at)
        at += len(ids)
    shared = [(s, ids) for i, (s, ids) in enumerate(zip(starts, per_piece))
              if 0 < i < len(per_piece) - 1 and len(ids) >= segmenter.min_segment_tokens]
    assert [(span.start, span.end) for span in out.spans] == [(s, s + len(ids)) for s, ids in shared]
    for span, (_, ids) in zip(out.spans, shared):
        assert span.hash == segment_hash(ids, SALT) and out.input_ids[span.start:span.end] == ids


@PROPERTIES
@given(pieces)
def test_pieces_are_refused_or_round_trip(tokenizer, given_pieces):
    segmenter = segmenter_of(tokenizer)
    try:
        out = segmenter.from_pieces(given_pieces)
    except SegmentError as e:
        assert str(e)  # a clear message, never another exception type
        return
    assert_round_trips(tokenizer, segmenter, given_pieces, out)
    assert all(0 <= t < VOCAB for t in out.input_ids)


@PROPERTIES
@given(st.lists(texts, min_size=1, max_size=10))
def test_marked_text_is_refused_or_equals_its_pieces(tokenizer, parts):
    segmenter = segmenter_of(tokenizer)
    text = SEP.join(parts)
    try:
        out = segmenter.from_text(text)
    except SegmentError as e:
        assert str(e)
        return
    # accepted: no piece holds what is left of a marker, and it round-trips piece by piece
    assert not any(segmenter.has_marker(p) for p in parts)
    assert_round_trips(tokenizer, segmenter, parts, out)


@PROPERTIES
@given(st.lists(texts.filter(lambda t: "tokendance" not in t), min_size=2, max_size=6),
       st.sampled_from(["<|im_start|>", "<|im_end|>", "<|endoftext|>"]), st.integers(1, 11))
def test_a_marker_inside_a_special_token_is_refused(tokenizer, parts, special, cut):
    cut = min(cut, len(special) - 1)
    text = SEP.join(parts) + special[:cut] + SEP + special[cut:] + "tail"
    with pytest.raises(SegmentError, match="splits the special token"):
        segmenter_of(tokenizer).from_text(text)


@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.integers(600, 2000))
def test_thousands_of_segments_are_refused_beyond_the_limit(tokenizer, n):
    segmenter = segmenter_of(tokenizer, max_segments=512)
    with pytest.raises(SegmentError, match="exceed --tokendance-max-segments"):
        segmenter.from_pieces(["head", *(["block text"] * n), "tail"])
    out = segmenter.from_pieces(["head", *([[7, 8, 9]] * 512), "tail"])
    assert len(out.spans) == 512 and len({s.hash for s in out.spans}) == 1
