"""TokenDance options: parsing, validation, the environment route, launcher defaults."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from sglang_tokendance import cpu
from sglang_tokendance.launch_server import given, with_defaults
from sglang_tokendance.server_args import ENV_VAR, TokenDanceArgs, TokenDanceArgsError


def parse(argv):
    parser = argparse.ArgumentParser()
    TokenDanceArgs.add_cli_args(parser)
    return TokenDanceArgs.from_cli_args(parser.parse_args(argv))


def test_defaults_and_disable_flag():
    assert parse([]) == TokenDanceArgs()
    assert parse([]).kv_enabled
    assert not parse(["--disable-tokendance"]).kv_enabled


def test_blend_options_parse_and_validate():
    args = parse(["--tokendance-recompute-ratio", "0.5", "--tokendance-check-layer", "3",
                  "--tokendance-selection", "cacheblend-k", "--tokendance-selection-granularity", "block",
                  "--tokendance-block-size", "8", "--tokendance-block-head-tokens", "2",
                  "--no-tokendance-sparse-writeback"])
    options = args.blend_options()
    assert (options.recompute_ratio, options.check_layer, options.granularity, options.block_size,
            options.block_head_tokens, options.sparse_writeback) == (0.5, 3, "block", 8, 2, False)
    assert args.selection == "cacheblend-k" and parse([]).sparse_writeback
    assert TokenDanceArgs.split_kwargs({"tokendance_sparse_writeback": False})[0].sparse_writeback is False
    for flag, value, message in [("--tokendance-recompute-ratio", "1.5", "in \\[0, 1\\]"),
                                 ("--tokendance-check-layer", "0", ">= 1"),
                                 ("--tokendance-selection", "best", "one of cacheblend-k"),
                                 ("--tokendance-selection-granularity", "page", "one of token, block"),
                                 ("--tokendance-block-size", "0", ">= 1"),
                                 ("--tokendance-block-head-tokens", "-1", ">= 0"),
                                 ("--tokendance-screen-layer", "-1", ">= 0"),
                                 ("--tokendance-screen-factor", "0.5", ">= 1")]:
        with pytest.raises(TokenDanceArgsError, match=message) as err:
            parse([flag, value])
        assert err.value.flag == flag


def test_unknown_option_names_it():
    with pytest.raises(TokenDanceArgsError, match="bogus") as err:
        TokenDanceArgs.from_dict({"bogus": 1})
    assert err.value.flag == "bogus"


def test_wrong_type_names_the_flag():
    with pytest.raises(TokenDanceArgsError, match="--disable-tokendance"):
        TokenDanceArgs(disable_tokendance="yes")


def test_split_kwargs_takes_ours_and_leaves_sglangs():
    args, rest = TokenDanceArgs.split_kwargs({"disable_tokendance": True, "port": 1, "dtype": "float32"})
    assert args.disable_tokendance and rest == {"port": 1, "dtype": "float32"}
    with pytest.raises(TokenDanceArgsError, match="tokendance_nope"):
        TokenDanceArgs.split_kwargs({"tokendance_nope": 3})


def test_environment_round_trip(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert TokenDanceArgs.from_env() is None
    TokenDanceArgs(disable_tokendance=True).export_to_env()
    assert TokenDanceArgs.from_env() == TokenDanceArgs(disable_tokendance=True)


def test_cpu_defaults_fill_only_what_is_not_given(smollm2_path):
    argv = with_defaults(["--dtype", "bfloat16", "--max-total-tokens=4096"], on_cpu=True)
    assert argv.count("--dtype") == 1 and argv[argv.index("--dtype") + 1] == "bfloat16"
    assert "--max-total-tokens=4096" in argv and argv.count("--max-total-tokens") == 0
    for flag in ("--device", "--attention-backend", "--disable-cuda-graph", "--sleep-on-idle"):
        assert given(argv, flag)
    assert argv[argv.index("--model-path") + 1] == str(smollm2_path)


def test_forest_is_the_default_radix_cache_unless_told_otherwise(smollm2_path):
    argv = with_defaults([], on_cpu=False, forest=True)
    assert argv[argv.index("--radix-cache-backend") + 1] == "tokendance"
    assert not given(with_defaults([], on_cpu=False, forest=False), "--radix-cache-backend")
    assert not given(with_defaults(["--disable-radix-cache"], on_cpu=False, forest=True), "--radix-cache-backend")
    mine = with_defaults(["--radix-cache-backend=other"], on_cpu=False, forest=True)
    assert mine.count("--radix-cache-backend=other") == 1 and "--radix-cache-backend" not in mine


def test_no_cpu_defaults_on_cuda_path(smollm2_path):
    argv = with_defaults(["--model-path", "/some/model"], on_cpu=False)
    assert argv == ["--model-path", "/some/model"]


def run_launcher(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "sglang_tokendance.launch_server", *argv],
        capture_output=True, text=True, timeout=300,
    )


def test_unknown_tokendance_flag_exits_with_one_line_error():
    result = run_launcher("--tokendance-bogus", "1")
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "--tokendance-bogus" in lines[0]


@pytest.mark.parametrize("argv,flag", [
    (["--tokendance-min-segment-tokens", "0"], "--tokendance-min-segment-tokens"),
    (["--tokendance-max-segments", "many"], "--tokendance-max-segments"),
    (["--tokendance-separator", " "], "--tokendance-separator"),
])
def test_bad_tokendance_value_exits_with_one_line_error(argv, flag):
    result = run_launcher(*argv)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and flag in lines[0]


def test_values_from_strings_are_converted_and_validated():
    args = TokenDanceArgs.from_dict({"min_segment_tokens": "8", "max_segments": "32", "separator": "[[SEP]]"})
    assert (args.min_segment_tokens, args.max_segments, args.separator) == (8, 32, "[[SEP]]")
    with pytest.raises(TokenDanceArgsError, match="--tokendance-max-segments"):
        TokenDanceArgs(max_segments=0)


def test_cpu_environment_reaches_children(monkeypatch):
    monkeypatch.delenv("PYTHONPATH", raising=False)
    monkeypatch.delenv("SGLANG_USE_CPU_ENGINE", raising=False)
    assert cpu.prepare_process()  # no CUDA on these machines
    child = subprocess.run(
        [sys.executable, "-c",
         "import os, sgl_kernel; print(os.environ['SGLANG_USE_CPU_ENGINE'], sgl_kernel.IS_TOKENDANCE_FALLBACK)"],
        capture_output=True, text=True, timeout=120,
    )
    assert child.stdout.split() == ["1", "True"], child.stderr
