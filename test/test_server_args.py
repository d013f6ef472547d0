"""TokenDance options: parsing, validation, the environment route, launcher defaults."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest

from sglang_tokendance import cpu
from sglang_tokendance.launch_server import given, with_defaults
from sglang_tokendance.server_args import ENV_VAR, TokenDanceArgs, TokenDanceArgsError, flag_of
from sglang_tokendance.bench.server_process import preloaded_launcher


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
    rounds = parse(["--tokendance-round-window-ms", "250", "--tokendance-round-min-shared", "2"])
    assert (rounds.round_window_ms, rounds.round_min_shared) == (250.0, 2)
    assert TokenDanceArgs.split_kwargs({"tokendance_sparse_writeback": False})[0].sparse_writeback is False
    group = parse(["--tokendance-group-selection", "aligned", "--tokendance-group-probe", "2"]).blend_options()
    assert (group.group_selection, group.group_probe) == ("aligned", 2)
    assert parse([]).blend_options().group_selection == "per-request"
    assert parse([]).approximate_budget is None
    assert parse(["--tokendance-max-approximate-tokens", "0"]).approximate_budget == 0
    for flag, value, message in [("--tokendance-recompute-ratio", "1.5", "in \\[0, 1\\]"),
                                 ("--tokendance-check-layer", "0", ">= 1"),
                                 ("--tokendance-selection", "best", "one of cacheblend-k"),
                                 ("--tokendance-selection-granularity", "page", "one of token, block"),
                                 ("--tokendance-block-size", "0", ">= 1"),
                                 ("--tokendance-block-head-tokens", "-1", ">= 0"),
                                 ("--tokendance-screen-layer", "-1", ">= 0"),
                                 ("--tokendance-screen-factor", "0.5", ">= 1"),
                                 ("--tokendance-round-window-ms", "-1", "in \\[0, 60000\\]"),
                                 ("--tokendance-round-window-ms", "1e9", "in \\[0, 60000\\]"),
                                 ("--tokendance-round-min-shared", "-2", ">= 0"),
                                 ("--tokendance-group-selection", "best", "one of per-request, aligned"),
                                 ("--tokendance-group-probe", "-1", ">= 0"),
                                 ("--tokendance-max-approximate-tokens", "-2", ">= -1"),
                                 ("--tokendance-diff-threshold", "-0.1", ">= 0"),
                                 ("--tokendance-recompute-ratio", "nan", "in \\[0, 1\\], got nan"),
                                 ("--tokendance-round-window-ms", "nan", "in \\[0, 60000\\]"),
                                 ("--tokendance-screen-factor", "inf", ">= 1, got inf"),
                                 ("--tokendance-diff-threshold", "nan", ">= 0"),
                                 ("--tokendance-group-probe", "1", "needs --tokendance-group-selection aligned")]:
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


def test_a_config_file_counts_as_given_and_the_command_line_wins(tmp_path, smollm2_path):
    """`--config FILE` (SGLang's YAML of flags, ours included) is expanded before our defaults
    fill what is not given: the file's model and dtype stay, its TokenDance flags are read,
    and a flag also on the command line takes the command line's value."""
    from sglang_tokendance.launch_server import _tokendance_parser, expand_config

    config = tmp_path / "server.yaml"
    config.write_text("model-path: /models/mine\ndtype: bfloat16\ntokendance-storage: mirror\n"
                      "tokendance-recompute-ratio: 0.2\nenable-metrics: true\n")
    argv = expand_config(["--config", str(config), "--tokendance-recompute-ratio", "0.4"])
    namespace, sglang_argv = _tokendance_parser().parse_known_args(argv)
    ours = TokenDanceArgs.from_cli_args(namespace)
    assert ours.mirror_storage and ours.recompute_ratio == 0.4
    merged = with_defaults(sglang_argv, on_cpu=True, forest=True, mirror=True)
    assert merged.count("--model-path") == 1 and merged[merged.index("--model-path") + 1] == "/models/mine"
    assert merged.count("--dtype") == 1 and merged[merged.index("--dtype") + 1] == "bfloat16"
    assert given(merged, "--enable-metrics") and "--config" not in merged


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
    """`python -m sglang_tokendance.launch_server *argv`, forked from the session's preloaded
    launcher (conftest): the refusals after SGLang's import skip its ~20 s. Its stdout and stderr
    come back together as `stderr`."""
    with tempfile.NamedTemporaryFile(suffix=".log") as log:
        log_path = Path(log.name)
        code = preloaded_launcher().start("sglang_tokendance.launch_server", list(argv), dict(os.environ),
                                          log_path).wait(timeout=300)
        return subprocess.CompletedProcess(argv, code, stdout="", stderr=log_path.read_text())


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


def sglang_args(**overrides):
    """The fields check_server_args reads, at SGLang's CPU-path values, with overrides."""
    from types import SimpleNamespace

    base = dict(tp_size=1, pp_size=1, dp_size=1, speculative_algorithm=None, kv_cache_dtype="auto", page_size=1,
                radix_eviction_policy="lru", device="cpu", disable_cuda_graph=True, disable_prefill_cuda_graph=False,
                disable_overlap_schedule=False)
    return SimpleNamespace(**{**base, **overrides})


@pytest.mark.parametrize("overrides,flag", [
    ({"tp_size": 2}, "--tp-size"),
    ({"pp_size": 2}, "--pp-size"),
    ({"dp_size": 2}, "--dp-size"),
    ({"speculative_algorithm": "EAGLE"}, "--speculative-algorithm"),
    ({"kv_cache_dtype": "fp8_e4m3"}, "--kv-cache-dtype"),
    ({"page_size": 16}, "--page-size"),
    ({"radix_eviction_policy": "tlru"}, "--radix-eviction-policy"),
    ({"disable_radix_cache": True}, "--disable-radix-cache"),
    ({"enable_return_hidden_states": True}, "--enable-return-hidden-states"),
    ({"enable_return_aux_hidden_states": True}, "--enable-return-aux-hidden-states"),
    ({"return_hidden_states_mode": "last"}, "--return-hidden-states-mode"),
    ({"device": "cuda", "disable_cuda_graph": False, "disable_overlap_schedule": True}, "--disable-prefill-cuda-graph"),
    ({"device": "cuda", "disable_overlap_schedule": False}, "--disable-overlap-schedule"),
    ({"device": "cuda", "disable_cuda_graph": False, "disable_prefill_cuda_graph": True,
      "cuda_graph_backend_prefill": "full", "disable_overlap_schedule": True}, "--disable-prefill-cuda-graph"),
    ({"device": "cuda", "disable_overlap_schedule": True, "cuda_graph_config": {"prefill": {"backend": "breakable"}}},
     "--disable-prefill-cuda-graph"),
    ({"device": "cuda", "disable_overlap_schedule": True,  # SGLang's resolved config: what every flag gave
      "cuda_graph_config": SimpleNamespace(prefill=SimpleNamespace(backend="full"),
                                           decode=SimpleNamespace(backend="full"))}, "--disable-prefill-cuda-graph"),
])
def test_configurations_the_blended_prefill_cannot_serve_are_refused(overrides, flag):
    from sglang_tokendance.server_args import check_server_args

    check_server_args(TokenDanceArgs(), sglang_args())  # the CPU defaults pass
    with pytest.raises(TokenDanceArgsError, match=flag) as refused:
        check_server_args(TokenDanceArgs(), sglang_args(**overrides))
    assert "--disable-tokendance" in str(refused.value) and "\n" not in str(refused.value)
    check_server_args(TokenDanceArgs(disable_tokendance=True), sglang_args(**overrides))  # stock SGLang's


def test_plain_float_kv_caches_and_gpu_without_prefill_graphs_pass():
    from sglang_tokendance.server_args import check_server_args

    for dtype in ("bfloat16", "float32", "auto"):
        check_server_args(TokenDanceArgs(), sglang_args(kv_cache_dtype=dtype))
    check_server_args(TokenDanceArgs(), sglang_args(device="cuda", disable_cuda_graph=False,
                                                    disable_prefill_cuda_graph=True, disable_overlap_schedule=True))
    check_server_args(TokenDanceArgs(), sglang_args(  # resolved: decode graphs on, prefill off
        device="cuda", disable_cuda_graph=False, disable_overlap_schedule=True,
        cuda_graph_config=SimpleNamespace(prefill=SimpleNamespace(backend="disabled"),
                                          decode=SimpleNamespace(backend="full"))))
    argv = with_defaults(["--model-path", "m"], on_cpu=False, forest=True)
    assert given(argv, "--disable-prefill-cuda-graph") and given(argv, "--disable-overlap-schedule")  # GPU defaults
    assert not given(with_defaults(["--model-path", "m"], on_cpu=False, forest=False), "--disable-prefill-cuda-graph")


def test_storage_flag_parses_and_validates():
    assert parse([]).storage == "auto" and not parse([]).mirror_storage  # resolved by the launcher
    assert parse(["--tokendance-storage", "mirror"]).mirror_storage
    with pytest.raises(TokenDanceArgsError, match="--tokendance-storage"):
        parse(["--tokendance-storage", "sparse"])


@pytest.mark.parametrize("on_cpu,given,flags,storage", [
    (True, {}, [], "mirror"),  # the CPU: the tokendance backend runs torch_native for the other rows
    (False, {}, [], "dense"),  # a GPU: FlashInfer/Triton and CUDA graphs stay
    (True, {"attention_backend": "torch_native"}, [], "dense"),  # another backend asked for
    (True, {"attention_backend": "tokendance"}, [], "mirror"),
    (True, {"decode_attention_backend": "triton"}, [], "dense"),
    (True, {"kv_events_config": "{}"}, [], "dense"),  # SGLang's KV events cannot hash a kept row's namespace
    (True, {}, ["--no-tokendance-sparse-writeback"], "dense"),
    (True, {}, ["--disable-tokendance"], "dense"),
    (True, {}, ["--tokendance-storage", "dense"], "dense"),  # a storage named is kept
    (False, {}, ["--tokendance-storage", "mirror"], "mirror"),
])
def test_auto_storage_is_mirror_where_its_backend_runs_and_nothing_given_refuses_it(on_cpu, given, flags, storage):
    assert parse(flags).with_storage_for(on_cpu, given.get).storage == storage


def test_the_launcher_reads_what_auto_storage_depends_on_from_the_command_line():
    from sglang_tokendance.launch_server import given_values

    get = given_values(["--port", "30000", "--attention-backend", "tokendance", "--kv-events-config", "{}"])
    assert (get("attention_backend"), get("kv_events_config"), get("decode_attention_backend")) == (
        "tokendance", "{}", None)


MIRROR = TokenDanceArgs(storage="mirror")


@pytest.mark.parametrize("args,overrides,flag,says", [
    (MIRROR, {"attention_backend": "torch_native"}, "--attention-backend", "only the tokendance attention backend"),
    (MIRROR, {"attention_backend": "tokendance", "decode_attention_backend": "triton"}, "--decode-attention-backend",
     "only the tokendance attention backend"),
    (MIRROR, {"attention_backend": "tokendance", "device": "cuda", "disable_cuda_graph": False},
     "--disable-cuda-graph", "without CUDA graphs"),
    (MIRROR, {"attention_backend": "tokendance", "device": "cuda", "disable_cuda_graph": True,
              "disable_overlap_schedule": True, "cuda_graph_backend_decode": "full"}, "--disable-cuda-graph",
     "without CUDA graphs"),
    (MIRROR, {"attention_backend": "tokendance", "kv_events_config": '{"publisher": "zmq"}'}, "--kv-events-config",
     "cannot hash"),
    (TokenDanceArgs(storage="mirror", disable_tokendance=True), {"attention_backend": "tokendance"},
     "--tokendance-storage", "--disable-tokendance switches off"),
    (TokenDanceArgs(storage="mirror", sparse_writeback=False), {"attention_backend": "tokendance"},
     "--no-tokendance-sparse-writeback", "needs sparse write-back"),
    (TokenDanceArgs(), {"attention_backend": "tokendance"}, "--attention-backend", "--tokendance-storage mirror"),
    (TokenDanceArgs(diff_threshold=0.05), {}, "--tokendance-diff-threshold", "--tokendance-storage mirror"),
    (TokenDanceArgs(disable_tokendance=True), {"prefill_attention_backend": "tokendance"},
     "--prefill-attention-backend", "--tokendance-storage mirror"),
])
def test_storage_and_attention_backend_must_agree(args, overrides, flag, says):
    from sglang_tokendance.server_args import check_server_args

    check_server_args(MIRROR, sglang_args(attention_backend="tokendance"))
    check_server_args(MIRROR, sglang_args(attention_backend="tokendance", device="cuda", disable_cuda_graph=True,
                                          disable_overlap_schedule=True))
    check_server_args(TokenDanceArgs(), sglang_args(kv_events_config='{"publisher": "zmq"}'))  # dense: SGLang's tree
    with pytest.raises(TokenDanceArgsError, match=flag) as refused:
        check_server_args(args, sglang_args(**overrides))
    assert says in str(refused.value) and "\n" not in str(refused.value)


def test_mirror_storage_selects_the_tokendance_attention_backend(smollm2_path):
    argv = with_defaults(["--model-path", "m"], on_cpu=True, forest=True, mirror=True)
    assert argv.count("--attention-backend") == 1 and argv[argv.index("--attention-backend") + 1] == "tokendance"
    assert not given(with_defaults(["--model-path", "m"], on_cpu=False, forest=True), "--disable-cuda-graph")
    assert given(with_defaults(["--model-path", "m"], on_cpu=False, forest=True, mirror=True), "--disable-cuda-graph")
    mine = with_defaults(["--model-path", "m", "--attention-backend=triton"], on_cpu=True, mirror=True)
    assert mine.count("--attention-backend=triton") == 1 and "--attention-backend" not in mine  # refused later


def test_refused_configuration_exits_before_sglang_starts():
    result = run_launcher("--tp-size", "2")
    assert result.returncode == 2
    last = result.stderr.strip().splitlines()[-1]  # SGLang's own warnings may come before it
    assert "--tp-size" in last and "--disable-tokendance" in last


@pytest.mark.parametrize("argv,says", [
    (["--tokendance-storage", "mirror", "--attention-backend", "torch_native"], "only the tokendance attention"),
    (["--tokendance-storage", "dense", "--attention-backend", "tokendance"], "it needs --tokendance-storage mirror"),
])
def test_storage_and_attention_backend_disagreeing_exit_before_sglang_starts(argv, says):
    result = run_launcher(*argv)
    assert result.returncode == 2
    last = result.stderr.strip().splitlines()[-1]
    assert "--attention-backend" in last and says in last


def test_model_identity_is_computed_at_start_for_local_and_cached_hub_models(tmp_path, monkeypatch, smollm2_path):
    import huggingface_hub.constants

    from sglang_tokendance.served_model import (SALT_ENV, ModelNotLocalError, export_model_salt, local_model_dir,
                                                model_salt_from_env)

    assert local_model_dir(str(smollm2_path)) == smollm2_path
    snapshot = tmp_path / "hub" / "models--org--tiny" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (tmp_path / "hub" / "models--org--tiny" / "refs").mkdir()
    (tmp_path / "hub" / "models--org--tiny" / "refs" / "main").write_text("abc123")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    assert local_model_dir("org/tiny") == snapshot
    with pytest.raises(ModelNotLocalError, match="org/absent"):
        local_model_dir("org/absent")
    monkeypatch.delenv(SALT_ENV, raising=False)
    with pytest.raises(RuntimeError, match=SALT_ENV):
        model_salt_from_env()
    salt = export_model_salt(str(smollm2_path), None, "float32", "auto")
    assert model_salt_from_env() == salt
    assert export_model_salt(str(smollm2_path), None, "bfloat16", "auto") != salt


def test_launcher_refuses_a_model_it_cannot_find_in_one_line():
    result = run_launcher("--model-path", "org/not-on-this-machine")
    assert result.returncode == 2
    last = result.stderr.strip().splitlines()[-1]
    assert "org/not-on-this-machine" in last and "Hugging Face cache" in last


def longrope_model(tmp_path, smollm2_path) -> Path:
    """A model folder whose config asks for a RoPE TokenDance cannot re-rotate (longrope)."""
    config = json.loads((smollm2_path / "config.json").read_text())
    pairs = config["hidden_size"] // config["num_attention_heads"] // 2
    config.pop("rope_parameters", None)
    config["rope_scaling"] = {"rope_type": "longrope", "rope_theta": 100000.0, "short_factor": [1.0] * pairs,
                              "long_factor": [1.0] * pairs, "original_max_position_embeddings": 2048}
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def test_a_model_whose_rope_cannot_be_rerotated_is_refused_before_sglang_starts(tmp_path, smollm2_path):
    from sglang_tokendance.served_model import check_rope

    check_rope(str(smollm2_path))  # SmolLM2's plain RoPE is served
    path = longrope_model(tmp_path, smollm2_path)
    with pytest.raises(TokenDanceArgsError, match="--model-path.*longrope.*--disable-tokendance"):
        check_rope(str(path))
    result = run_launcher("--model-path", str(path))
    assert result.returncode == 2, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert "longrope" in last and "--disable-tokendance" in last


def test_a_rope_override_the_served_model_cannot_rerotate_is_refused_before_sglang_starts(smollm2_path):
    """Before, the launch check read config.json alone: a longrope override passed it and the
    scheduler raised once SGLang had started."""
    from sglang_tokendance.served_model import check_rope

    pairs = 64 // 2
    longrope = json.dumps({"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0] * pairs,
                                            "long_factor": [1.0] * pairs, "factor": 2.0,
                                            "original_max_position_embeddings": 2048}})
    check_rope(str(smollm2_path), None, json.dumps({"rope_scaling": {"rope_theta": 50000.0}}))  # still plain
    with pytest.raises(TokenDanceArgsError, match="--json-model-override-args.*longrope"):
        check_rope(str(smollm2_path), None, longrope)
    result = run_launcher("--model-path", str(smollm2_path), "--json-model-override-args", longrope)
    assert result.returncode == 2, result.stderr
    assert "longrope" in result.stderr.strip().splitlines()[-1]


def test_options_doc_is_generated_from_the_dataclass():
    from pathlib import Path

    from sglang_tokendance.server_args import options_markdown

    doc = Path(__file__).resolve().parent.parent / "docs" / "options.md"
    regenerate = "python -m sglang_tokendance.server_args > docs/options.md"
    assert doc.read_text() == options_markdown(), f"regenerate it: {regenerate}"
    for f in dataclasses.fields(TokenDanceArgs):
        assert flag_of(f) in doc.read_text()
