"""TokenDance options: one dataclass, parsed from `--tokendance-*` flags and validated here.

SGLang's ServerArgs is a closed msgspec record pickled into its spawned processes, so our
options travel beside it: the launcher (or Engine) serialises them into the environment
variable SGLANG_TOKENDANCE_CONFIG, which every spawned process inherits and our plugin reads.
A plain `python -m sglang.launch_server` never sets it, so the plugin stays inert there.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, Callable

from sglang_tokendance.core.blend_types import GROUP_SELECTIONS, BlendOptions
from sglang_tokendance.core.content_chunks import ChunkRule
from sglang_tokendance.core.segments import DEFAULT_SEPARATOR
from sglang_tokendance.core.selection import GRANULARITIES, RULES

SELECTION_RULES = tuple(RULES)
STORAGES = ("auto", "dense", "mirror")
EVICTIONS = ("next-use", "recency")
DEFAULT_CHUNK_SPACING = 8  # --tokendance-content-chunks -1 under mirror storage (benchmark/results/content_chunks.md)

ENV_VAR = "SGLANG_TOKENDANCE_CONFIG"
FOREST_BACKEND = "tokendance"  # the radix-cache backend name of srt/forest.py
ATTENTION_BACKEND = "tokendance"  # the attention backend name of srt/attention.py (mirror storage)


class TokenDanceArgsError(ValueError):
    """A bad TokenDance option; `flag` names it as the user typed it."""

    def __init__(self, flag: str, message: str):
        super().__init__(f"{flag}: {message}")
        self.flag = flag


def _option(default: Any, help: str, flag: str | None = None) -> Any:
    return field(default=default, metadata={"help": help, "flag": flag})


@dataclass(frozen=True)
class TokenDanceArgs:
    disable_tokendance: bool = _option(
        False,
        "Switch TokenDance's KV machinery off: the server behaves as stock SGLang.",
        flag="--disable-tokendance",
    )

    separator: str = _option(
        DEFAULT_SEPARATOR,
        "Zero-width marker between prompt segments (stripped; each segment is tokenised alone).",
    )
    min_segment_tokens: int = _option(
        16, "Segments shorter than this many tokens are treated as private text."
    )
    max_segments: int = _option(512, "Most segments one prompt may hold (more is a 400 error).")
    chat_segments: bool = _option(
        True, "Each /v1/chat/completions message at least --tokendance-min-segment-tokens long is a segment, with no "
        "markers (found, tokenised alone, in SGLang's own ids of the rendered chat template, whose text stays "
        "private), one at least two content chunks long but an assistant's cut into its chunks where "
        "--tokendance-content-chunks is on; a chat holding separators is split at them alone "
        "(--no-tokendance-chat-segments: only marked text is)."
    )

    content_chunks: int = _option(
        -1, "Find shared text in /generate and /v1/completions prompts that hold no separators: each is cut into "
        "content-defined chunks (a cut after a token where a hash of the two tokens ending there falls in a 1-in-N "
        "bucket, chunks at least --tokendance-min-segment-tokens long), each a segment found wherever the same text "
        "sits. N, a power of two: chunks are about N + --tokendance-min-segment-tokens long; 0: off; -1: 8 under "
        "mirror storage (a chunk's Master is a reference on its author's slots), off under dense storage (where each "
        "would be a copy of every prompt's KV)."
    )

    recompute_ratio: float = _option(
        0.3, "Share of each request's reused tokens recomputed by the blended prefill (0: plain reuse, "
        "1: a full prefill)."
    )
    check_layer: int = _option(
        8, "Layer at which reused tokens are scored; layers up to it run on the tokens the screen passes "
        "(>= 1: layer 0 carries no signal)."
    )
    selection: str = _option(
        "cacheblend-kv", "Rule that picks the reused tokens to recompute: "
        + ", ".join(SELECTION_RULES) + " (the default was chosen on the decode-step KL of content tokens)."
    )
    screen_layer: int = _option(
        1, "Layer at which the selection rule first screens the reused tokens: only those that pass run "
        "the probe on to the check layer (no screen when 0 or not below --tokendance-check-layer)."
    )
    screen_factor: float = _option(
        2.0, "The screen passes this multiple of the recompute ratio of each request's reused tokens "
        "(at most all of them; >= 1)."
    )
    block_head_tokens: int = _option(0, "Always recompute the first this-many tokens of every reused segment.")
    selection_granularity: str = _option(
        "token", "Select single tokens, or whole blocks of --tokendance-block-size tokens (counted from "
        "each segment's start): token or block."
    )
    block_size: int = _option(16, "Block length for --tokendance-selection-granularity block.")
    sparse_writeback: bool = _option(
        True, "Tokens not recomputed keep the reused KV at every layer, the probe layers included "
        "(--no-tokendance-sparse-writeback keeps the probe's recomputed KV there)."
    )
    storage: str = _option(
        "auto", "Where reused KV is read: dense (each reader gets a copy rotated to its positions), mirror "
        "(zero copy: rows read the Masters' slots in place at a shift, through the tokendance attention backend; "
        "finished rows are kept for their continuation), or auto: mirror where the tokendance backend runs "
        "SGLang's own attention for every other row (the CPU, torch_native) and nothing given asks for another "
        "backend, dense elsewhere (a GPU: SGLang's FlashInfer/Triton backends and CUDA graphs)."
    )
    diff_threshold: float = _option(
        0.0, "Mirror storage: a recomputed token whose K and V lie within this relative L2 distance of its "
        "Master's at every layer is not stored -- its row reads the Master there (a smaller Mirror diff; counted "
        "as within_threshold_tokens in meta_info). 0: every recomputed token keeps its own KV."
    )
    exact_recurrence: bool = _option(
        True, "A marked block met again at the same place after the same exact prefix (a static briefing after an "
        "agent's notes, last round's blocks in a growing conversation) is computed exactly and published to the "
        "radix tree, so later prompts hit it exactly as on stock SGLang; a prompt that continues a finished "
        "request's prompt and registered answer is computed exactly throughout (--no-tokendance-exact-recurrence: "
        "every cached block is reused approximately, wherever it sits)."
    )
    keep_rows: bool = _option(
        True, "Mirror storage: a finished request that holds approximate KV is kept (zero copy, evictable) for the "
        "prompt that continues it -- its agent's next prompt, or, for a request naming no agent, any prompt with "
        "segments that repeats its tokens -- which then reads the KV it read instead of computing its blocks "
        "again (--no-tokendance-keep-rows: only requests naming their `agent` are kept)."
    )
    max_approximate_tokens: int = _option(
        -1, "Fidelity budget: at most this many of a request's reused tokens keep their cached (approximate) KV; "
        "where the recompute ratio would leave more, more are recomputed (a prompt with more reused blocks -- a "
        "larger round -- then recomputes a larger share, and its decode error stays bounded). -1: no bound, the "
        "ratio alone decides; 0: every reused token is recomputed."
    )
    cost_check: bool = _option(
        True, "Blend a prefill chunk only where its estimated work (probe, kept and fresh tokens, attention, the "
        "restore) is below SGLang's own forward of the same chunk; elsewhere its matched blocks are computed "
        "(counted as cost_fallback_tokens in meta_info) (--no-tokendance-cost-check: blend wherever a block matches)."
    )
    planned_selection: bool = _option(
        True, "Under --chunked-prefill-size, a prompt's reused tokens to recompute are chosen once, over the whole "
        "prompt, at its first chunk that reads cached blocks (the probe runs on the later chunks' tokens too, over "
        "scratch KV); every chunk then recomputes its part without a probe (counted as planned_tokens in meta_info) "
        "(--no-tokendance-planned-selection: each chunk probes and selects its own share)."
    )

    round_window_ms: float = _option(
        50.0, "Longest time a round's requests are held for its missing members before they are admitted "
        "anyway (from the round's first arrival in the scheduler); requests without a round are never held."
    )
    round_min_shared: int = _option(
        1, "Infer rounds: a request without a `round` holding at least this many segments shared at a shift (held "
        "by another waiting prompt at another offset, or cached from another offset) joins the requests of the "
        "last --tokendance-round-window-ms sharing that many with it, held for that window, and its round is led "
        "like a named one; a request holding at least this many segments that an admitted request is still computing "
        "at another offset waits for that prefill, then reads them; a request sharing none is never held (0: rounds "
        "are only those clients name)."
    )
    round_leader: bool = _option(
        True, "A released round of two or more requests goes in two steps: its leader (the member holding the most "
        "of the round's blocks) is prefilled exactly, its blocks' KV -- computed after the messages that precede "
        "them in a round prompt -- replaces their Masters, then the others are admitted and read those "
        "(--no-tokendance-round-leader: every member reads the Masters as cached, all admitted at once)."
    )
    group_selection: str = _option(
        "per-request", "How a round group that shares a prefill batch selects the reused tokens to recompute: "
        "per-request (each request its own top share) or aligned (one kept set per segment two or more members "
        "read: offsets ranked by the members' mean score, the same offsets recomputed in every member)."
    )
    eviction: str = _option(
        "recency", "What the cache evicts first under memory pressure, among the tree's leaves and the Masters: "
        "recency (--radix-eviction-policy alone) or next-use (what no round will read soon: an item unread for "
        "three of its periods first, then the one whose next read -- its last read by a round plus the time between "
        "the rounds that read it -- is farthest; --radix-eviction-policy orders the rest). next-use is not the "
        "default: it has shown no gain yet (benchmark/results/memory_pressure.md)."
    )
    max_hint_seconds: float = _option(
        600.0, "Longest `pin_seconds` or `retain_seconds` a request may give (a longer one is refused with a 400): "
        "a client's hint on what a finished request's KV is worth -- pin (not evictable until then), retain "
        "(evicted after everything not retained) or release (evicted first)."
    )
    max_pinned_share: float = _option(
        0.25, "Share of the KV pool that requests' `pin_seconds` hints may hold at once, so one client cannot pin "
        "the pool; a pin past it is taken as a retain (hint_pins_clipped in /server_info). 0: every pin is a retain."
    )
    group_probe: int = _option(
        0, "With aligned group selection: only this many members of a round group probe each segment they share "
        "(the layers up to the check layer); the others adopt the group's choice and compute only their kept "
        "tokens there (0: every member probes)."
    )

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            expected = _TYPES[str(f.type)]
            if type(value) is not expected and not (expected is float and type(value) is int):
                raise TokenDanceArgsError(flag_of(f), f"expected {expected.__name__}, got {value!r}")
        if not any(c.isalnum() for c in self.separator) or self.separator != self.separator.strip():
            raise TokenDanceArgsError(
                "--tokendance-separator",
                f"{self.separator!r} must contain letters or digits and no surrounding whitespace",
            )
        for name, (low, high) in _RANGES.items():
            value = getattr(self, name)
            if not math.isfinite(value) or value < low or (high is not None and value > high):
                bounds = f">= {low:g}" if high is None else f"in [{low:g}, {high:g}]"
                raise TokenDanceArgsError(flag_of(_field(name)), f"must be {bounds}, got {value}")
        for name, choices in (("selection", SELECTION_RULES), ("selection_granularity", GRANULARITIES),
                              ("storage", STORAGES), ("group_selection", GROUP_SELECTIONS),
                              ("eviction", EVICTIONS)):
            if getattr(self, name) not in choices:
                raise TokenDanceArgsError(
                    flag_of(_field(name)), f"must be one of {', '.join(choices)}, got {getattr(self, name)!r}")
        if self.content_chunks > 0 and self.content_chunks & (self.content_chunks - 1):
            raise TokenDanceArgsError(flag_of(_field("content_chunks")),
                                      f"must be a power of two, 0 or -1, got {self.content_chunks}")
        if self.group_probe and self.group_selection != "aligned":
            raise TokenDanceArgsError(flag_of(_field("group_probe")), "members adopt their group's kept set, which "
                                      "needs --tokendance-group-selection aligned")

    # --- command line -------------------------------------------------------------------

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        group = parser.add_argument_group("TokenDance")
        for f in dataclasses.fields(TokenDanceArgs):
            if f.type in ("bool", bool) and f.default:
                group.add_argument(flag_of(f), dest=f.name, default=True, action=argparse.BooleanOptionalAction,
                                   help=f"{f.metadata['help']} (default: on)")
            elif f.type in ("bool", bool):
                group.add_argument(flag_of(f), dest=f.name, action="store_true", help=f.metadata["help"])
            else:
                group.add_argument(
                    flag_of(f), dest=f.name, default=f.default, metavar=f.name.upper(),
                    help=f"{f.metadata['help']} (default: {f.default})",
                )

    @classmethod
    def from_cli_args(cls, namespace: argparse.Namespace) -> "TokenDanceArgs":
        return cls.from_dict({f.name: getattr(namespace, f.name) for f in dataclasses.fields(cls)})

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "TokenDanceArgs":
        """Build from raw values (strings from a command line are converted), validating."""
        known = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise TokenDanceArgsError(unknown[0], f"unknown TokenDance option (known: {', '.join(known)})")
        return cls(**{name: _convert(known[name], value) for name, value in values.items()})

    @classmethod
    def split_kwargs(cls, kwargs: dict[str, Any]) -> tuple["TokenDanceArgs", dict[str, Any]]:
        """Engine(**kwargs): take `tokendance_*` / `disable_tokendance`, leave SGLang's."""
        by_kwarg = {kwarg_of(f): f.name for f in dataclasses.fields(cls)}
        ours, rest = {}, {}
        for key, value in kwargs.items():
            if key in by_kwarg:
                ours[by_kwarg[key]] = value
            elif key.startswith("tokendance_"):
                raise TokenDanceArgsError(key, f"unknown TokenDance option (known: {', '.join(by_kwarg)})")
            else:
                rest[key] = value
        return cls.from_dict(ours), rest

    # --- the route into spawned processes -------------------------------------------------

    def export_to_env(self) -> None:
        os.environ[ENV_VAR] = json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_env(cls) -> "TokenDanceArgs | None":
        raw = os.environ.get(ENV_VAR)
        return None if raw is None else cls.from_dict(json.loads(raw))

    @property
    def kv_enabled(self) -> bool:
        return not self.disable_tokendance

    @property
    def mirror_storage(self) -> bool:
        """Rows read Masters' slots in place, through the tokendance attention backend (`auto`
        is resolved by the launcher and Engine first: `with_storage_for`)."""
        return self.storage == "mirror"

    def with_storage_for(self, on_cpu: bool, get: Callable[[str], Any]) -> "TokenDanceArgs":
        """These options with `auto` storage resolved for a server whose SGLang arguments `get`
        returns by field name (None: not given): mirror on the CPU, where the tokendance
        attention backend runs SGLang's torch_native for the rows that read no Master at a
        shift, unless what is given asks for what mirror storage refuses (another attention
        backend, dense write-back, SGLang's KV events) or TokenDance is off; dense elsewhere
        (on a GPU the backend would replace FlashInfer/Triton and CUDA graphs)."""
        if self.storage != "auto":
            return self
        backends = {get(name) for name in ATTENTION_BACKEND_FIELDS} - {None, ATTENTION_BACKEND}
        mirror = on_cpu and self.kv_enabled and self.sparse_writeback and not backends and not get("kv_events_config")
        return dataclasses.replace(self, storage="mirror" if mirror else "dense")

    @property
    def chunk_rule(self) -> ChunkRule | None:
        """How unmarked /generate and /v1/completions prompts are cut into segments (None: they are not)."""
        spacing = self.content_chunks
        if spacing < 0:
            spacing = DEFAULT_CHUNK_SPACING if self.mirror_storage else 0
        if not spacing or not self.kv_enabled:
            return None
        return ChunkRule(min_tokens=self.min_segment_tokens, spacing=spacing, window=min(2, self.min_segment_tokens),
                         max_tokens=max(256, self.min_segment_tokens))

    @property
    def approximate_budget(self) -> int | None:
        """--tokendance-max-approximate-tokens, None for no bound."""
        return None if self.max_approximate_tokens < 0 else self.max_approximate_tokens

    def blend_options(self) -> BlendOptions:
        """The blended prefill's options (core/blend.py) from these flags."""
        return BlendOptions(recompute_ratio=self.recompute_ratio, check_layer=self.check_layer,
                            block_head_tokens=self.block_head_tokens, granularity=self.selection_granularity,
                            block_size=self.block_size, sparse_writeback=self.sparse_writeback,
                            screen_layer=self.screen_layer, screen_factor=self.screen_factor,
                            group_selection=self.group_selection, group_probe=self.group_probe)


