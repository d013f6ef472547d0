"""`sglang_tokendance.Engine`, the offline engine, mirrors `sglang.Engine`."""

from __future__ import annotations

import pytest

from conftest import hf_greedy

pytestmark = pytest.mark.slow


def test_engine_refuses_a_built_server_args():
    """Our defaults (model, CPU flags, the forest) and the launch checks read the keywords; a
    ServerArgs built already would bypass all of them."""
    import sglang_tokendance

    with pytest.raises(TypeError, match="not server_args="):
        sglang_tokendance.Engine(server_args=object())


def test_engine_defaults_to_smollm2_and_matches_hf(hf_smollm2):
    """The defaults on the CPU resolve to mirror storage: the tokendance attention backend (K
    un-rotated in the pool, RoPE on read) gives HF's greedy output on SmolLM2."""
    import sglang_tokendance

    engine = sglang_tokendance.Engine(log_level="error")
    try:
        assert engine.get_server_info()["attention_backend"] == "tokendance"
        prompts = ["The capital of France is", "List three animals:"]
        outs = engine.generate(prompts, {"max_new_tokens": 16, "temperature": 0})
        for prompt, out in zip(prompts, outs):
            assert out["output_ids"] == hf_greedy(hf_smollm2, prompt, 16)
        assert engine.tokendance_args.kv_enabled and engine.tokendance_args.mirror_storage
        assert engine.get_server_info()["tokendance"]["disable_tokendance"] is False
    finally:
        engine.shutdown()


def test_engine_disabled_tokendance_keeps_the_interface(tiny_llama):
    """--disable-tokendance: markers are still stripped and segments tokenised alone (a tiny
    random Llama with SmolLM2's tokenizer: the model does not matter)."""
    import sglang_tokendance
    from sglang_tokendance.core.segments import DEFAULT_SEPARATOR as SEP
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    block = "Ada: The council will vote on the new market hall tomorrow at noon in the square."
    pieces = ["History of the baker.", block, " Reply:"]
    ids = tokenizer.encode(pieces[0]) + sum((tokenizer.encode(p, add_special_tokens=False) for p in pieces[1:]), [])
    engine = sglang_tokendance.Engine(model_path=tiny_llama, disable_tokendance=True, tokendance_min_segment_tokens=4,
                                      log_level="error")
    try:
        params = {"max_new_tokens": 8, "temperature": 0}
        marked = engine.generate(SEP.join(pieces), params)
        assert marked["output_ids"] == engine.generate(input_ids=ids, sampling_params=params)["output_ids"]
        (span,) = marked["meta_info"]["tokendance"]["segments"]
        assert span["start"] == len(tokenizer.encode(pieces[0]))
        assert engine.get_server_info()["tokendance"]["disable_tokendance"] is True
    finally:
        engine.shutdown()


def test_engine_rejects_unknown_tokendance_option():
    import sglang_tokendance
    from sglang_tokendance.server_args import TokenDanceArgsError

    with pytest.raises(TokenDanceArgsError, match="tokendance_nope"):
        sglang_tokendance.Engine(tokendance_nope=1)


def test_engine_refuses_mirror_storage_with_another_attention_backend():
    import sglang_tokendance
    from sglang_tokendance.server_args import TokenDanceArgsError

    with pytest.raises(TokenDanceArgsError, match="--attention-backend"):
        sglang_tokendance.Engine(tokendance_storage="mirror", attention_backend="triton")


def test_launcher_help_lists_sglang_and_tokendance_flags(capsys):
    from sglang_tokendance import launch_server

    launch_server.main(["--help"])  # in-process: a fresh interpreter spent 17 s importing SGLang
    out = capsys.readouterr().out
    for flag in ("--model-path", "--radix-cache-backend", "--disable-tokendance"):
        assert flag in out
