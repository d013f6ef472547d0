"""Entry point of the `sglang.srt.plugins` group, run by SGLang in each of its processes.

It does nothing unless our launcher or Engine put TokenDance options in the environment, so
installing this package beside stock SGLang never changes `python -m sglang.launch_server`.
"""

from __future__ import annotations

from typing import Any

from sglang_tokendance.server_args import TokenDanceArgs, tokendance_info


def register() -> None:
    args = TokenDanceArgs.from_env()
    if args is None:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from sglang_tokendance.srt import prompt_interface

    prompt_interface.register(args)  # the interface stays on under --disable-tokendance

    def add_tokendance_info(result: dict[str, Any], *unused, **unused_kw) -> dict[str, Any]:
        """/server_info tells clients (e.g. sgl.separator()) that TokenDance is serving."""
        return {**result, "tokendance": tokendance_info(args)}

    HookRegistry.register(
        "sglang.srt.utils.common.build_server_info", add_tokendance_info, HookType.AFTER
    )