# KV-cache dtypes stored as plain floats: a restore copies them like any tensor. Quantised
# ones (fp8, fp4, ...) carry per-pool scales that a restore would bypass.
PLAIN_KV_CACHE_DTYPES = ("auto", "bfloat16", "bf16", "float16", "fp16", "half", "float32", "fp32", "float")


def check_server_args(args: TokenDanceArgs, server_args: Any) -> None:
    """Refuse, with one line naming the flag, every SGLang configuration the blended prefill
    does not handle. `server_args` is SGLang's ServerArgs or any object with its field names
    (absent fields take SGLang's defaults). Per-request features it does not handle (LoRA
    adapters, input embeddings, input-token logprobs) are not refused: those requests take
    SGLang's own forward. Hidden-state outputs are: SGLang serves them only under a server-wide
    mode in which every forward captures them."""
    get = lambda name, default=None: getattr(server_args, name, default)  # noqa: E731
    _check_storage(args, get)
    if not args.kv_enabled:
        return
    hint = "; or pass --disable-tokendance"
    for flag, name in (("--tp-size", "tp_size"), ("--pp-size", "pp_size")):
        if (get(name) or 1) > 1:
            raise TokenDanceArgsError(flag, f"TokenDance's blended prefill runs on one rank (its selection of "
                                            f"the tokens to recompute would differ per rank), got {get(name)}{hint}")
    if (get("dp_size") or 1) > 1:
        raise TokenDanceArgsError("--dp-size", f"each data-parallel rank would hold its own segments and a round's "
                                  f"requests would scatter over the ranks, got {get('dp_size')}; run one server per "
                                  "rank behind SGLang's router (python -m sglang_router.launch_router --policy manual, "
                                  f"one routing key per simulation){hint}")
    if get("speculative_algorithm") is not None:
        raise TokenDanceArgsError("--speculative-algorithm", "speculative decoding is not supported with "
                                                             f"TokenDance's segment reuse{hint}")
    for flag, name in (("--enable-return-hidden-states", "enable_return_hidden_states"),
                       ("--enable-return-aux-hidden-states", "enable_return_aux_hidden_states"),
                       ("--return-hidden-states-mode", "return_hidden_states_mode")):
        if get(name):
            raise TokenDanceArgsError(flag, "it makes every forward capture hidden states, which the blended "
                                            "prefill does not compute for the tokens it reuses: no request would "
                                            f"reuse{hint}")
    if str(get("kv_cache_dtype", "auto")).lower() not in PLAIN_KV_CACHE_DTYPES:
        raise TokenDanceArgsError("--kv-cache-dtype", f"{get('kv_cache_dtype')} is a quantised KV cache whose scales "
                                                      f"a segment restore would bypass; use auto{hint}")
    if (get("page_size") or 1) != 1:
        raise TokenDanceArgsError("--page-size", f"segments are reused token by token, so the KV pool needs page "
                                                 f"size 1, got {get('page_size')}{hint}")
    if get("disable_radix_cache"):
        raise TokenDanceArgsError("--disable-radix-cache", "TokenDance's segments are cached beside SGLang's "
                                  "radix tree and evicted with it; with the radix cache off nothing would ever free "
                                  f"them{hint}")
    if get("radix_eviction_policy") == "tlru":
        raise TokenDanceArgsError("--radix-eviction-policy", f"tlru needs SGLang's unified radix tree; the segment "
                                                             f"forest builds on its Python radix tree{hint}")
    if str(get("device") or "cuda") != "cpu" and not get("disable_overlap_schedule"):
        raise TokenDanceArgsError("--disable-overlap-schedule", "the overlap scheduler copies and re-points segment "
                                  "KV on its own stream while the previous batch's forward may still write it"
                                  f"{hint}")
    if str(get("device") or "cuda") != "cpu" and _graphs_on(get, "prefill"):
        raise TokenDanceArgsError("--disable-prefill-cuda-graph", "prefill CUDA graphs would replay SGLang's own "
                                  "forward instead of the blended prefill (--cuda-graph-backend-prefill and "
                                  f"--cuda-graph-config must leave them disabled too){hint}")


