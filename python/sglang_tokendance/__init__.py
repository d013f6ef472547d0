"""sglang-tokendance: round-aware KV cache sharing for multi-agent workloads on SGLang."""

__version__ = "0.1.0"

__all__ = ["Engine", "__version__"]

if "sglang" in __import__("sys").modules:  # cheap now: sgl.separator(), sgl.gen(register_output=)
    import sglang_tokendance.lang  # noqa: F401


def __getattr__(name: str):
    # Lazy: importing SGLang takes seconds and must follow the CPU setup in engine.py.
    if name == "Engine":
        from sglang_tokendance.engine import Engine

        return Engine
    raise AttributeError(f"module 'sglang_tokendance' has no attribute {name!r}")
