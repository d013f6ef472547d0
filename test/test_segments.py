"""core/segments: splitting, per-segment tokenisation, content hashes, bad input."""

from __future__ import annotations

import pytest

from sglang_tokendance.core.model_identity import model_identity, weight_checksums
from sglang_tokendance.core.segments import (
    DEFAULT_SEPARATOR as SEP, SegmentError, Segmenter, segment_hash,
)

BLOCK = "Alice said the market opens at nine and the bakery sells fresh bread every morning."
OTHER = "Bob replied that the river flooded the old mill last spring, so the road is closed."


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_path)


@pytest.fixture(scope="module")
def segmenter(tokenizer):
    return make(tokenizer)


def make(tokenizer, **kw):
    return Segmenter(tokenizer, model_salt=b"salt", vocab_size=len(tokenizer),
                     special_tokens=tokenizer.all_special_tokens, **kw)


def test_same_block_different_neighbours_same_ids_and_hash(segmenter):
    a = segmenter.from_text(f"History of agent one, short.{SEP}{BLOCK}{SEP}{OTHER}{SEP}Answer:")
    b = segmenter.from_text(f"A much longer private history for agent two.\n{SEP}{OTHER}{SEP}{BLOCK}{SEP}Go.")
    (a1, a2), (b1, b2) = a.spans, b.spans
    assert a.input_ids[a1.start:a1.end] == b.input_ids[b2.start:b2.end]
    assert a1.hash == b2.hash and a2.hash == b1.hash and a1.hash != a2.hash
    assert a1.start != b2.start  # same block, different offsets


def test_tokens_are_concatenation_of_pieces(segmenter, tokenizer):
    pieces = ["Head text.", BLOCK, " tail"]
    out = segmenter.from_text(SEP.join(pieces))
    expected = tokenizer.encode(pieces[0]) + sum(
        (tokenizer.encode(p, add_special_tokens=False) for p in pieces[1:]), [])
    assert out.input_ids == expected
    assert out.spans[0].start == len(tokenizer.encode(pieces[0]))


def test_explicit_pieces_equal_marked_text(segmenter, tokenizer):
    ids = tokenizer.encode(OTHER, add_special_tokens=False)
    from_text = segmenter.from_text(f"x{SEP}{BLOCK}{SEP}{OTHER}{SEP}y")
    from_pieces = segmenter.from_pieces(["x", BLOCK, ids, "y"])
    assert from_text == from_pieces


def test_markers_at_either_end_are_allowed(segmenter, tokenizer):
    out = segmenter.from_text(f"{SEP}{BLOCK}{SEP}")
    assert out.input_ids == tokenizer.encode(BLOCK, add_special_tokens=False)
    assert [(s.start, s.end) for s in out.spans] == [(0, len(out.input_ids))]


def test_short_segments_are_private(tokenizer):
    seg = make(tokenizer, min_segment_tokens=16)
    out = seg.from_text(f"a{SEP}too short{SEP}{BLOCK}{SEP}b")
    assert len(out.spans) == 1
    assert out.spans[0].end - out.spans[0].start >= 16


def test_hash_is_salted_by_model_identity(tmp_path):
    config = tmp_path / "config.json"
    config.write_text('{"a": 1}')
    salt_a = model_identity(config, ["w1"], "float32", "auto")
    salt_b = model_identity(config, ["w1"], "bfloat16", "auto")
    salt_c = model_identity(config, ["w2"], "float32", "auto")
    assert len({salt_a, salt_b, salt_c}) == 3
    ids = list(range(20))
    assert segment_hash(ids, salt_a) != segment_hash(ids, salt_b)
    assert segment_hash(ids, salt_a) == segment_hash(list(ids), salt_a)
    assert len(segment_hash(ids, salt_a)) == 32  # 128 bits


@pytest.mark.parametrize("text,match", [
    (f"a{SEP}{SEP}b", "empty"),
    (f"a{SEP}{BLOCK}<|tokendance_sep b", "malformed"),
    (f"a<|tokendance_sep>{BLOCK}", "malformed"),
    (f"<|im_{SEP}start|>user", "special token"),
    (f"<|im_start{SEP}|>user", "special token"),
])
def test_bad_text_is_rejected(segmenter, text, match):
    with pytest.raises(SegmentError, match=match):
        segmenter.from_text(text)


@pytest.mark.parametrize("separator", ["<|sep|>", "[[SEP]]"])
def test_a_custom_separators_core_is_a_marker_only_as_a_word_of_its_own(tokenizer, separator):
    """Prose that holds a short separator's core inside a word ("separate", "SEPTEMBER") is a
    plain prompt; the core left standing alone (a broken marker) is still refused."""
    seg = make(tokenizer, separator=separator)
    core = separator.strip("<>|[]{}()")
    for prose in ("Please separate the eggs.", "SEPTEMBER 5, sepal, xSEPx", f"{core}x and x{core}"):
        assert not seg.has_marker(prose) and seg.from_text(prose).spans == ()
    marked = seg.from_text(f"a{separator}{BLOCK}{separator}b")
    assert seg.has_marker(f"a{separator}b") and len(marked.spans) == 1
    with pytest.raises(SegmentError, match="malformed"):
        seg.from_text(f"a{separator}{BLOCK}{separator[:-1]} b")


