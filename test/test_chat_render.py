"""A marked chat is rendered by the template to text and tokenised piece by piece: no
decode of SGLang's ids in between (a decode is not guaranteed to give the same text back)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from sglang_tokendance.core.segments import DEFAULT_SEPARATOR as SEP
from sglang_tokendance.server_args import TokenDanceArgs


class NoDecode:
    """The server's tokenizer, except that decoding fails: a decode of ids is not guaranteed
    to give the rendered text back, so a marked chat must never go through one."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)

    def __len__(self) -> int:
        return len(self.tokenizer)

    def decode(self, *args, **kwargs):
        raise AssertionError("a marked chat was decoded")


@pytest.fixture()
def serving_chat(smollm2_path, monkeypatch):
    from transformers import AutoTokenizer

    from sglang_tokendance.served_model import SALT_ENV

    monkeypatch.setenv(SALT_ENV, "00" * 32)
    tokenizer = NoDecode(AutoTokenizer.from_pretrained(smollm2_path))
    manager = SimpleNamespace(tokenizer=tokenizer, model_config=SimpleNamespace(vocab_size=len(tokenizer)))
    return SimpleNamespace(tokenizer_manager=manager, _prompt_text_round_trip_is_lossy=False)


def render(serving_chat, messages, **kw):
    from sglang_tokendance.srt.prompt_interface import render_marked_chat_as_text

    def sglangs_own(*args, **kwargs):
        return "sglang's ids", None

    return render_marked_chat_as_text(sglangs_own, TokenDanceArgs(), serving_chat, messages,
                                      tools=None, template_kwargs={}, encode_kwargs={}, use_cache=False, **kw)


def test_marked_chat_goes_on_as_the_templates_own_text(serving_chat):
    tokenizer = serving_chat.tokenizer_manager.tokenizer
    messages = [{"role": "user", "content": f"News , first:{SEP}Tom , the miller , says the road is shut.{SEP}Why ?"}]
    text, decoded = render(serving_chat, messages)
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == rendered and decoded is None
    no_prompt, _ = render(serving_chat, messages, add_generation_prompt=False)
    assert not no_prompt.endswith("assistant\n")


def test_plain_chat_keeps_sglangs_path_and_lossy_templates_refuse_markers(serving_chat):
    assert render(serving_chat, [{"role": "user", "content": "Hello , there"}]) == ("sglang's ids", None)
    serving_chat._prompt_text_round_trip_is_lossy = True
    with pytest.raises(ValueError, match="separators in chat messages"):
        render(serving_chat, [{"role": "user", "content": f"a{SEP}b"}])


def test_continue_final_message_appends_the_prefix_as_text():
    from sglang_tokendance.srt.prompt_interface import _append_prefix_to_text

    assert _append_prefix_to_text(None, None, "rendered", " Sure,") == "rendered Sure,"
    assert _append_prefix_to_text(lambda chat, ids, prefix: ids + [7], None, [1, 2], "x") == [1, 2, 7]


def test_an_unmarked_chats_messages_are_found_in_sglangs_ids_and_its_answer_registered(serving_chat):
    """No markers: SGLang's ids stay; each message long enough is a segment; the template's text
    is private; the answer is registered (n = 1). Without messages (--no-tokendance-chat-segments,
    or --disable-tokendance) the request is SGLang's alone."""
    from sglang_tokendance.srt.prompt_interface import apply_segments, chat_message_texts, segmenter_of
    from sglang_tokendance.srt.request import RequestOptions

    tokenizer = serving_chat.tokenizer_manager.tokenizer
    body = {"messages": [{"role": "system", "content": "You are Mira, the baker of Oakvale, who sold rye bread "
                                                      "to the mayor yesterday morning."},
                         {"role": "user", "content": [{"type": "text", "text": "Hi."}]},
                         {"role": "user", "content": "Tom: The river flooded the old mill last night, so the north "
                                                     "road is closed until Friday."}]}
    ids = list(tokenizer.apply_chat_template(body["messages"][:1] + body["messages"][2:], tokenize=True,
                                             add_generation_prompt=True, return_dict=False))
    segmenter = segmenter_of(serving_chat.tokenizer_manager, TokenDanceArgs())
    texts = chat_message_texts(body)
    assert texts[1] == ("user", "Hi.") and len(texts) == 3

    def request(n=None):
        return SimpleNamespace(text=None, input_ids=list(ids), sampling_params={"max_new_tokens": 4, "n": n})

    obj = request()
    apply_segments(obj, segments_field=None, from_chat=True, segmenter=segmenter, messages=texts)
    carried = RequestOptions.carried_by(obj.sampling_params["custom_params"])
    assert obj.input_ids == ids and carried.register_output
    assert [tokenizer.tokenizer.decode(ids[s.start:s.end]) for s in carried.spans] == [texts[0][1], texts[2][1]]
    sampled = request(n=2)
    apply_segments(sampled, segments_field=None, from_chat=True, segmenter=segmenter, messages=texts)
    assert not RequestOptions.carried_by(sampled.sampling_params["custom_params"]).register_output
    plain = request()
    apply_segments(plain, segments_field=None, from_chat=True, segmenter=segmenter, messages=())
    assert "custom_params" not in plain.sampling_params and plain.input_ids == ids


