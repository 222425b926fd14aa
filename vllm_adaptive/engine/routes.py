"""HTTP route for per-request adaptive telemetry (entry point ``vllm.endpoint_plugins``).

``GET /v1/adaptive/requests/{tag}`` answers ``{"tag": tag, "records": [...]}``
with every kept record of that tag from
:func:`~vllm_adaptive.telemetry_exchange.read_request_records` (oldest first),
or 404 with vLLM's error shape naming the tag.

vLLM 0.32 loads endpoint plugins only when they are named in ``VLLM_PLUGINS``
(routes widen the network surface, so they are opt-in). ``VLLM_PLUGINS`` is
also the allowlist of the general and stat-logger plugin groups, so it must
name the plugin's other entry points too::

    VLLM_PLUGINS=vllm_adaptive,vllm_adaptive_metrics,vllm_adaptive_routes vllm serve ...

(comma-separated, no spaces; logits processors are not filtered by it). The
route sits under ``/v1``, so ``--api-key`` protects it like the OpenAI routes.
"""

from __future__ import annotations

from argparse import Namespace
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from vllm_adaptive.telemetry_exchange import read_request_records

ROUTE = "/v1/adaptive/requests/{tag:path}"


def get_request_records(tag: str) -> JSONResponse:
    # A plain (sync) handler: FastAPI runs it in its thread pool, off the event loop.
    records = read_request_records(tag)
    if not records:
        return JSONResponse(
            status_code=404,
            content={
                "error": {
                    "message": f"no adaptive telemetry records for tag {tag!r}",
                    "type": "NotFoundError",
                    "param": "tag",
                    "code": 404,
                },
                "tag": tag,
            },
        )
    return JSONResponse({"tag": tag, "records": records})


class AdaptiveEndpointPlugin:
    """vLLM ``EndpointPlugin``: adds :data:`ROUTE`; needs no engine access."""

    name = "vllm_adaptive_routes"
    required_tasks = None

    def attach_router(self, app: FastAPI) -> None:
        app.add_api_route(
            ROUTE,
            get_request_records,
            methods=["GET"],
            name="adaptive_request_records",
            summary="Per-request adaptive telemetry records by adaptive_request_tag",
        )

    async def init_state(self, engine_client: Any, state: Any, args: Namespace) -> None:
        return None
