"""The frame of every KV-pool slot: the position its K was rotated at.

SGLang writes K rotated at the position of the token in the row that computes it. Under
zero-copy storage a slot is also read by other rows (a Master's slots, read in place by every
row that reuses the segment), at other positions. RoPE is relative, so a row that reads slot s
at its own position n only needs the shift n - frame[s]: 0 for the row's own tokens and its
radix prefix (SGLang's layout, nothing to do), one constant per Master run it reads. Whoever
writes a slot records its frame (the attention backend, for every forward's new slots).
"""

from __future__ import annotations

import torch


class SlotFrames:
    """frame[s] for slots 0..size (slot 0 is SGLang's padding slot)."""

    def __init__(self, size: int, device: torch.device | str = "cpu"):
        self.frame = torch.zeros(size + 1, dtype=torch.int32, device=device)

    def record(self, slots: torch.Tensor, positions: torch.Tensor) -> None:
        """K of `slots` was written rotated at `positions`."""
        self.frame[slots] = positions.to(torch.int32)

    def shifts(self, slots: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """int64 shifts of `slots` read at `positions` (None: a row, [..., L], slot j read at
        position j): what a reader must rotate their K by to have it at its own positions."""
        if positions is None:
            positions = torch.arange(slots.shape[-1], device=slots.device)
        return positions.to(torch.int64) - self.frame[slots].to(torch.int64)
