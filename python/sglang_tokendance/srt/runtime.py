"""The scheduler's TokenDance objects, owned by the plugin and handed to the hooks that need them.

SGLang runs our plugin once in each of its processes (srt/plugin). There the plugin builds
one `SchedulerRuntime` and registers its bound methods, so every hook reaches the same
objects by one explicit path -- no module globals, nothing attached to SGLang's objects:

* `options`: each request's TokenDance options, parsed once per Req (srt/request);
* `policy`: the round groups SGLang admits together (srt/policy; None under --disable-tokendance);
* `forest`: the radix cache SGLang builds through our backend's factory (`build_forest`);
  the model forward hook runs the blended prefill on the plans it holds.

Only the scheduler process builds a forest and forwards a model; elsewhere these stay unused.
"""

from __future__ import annotations

from typing import Hashable

from sglang_tokendance.server_args import TokenDanceArgs
from sglang_tokendance.srt import forest as forest_module
from sglang_tokendance.srt import forward_hook
from sglang_tokendance.srt.policy import RoundPolicy
from sglang_tokendance.srt.request import RequestOptionsCache


class SchedulerRuntime:
    def __init__(self, args: TokenDanceArgs):
        self.options = RequestOptionsCache()
        self.policy = RoundPolicy(args, self.options, cached_at=self.cached_at) if args.kv_enabled else None
        self.forest: forest_module.SegmentForest | None = None

    def build_forest(self, ctx) -> forest_module.SegmentForest:
        """The `register_radix_cache_backend` factory of the "tokendance" backend."""
        self.forest = forest_module.build_forest(ctx, self)
        return self.forest

    def group_key(self, req) -> Hashable | None:
        """The key of the round group SGLang is admitting `req` with (None: no round)."""
        return None if self.policy is None else self.policy.group_key(req)

    def cached_at(self, key: Hashable) -> int | None:
        """Where the Master cached under `key` was computed (None: none; srt/policy infers rounds)."""
        return None if self.forest is None else self.forest.segments.position(key)

    def leads(self, req) -> bool:
        """Whether SGLang is admitting `req` as its round's leader (srt/policy)."""
        return self.policy is not None and self.policy.leads(req)

    def reopen_admission(self, scheduler, running_batch, *args, **kwargs) -> None:
        """BEFORE hook on `Scheduler.get_new_batch_prefill` (mirror storage). Once a waiting
        request does not fit, SGLang stops admitting (`running_batch.batch_is_full`) until a
        request leaves the running batch: in stock SGLang nothing else frees KV. Under mirror
        storage a prefill does: after its forward, the own slots SGLang allocated at the reused
        positions go back to the pool but for the kept tokens (srt/storage.settle_row). When that
        happened since the last pass, admission is tried again, as after a request left; a
        request that still does not fit closes it again."""
        if self.forest is not None and self.forest.storage.freed_after_forwards():
            running_batch.batch_is_full = False

    def admit(self, add_one_req, adder, req, *args, **kwargs):
        """AROUND hook on `PrefillAdder.add_one_req` (mirror storage). SGLang reserves a slot for
        every extend token it admits; a reader allocates only its fresh tokens and one slot per
        reused token it can keep (srt/batch_reuse `allocate_extend`). So once SGLang commits a
        request, the batch's reuse plans its chunk and holds its Masters (`admit`: no longer
        evictable), and the slots it will not allocate go back to this pass's budget: the
        round's next readers are admitted on what the first ones really take. A request the
        blended prefill cannot serve (srt/batch_reuse `blendable_request`) never joins a batch with
        such a reader (SGLang would compute the reader's tokens in full, beyond what was
        reserved): it waits for the next batch, or the readers after it keep SGLang's charge."""
        from sglang.srt.managers.schedule_policy import AddReqResult

        from sglang_tokendance.srt.batch_reuse import blendable_request

        forest, batch = self.forest, adder.can_run_list
        if forest is None:
            return add_one_req(adder, req, *args, **kwargs)
        if not blendable_request(req) and any(map(forest.batch.reads_admitted, batch)):
            return AddReqResult.OTHER
        admitted = len(batch)
        verdict = add_one_req(adder, req, *args, **kwargs)
        if len(batch) == admitted or not all(map(blendable_request, batch)):
            return verdict
        unallocated = forest.batch.admit(req)
        if not unallocated:
            return verdict
        budget = adder.memory_budget  # reserve() charges extend + one page + extra: this charges -unallocated
        budget.reserve(0, 0, extra_tokens=-(unallocated + budget.page_size))
        return adder.budget_state()

    def check_admission(self, check, adder, req, *args, total_tokens: int, **kwargs):
        """AROUND hook on `PrefillAdder._check_prefill_budget` (mirror storage): SGLang checks
        a waiting request against its whole remaining prompt and decode headroom; a reader is
        checked against what it would take (srt/batch_reuse `spared_slots`), under the same
        condition `admit` credits it (no request the blended prefill cannot serve in the
        batch)."""
        from sglang_tokendance.srt.batch_reuse import blendable_request

        forest = self.forest
        if forest is not None and all(map(blendable_request, [*adder.can_run_list, req])):
            total_tokens -= forest.batch.spared_slots(req)
        return check(adder, req, *args, total_tokens=total_tokens, **kwargs)

    def model_forward(self, original, model, input_ids, positions, forward_batch, *args, **kwargs):
        """AROUND hook on the decoder forwards (srt/model.FORWARD_HOOK_TARGETS)."""
        return forward_hook.model_forward(self.forest, original, model, input_ids, positions, forward_batch,
                                          *args, **kwargs)
