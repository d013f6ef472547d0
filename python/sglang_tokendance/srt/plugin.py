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
    from sglang_tokendance.srt.runtime import SchedulerRuntime

    runtime = SchedulerRuntime(args)
    _register_forest(runtime)
    if args.mirror_storage:
        from sglang_tokendance.srt import forest, pool

        HookRegistry.register("sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator."
                              "_build_token_to_kv_pool_allocator", pool.install_allocator, HookType.AFTER)
        HookRegistry.register("sglang.srt.mem_cache.allocation.alloc_token_slots", forest.allocate_after_reads,
                              HookType.AROUND)
        for method, hook in (("add_one_req", runtime.admit), ("_check_prefill_budget", runtime.check_admission)):
            HookRegistry.register(f"sglang.srt.managers.schedule_policy.PrefillAdder.{method}", hook, HookType.AROUND)
        HookRegistry.register("sglang.srt.managers.scheduler.Scheduler.get_new_batch_prefill",
                              runtime.reopen_admission, HookType.BEFORE)
    _register_attention()
    if runtime.policy is not None:  # stock SGLang's scheduling under --disable-tokendance
        runtime.policy.register_hooks()

    def add_tokendance_info(result: dict[str, Any], *unused, **unused_kw) -> dict[str, Any]:
        """/server_info tells clients (e.g. sgl.separator()) that TokenDance is serving."""
        return {**result, "tokendance": tokendance_info(args)}

    HookRegistry.register(
        "sglang.srt.utils.common.build_server_info", add_tokendance_info, HookType.AFTER
    )


def _register_forest(runtime) -> None:
    """The "tokendance" radix-cache backend; our launcher selects it unless told otherwise."""
    from sglang.srt.mem_cache.registry import register_radix_cache_backend, registered_radix_cache_backends
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from sglang_tokendance.server_args import FOREST_BACKEND
    from sglang_tokendance.srt import forest, reuse
    from sglang_tokendance.srt.model import FORWARD_HOOK_TARGETS

    if FOREST_BACKEND not in registered_radix_cache_backends():
        register_radix_cache_backend(FOREST_BACKEND, runtime.build_forest)
    HookRegistry.register(
        "sglang.srt.managers.scheduler.Scheduler.get_internal_state", forest.add_forest_stats, HookType.AFTER
    )
    HookRegistry.register(
        "sglang.srt.managers.schedule_batch.ScheduleBatch.prepare_for_extend",
        forest.restore_after_allocation, HookType.AROUND,
    )
    for target in FORWARD_HOOK_TARGETS:
        HookRegistry.register(target, runtime.model_forward, HookType.AROUND)
    HookRegistry.register(
        "sglang.srt.managers.scheduler.Scheduler.get_output_streamer_class",
        reuse.output_streamer_class, HookType.REPLACE,
    )


def _register_attention() -> None:
    """The "tokendance" attention backend (rows reading Masters in place at a shift), a choice of
    --attention-backend; --tokendance-storage mirror selects it (server_args checks the pair)."""
    from sglang.srt.arg_groups.choices import ATTENTION_BACKEND_CHOICES, add_attention_backend_choices
    from sglang.srt.layers.attention.attention_registry import register_attention_backend

    from sglang_tokendance.server_args import ATTENTION_BACKEND
    from sglang_tokendance.srt import attention

    register_attention_backend(ATTENTION_BACKEND)(attention.create_backend)
    if ATTENTION_BACKEND not in ATTENTION_BACKEND_CHOICES:
        add_attention_backend_choices([ATTENTION_BACKEND])