def _graphs_on(get: Callable[..., Any], phase: str) -> bool:
    """Whether SGLang captures CUDA graphs for `phase` ("prefill", "decode"), with SGLang
    0.5.23's precedence: its resolved config, else --cuda-graph-config, then
    --cuda-graph-backend-<phase>, then the disable flags."""
    config = get("cuda_graph_config")
    if hasattr(config, phase):  # resolved by SGLang: every flag applied
        return getattr(config, phase).backend != "disabled"
    explicit = config.get(phase) if isinstance(config, dict) else None
    if isinstance(explicit, dict) and "backend" in explicit:
        return explicit["backend"] != "disabled"
    backend = get(f"cuda_graph_backend_{phase}")
    if backend is not None:
        return backend != "disabled"
    return not (get("disable_cuda_graph") or get(f"disable_{phase}_cuda_graph"))


ATTENTION_BACKEND_FIELDS = ("attention_backend", "prefill_attention_backend", "decode_attention_backend")
STORAGE_DEPENDS_ON = (*ATTENTION_BACKEND_FIELDS, "kv_events_config")  # the SGLang arguments `auto` storage reads


def _check_storage(args: TokenDanceArgs, get: Callable[..., Any]) -> None:
    """The storage and the attention backend must agree: only the tokendance backend reads slots
    at a shift (Masters read in place), and only mirror storage records the frames it needs."""
    chosen = {name: get(name) for name in ATTENTION_BACKEND_FIELDS if get(name) is not None}
    flag = lambda name: "--" + name.replace("_", "-")  # noqa: E731
    if not args.mirror_storage:
        if args.diff_threshold > 0:
            raise TokenDanceArgsError("--tokendance-diff-threshold", "only mirror storage keeps a recomputed token's "
                                      "KV as a diff against its Master; it needs --tokendance-storage mirror")
        for name, value in chosen.items():
            if value == ATTENTION_BACKEND:
                raise TokenDanceArgsError(flag(name), f"the {ATTENTION_BACKEND} attention backend reads Masters in "
                                                      "place at a shift; it needs --tokendance-storage mirror")
        return
    if not args.kv_enabled:
        raise TokenDanceArgsError("--tokendance-storage", "mirror storage is part of TokenDance's KV machinery, "
                                                          "which --disable-tokendance switches off")
    if not args.sparse_writeback:
        raise TokenDanceArgsError("--no-tokendance-sparse-writeback", "under mirror storage the tokens not "
                                  "recomputed read the shared Master's slots, which the probe's KV must not "
                                  "overwrite: mirror storage needs sparse write-back")
    for name, value in chosen.items():
        if value != ATTENTION_BACKEND:
            raise TokenDanceArgsError(flag(name), f"mirror storage reads Masters' slots in place at a shift, which "
                                                  f"only the {ATTENTION_BACKEND} attention backend does; got {value}")
    if str(get("device") or "cuda") != "cpu" and (_graphs_on(get, "decode") or _graphs_on(get, "prefill")):
        raise TokenDanceArgsError("--disable-cuda-graph", f"the {ATTENTION_BACKEND} attention backend (mirror "
                                  "storage) runs without CUDA graphs (--cuda-graph-backend-* and "
                                  "--cuda-graph-config must leave them disabled too)")
    if get("kv_events_config"):
        raise TokenDanceArgsError("--kv-events-config", "mirror storage keeps an agent's row in SGLang's tree under "
                                  "a namespace no client can send, which SGLang's KV events cannot hash; use "
                                  "dense storage with KV events")


