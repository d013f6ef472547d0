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
