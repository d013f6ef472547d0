"""The round-aware prompt interface inside SGLang's tokenizer manager (HookRegistry hooks).

* /generate, /v1/completions and Engine: text holding separators, or the explicit
  `segments` field of /generate, becomes input_ids tokenised segment by segment
  (core/segments). Plain prompts take SGLang's own path and ids; once SGLang has tokenised
  one, its content-defined chunks (core/content_chunks) are its segments
  (--tokendance-content-chunks), so text shared at any offset is found without markers.
* /v1/chat/completions: each message long enough to be a segment is one (found, tokenised
  alone, in SGLang's own ids of the rendered template; the template's text stays private),
  and the answer is registered as a segment (`register_output`) for the next turns that quote
  it (--no-tokendance-chat-segments: marked text only). A long message but an assistant's
  (a transcript pasted into one message) is cut into its content-defined chunks, as a plain
  prompt is. When a message holds a separator, the template renders the chat to text
  (SGLang's own render step, markers intact) and the text is sent on instead of SGLang's ids,
  so the markers alone split it, as in a plain prompt.
* The client's options come from its `tokendance` field, or as JSON text in the string map a
  router passes on (`custom_labels` on /generate, `metadata` on OpenAI requests; srt/request).
* Offsets and hashes ride to the scheduler inside `sampling_params.custom_params` under a key
  that is always stripped from client input first, so clients can never supply them.
* Every /generate response gets `meta_info["tokendance"]`; non-streaming OpenAI responses
  get it as `metadata["tokendance"]` (the first prompt's, for a batch).
Bad input raises ValueError, which SGLang answers with HTTP 400; streaming /generate
requests are checked earlier, at SGLang's contract gate, so they get a real 400 too.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any, Sequence

from sglang_tokendance.core.content_chunks import ChunkRule
from sglang_tokendance.core.segments import Piece, SegmentError, Segmenter
from sglang_tokendance.served_model import model_salt_from_env
from sglang_tokendance.server_args import TokenDanceArgs
from sglang_tokendance.srt.request import CARRIER_KEY, RequestOptions, client_options, strip_router_carrier

REUSE_INFO_KEY = "tokendance_reuse"  # scheduler -> meta_info: reused / computed token counts
TOKENIZER_MANAGER = "sglang.srt.managers.tokenizer_manager.TokenizerManager"
SERVING_CHAT = "sglang.srt.entrypoints.openai.serving_chat.OpenAIServingChat"


def register(args: TokenDanceArgs) -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    rule = args.chunk_rule

    def generate_request(original, self, obj, request=None, *rest, **kw):
        return _generate_request(original, args, rule, self, obj, request, *rest, **kw)

    def validate_prompt(original, self, obj, input_ids, *rest, **kw):
        result = refuse_unservable_prompt(original, self, obj, input_ids, *rest, **kw)
        if rule is not None:
            cut_content_chunks(obj, input_ids, segmenter_of(self, args), rule)
        return result

    def contract_error(result, body, *rest, **kw):
        return result if result is not None else _streaming_contract_error(args, body)

    def render_marked_chat(original, serving_chat, messages, *rest, **kw):
        return render_marked_chat_as_text(original, args, serving_chat, messages, *rest, **kw)

    HookRegistry.register(f"{TOKENIZER_MANAGER}.generate_request", generate_request, HookType.AROUND)
    HookRegistry.register(f"{TOKENIZER_MANAGER}._wait_one_response", _wait_one_response, HookType.AROUND)
    HookRegistry.register(f"{TOKENIZER_MANAGER}._validate_one_request", validate_prompt, HookType.AROUND)
    HookRegistry.register(f"{SERVING_CHAT}._render_and_encode_chat_template", render_marked_chat, HookType.AROUND)
    HookRegistry.register(f"{SERVING_CHAT}._append_assistant_prefix_to_prompt_ids", _append_prefix_to_text,
                          HookType.AROUND)
    HookRegistry.register(
        "sglang.srt.entrypoints.api_contract.generate_contract_error", contract_error, HookType.AFTER
    )
    HookRegistry.register(
        "sglang.srt.utils.weight_versions.build_endpoint_weight_version_metadata",
        _openai_metadata, HookType.AFTER,
    )


# --- the segmenter of one tokenizer manager ---------------------------------------------


def segmenter_of(tokenizer_manager, args: TokenDanceArgs) -> Segmenter:
    segmenter = getattr(tokenizer_manager, "_tokendance_segmenter", None)
    if segmenter is None:
        tokenizer = tokenizer_manager.tokenizer
        segmenter = Segmenter(
            tokenizer,
            model_salt=model_salt_from_env(),
            vocab_size=tokenizer_manager.model_config.vocab_size,
            separator=args.separator,
            min_segment_tokens=args.min_segment_tokens,
            max_segments=args.max_segments,
            special_tokens=special_token_strings(tokenizer),
        )
        tokenizer_manager._tokendance_segmenter = segmenter
    return segmenter


def special_token_strings(tokenizer) -> list[str]:
    """Every special/added token a separator must not cut through."""
    tokens = set(getattr(tokenizer, "all_special_tokens", []))
    for added in getattr(tokenizer, "added_tokens_decoder", {}).values():
        if getattr(added, "special", False):
            tokens.add(str(added))
    return sorted(tokens)


# --- requests ---------------------------------------------------------------------------


async def _generate_request(original, args, rule: ChunkRule | None, tokenizer_manager, obj, request, *rest, **kw):
    from sglang.srt.managers.io_struct import GenerateReqInput

    if isinstance(obj, GenerateReqInput):
        body = None
        if request is not None and request.url.path.endswith(("/generate", "/completions")):
            body = await request.json()
        segments = body.get("segments") if isinstance(body, dict) and request.url.path.endswith("/generate") else None
        chat = request is not None and request.url.path.endswith("/chat/completions")
        try:
            options = RequestOptions.from_client(client_options(body), args.mirror_storage, args.max_hint_seconds)
            strip_router_carrier(obj)
            apply_segments(obj, segments_field=segments, from_chat=chat,
                           segmenter=segmenter_of(tokenizer_manager, args), options=options,
                           messages=chat_message_texts(body) if chat and args.chat_segments and args.kv_enabled else (),
                           chunks=None if _multimodal(obj) else rule)
        except SegmentError as e:
            raise ValueError(str(e)) from None
    async for out in original(tokenizer_manager, obj, request, *rest, **kw):
        yield out


def apply_segments(obj, *, segments_field, from_chat: bool, segmenter: Segmenter,
                   options: RequestOptions = RequestOptions(), messages: Sequence[tuple[str, str]] = (),
                   chunks: ChunkRule | None = None) -> None:
    """Rewrite a GenerateReqInput in place: segmented prompts become ids + carried spans.

    Chat prompts are rendered templates, which SGLang encodes without added special tokens;
    an unmarked one keeps SGLang's ids, its `messages` ((role, text) pairs) found in them as
    segments, each long one but an assistant's cut into its content-defined `chunks`
    (`Segmenter.find_texts`), and registers its answer (n = 1): a framework appending it to
    the history reuses it. Other unmarked prompts keep SGLang's path; with `chunks`, each is
    marked to be cut into content-defined chunks once SGLang has its ids (`cut_content_chunks`).
    `options` (the client's, validated) ride along to the scheduler with every prompt.
    """
    strip_client_carrier(obj)
    texts = obj.text
    if segments_field is not None:
        if texts is not None or obj.input_ids is not None:
            raise SegmentError("`segments` cannot be combined with `text` or `input_ids`")
        prompts = _segments_as_prompts(segments_field)
        batched = _is_batch_of_pieces(segments_field)
    else:
        batched = isinstance(texts, list)
        items = texts if batched else [texts]
        if texts is None or not any(isinstance(t, str) and segmenter.has_marker(t) for t in items):
            if messages and texts is None and _batch_size(obj) is None and isinstance(obj.input_ids, list):
                assistant = {i for i, (role, _) in enumerate(messages) if role == "assistant"}
                found = segmenter.find_texts(obj.input_ids, [text for _, text in messages], chunks, assistant).spans
                single = (obj.sampling_params or {}).get("n") in (None, 1)
                cut = any(a.end == b.start for a, b in zip(found, found[1:]))  # the template parts messages
                _carry(obj, [replace(options.with_spans(found), register_output=options.register_output or single,
                                     content_chunks=cut)], False)
                return
            if chunks is not None and not from_chat:
                options = replace(options, find_chunks=True)
            if options != RequestOptions():  # a plain prompt keeps SGLang's own path; only the options ride along
                count = _batch_size(obj)
                _carry(obj, [options] * (count or 1), count is not None)
            return
        if obj.input_ids is not None:
            raise SegmentError("separators in `text` cannot be combined with `input_ids`")
        prompts = [segmenter.split_text(t) for t in items]
    results = [segmenter.from_pieces(p, add_special_tokens=not from_chat) for p in prompts]
    obj.text = None
    obj.input_ids = [r.input_ids for r in results] if batched else results[0].input_ids
    _carry(obj, [options.with_spans(r.spans) for r in results], batched)


def cut_content_chunks(obj, input_ids: Sequence[int], segmenter: Segmenter, rule: ChunkRule) -> None:
    """After SGLang tokenised a prompt marked `find_chunks`: its content-defined chunks become
    its carried segments (in its own sampling_params copy, made by `_carry`)."""
    params = obj.sampling_params
    custom = params.get("custom_params") if isinstance(params, dict) else None
    options = RequestOptions.carried_by(custom)
    if options.find_chunks and input_ids is not None:
        spans = segmenter.content_chunks(input_ids, rule).spans
        custom[CARRIER_KEY] = json.dumps(replace(options, spans=spans, find_chunks=False,
                                                 content_chunks=True).payload())


def _multimodal(obj) -> bool:
    """Image, video or audio placeholders stand for content their ids do not hold."""
    return any(getattr(obj, field, None) is not None for field in ("image_data", "video_data", "audio_data",
                                                                    "input_embeds"))


def chat_message_texts(body: Any) -> list[tuple[str, str]]:
    """(role, text) of each message of a chat request, in order (a string content, or the
    text parts of a list of parts)."""
    messages = body.get("messages") if isinstance(body, dict) else None
    texts: list[tuple[str, str]] = []
    for message in messages if isinstance(messages, list) else ():
        content = message.get("content") if isinstance(message, dict) else None
        role = message.get("role") if isinstance(message, dict) else None
        parts = [content] if isinstance(content, str) else content if isinstance(content, list) else []
        texts.extend((role, p if isinstance(p, str) else p.get("text")) for p in parts
                     if isinstance(p, str) or (isinstance(p, dict) and isinstance(p.get("text"), str)))
    return texts


def strip_client_carrier(obj) -> None:
    params = obj.sampling_params
    for p in params if isinstance(params, list) else [params]:
        if isinstance(p, dict) and isinstance(p.get("custom_params"), dict):
            p["custom_params"].pop(CARRIER_KEY, None)


def _is_batch_of_pieces(value: Any) -> bool:
    """[[pieces of prompt 1], [pieces of prompt 2]] vs [piece, piece] (a piece is a str or
    a list of ints, so a list holding a str or a list is a prompt, not a piece)."""
    return (
        isinstance(value, list) and bool(value)
        and all(isinstance(item, list) for item in value)
        and any(isinstance(p, (str, list)) for item in value for p in item)
    )


def _batch_size(obj) -> int | None:
    """The prompts of a batched request (a list of texts, or of token-id lists, as SGLang
    reads them), None for one prompt."""
    if isinstance(obj.text, list):
        return len(obj.text)
    ids = obj.input_ids
    if obj.text is None and isinstance(ids, list) and ids and isinstance(ids[0], list):
        return len(ids)
    return None


def _segments_as_prompts(value: Any) -> list[list[Piece]]:
    if not isinstance(value, list) or not value:
        raise SegmentError("`segments` must be a non-empty list of strings or token-id lists")
    return value if _is_batch_of_pieces(value) else [value]


def _carry(obj, options: list[RequestOptions], batched: bool) -> None:
    """Put each prompt's options in its own sampling_params copy (SGLang shares one dict)."""
    params = obj.sampling_params
    base = params if isinstance(params, list) else [params] * len(options)
    carried = []
    for p, prompt_options in zip(base, options):
        p = dict(p or {})
        custom = p.get("custom_params") or {}
        if not isinstance(custom, dict):
            raise SegmentError(f"`sampling_params.custom_params` must be an object (TokenDance carries a request's "
                               f"options in it), got {type(custom).__name__}")
        n = p.get("n")
        if isinstance(n, int) and n > 1 and (prompt_options.round or prompt_options.agent
                                             or prompt_options.register_output):
            raise SegmentError("`round`, `agent` and `register_output` need n = 1: parallel sampling sends a "
                               "prompt n + 1 times (a warm-up, then each sample)")
        p["custom_params"] = {**custom, CARRIER_KEY: json.dumps(prompt_options.payload())}
        carried.append(p)
    obj.sampling_params = carried if batched else carried[0]


def carried_info(obj) -> dict:
    """meta_info["tokendance"] of one request (empty segments for plain prompts)."""
    params = obj.sampling_params
    custom = params.get("custom_params") if isinstance(params, dict) else None
    return RequestOptions.carried_by(custom).payload()


def _wait_one_response(original, self, obj, request=None, *rest, **kw):
    responses = original(self, obj, request, *rest, **kw)
    info = carried_info(obj)

    async def with_tokendance_info():
        async for out in responses:
            meta = out.get("meta_info") if isinstance(out, dict) else None
            if isinstance(meta, dict):
                reuse = meta.pop(REUSE_INFO_KEY, None)
                meta["tokendance"] = {**info, **reuse[0]} if reuse else info
            yield out

    return with_tokendance_info()


def refuse_unservable_prompt(original, tokenizer_manager, obj, input_ids, *rest, **kw):
    """AROUND SGLang's per-request validation: a prompt of no tokens (empty text on a
    tokenizer without BOS, `"input_ids": []`) or holding a token id outside the vocabulary is a
    400. SGLang 0.5.23 checks neither, and its forward over such a batch raises in the
    scheduler, which takes the server down with every request in it."""
    if input_ids is not None and getattr(obj, "input_embeds", None) is None:
        if len(input_ids) == 0:
            raise ValueError("the prompt is empty: it has no tokens")
        vocab_size = tokenizer_manager.model_config.vocab_size
        bad = next((t for t in input_ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise ValueError(f"token id {bad} is outside the vocabulary [0, {vocab_size})")
    return original(tokenizer_manager, obj, input_ids, *rest, **kw)


def _openai_metadata(result: dict, meta_info: dict, *rest, **kw) -> dict:
    """Non-streaming OpenAI responses show the (first) prompt's segments in `metadata`."""
    if "tokendance" in meta_info:
        return {**result, "tokendance": meta_info["tokendance"]}
    return result


def render_marked_chat_as_text(original, args: TokenDanceArgs, serving_chat, messages: list[dict], *rest, **kw):
    """AROUND SGLang's chat render-and-encode step: a chat whose messages hold separators is
    rendered by the template to text, markers intact, and goes on as text, so that it is
    tokenised segment by segment like any marked prompt (SGLang's own encode of the same
    rendered text, piece by piece; no decode of ids). Other chats are SGLang's."""
    tokenizer_manager = serving_chat.tokenizer_manager
    segmenter = segmenter_of(tokenizer_manager, args)
    if not any(segmenter.has_marker(str(m.get("content") or "")) for m in messages):
        return original(serving_chat, messages, *rest, **kw)
    if serving_chat._prompt_text_round_trip_is_lossy:
        raise ValueError("separators in chat messages need a chat template whose rendered text encodes back to "
                         "its ids, and this tokenizer's does not")
    text = tokenizer_manager.tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=kw.get("add_generation_prompt", True),
        tools=kw.get("tools"), return_dict=False, **(kw.get("template_kwargs") or {}))
    return text, None


def _append_prefix_to_text(original, serving_chat, prompt, assistant_prefix: str, *rest, **kw):
    """continue_final_message on a marked chat: its prompt is text, so the prefix is text too."""
    if isinstance(prompt, str):
        return prompt + assistant_prefix
    return original(serving_chat, prompt, assistant_prefix, *rest, **kw)


def _streaming_contract_error(args: TokenDanceArgs, body: Any) -> str | None:
    """Check a streaming /generate body before its 200 stream starts."""
    if not isinstance(body, dict) or not body.get("stream"):
        return None
    from types import SimpleNamespace

    from sglang.srt.entrypoints.http_server import _global_state

    obj = SimpleNamespace(text=body.get("text"), input_ids=body.get("input_ids"),
                          sampling_params=json.loads(json.dumps(body.get("sampling_params"))))
    try:
        apply_segments(obj, segments_field=body.get("segments"), from_chat=False,
                       segmenter=segmenter_of(_global_state.tokenizer_manager, args),
                       options=RequestOptions.from_client(client_options(body), args.mirror_storage,
                                                          args.max_hint_seconds))
    except SegmentError as e:
        return str(e)
    return None
