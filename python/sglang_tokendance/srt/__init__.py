"""Thin adapters into SGLang 0.5.23's extension points; the algorithms live in core/."""
