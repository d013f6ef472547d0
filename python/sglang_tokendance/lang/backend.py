"""Whether a frontend-language backend serves TokenDance, asked once per backend.

It does when its /server_info has a "tokendance" block (which also names the separator
marker); other backends, or any without /server_info, do not.
"""

from __future__ import annotations

from typing import Any


def tokendance_info(backend: Any) -> dict:
    """The backend's "tokendance" server info, or {} when it does not serve TokenDance (cached)."""
    cached = getattr(backend, "_tokendance_info", None)
    if cached is None:
        info = {}
        if hasattr(backend, "get_server_info"):
            try:
                info = backend.get_server_info() or {}
            except Exception:  # a backend without /server_info is not TokenDance
                info = {}
        cached = info.get("tokendance") or {}
        backend._tokendance_info = cached
    return cached
