"""What a client sends so that SGLang's router (`sglang-router` 0.3.2) keeps a simulation on the
worker that holds its Masters, and passes TokenDance's options on.

The router routes by the header below under `--policy manual` (one key per simulation). It
re-serialises request bodies and drops every field it does not know, a top-level `tokendance`
included, on /generate and /v1/chat/completions; it keeps the string maps `custom_labels`
(/generate) and `metadata` (OpenAI), where the options go as JSON text (srt/request reads them).
"""

from __future__ import annotations

import json
from typing import Any

ROUTING_HEADER = "X-SMG-Routing-Key"
OPTIONS_LABEL = "tokendance"  # the key of the options' JSON text in `custom_labels` / `metadata`


def options_label(options: dict[str, Any]) -> dict[str, str]:
    """The `custom_labels` (or `metadata`) entry that carries `options` through the router."""
    return {OPTIONS_LABEL: json.dumps(options)}