def tokendance_info(args: TokenDanceArgs) -> dict[str, Any]:
    """What /server_info reports under "tokendance": clients detect TokenDance by it."""
    from sglang_tokendance import __version__

    return {"version": __version__, **dataclasses.asdict(args)}


_TYPES = {"bool": bool, "int": int, "float": float, "str": str}
_RANGES = {  # field -> (lowest, highest or None) allowed value
    "max_hint_seconds": (1e-3, None), "max_pinned_share": (0, 1),
    "min_segment_tokens": (1, None), "content_chunks": (-1, None),
    "max_segments": (1, None), "check_layer": (1, None), "block_size": (1, None),
    "block_head_tokens": (0, None), "screen_layer": (0, None), "screen_factor": (1, None), "recompute_ratio": (0, 1),
    "max_approximate_tokens": (-1, None), "diff_threshold": (0, None),
    "round_window_ms": (0, 60_000), "round_min_shared": (0, None), "group_probe": (0, None),
}


def _field(name: str) -> dataclasses.Field:
    return next(f for f in dataclasses.fields(TokenDanceArgs) if f.name == name)


def flag_of(f: dataclasses.Field) -> str:
    return f.metadata.get("flag") or "--tokendance-" + f.name.replace("_", "-")


def kwarg_of(f: dataclasses.Field) -> str:
    """The Engine keyword of an option: its flag without dashes (`tokendance_separator`)."""
    return flag_of(f).lstrip("-").replace("-", "_")


