"""`sglang_tokendance.Engine`: SGLang's offline engine with TokenDance, same API.

Takes every `sglang.Engine` keyword (ServerArgs' fields; not a built `server_args`) plus
`tokendance_*` / `disable_tokendance`; `model_path`
defaults to the prepared SmolLM2 and, without CUDA, the CPU defaults fill what is not given.
Import this module before SGLang's runtime modules: SGLang decides at import time whether it
runs its CPU engine.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from sglang_tokendance import cpu
from sglang_tokendance.model_store import prepared_default_model
from sglang_tokendance.served_model import check_rope, export_model_salt
from sglang_tokendance.server_args import (
    ATTENTION_BACKEND,
    FOREST_BACKEND,
    TokenDanceArgs,
    check_server_args,
    tokendance_info,
)

ON_CPU = cpu.prepare_process()

from sglang.srt.entrypoints.engine import Engine as SGLangEngine  # noqa: E402  after the CPU setup


class Engine(SGLangEngine):
    def __init__(self, **kwargs: Any):
        if "server_args" in kwargs:  # built already: our defaults and checks could not tell what was given
            raise TypeError("sglang_tokendance.Engine takes ServerArgs' fields as keywords, not server_args=: "
                            "its defaults fill, and its checks read, what the keywords give")
        tokendance_args, kwargs = TokenDanceArgs.split_kwargs(kwargs)
        tokendance_args = tokendance_args.with_storage_for(ON_CPU, kwargs.get)
        tokendance_args.export_to_env()  # read by our plugin in every spawned process
        if "model_path" not in kwargs:
            kwargs["model_path"] = str(prepared_default_model())
        if tokendance_args.mirror_storage:  # check_server_args refuses another attention backend
            kwargs.setdefault("attention_backend", ATTENTION_BACKEND)
            if not ON_CPU:
                kwargs.setdefault("disable_cuda_graph", True)
        if ON_CPU:
            for name, value in cpu.CPU_SERVER_DEFAULTS.items():
                kwargs.setdefault(name, value)
        if tokendance_args.kv_enabled and not kwargs.get("disable_radix_cache"):
            kwargs.setdefault("radix_cache_backend", FOREST_BACKEND)
        if tokendance_args.kv_enabled and not ON_CPU:
            kwargs.setdefault("disable_overlap_schedule", True)  # segment KV is copied on the scheduling stream
        if tokendance_args.kv_enabled and not ON_CPU and not kwargs.get("disable_cuda_graph"):
            kwargs.setdefault("disable_prefill_cuda_graph", True)  # graphs would replay SGLang's forward
        check_server_args(tokendance_args, SimpleNamespace(**kwargs))
        if tokendance_args.kv_enabled:
            check_rope(kwargs["model_path"], kwargs.get("revision"), kwargs.get("json_model_override_args"))
        export_model_salt(kwargs["model_path"], kwargs.get("revision"), kwargs.get("dtype", "auto"),
                          kwargs.get("kv_cache_dtype", "auto"))
        self.tokendance_args = tokendance_args
        super().__init__(**kwargs)

    def get_server_info(self) -> dict[str, Any]:
        """SGLang's server info plus the `tokendance` block the HTTP server reports too."""
        return {**super().get_server_info(), "tokendance": tokendance_info(self.tokendance_args)}
