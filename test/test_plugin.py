"""The plugin registers hooks only when TokenDance options are in the environment."""

from __future__ import annotations

import pytest

from sglang_tokendance.server_args import ENV_VAR, TokenDanceArgs
from sglang_tokendance.srt import plugin


@pytest.fixture
def hook_registry(monkeypatch):
    from sglang.srt.plugins.hook_registry import HookRegistry

    monkeypatch.setattr(HookRegistry, "_hooks", type(HookRegistry._hooks)(list))
    return HookRegistry


def test_register_without_options_does_nothing(monkeypatch, hook_registry):
    monkeypatch.delenv(ENV_VAR, raising=False)
    plugin.register()
    assert not any(hook_registry._hooks.values())


def test_register_with_options_adds_server_info(monkeypatch, hook_registry):
    monkeypatch.delenv(ENV_VAR, raising=False)
    TokenDanceArgs(disable_tokendance=True).export_to_env()
    plugin.register()
    (hook_type, hook, _), = hook_registry._hooks["sglang.srt.utils.common.build_server_info"]
    info = hook({"model_path": "m"}, None, {})
    assert info["model_path"] == "m" and info["tokendance"]["disable_tokendance"] is True


@pytest.mark.parametrize("disable", [False, True])
def test_round_policy_hooks_only_with_tokendance_on(monkeypatch, hook_registry, disable):
    monkeypatch.delenv(ENV_VAR, raising=False)
    TokenDanceArgs(disable_tokendance=disable).export_to_env()
    plugin.register()
    target = "sglang.srt.managers.scheduler.Scheduler.get_new_batch_prefill"
    assert (target in hook_registry._hooks and bool(hook_registry._hooks[target])) is not disable
