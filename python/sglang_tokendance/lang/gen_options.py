"""`sgl.gen(..., register_output=True, round="r1", round_size=4)`: a gen's `tokendance` options.

The `tokendance` options of a /generate request (sent as JSON text in its `custom_labels`, which
sglang-router passes on) are per-request: `register_output` asks a
TokenDance server to cache the generated text as a segment (the next round, where every agent
reads that output as a shared block, hits it); `round` / `round_size` name the multi-agent
round the request belongs to, so the server admits the round's requests together. `sgl.gen`
gets the keywords (a gen inside a `sglang_tokendance.lang.round(...)` block takes that round
unless it names its own) and marks its SglGen; while the interpreter executes a marked gen,
RuntimeEndpoint's /generate body gets the options, and the enclosing
`simulation(...)` block's routing key (lang/routing). SGLang builds that body inside
`generate`/`generate_stream` with no slot for extra fields; its `_add_images(executor, body)`
step, run on every body just before sending, is the one place that sees both the executor and
the body. Backends that do not serve TokenDance (per /server_info) never get the options, and
other backends (OpenAI, ...) never build such a body: there the keywords do nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import sglang
from sglang.lang.api import gen as sglang_gen
from sglang.lang.backend.runtime_endpoint import RuntimeEndpoint
from sglang.lang.interpreter import StreamExecutor
from sglang.lang.ir import SglExpr, SglGen

from sglang_tokendance.lang.backend import tokendance_info
from sglang_tokendance.lang.round import current_round
from sglang_tokendance.lang.routing import ROUTING_FIELD, current_routing_key
from sglang_tokendance.lang.wrapping import wrap_method
from sglang_tokendance.routing import options_label

MARK = "tokendance_request"  # a GenRequest on every SglGen, and on its executor while it runs


def gen(*args: Any, register_output: bool = False, round: str | None = None, round_size: int | None = None,
        **kwargs: Any) -> SglExpr:
    """`sglang.gen` (same arguments); `register_output=True` asks a TokenDance server to cache
    the generated text as a segment, `round` / `round_size` name the request's round (the
    enclosing `round(...)` block's when not given)."""
    expr = sglang_gen(*args, **kwargs)
    options = {"register_output": True} if register_output else {}
    if round is None:
        round, round_size = current_round() or (None, round_size)
    if round is not None:
        options["round"] = round
    if round_size is not None:
        options["round_size"] = round_size
    if options and not isinstance(expr, SglGen):
        raise ValueError(f"{', '.join(options)} applies to generated text, not to choices")
    if isinstance(expr, SglGen):
        setattr(expr, MARK, GenRequest(options, current_routing_key()))
    return expr


@dataclass(frozen=True)
class GenRequest:
    """What one gen adds to its /generate request: TokenDance options, the router's key."""

    options: dict[str, Any]
    routing_key: str | None


def _execute_gen(original, executor: StreamExecutor, expr: SglGen) -> None:
    setattr(executor, MARK, getattr(expr, MARK, None))
    try:
        original(executor, expr)
    finally:
        setattr(executor, MARK, None)


def _add_images(original, endpoint: RuntimeEndpoint, executor: StreamExecutor, data: dict) -> None:
    """The options go as JSON text in `custom_labels`, the one string map of /generate that
    sglang-router passes on (it drops a top-level `tokendance`)."""
    original(endpoint, executor, data)
    request: GenRequest | None = getattr(executor, MARK, None)
    if request is None:
        return
    if request.options and tokendance_info(endpoint):
        data["custom_labels"] = {**(data.get("custom_labels") or {}), **options_label(request.options)}
    if request.routing_key is not None:
        data[ROUTING_FIELD] = request.routing_key


def install() -> None:
    """Give `sgl.gen` the keywords and RuntimeEndpoint's /generate bodies the options."""
    sglang.gen = gen
    wrap_method(StreamExecutor, "_execute_gen", _execute_gen)
    wrap_method(RuntimeEndpoint, "_add_images", _add_images)
