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
        self.policy = RoundPolicy(args, self.options) if args.kv_enabled else None
        self.forest: forest_module.SegmentForest | None = None

    def build_forest(self, ctx) -> forest_module.SegmentForest:
        """The `register_radix_cache_backend` factory of the "tokendance" backend."""
        self.forest = forest_module.build_forest(ctx, self.options, self.group_key, self.leads)
        return self.forest

    def group_key(self, req) -> Hashable | None:
        """The key of the round group SGLang is admitting `req` with (None: no round)."""
        return None if self.policy is None else self.policy.group_key(req)

    def leads(self, req) -> bool:
        """Whether SGLang is admitting `req` as its round's leader (srt/policy)."""
        return self.policy is not None and self.policy.leads(req)

    def model_forward(self, original, model, input_ids, positions, forward_batch, *args, **kwargs):
        """AROUND hook on the decoder forwards (srt/model.FORWARD_HOOK_TARGETS)."""
        return forward_hook.model_forward(self.forest, original, model, input_ids, positions, forward_batch,
                                          *args, **kwargs)