def test_an_unmarked_plain_prompt_gets_its_content_chunks_once_sglang_has_its_ids(serving_chat):
    """/generate and /v1/completions without markers keep SGLang's path; each prompt of a batch
    is marked `find_chunks` in its own sampling params, and SGLang's ids, once known, are cut
    into content-defined chunks that become its spans. Off (`chunk_rule` None): nothing rides."""
    from sglang_tokendance.srt.prompt_interface import apply_segments, cut_content_chunks, segmenter_of
    from sglang_tokendance.srt.request import RequestOptions

    tokenizer = serving_chat.tokenizer_manager.tokenizer
    args = TokenDanceArgs(storage="mirror")
    segmenter = segmenter_of(serving_chat.tokenizer_manager, args)
    shared = " ".join(f"On day {d} the ferry to the island left at {d + 6} in the morning." for d in range(8))
    texts = [f"You are Mira the baker. {shared} What now?", f"Tom, the miller, speaks first today. {shared} Go."]
    obj = SimpleNamespace(text=list(texts), input_ids=None, sampling_params={"max_new_tokens": 4})
    apply_segments(obj, segments_field=None, from_chat=False, segmenter=segmenter, chunks=args.chunk_rule)
    assert obj.text == texts and obj.input_ids is None  # SGLang tokenises them, as for any plain prompt
    spans = []
    for text, params in zip(texts, obj.sampling_params):
        ids = tokenizer.tokenizer(text)["input_ids"]  # as SGLang tokenises a plain prompt
        assert RequestOptions.carried_by(params["custom_params"]).find_chunks
        cut_content_chunks(SimpleNamespace(sampling_params=params), ids, segmenter, args.chunk_rule)
        carried = RequestOptions.carried_by(params["custom_params"])
        assert not carried.find_chunks and carried.spans
        assert carried.spans == segmenter.content_chunks(ids, args.chunk_rule).spans
        spans.append({span.hash for span in carried.spans})
    assert spans[0] & spans[1]  # the shared text's chunks have the same hashes at both offsets
    assert TokenDanceArgs(storage="dense").chunk_rule is None and TokenDanceArgs(content_chunks=0).chunk_rule is None
    assert TokenDanceArgs(storage="dense", content_chunks=16).chunk_rule.spacing == 16
    plain = SimpleNamespace(text=texts[0], input_ids=None, sampling_params={"max_new_tokens": 4})
    apply_segments(plain, segments_field=None, from_chat=False, segmenter=segmenter)
    assert "custom_params" not in plain.sampling_params


def test_a_transcript_in_one_chat_message_is_cut_into_content_chunks_but_an_answer_stays_whole(serving_chat):
    """A long user message (a transcript pasted into one message) is cut into content-defined
    chunks: two agents whose messages hold the same turns after different openings share most
    of them. An assistant message (an earlier answer, registered whole) and a message shorter
    than two chunks stay one segment; without a chunk rule (dense storage) nothing is cut."""
    from sglang_tokendance.srt.prompt_interface import apply_segments, chat_message_texts, segmenter_of
    from sglang_tokendance.srt.request import RequestOptions

    tokenizer = serving_chat.tokenizer_manager.tokenizer
    args = TokenDanceArgs(storage="mirror")
    segmenter = segmenter_of(serving_chat.tokenizer_manager, args)
    turns = "\n".join(f"{name}: On day {d} the ferry to the island left at {d + 6} and the {name.lower()} "
                       f"counted {3 * d + 2} crates of apples on the pier." for d, name in
                       enumerate(["Mira", "Tom", "Oskar", "Ada", "Bram", "Lena"]))
    answer = ("Mira: The bakery has flour for four more days, and the mill wheel must be mended before the rye "
              "harvest comes in next week, or the whole village will be short of bread by the festival. Oskar "
              "can mend it if the smith lends him iron bands; the council should pay him in grain.")

    def spans_of(opening: str, messages_after: list[dict]):
        messages = [{"role": "system", "content": f"You are {opening}, who lives in Oakvale."},
                    {"role": "user", "content": f"{opening} reads the log of the day. {turns} What now?"},
                    *messages_after]
        body = {"messages": messages}
        ids = list(tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                                 return_dict=False))
        obj = SimpleNamespace(text=None, input_ids=list(ids), sampling_params={"max_new_tokens": 4})
        apply_segments(obj, segments_field=None, from_chat=True, segmenter=segmenter,
                       messages=chat_message_texts(body), chunks=args.chunk_rule)
        return ids, RequestOptions.carried_by(obj.sampling_params["custom_params"])

    ids_a, a = spans_of("Tom, the miller", [{"role": "assistant", "content": answer}])
    ids_b, b = spans_of("Bram, the ferryman", [{"role": "user", "content": answer}])
    assert a.content_chunks and b.content_chunks and len(a.spans) > 3
    shared = {s.hash for s in a.spans} & {s.hash for s in b.spans}
    turn_tokens = len(tokenizer.encode(turns, add_special_tokens=False))
    assert sum(s.end - s.start for s in b.spans if s.hash in shared) > 0.6 * turn_tokens
    answer_ids = tokenizer.encode(answer, add_special_tokens=False)
    assert ids_a[a.spans[-1].start:a.spans[-1].end] == answer_ids  # the assistant's answer: one segment
    assert b.spans[-1].end - b.spans[-1].start < len(answer_ids)  # the same text as a user's: chunks
    dense = SimpleNamespace(text=None, input_ids=list(ids_a), sampling_params={"max_new_tokens": 4})
    apply_segments(dense, segments_field=None, from_chat=True, segmenter=segmenter,
                   messages=[("system", "x"), ("user", turns)], chunks=None)
    whole = RequestOptions.carried_by(dense.sampling_params["custom_params"])
    assert not whole.content_chunks and len(whole.spans) <= 1
