"""Installed beside stock SGLang, our plugin does nothing in `python -m sglang.launch_server`."""

from __future__ import annotations

from importlib.metadata import entry_points

import pytest
import requests

from conftest import emptied, generate, hf_greedy

pytestmark = pytest.mark.slow


def test_plugin_is_inert_under_stock_launch_server(stock_server_url, hf_smollm2):
    installed = entry_points(group="sglang.srt.plugins")
    assert "sglang_tokendance.srt.plugin:register" in {ep.value for ep in installed}
    url = emptied(stock_server_url)
    info = requests.get(url + "/server_info", timeout=60).json()
    assert "tokendance" not in info
    prompt = "The capital of France is"
    assert generate(url, prompt, 16)["output_ids"] == hf_greedy(hf_smollm2, prompt, 16)
    assert_separator_emits_nothing(url)


def assert_separator_emits_nothing(url):
    """Against a server without TokenDance, sgl.separator() adds no text at all."""
    import sglang as sgl

    import sglang_tokendance.lang  # noqa: F401

    @sgl.function
    def program(s, with_separators):
        sep = sgl.separator() if with_separators else ""
        s += "Bread prices rose." + sep + " The mill is closed." + sep + " So"
        s += sgl.gen("answer", max_tokens=8, temperature=0)

    backend = sgl.RuntimeEndpoint(url)
    marked = program.run(with_separators=True, backend=backend)
    plain = program.run(with_separators=False, backend=backend)
    assert marked.text() == plain.text()
    assert "tokendance" not in marked.text()
