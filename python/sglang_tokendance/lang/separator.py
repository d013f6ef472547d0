"""`sgl.separator()`: the segment boundary as a frontend-language expression.

It executes to the serving backend's separator marker when that backend runs TokenDance
(its /server_info has a "tokendance" block, which also names the marker), and to nothing
otherwise, so one program runs against both. It is constant text to everything else in the
interpreter, so fork, run_batch and streaming keep working.
"""

from __future__ import annotations

import functools

import sglang
from sglang.lang.interpreter import StreamExecutor
from sglang.lang.ir import SglConstantText


class SglSeparator(SglConstantText):
    def __init__(self):
        super().__init__("")  # the marker is the backend's, resolved at execution

    def __repr__(self) -> str:
        return "Separator()"


def separator() -> SglSeparator:
    return SglSeparator()


def backend_separator(backend) -> str:
    """The marker a backend accepts, or "" when it does not serve TokenDance (cached)."""
    cached = getattr(backend, "_tokendance_separator", None)
    if cached is None:
        info = {}
        if hasattr(backend, "get_server_info"):
            try:
                info = backend.get_server_info() or {}
            except Exception:  # a backend without /server_info is not TokenDance
                info = {}
        cached = (info.get("tokendance") or {}).get("separator", "")
        backend._tokendance_separator = cached
    return cached


def install() -> None:
    """Teach the interpreter to execute separators and expose `sgl.separator`."""
    sglang.separator = separator
    original = StreamExecutor._execute
    if getattr(original, "_tokendance", False):
        return

    @functools.wraps(original)
    def _execute(self, other):
        if isinstance(other, SglSeparator):
            marker = backend_separator(self.backend)
            if marker:
                self._execute_fill(marker)
            return None
        return original(self, other)

    _execute._tokendance = True
    StreamExecutor._execute = _execute
