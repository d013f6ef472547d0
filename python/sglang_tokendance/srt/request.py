"""A request's `tokendance` options: validated once in the tokenizer manager, parsed once in the scheduler.

The client's `tokendance` object (`"register_output"`, `"round"`, `"round_size"`, `"agent"`,
`"max_approximate_tokens"`, and one hint on what its KV is worth once it ends: `"pin_seconds"`,
`"retain_seconds"` or `"release"`, core/hints.py; the `"simulation"` it belongs to, and
`"end_simulation"` on the request that ends it) is checked by `RequestOptions.from_client`
(bad input: `SegmentError`, a 400). The tokenizer manager (srt/prompt_interface) adds the
prompt's segment spans and sends the whole as JSON in
`sampling_params.custom_params[CARRIER_KEY]`, a key stripped from client input first, so a
client can never supply spans or hashes. In the scheduler `RequestOptionsCache` turns that
JSON into one `RequestOptions` per SGLang `Req`, the first time anything asks (the round
policy when the request arrives, the forest when it is matched and planned), and every later
reader gets the same object.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any
from weakref import WeakKeyDictionary

from sglang_tokendance.core.collective import MAX_ROUND_ID_CHARS, MAX_ROUND_SIZE, RoundTag
from sglang_tokendance.core.hints import KVHint
from sglang_tokendance.core.segments import SegmentError, SegmentSpan
from sglang_tokendance.routing import OPTIONS_LABEL
from sglang_tokendance.server_args import TokenDanceArgs

CARRIER_KEY = "tokendance"  # in sampling_params.custom_params; only the tokenizer manager sets it
OPTIONS_SHAPE = ('`tokendance` must be an object like {"register_output": true, "round": "r1", "round_size": 4, '
                 '"agent": "alice", "max_approximate_tokens": 200, "retain_seconds": 60}')
HINT_FIELDS = ("pin_seconds", "retain_seconds", "release")  # at most one per request (core/hints.py)
CLIENT_FIELDS = frozenset({"register_output", "round", "round_size", "agent", "max_approximate_tokens", *HINT_FIELDS,
                           "simulation", "end_simulation"})
# The string maps sglang-router 0.3.2 keeps when it re-serialises a body (it drops every field it
# does not know, `tokendance` included, on /generate and /v1/chat/completions): the same object, as
# JSON text under OPTIONS_LABEL (sglang_tokendance/routing.py).
ROUTER_SAFE_MAPS = ("custom_labels", "metadata")


@dataclass(frozen=True)
class RequestOptions:
    """What TokenDance knows of one request: its shared segments (token spans and content
    hashes) and its client's options. `round`: the multi-agent round it belongs to (None: no
    round); `agent`: keep the finished row's KV for this agent's next prompt (mirror storage);
    `max_approximate_tokens`: its fidelity budget, in place of --tokendance-max-approximate-tokens
    (None: the server's). `find_chunks`: an unmarked prompt whose segments are its content-defined
    chunks, cut once its ids are final (srt/prompt_interface); never in the scheduler.
    `content_chunks`: its spans are those chunks, whose boundaries the content chose, not the
    client: a read may continue across them into a missed neighbour (core/plan). `hint`: what
    its KV is worth once it ends (pin, retain or release; None: SGLang's eviction order).
    `simulation`: the simulation it belongs to; `end_simulation`: once it ends, what every request
    of that simulation left cached is released (srt/hinted_kv)."""

    spans: tuple[SegmentSpan, ...] = ()
    register_output: bool = False
    round: RoundTag | None = None
    agent: str | None = None
    max_approximate_tokens: int | None = None
    find_chunks: bool = False
    content_chunks: bool = False
    hint: KVHint | None = None
    simulation: str | None = None
    end_simulation: bool = False

    @property
    def concerns_tokendance(self) -> bool:
        """Whether the scheduler keeps per-request state for it (segments, output
        registration or a named agent); any other request is SGLang's alone."""
        return bool(self.spans) or self.register_output or self.agent is not None

    @property
    def hints_what_it_leaves(self) -> bool:
        """Whether what it leaves cached takes a hint or its simulation's book (srt/hinted_kv)."""
        return self.hint is not None or self.simulation is not None

    @property
    def hashes(self) -> list[str]:
        return [span.hash for span in self.spans]

    @classmethod
    def from_client(cls, options: Any, mirror_storage: bool,
                    max_hint_seconds: float = TokenDanceArgs.max_hint_seconds) -> "RequestOptions":
        """The client's `tokendance` object (None: absent), validated; `SegmentError` names
        the first bad field. A hint's seconds are at most `max_hint_seconds`."""
        if options is None:
            return cls()
        if not isinstance(options, dict) or set(options) - CLIENT_FIELDS:
            raise SegmentError(OPTIONS_SHAPE)
        agent = options.get("agent")
        _check_name("agent", agent)
        if agent is not None and not mirror_storage:
            raise SegmentError("`tokendance.agent` keeps a request's KV as Master references plus its own diff "
                               "for the agent's next prompt: it needs --tokendance-storage mirror")
        if not isinstance(options.get("register_output", False), bool):
            raise SegmentError(f"`tokendance.register_output` must be true or false; {OPTIONS_SHAPE}")
        round_id, size = options.get("round"), options.get("round_size")
        _check_name("round", round_id)
        if size is not None and not (type(size) is int and 1 <= size <= MAX_ROUND_SIZE):
            raise SegmentError(f"`tokendance.round_size` must be an integer in [1, {MAX_ROUND_SIZE}], "
                               f"got {json.dumps(size)[:80]}")
        if size is not None and round_id is None:
            raise SegmentError("`tokendance.round_size` needs `tokendance.round`")
        budget = options.get("max_approximate_tokens")
        if budget is not None and not (type(budget) is int and budget >= 0):
            raise SegmentError(f"`tokendance.max_approximate_tokens` must be an integer >= 0, got "
                               f"{json.dumps(budget)[:80]}")
        _check_hint(options, max_hint_seconds)
        _check_name("simulation", options.get("simulation"))
        if not isinstance(options.get("end_simulation", False), bool):
            raise SegmentError(f"`tokendance.end_simulation` must be true or false, got "
                               f"{json.dumps(options['end_simulation'])[:80]}")
        if options.get("end_simulation") and options.get("simulation") is None:
            raise SegmentError("`tokendance.end_simulation` needs `tokendance.simulation`: the simulation it ends")
        given = {key: value for key, value in options.items() if value is not None and value is not False}
        return cls.from_payload(given)

    @classmethod
    def from_payload(cls, payload: dict) -> "RequestOptions":
        """The options as the tokenizer manager carried them (`payload`)."""
        spans = tuple(SegmentSpan(**span) for span in payload.get("segments", ()))
        tag = RoundTag(payload["round"], payload.get("round_size")) if "round" in payload else None
        hint = next((KVHint(name.removesuffix("_seconds"), float(payload[name]) if name != "release" else None)
                     for name in HINT_FIELDS if name in payload), None)
        return cls(spans, bool(payload.get("register_output")), tag, payload.get("agent"),
                   payload.get("max_approximate_tokens"), bool(payload.get("find_chunks")),
                   bool(payload.get("content_chunks")), hint, payload.get("simulation"),
                   bool(payload.get("end_simulation")))

    @classmethod
    def carried_by(cls, custom_params: dict | None) -> "RequestOptions":
        """The scheduler's end of the route: the options in SGLang's `SamplingParams.custom_params`."""
        raw = custom_params.get(CARRIER_KEY) if isinstance(custom_params, dict) else None
        return cls.from_payload(json.loads(raw)) if raw else cls()

    def with_spans(self, spans: tuple[SegmentSpan, ...]) -> "RequestOptions":
        return replace(self, spans=spans)

    def payload(self) -> dict:
        """The JSON form carried to the scheduler, and shown as meta_info["tokendance"]."""
        payload: dict[str, Any] = {"segments": [span.to_json() for span in self.spans]}
        if self.register_output:
            payload["register_output"] = True
        if self.round is not None:
            payload["round"] = self.round.round_id
            if self.round.size is not None:
                payload["round_size"] = self.round.size
        if self.agent is not None:
            payload["agent"] = self.agent
        if self.max_approximate_tokens is not None:
            payload["max_approximate_tokens"] = self.max_approximate_tokens
        if self.find_chunks:
            payload["find_chunks"] = True
        if self.content_chunks:
            payload["content_chunks"] = True
        if self.hint is not None:
            payload.update(self.hint.payload())
        if self.simulation is not None:
            payload["simulation"] = self.simulation
        if self.end_simulation:
            payload["end_simulation"] = True
        return payload


def client_options(body: Any) -> Any:
    """The client's `tokendance` object in a request body: the field itself, or its JSON text in
    `custom_labels` (/generate) or `metadata` (OpenAI), the string maps a router passes on.
    Given twice, or as text that is not a JSON object, is a `SegmentError`."""
    if not isinstance(body, dict):
        return None
    given = {"tokendance": body["tokendance"]} if body.get("tokendance") is not None else {}
    for field in ROUTER_SAFE_MAPS:
        carried = body.get(field)
        text = carried.get(OPTIONS_LABEL) if isinstance(carried, dict) else None
        if text is not None:
            given[f"{field}.{OPTIONS_LABEL}"] = _options_from_text(field, text)
    if len(given) > 1:
        raise SegmentError(f"TokenDance options given twice ({' and '.join(given)}); give them once")
    return next(iter(given.values()), None)


def _options_from_text(field: str, text: Any) -> dict:
    try:
        options = json.loads(text) if isinstance(text, str) else None
    except json.JSONDecodeError:
        options = None
    if not isinstance(options, dict):
        raise SegmentError(f"`{field}.{OPTIONS_LABEL}` must be the `tokendance` object as JSON text, "
                           f"got {json.dumps(text)[:80]}")
    return options


def strip_router_carrier(obj: Any) -> None:
    """Take the options' JSON out of a GenerateReqInput's `custom_labels` (SGLang would make it a
    metric label)."""
    labels = getattr(obj, "custom_labels", None)
    if isinstance(labels, dict) and OPTIONS_LABEL in labels:
        rest = {key: value for key, value in labels.items() if key != OPTIONS_LABEL}
        obj.custom_labels = rest or None


def _check_hint(options: dict, max_seconds: float) -> None:
    """At most one hint; its seconds a number in (0, max_seconds]; `release` true or false."""
    given = [name for name in HINT_FIELDS if options.get(name) not in (None, False)]
    if len(given) > 1:
        raise SegmentError(f"give at most one of `tokendance.{'`, `tokendance.'.join(HINT_FIELDS)}`, got "
                           f"{' and '.join(given)}")
    if not isinstance(options.get("release", False), bool):
        raise SegmentError(f"`tokendance.release` must be true or false, got {json.dumps(options['release'])[:80]}")
    for name in HINT_FIELDS[:2]:
        value = options.get(name)
        if value is not None and not (type(value) in (int, float) and 0 < value <= max_seconds):
            raise SegmentError(f"`tokendance.{name}` must be a number of seconds in (0, {max_seconds:g}] "
                               f"(--tokendance-max-hint-seconds), got {json.dumps(value)[:80]}")


def _check_name(name: str, value: Any) -> None:
    if value is not None and not (isinstance(value, str) and 0 < len(value) <= MAX_ROUND_ID_CHARS):
        raise SegmentError(f"`tokendance.{name}` must be a non-empty string of at most {MAX_ROUND_ID_CHARS} "
                           f"characters, got {json.dumps(value)[:80]}")


class RequestOptionsCache:
    """The scheduler's `RequestOptions` of each live SGLang `Req`, parsed on first use and
    forgotten with the request (SGLang matches a waiting request at every scheduling step)."""

    def __init__(self) -> None:
        self._options: WeakKeyDictionary = WeakKeyDictionary()

    def __call__(self, req) -> RequestOptions:
        options = self._options.get(req)
        if options is None:
            options = self._options[req] = RequestOptions.carried_by(req.sampling_params.custom_params)
        return options
