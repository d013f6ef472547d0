"""`sgl.gen(..., register_output=True)`: output registration in the frontend language.

The /generate option `"tokendance": {"register_output": true}` asks a TokenDance server to
cache the generated text as a segment, so the next round, where every agent reads that output
as a shared block, hits it. `sgl.gen` gets the keyword and marks its SglGen; while the
interpreter executes a marked gen, RuntimeEndpoint's /generate body gets the option. SGLang
builds that body inside `generate`/`generate_stream` with no slot for extra fields; its
`_add_images(executor, body)` step, run on every body just before sending, is the one place
that sees both the executor and the body. Backends that do not serve TokenDance (per
/server_info) never get the option, and other backends (OpenAI, ...) never build such a body:
there the keyword does nothing.
"""

from __future__ import annotations

from typing import Any

import sglang
from sglang.lang.api import gen as sglang_gen
from sglang.lang.backend.runtime_endpoint import RuntimeEndpoint
from sglang.lang.interpreter import StreamExecutor
from sglang.lang.ir import SglExpr, SglGen

from sglang_tokendance.lang.backend import tokendance_info
from sglang_tokendance.lang.wrapping import wrap_method

MARK = "tokendance_register_output"  # on a marked SglGen, and on its executor while it runs


def gen(*args: Any, register_output: bool = False, **kwargs: Any) -> SglExpr:
    """`sglang.gen` (same arguments); `register_output=True` asks a TokenDance server to cache
    the generated text as a segment."""
    expr = sglang_gen(*args, **kwargs)
    if register_output:
        if not isinstance(expr, SglGen):
            raise ValueError("register_output applies to generated text, not to choices")
        setattr(expr, MARK, True)
    return expr


def _execute_gen(original, executor: StreamExecutor, expr: SglGen) -> None:
    setattr(executor, MARK, getattr(expr, MARK, False))
    try:
        original(executor, expr)
    finally:
        setattr(executor, MARK, False)


def _add_images(original, endpoint: RuntimeEndpoint, executor: StreamExecutor, data: dict) -> None:
    original(endpoint, executor, data)
    if getattr(executor, MARK, False) and tokendance_info(endpoint):
        data["tokendance"] = {"register_output": True}


def install() -> None:
    """Give `sgl.gen` the keyword and RuntimeEndpoint's /generate bodies the option."""
    sglang.gen = gen
    wrap_method(StreamExecutor, "_execute_gen", _execute_gen)
    wrap_method(RuntimeEndpoint, "_add_images", _add_images)
