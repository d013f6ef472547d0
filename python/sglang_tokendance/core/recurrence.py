"""Where a marked block recurs: at the same place, after the same exact prefix. Pure.

Stock SGLang serves a block exactly from its radix tree the second time an agent sends it
after the same tokens (a static briefing after the agent's notes, last round's transcript in
a growing conversation). Reuse at its first sighting leaves that KV approximate, and
approximate KV never enters the tree, so without this rule the block would be approximated in
every later round where stock SGLang had it exact. So the server remembers every block it
served approximately, by (cache namespace, digest of the prompt before the block, the block's
hash): a `sighting`. When a later prompt holds the same block after the same tokens, right at
its exact frontier, the block is computed in full and published; from then on the tree hits
it. A registered output is sighted after its author's prompt: a prompt that holds it there
continues a finished request (a growing conversation), whose every block comes back in the
next round's prefix, so such a prompt is computed exactly throughout, as stock SGLang would:
approximating a block now would only cost its exact computation one round later.

A block made exact this way leaves the request's reuse, and with it the pool its recompute
share is taken of: r x (reused tokens) shrinks to the blocks still reused, often the round's
short new messages, whose cached KV is the least faithful. Measured on an All-Gather round of
6 agents (two 156-token briefings recurring, six ~35-token messages cached on their own),
that tripled the first-token KL (0.083 against 0.031 with the rule off). So the blocks a prompt
holds exactly that were read approximately at their place before (`Recurrence.seen`) stay in
its recompute budget (core/selection `credited_allowance`): exact recurrence never leaves the
blocks a request still reuses fewer recomputed tokens than it would have recomputed of them
all.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from enum import Enum
from typing import Hashable, NamedTuple, Sequence

from sglang_tokendance.core.segments import SegmentSpan

DEFAULT_CAPACITY = 1 << 16  # sightings remembered (least recently seen forgotten first)


class Sighting(Enum):
    PROMPT = "prompt"  # the block sat there in a prompt that read it approximately
    OUTPUT = "output"  # the block was generated there (a registered output, after its author's prompt)


def prefix_digests(ids: Sequence[int], positions: Sequence[int]) -> list[bytes]:
    """The digest of `ids[:p]` for each p of the non-decreasing `positions`, in one pass."""
    digest = hashlib.blake2b(digest_size=16)
    done, out = 0, []
    for position in positions:
        digest.update(array("q", ids[done:position]).tobytes())
        done = position
        out.append(digest.digest())
    return out


class Recurrence(NamedTuple):
    """A prompt's blocks at its exact frontier. `exact_until`: the prompt position up to which
    it computes its blocks exactly -- the whole prompt when any of its blocks is a sighted
    output at its place (the prompt continues a finished request: a growing conversation, whose
    blocks all come back in the next round's prefix); otherwise through each block past the
    radix match that was sighted there, up to the first that was not (after that block nothing
    is published exactly, so later recurrences are reused as usual). `seen`: the blocks it holds
    exactly (in the radix match, or computed up to `exact_until`) that a prompt read
    approximately at the same place before -- without this rule they would be reused again, so
    they stay in the request's recompute budget (srt/reuse: exact recurrence never leaves the
    blocks a request still reuses fewer recomputed tokens)."""

    exact_until: int
    seen: tuple[SegmentSpan, ...] = ()


def _exact_until(spans: Sequence[SegmentSpan], kinds: Sequence["Sighting | None"], prefix_len: int,
                 prompt_len: int) -> int:
    if Sighting.OUTPUT in kinds:
        return prompt_len
    exact = prefix_len
    for span, kind in zip(spans, kinds):
        if span.end <= prefix_len:
            continue
        if kind is None:
            return exact
        exact = span.end
    return exact


class Sightings:
    """The blocks served approximately (or generated) at a place, bounded: least recently
    seen forgotten first. Keys: (namespace, prefix digest, block hash)."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY):
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        self.capacity = capacity
        self._seen: OrderedDict[tuple, Sighting] = OrderedDict()

    def __len__(self) -> int:
        return len(self._seen)

    def get(self, key: tuple) -> Sighting | None:
        kind = self._seen.get(key)
        if kind is not None:
            self._seen.move_to_end(key)
        return kind

    def record(self, key: tuple, kind: Sighting) -> None:
        if self._seen.get(key) is not Sighting.OUTPUT:  # a generated block stays known as one
            self._seen[key] = kind
        self._seen.move_to_end(key)
        while len(self._seen) > self.capacity:
            self._seen.popitem(last=False)

    def clear(self) -> None:
        self._seen.clear()

    def recurrence(self, namespace: Hashable, ids: Sequence[int], spans: Sequence[SegmentSpan],
                   prefix_len: int) -> "Recurrence":
        """What the sightings decide for a prompt whose radix match ends at `prefix_len`: up to
        where it computes its blocks exactly, and which of the blocks it then holds exactly were
        read approximately at their place before (`Recurrence`)."""
        keys = [(namespace, digest, span.hash)
                for span, digest in zip(spans, prefix_digests(ids, [span.start for span in spans]))]
        kinds = [self.get(key) for key in keys]
        exact = _exact_until(spans, kinds, prefix_len, len(ids))
        return Recurrence(exact, tuple(span for span, kind in zip(spans, kinds)
                                       if span.end <= exact and kind is Sighting.PROMPT))

    def record_prompt(self, namespace: Hashable, ids: Sequence[int], spans: Sequence[SegmentSpan]) -> None:
        """`spans` of the prompt `ids` were served without their exact KV reaching the tree."""
        for span, digest in zip(spans, prefix_digests(ids, [span.start for span in spans])):
            self.record((namespace, digest, span.hash), Sighting.PROMPT)

    def record_output(self, namespace: Hashable, prompt_ids: Sequence[int], output_hash: str) -> None:
        """A finished request generated the block `output_hash` right after `prompt_ids`."""
        self.record((namespace, prefix_digests(prompt_ids, [len(prompt_ids)])[0], output_hash), Sighting.OUTPUT)