def test_too_many_segments(tokenizer):
    seg = make(tokenizer, max_segments=2)
    seg.from_text(SEP.join(["a", BLOCK, OTHER, "b"]))
    with pytest.raises(SegmentError, match="max-segments"):
        seg.from_text(SEP.join(["a", BLOCK, OTHER, BLOCK, "b"]))


@pytest.mark.parametrize("piece,match", [
    ([1, 2, 10**9], "outside the vocabulary"),
    ([1, -1], "outside the vocabulary"),
    ([1, 2.5], "string or a list of token ids"),
    ({"text": "x"}, "string or a list of token ids"),
    ([True, 1], "string or a list of token ids"),
])
def test_bad_pieces_are_rejected(segmenter, piece, match):
    with pytest.raises(SegmentError, match=match):
        segmenter.from_pieces(["a", piece, "b"])


def test_special_tokens_inside_segments_still_work(segmenter, tokenizer):
    out = segmenter.from_text(f"<|im_start|>user\n{SEP}{BLOCK}<|im_end|>{SEP}\n")
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") in out.input_ids


def test_weight_checksums_are_cached(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"weights")
    (model / "config.json").write_text("{}")
    cache = tmp_path / "cache.json"
    first = weight_checksums(model, cache)
    assert len(first) == 1 and cache.is_file()
    assert weight_checksums(model, cache) == first
    (model / "model.safetensors").write_bytes(b"other weights")
    assert weight_checksums(model, cache) != first


class BosTokenizer:
    """Adds BOS (id 1) when asked, like Llama-2/3 tokenizers; one id per byte otherwise."""

    def encode(self, text, add_special_tokens=True):
        return ([1] if add_special_tokens else []) + [b + 2 for b in text.encode()]


def test_bos_only_at_the_prompt_start_and_never_for_chat():
    seg = Segmenter(BosTokenizer(), model_salt=b"s", vocab_size=300, min_segment_tokens=2)
    plain = seg.from_pieces(["ab", "cd", "ef"])
    assert plain.input_ids == [1, 99, 100, 101, 102, 103, 104]
    assert (plain.spans[0].start, plain.spans[0].end) == (3, 5)
    chat = seg.from_pieces(["ab", "cd", "ef"], add_special_tokens=False)
    assert chat.input_ids == [99, 100, 101, 102, 103, 104]
    assert chat.spans[0].hash == plain.spans[0].hash  # same block, same identity
    assert seg.from_pieces(["", "cd", ""]).input_ids == [1, 101, 102]


def chat_ids(tokenizer, system: str, turns: list[str]) -> list[int]:
    messages = [{"role": "system", "content": system}] + [
        {"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(turns)]
    return list(tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False))


def test_chat_messages_are_found_as_segments_at_any_offset(segmenter, tokenizer):
    """Two agents' chats: the same two messages after different system messages and in another
    order are the same segments (hashes of the text tokenised alone, as if marked), at other
    offsets; the template's text around them stays private and the ids are SGLang's own."""
    short = "You are agent one."
    long = "You are agent two, a careful historian of the valley, its rivers and its mills."
    a_ids = chat_ids(tokenizer, short, [BLOCK, OTHER])
    b_ids = chat_ids(tokenizer, long, [OTHER, BLOCK])
    a = segmenter.find_texts(a_ids, [short, BLOCK, OTHER])
    b = segmenter.find_texts(b_ids, [long, OTHER, BLOCK])
    assert a.input_ids == a_ids and b.input_ids == b_ids
    block, other = segmenter.from_text(f"x{SEP}{BLOCK}{SEP}{OTHER}{SEP}y").spans
    assert [s.hash for s in a.spans] == [block.hash, other.hash]  # the short system message stays private
    assert [s.hash for s in b.spans][1:] == [other.hash, block.hash]
    assert [tokenizer.decode(b_ids[s.start:s.end]) for s in b.spans] == [long, OTHER, BLOCK]
    assert a.spans[0].start != b.spans[2].start
    template = [t for i, t in enumerate(a_ids) if not any(s.start <= i < s.end for s in a.spans)]
    assert tokenizer.decode(template).count("<|im_start|>") == 4  # system, two turns, the answer's


def test_chat_texts_not_held_or_too_short_stay_private(segmenter, tokenizer):
    ids = chat_ids(tokenizer, "Be brief.", [BLOCK])
    out = segmenter.find_texts(ids, ["Be brief.", OTHER, BLOCK, BLOCK])
    assert [tokenizer.decode(ids[s.start:s.end]) for s in out.spans] == [BLOCK]  # once: the ids hold it once


def test_a_message_the_template_trims_or_glues_is_found_inside_its_seams(segmenter, tokenizer):
    ids = tokenizer.encode("Header:" + BLOCK.strip() + "!tail", add_special_tokens=False)
    out = segmenter.find_texts(ids, ["  " + BLOCK + "  "])
    (span,) = out.spans
    assert BLOCK[3:-3] in tokenizer.decode(ids[span.start:span.end])
    assert span.end - span.start >= len(tokenizer.encode(BLOCK, add_special_tokens=False)) - 2