def _convert(f: dataclasses.Field, value: Any) -> Any:
    kind = _TYPES[str(f.type)]
    if kind in (bool, str) or not isinstance(value, str):
        return value
    try:
        return kind(value)
    except ValueError:
        raise TokenDanceArgsError(flag_of(f), f"expected {kind.__name__}, got {value!r}") from None


def options_markdown() -> str:
    """The options table of docs/options.md, generated from this dataclass (a test keeps the
    committed file equal to it): `python -m sglang_tokendance.server_args > docs/options.md`."""
    rows = ["# TokenDance options", "",
            "Generated from `TokenDanceArgs` (`python/sglang_tokendance/server_args.py`) by",
            "`python -m sglang_tokendance.server_args > docs/options.md`; do not edit by hand.",
            "Every flag is also an `Engine` keyword (`--tokendance-recompute-ratio` -> "
            "`tokendance_recompute_ratio`).", "",
            "| flag | type | default | meaning |", "|---|---|---|---|"]
    for f in dataclasses.fields(TokenDanceArgs):
        default = f.default
        shown = ("on (`--no-" + flag_of(f)[2:] + "` turns it off)" if default is True
                 else "off" if default is False else f"`{default}`")
        cells = (f"`{flag_of(f)}`", str(f.type), shown, f.metadata["help"])
        rows.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(options_markdown(), end="")
