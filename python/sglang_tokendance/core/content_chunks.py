"""Content-defined chunks over token ids: shared text found in prompts that carry no markers.

A chunk ends after token i when a hash of the `window` tokens ending at i falls in a 1-in-
`spacing` bucket (and the chunk is at least `min_tokens` long; at `max_tokens` it is cut
anyway). The cut depends only on the tokens around it, never on the offset, so the same text
gives the same chunks wherever it sits, once `window` tokens past the seam with whatever came
before it (where a tokenizer may merge across the join) and past the first cut the two share.
Each chunk is then a segment, hashed by content like a marked one (core/segments): the forest
finds it at any offset. What a shared span loses is its ends: the part before its first
common cut and after its last, about a chunk each (benchmark/results/content_chunks.md).

Plain numpy over the ids: one vectorised pass for the cut candidates, a short loop over them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

_MIX = np.uint64(0x9E3779B97F4A7C15)  # Fibonacci hashing: spreads nearby ids over 64 bits
_SHIFT = np.uint64(29)


@dataclass(frozen=True)
class ChunkRule:
    """Where content-defined cuts fall. `spacing` is the mean gap between cut candidates
    (a power of two); chunks are `spacing` + `min_tokens` long on average."""

    min_tokens: int = 16
    spacing: int = 16
    window: int = 4
    max_tokens: int = 256

    def __post_init__(self) -> None:
        if self.spacing < 1 or self.spacing & (self.spacing - 1):
            raise ValueError(f"spacing must be a power of two, got {self.spacing}")
        if not 1 <= self.window <= self.min_tokens <= self.max_tokens:
            raise ValueError("need 1 <= window <= min_tokens <= max_tokens, got "
                             f"{self.window}, {self.min_tokens}, {self.max_tokens}")

    def cuts(self, ids: Sequence[int]) -> np.ndarray:
        """Offsets i (window <= i <= len) where a chunk may end before token i, by content alone."""
        n = len(ids)
        if n < self.window:
            return np.empty(0, dtype=np.int64)
        token = np.asarray(ids, dtype=np.uint64) * _MIX
        token ^= token >> _SHIFT
        summed = np.concatenate(([np.uint64(0)], np.cumsum(token, dtype=np.uint64)))
        windows = summed[self.window:] - summed[:-self.window]  # windows[j]: tokens j .. j + window - 1
        hits = np.flatnonzero(((windows * _MIX) >> np.uint64(64 - 16)) % np.uint64(self.spacing) == 0)
        return hits + self.window  # a cut after the window's last token

    def chunks(self, ids: Sequence[int]) -> list[tuple[int, int]]:
        """The prompt cut into [start, end) chunks covering it, each at least `min_tokens`
        long but the last, none longer than `max_tokens`."""
        spans: list[tuple[int, int]] = []
        start = 0
        for cut in self.cuts(ids).tolist():
            while cut - start > self.max_tokens:
                spans.append((start, start + self.max_tokens))
                start += self.max_tokens
            if cut - start >= self.min_tokens:
                spans.append((start, cut))
                start = cut
        while len(ids) - start > self.max_tokens:
            spans.append((start, start + self.max_tokens))
            start += self.max_tokens
        if start < len(ids):
            spans.append((start, len(ids)))
        return spans

    def message_chunks(self, ids: Sequence[int]) -> list[tuple[int, int]]:
        """A whole message's chunks: [(0, len)] for a message shorter than two chunks on average
        (`spacing` + `min_tokens` each: cutting it finds nothing its whole would not), else
        `chunks` with a last chunk shorter than `min_tokens` joined to the one before, so every
        token of a message shared whole is in a segment."""
        if len(ids) < 2 * (self.spacing + self.min_tokens):
            return [(0, len(ids))]
        spans = self.chunks(ids)
        if len(spans) > 1 and spans[-1][1] - spans[-1][0] < self.min_tokens:
            spans[-2:] = [(spans[-2][0], spans[-1][1])]
        return spans
