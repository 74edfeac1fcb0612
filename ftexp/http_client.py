"""HTTP clients that never send a request on a connection the server is about to close.

Our rollout engines and control server, and sglang's servers, run under uvicorn, which closes a
connection idle for 5 s. httpx keeps an idle connection for 5 s as well, so a request sent about 5 s
after the previous one could go out on a connection the server was closing at that moment: "Server
disconnected without sending a response", for a request that never ran.
Forgetting idle connections well before the server does leaves no such window.
"""

from __future__ import annotations

from typing import Any

import httpx

KEEPALIVE_EXPIRY_S = 2.0  # well below uvicorn's 5 s


def short_keepalive_client(**kwargs: Any) -> httpx.Client:
    """An ``httpx.Client`` (same arguments) whose idle connections expire after ``KEEPALIVE_EXPIRY_S``."""
    return httpx.Client(limits=httpx.Limits(keepalive_expiry=KEEPALIVE_EXPIRY_S), **kwargs)
