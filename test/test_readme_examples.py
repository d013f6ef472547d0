"""The README's "Serve your own app" examples run as printed and show the cache hit they claim.

Each example is a ```python block whose first line is `# example: NAME`; it reads the server's
URL from TOKENDANCE_URL and prints one `segment_hits=N reused_tokens=M ...` line per request.
The slow tests run each as a script of its own against the session's default server, emptied
first; the router example runs in test_router_server.py, against its router."""

from __future__ import annotations

import contextlib
import io
import os
import re
from pathlib import Path
from unittest import mock

import pytest

from conftest import emptied

README = Path(__file__).resolve().parent.parent / "README.md"
EXAMPLE = re.compile(r"^```python\n# example: (\S+)\n(.*?)^```$", re.MULTILINE | re.DOTALL)
ON_ONE_SERVER = ["generate", "chat", "sgl"]  # "router" needs a router: test_router_server.py


def readme_examples() -> dict[str, str]:
    """Name -> the code of each marked example, in README order."""
    return {name: f"# example: {name}\n{code}" for name, code in EXAMPLE.findall(README.read_text())}


def run_example(name: str, url: str) -> list[tuple[int, int | None]]:
    """Run README example `name` against `url` as a script of its own (fresh globals, its own
    imports; in this process, which has imported SGLang already): (segment_hits, reused_tokens or
    None) per printed line. SGLang's frontend default backend is put back after."""
    from sglang.lang.global_config import global_config

    backend, out = global_config.default_backend, io.StringIO()
    try:
        with mock.patch.dict(os.environ, {"TOKENDANCE_URL": url}), contextlib.redirect_stdout(out):
            exec(compile(readme_examples()[name], "README.md", "exec"), {"__name__": "__main__"})
    finally:
        global_config.default_backend = backend
    counts = re.findall(r"segment_hits=(\d+)(?: reused_tokens=(\d+))?", out.getvalue())
    assert counts, out.getvalue()
    return [(int(hits), int(reused) if reused else None) for hits, reused in counts]


def test_every_example_is_found_and_reads_its_url_from_the_environment():
    examples = readme_examples()
    assert list(examples) == [*ON_ONE_SERVER, "router"]
    for code in examples.values():
        assert 'os.environ.get("TOKENDANCE_URL", "http://127.0.0.1:30000")' in code
        compile(code, "README.md", "exec")


@pytest.mark.slow
@pytest.mark.parametrize("name", ON_ONE_SERVER)
def test_example_shows_a_cache_hit(name, default_server_url):
    counts = run_example(name, emptied(default_server_url))
    assert len(counts) == 2  # two agents' requests
    assert min(hits for hits, _ in counts) == 0  # the first (or the round's leader) found nothing cached
    assert any(hits >= 1 and reused > 0 for hits, reused in counts), counts  # the other read its blocks
