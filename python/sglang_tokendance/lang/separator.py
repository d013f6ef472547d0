"""`sgl.separator()`: the segment boundary as a frontend-language expression.

It executes to the serving backend's separator marker when that backend runs TokenDance
(its /server_info has a "tokendance" block, which also names the marker), and to nothing
otherwise, so one program runs against both. It is constant text to everything else in the
interpreter, so fork, run_batch and streaming keep working.
"""

from __future__ import annotations

import sglang
from sglang.lang.interpreter import StreamExecutor
from sglang.lang.ir import SglConstantText

from sglang_tokendance.lang.backend import tokendance_info
from sglang_tokendance.lang.wrapping import wrap_method


class SglSeparator(SglConstantText):
    def __init__(self):
        super().__init__("")  # the marker is the backend's, resolved at execution

    def __repr__(self) -> str:
        return "Separator()"


def separator() -> SglSeparator:
    return SglSeparator()


def _execute(original, executor: StreamExecutor, other):
    if isinstance(other, SglSeparator):
        marker = tokendance_info(executor.backend).get("separator", "")
        if marker:
            executor._execute_fill(marker)
        return None
    return original(executor, other)


def install() -> None:
    """Teach the interpreter to execute separators and expose `sgl.separator`."""
    sglang.separator = separator
    wrap_method(StreamExecutor, "_execute", _execute)
