"""`python -m sglang_tokendance.launch_server`: SGLang's server with TokenDance.

Accepts every `python -m sglang.launch_server` flag plus the `--tokendance-*` ones.
`--model-path` defaults to the prepared SmolLM2-135M-Instruct; without CUDA the CPU defaults
(cpu.CPU_SERVER_DEFAULTS) apply to every flag the user did not give.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Callable

from sglang_tokendance import cpu
from sglang_tokendance.served_model import ModelNotLocalError, check_rope, export_model_salt
from sglang_tokendance.server_args import (
    ATTENTION_BACKEND,
    FOREST_BACKEND,
    STORAGE_DEPENDS_ON,
    TokenDanceArgs,
    TokenDanceArgsError,
    check_server_args,
)

PROG = "python -m sglang_tokendance.launch_server"


class _OneLineErrorParser(argparse.ArgumentParser):
    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def _tokendance_parser() -> argparse.ArgumentParser:
    parser = _OneLineErrorParser(prog=PROG, add_help=False, allow_abbrev=False)
    TokenDanceArgs.add_cli_args(parser)
    return parser


def _print_help() -> None:
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(
        prog=PROG,
        description="SGLang's HTTP server with TokenDance's round-aware KV sharing. "
        "--model-path defaults to the prepared SmolLM2-135M-Instruct.",
    )
    ServerArgs.add_cli_args(parser)
    TokenDanceArgs.add_cli_args(parser)
    parser.print_help()


def given(argv: list[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in argv)


def with_defaults(argv: list[str], on_cpu: bool, forest: bool = False, mirror: bool = False) -> list[str]:
    """argv plus our defaults for every flag it does not set; `forest` makes the segment-hash
    forest the radix cache (unless the radix cache is off or another backend is chosen) and,
    on a GPU, turns prefill CUDA graphs off (they would replay SGLang's own forward) and the
    overlap scheduler (segment KV is copied on the scheduling stream); `mirror`
    (--tokendance-storage mirror) makes the tokendance attention backend the attention backend
    (check_server_args refuses any other) and, on a GPU, turns CUDA graphs off."""
    extra: list[str] = []
    if mirror and not given(argv, "--attention-backend"):
        extra += ["--attention-backend", ATTENTION_BACKEND]
    if mirror and not on_cpu and not given(argv, "--disable-cuda-graph"):
        extra += ["--disable-cuda-graph"]
    if forest and not given(argv, "--radix-cache-backend") and not given(argv, "--disable-radix-cache"):
        extra += ["--radix-cache-backend", FOREST_BACKEND]
    if forest and not on_cpu and not given(argv, "--disable-overlap-schedule"):
        extra += ["--disable-overlap-schedule"]
    if forest and not on_cpu and not given(argv, "--disable-cuda-graph"):
        extra += [] if given(argv, "--disable-prefill-cuda-graph") else ["--disable-prefill-cuda-graph"]
    if not given(argv, "--model-path") and not given(argv, "--model"):
        from sglang_tokendance.model_store import prepared_default_model

        extra += ["--model-path", str(prepared_default_model())]
    if on_cpu:
        for name, value in cpu.CPU_SERVER_DEFAULTS.items():
            flag = "--" + name.replace("_", "-")
            if given(argv + extra, flag):
                continue
            extra += [flag] if value is True else [flag, str(value)]
    return argv + extra


def given_values(argv: list[str]) -> Callable[[str], Any]:
    """What `argv` gives for the SGLang arguments `auto` storage depends on, by ServerArgs field
    name (None: not given; SGLang's defaults for these are None)."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    for name in STORAGE_DEPENDS_ON:
        parser.add_argument("--" + name.replace("_", "-"), dest=name)
    values = vars(parser.parse_known_args(argv)[0])
    return values.get


def expand_config(argv: list[str]) -> list[str]:
    """argv with `--config FILE` replaced by the file's flags, SGLang's and ours, by SGLang's
    own merger (the command line wins), so our defaults see what the file gives."""
    if "--config" not in argv:
        return argv
    from sglang.srt.server_args import ServerArgs
    from sglang.srt.utils.server_args_config_parser import ConfigArgumentMerger

    parser = argparse.ArgumentParser(add_help=False)
    ServerArgs.add_cli_args(parser)
    TokenDanceArgs.add_cli_args(parser)
    return ConfigArgumentMerger(parser).merge_config_with_args(argv)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        _print_help()
        return
    parser = _tokendance_parser()
    try:
        argv = expand_config(argv)
    except ValueError as e:
        parser.error(str(e))
    td_namespace, sglang_argv = parser.parse_known_args(argv)
    unknown = [a.split("=")[0] for a in sglang_argv if a.startswith("--tokendance-")]
    if unknown:
        parser.error(f"unrecognized TokenDance option: {unknown[0]}")
    try:
        td_args = TokenDanceArgs.from_cli_args(td_namespace)
    except TokenDanceArgsError as e:
        parser.error(str(e))
    on_cpu = cpu.prepare_process()
    td_args = td_args.with_storage_for(on_cpu, given_values(sglang_argv))
    td_args.export_to_env()
    try:
        sglang_argv = with_defaults(sglang_argv, on_cpu, forest=td_args.kv_enabled, mirror=td_args.mirror_storage)
    except RuntimeError as e:
        sys.exit(f"{PROG}: error: {e}")

    from sglang.launch_server import run_server
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.utils import kill_process_tree

    load_plugins()
    server_args = prepare_server_args(sglang_argv)
    try:  # before SGLang spawns anything: the guards, and the model's identity computed once
        check_server_args(td_args, server_args)
        if td_args.kv_enabled:
            check_rope(server_args.model_path, server_args.revision, server_args.json_model_override_args)
        export_model_salt(server_args.model_path, server_args.revision, server_args.dtype, server_args.kv_cache_dtype)
    except (TokenDanceArgsError, ModelNotLocalError) as e:
        parser.error(str(e))
    try:
        run_server(server_args)
    finally:
        kill_process_tree(os.getpid(), include_parent=False)


if __name__ == "__main__":
    main()
