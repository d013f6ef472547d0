"""`with sglang_tokendance.lang.simulation("sim-7"):`: every gen built inside is routed by that key.

SGLang's router (`sglang-router`, `--policy manual`) sends every request with the same
`X-SMG-Routing-Key` header to the same worker, which is where a simulation's Masters live. The
block sets a context variable that `sgl.gen` (lang/gen_options.py) reads when it builds a gen;
RuntimeEndpoint's /generate call for that gen then carries the header. RuntimeEndpoint's HTTP
helper takes no headers, so the key rides in the body under a private field up to the helper,
which is wrapped here to turn it into the header (and never sends the field).
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Iterator

import requests
from sglang.lang.backend import runtime_endpoint

from sglang_tokendance.lang.wrapping import wrap_method
from sglang_tokendance.routing import ROUTING_HEADER

ROUTING_FIELD = "_tokendance_routing_key"  # body -> header, inside this process only

_CURRENT: contextvars.ContextVar[str | None] = contextvars.ContextVar("tokendance_routing_key", default=None)


def current_routing_key() -> str | None:
    """The routing key of the enclosing `simulation(...)` block, or None."""
    return _CURRENT.get()


@contextlib.contextmanager
def simulation(key: str) -> Iterator[None]:
    """Route every gen built inside to one worker: `X-SMG-Routing-Key: key` on its request."""
    if not isinstance(key, str) or not key:
        raise ValueError(f"a simulation's routing key must be a non-empty string, got {key!r}")
    token = _CURRENT.set(key)
    try:
        yield
    finally:
        _CURRENT.reset(token)


def _http_request(original, url: str, json: Any = None, stream: bool = False, api_key: str | None = None,
                  verify: Any = None, method: str | None = None) -> Any:
    key = json.pop(ROUTING_FIELD, None) if isinstance(json, dict) else None
    if key is None:
        return original(url, json=json, stream=stream, api_key=api_key, verify=verify, method=method)
    headers = {ROUTING_HEADER: key}
    if api_key is not None:
        headers["Authorization"] = f"Bearer {api_key}"
    return requests.request(method or "POST", url, json=json, stream=stream, headers=headers,
                            verify=verify if verify is not None else True)


def install() -> None:
    """Turn a /generate body's routing key into the router's header."""
    wrap_method(runtime_endpoint, "http_request", _http_request)
