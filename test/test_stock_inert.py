"""Installed beside stock SGLang, our plugin does nothing in `python -m sglang.launch_server`."""

from __future__ import annotations

from importlib.metadata import entry_points

import pytest
import requests

from conftest import generate, hf_greedy
from sglang_tokendance.server_process import ServerProcess

pytestmark = pytest.mark.slow


def test_plugin_is_inert_under_stock_launch_server(smollm2_path, hf_smollm2):
    installed = entry_points(group="sglang.srt.plugins")
    assert "sglang_tokendance.srt.plugin:register" in {ep.value for ep in installed}
    with ServerProcess([], stock=True) as stock:
        info = requests.get(stock.url + "/server_info", timeout=60).json()
        assert "tokendance" not in info
        prompt = "The capital of France is"
        assert generate(stock.url, prompt, 16)["output_ids"] == hf_greedy(hf_smollm2, prompt, 16)
