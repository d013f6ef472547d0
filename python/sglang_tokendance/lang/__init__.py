"""SGLang frontend-language extension: `sgl.separator()` and `sgl.gen(..., register_output=True)`.

Importing this module adds `separator` to the `sglang` module and the `register_output`
keyword to `sglang.gen`, so `@sgl.function` programs can write
`s += history + sgl.separator() + block + sgl.separator() + question` and
`s += sgl.gen("answer", register_output=True)`.
"""

from sglang_tokendance.lang.register_output import install as install_register_output
from sglang_tokendance.lang.separator import SglSeparator, separator
from sglang_tokendance.lang.separator import install as install_separator

install_separator()
install_register_output()

__all__ = ["SglSeparator", "separator"]
