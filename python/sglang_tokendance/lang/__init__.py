"""SGLang frontend-language extension: `sgl.separator()`.

Importing this module adds `separator` to the `sglang` module, so `@sgl.function` programs
can write `s += history + sgl.separator() + block + sgl.separator() + question`.
"""

from sglang_tokendance.lang.separator import SglSeparator, install, separator

install()

__all__ = ["SglSeparator", "separator"]
