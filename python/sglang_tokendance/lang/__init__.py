"""SGLang frontend-language extension: `sgl.separator()`, `sgl.gen(..., register_output=True,
round="r1", round_size=4)` and the `round(...)` block.

Importing this module adds `separator` to the `sglang` module and the keywords to
`sglang.gen`, so `@sgl.function` programs can write
`s += history + sgl.separator() + block + sgl.separator() + question` and
`s += sgl.gen("answer", register_output=True)`; `with sglang_tokendance.lang.round("r1", 4):`
tags every gen built inside with that round; `with sglang_tokendance.lang.simulation("sim-7"):`
routes every gen built inside to one worker behind SGLang's router (`X-SMG-Routing-Key`).
"""

from sglang_tokendance.lang.gen_options import install as install_gen_options
from sglang_tokendance.lang.round import install as install_round
from sglang_tokendance.lang.round import round
from sglang_tokendance.lang.routing import install as install_routing
from sglang_tokendance.lang.routing import simulation
from sglang_tokendance.lang.separator import SglSeparator, separator
from sglang_tokendance.lang.separator import install as install_separator

install_separator()
install_gen_options()
install_round()
install_routing()

__all__ = ["SglSeparator", "round", "separator", "simulation"]
