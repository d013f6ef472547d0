"""Round-aware prompts: split at separators, tokenise each segment alone, hash it by content.

A prompt is a sequence of pieces separated by a zero-width marker. Pieces between two markers
are *segments*: each is tokenised on its own (no BOS inside), so its token ids, and therefore
its content hash, do not depend on its neighbours or on where it sits. The piece before the
first marker and the one after the last are private text, and so is any segment shorter than
`min_segment_tokens`. The model sees exactly the concatenation of the pieces' tokens.

Plain torch-free Python: the tokenizer is any object with `encode(text, add_special_tokens=)`.
"""

from __future__ import annotations

import hashlib
import re
from array import array
from dataclasses import dataclass
from typing import Container, Iterable, Protocol, Sequence, Union

from sglang_tokendance.core.content_chunks import ChunkRule

DEFAULT_SEPARATOR = "<|tokendance_sep|>"

Piece = Union[str, Sequence[int]]


class SegmentError(ValueError):
    """Malformed round-aware input; the server answers it with HTTP 400."""


class Tokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...


@dataclass(frozen=True)
class SegmentSpan:
    """One shared segment: token offsets [start, end) in the prompt and its content hash."""

    start: int
    end: int
    hash: str

    def to_json(self) -> dict:
        return {"start": self.start, "end": self.end, "hash": self.hash}


@dataclass(frozen=True)
class SegmentedPrompt:
    input_ids: list[int]
    spans: tuple[SegmentSpan, ...]

    def to_json(self) -> dict:
        return {"segments": [s.to_json() for s in self.spans]}


def segment_hash(token_ids: Sequence[int], model_salt: bytes) -> str:
    """128-bit blake2b of the ids, keyed by the model's identity: equal ids on another model
    (or dtype, or KV dtype) never share KV."""
    digest = hashlib.blake2b(digest_size=16, key=model_salt[:64])
    digest.update(array("q", token_ids).tobytes())
    return digest.hexdigest()


def _marker_core(separator: str) -> re.Pattern:
    """What is left of a marker once its punctuation is gone (a broken marker keeps it), as a
    word of its own: a core such as `sep` of `<|sep|>` inside "separate" is prose, not a marker."""
    core = separator.strip("<>|[]{}()") or separator
    before = r"(?<!\w)" if re.match(r"\w", core) else ""
    after = r"(?!\w)" if re.match(r"\w", core[-1]) else ""
    return re.compile(before + re.escape(core) + after)


