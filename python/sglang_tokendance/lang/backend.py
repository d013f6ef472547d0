"""Whether a frontend-language backend serves TokenDance, asked once per backend.

It does when its /server_info has a "tokendance" block (which also names the separator
marker). Behind SGLang's router, which answers /server_info with a 404, the router's worker
list (`GET /workers`) names the workers, and the first healthy one that answers says. Other
backends, or any that cannot say, do not.
"""

from __future__ import annotations

from typing import Any

from sglang.lang.backend import runtime_endpoint


def tokendance_info(backend: Any) -> dict:
    """The backend's "tokendance" server info, or {} when it does not serve TokenDance (cached)."""
    cached = getattr(backend, "_tokendance_info", None)
    if cached is None:
        info = {}
        if hasattr(backend, "get_server_info"):
            try:
                info = backend.get_server_info() or {}
            except Exception:  # no /server_info: a router, or not TokenDance
                info = _worker_server_info(backend)
        cached = info.get("tokendance") or {}
        backend._tokendance_info = cached
    return cached


def _worker_server_info(backend: Any) -> dict:
    """/server_info of the first healthy worker a router lists ({} if none answers)."""
    base_url = getattr(backend, "base_url", None)
    if base_url is None:
        return {}
    try:
        workers = _get_json(backend, f"{base_url}/workers").get("workers") or []
    except Exception:  # not a router
        return {}
    for worker in workers:
        if isinstance(worker, dict) and worker.get("is_healthy") and isinstance(worker.get("url"), str):
            try:
                return _get_json(backend, worker["url"].split("@")[0] + "/server_info")  # "@rank": --dp-aware
            except Exception:  # unreachable from here: try the next
                continue
    return {}


def _get_json(backend: Any, url: str) -> dict:
    response = runtime_endpoint.http_request(url, api_key=backend.api_key, verify=backend.verify)
    if response.status_code != 200:
        raise RuntimeError(f"{url}: HTTP {response.status_code}")
    answer = response.json()
    if not isinstance(answer, dict):
        raise RuntimeError(f"{url}: not a JSON object")
    return answer