class Segmenter:
    """Turns marked text, or an explicit list of pieces, into ids + shared segment spans."""

    def __init__(self, tokenizer: Tokenizer, *, model_salt: bytes, vocab_size: int,
                 separator: str = DEFAULT_SEPARATOR, min_segment_tokens: int = 16,
                 max_segments: int = 512, special_tokens: Iterable[str] = ()):
        self.tokenizer = tokenizer
        self.model_salt = model_salt
        self.vocab_size = vocab_size
        self.separator = separator
        self.min_segment_tokens = min_segment_tokens
        self.max_segments = max_segments
        self.special_tokens = tuple(t for t in special_tokens if t)
        self._marker_core = _marker_core(separator)

    def has_marker(self, text: str) -> bool:
        return self._marker_core.search(text) is not None

    def split_text(self, text: str) -> list[str]:
        """The pieces of marked text, rejecting broken markers and split special tokens."""
        pieces = text.split(self.separator)
        for i, piece in enumerate(pieces):
            broken = self._marker_core.search(piece)
            if broken is not None:
                raise SegmentError(
                    f"malformed separator near {piece[max(0, broken.start() - 8):][:40]!r}: "
                    f"write it exactly as {self.separator!r}"
                )
            if i > 0:
                self._check_cut(pieces[i - 1], piece)
        return pieces

    def _check_cut(self, before: str, after: str) -> None:
        """A marker must not sit inside a special token such as <|im_start|>."""
        for token in self.special_tokens:
            joined = before[-len(token) + 1:] + after[: len(token) - 1]
            cut = len(before[-len(token) + 1:])
            at = joined.find(token)
            while at != -1:
                if at < cut < at + len(token):
                    raise SegmentError(f"a separator splits the special token {token!r}")
                at = joined.find(token, at + 1)

    def from_text(self, text: str) -> SegmentedPrompt:
        return self.from_pieces(self.split_text(text))

    def from_pieces(self, pieces: Sequence[Piece], add_special_tokens: bool = True) -> SegmentedPrompt:
        """pieces[0] and pieces[-1] are private; pieces[1:-1] are the segments.

        `add_special_tokens` lets the first piece carry the tokenizer's BOS, as a plain prompt
        would; a rendered chat template already holds its own."""
        if not pieces:
            raise SegmentError("no prompt pieces given")
        if len(pieces) - 2 > self.max_segments:
            raise SegmentError(
                f"{len(pieces) - 2} segments exceed --tokendance-max-segments={self.max_segments}"
            )
        input_ids: list[int] = []
        spans: list[SegmentSpan] = []
        last = len(pieces) - 1
        for i, piece in enumerate(pieces):
            ids = self._piece_ids(piece, specials=add_special_tokens and i == 0)
            if 0 < i < last:
                if not ids:
                    raise SegmentError(f"segment {i} is empty (two separators with nothing between)")
                if len(ids) >= self.min_segment_tokens:
                    start = len(input_ids)
                    spans.append(SegmentSpan(start, start + len(ids), segment_hash(ids, self.model_salt)))
            input_ids.extend(ids)
        return SegmentedPrompt(input_ids, tuple(spans))

    def find_texts(self, input_ids: Sequence[int], texts: Iterable[str], rule: ChunkRule | None = None,
                   whole: Container[int] = ()) -> SegmentedPrompt:
        """The prompt `input_ids` with each of `texts` that it holds, in order, as a segment:
        chat messages in a rendered template, found without markers.

        Each text is tokenised alone (its hash is then that of the same text marked anywhere
        else); where the template's text merged a seam token (a trimmed message, a header
        glued to the first word), the text's tokens inside the seams are the segment. A text
        the ids do not hold, or shorter than a segment, stays private; the ids are untouched.
        With `rule`, a text at least two chunks long is cut into its content-defined chunks
        (`ChunkRule.message_chunks`): a transcript pasted into one message shares its turns with
        prompts that hold them in other messages or at other offsets. Texts whose index is in
        `whole` stay one segment (an assistant message: an earlier answer, registered whole)."""
        haystack = array("q", input_ids).tobytes()
        spans: list[SegmentSpan] = []
        cursor = 0
        for index, text in enumerate(texts):
            if len(spans) >= self.max_segments:
                break
            found = self._find_text(haystack, text, cursor)
            if found is not None:
                start, ids = found
                pieces = [(0, len(ids))] if rule is None or index in whole else rule.message_chunks(ids)
                spans.extend(SegmentSpan(start + s, start + e, segment_hash(ids[s:e], self.model_salt))
                             for s, e in pieces if e - s >= self.min_segment_tokens)
                cursor = start + len(ids)
        return SegmentedPrompt(list(input_ids), tuple(spans[:self.max_segments]))

    def content_chunks(self, input_ids: Sequence[int], rule: ChunkRule) -> SegmentedPrompt:
        """The prompt `input_ids` with its content-defined chunks (core/content_chunks) as
        segments: shared text found without markers. Chunks shorter than a segment, and any
        past --tokendance-max-segments, stay private; the ids are untouched."""
        spans = tuple(SegmentSpan(start, end, segment_hash(input_ids[start:end], self.model_salt))
                      for start, end in rule.chunks(input_ids) if end - start >= self.min_segment_tokens)
        return SegmentedPrompt(list(input_ids), spans[:self.max_segments])

    def _find_text(self, haystack: bytes, text: str, cursor: int) -> tuple[int, list[int]] | None:
        for variant in dict.fromkeys((text, text.strip())):
            ids = list(self.tokenizer.encode(variant, add_special_tokens=False))
            for needle in (ids, ids[1:], ids[:-1], ids[1:-1]):
                if len(needle) < self.min_segment_tokens:
                    break
                start = _find_ids(haystack, needle, cursor)
                if start is not None:
                    return start, needle
        return None

    def _piece_ids(self, piece: Piece, specials: bool) -> list[int]:
        if isinstance(piece, str):
            # Only the prompt's start may carry the tokenizer's BOS (if it adds one).
            if not piece and not specials:
                return []
            return list(self.tokenizer.encode(piece, add_special_tokens=specials))
        if isinstance(piece, (list, tuple)) and all(type(t) is int for t in piece):
            bad = [t for t in piece if not 0 <= t < self.vocab_size]
            if bad:
                raise SegmentError(f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
            return list(piece)
        raise SegmentError(
            f"a segment must be a string or a list of token ids, got {type(piece).__name__}"
        )


def _find_ids(haystack: bytes, needle: Sequence[int], start: int) -> int | None:
    """The first token offset >= `start` where `needle` sits in the ids packed in `haystack`
    (8 bytes an id: a byte match off that grid is skipped)."""
    pattern = array("q", needle).tobytes()
    at = haystack.find(pattern, start * 8)
    while at != -1 and at % 8:
        at = haystack.find(pattern, at + 1)
    return None if at == -1 else at // 8
