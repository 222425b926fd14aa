"""OpenAI-compatible HTTP server for the MLX backend: ``vllm-adaptive serve --backend mlx``.

The contract is the vLLM path's: ``POST /v1/completions`` and ``/v1/chat/completions``
(streaming or not), ``GET /v1/models``, ``GET /health``, the per-request telemetry route
``GET /v1/adaptive/requests/{tag}`` (always on here: there is no plugin allowlist), and the
engine config as ``--additional-config '{"adaptive": {...}}'``. Per-request adaptive keys are
those of the vLLM path, in ``vllm_xargs`` as a vLLM client sends them (or at the top level of
the body, as an mlx-lm client would add them); a bad key is HTTP 400 in vLLM's error shape
with ``param`` naming it, for streaming requests too (validation runs before any byte is
sent). As on vLLM, a knob this engine cannot honour (a gear without precision gears, a depth
budget without adaptive depth) is HTTP 400 naming why.

Built on the standard library's ``http.server`` (as ``mlx_lm.server`` is), so a Mac needs
nothing beyond mlx and mlx-lm. Requests run one at a time (MLX holds one model; a second
request waits for the first), which is also mlx-lm's server model.

Over 400 lines because it carries the OpenAI routes the vLLM server offers (completions, chat,
streaming, the per-request route) on the standard library alone.
"""

from __future__ import annotations

import argparse
import json
import logging
import threading
import time
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import unquote

from vllm_adaptive.config import ADDITIONAL_CONFIG_KEY, AdaptiveConfigError, load_config_arg
from vllm_adaptive.overrides import (
    EXTRA_ARGS_PREFIX,
    RequestOverrideError,
    RequestOverrides,
    check_honoured,
    check_overrides,
    parse_overrides,
)

logger = logging.getLogger("vllm_adaptive.mlx.server")

TELEMETRY_ROUTE = "/v1/adaptive/requests/"
DEFAULT_MAX_TOKENS = 16  # the OpenAI completions default


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


# -- request parsing (no MLX: unit-testable) ---------------------------------------------------
def _number(body: dict[str, Any], key: str, default: float, lo: float, hi: float) -> float:
    value = body.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BadRequest(f"{key} must be a number, got {value!r}", key)
    if not lo <= value <= hi:
        raise BadRequest(f"{key} must be in [{lo}, {hi}], got {value!r}", key)
    return float(value)


_UNKNOWN: Any = object()


def _int(body: dict[str, Any], key: str, default: int | None, lo: int) -> int | None:
    value = body.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(f"{key} must be an integer, got {value!r}", key)
    if value < lo:
        raise BadRequest(f"{key} must be >= {lo}, got {value!r}", key)
    return value


def adaptive_overrides(body: dict[str, Any], engine_config: Any = _UNKNOWN) -> RequestOverrides:
    """The request's ``adaptive_*`` keys (``vllm_xargs`` and top level), validated as in the
    vLLM path: `BadRequest` naming the key; with ``engine_config`` (the engine's
    ``AdaptiveConfig``) also what that engine cannot honour, naming why."""
    xargs = body.get("vllm_xargs") or {}
    if not isinstance(xargs, dict):
        raise BadRequest("vllm_xargs must be an object", "vllm_xargs")
    top = {k: v for k, v in body.items() if isinstance(k, str) and k.startswith(EXTRA_ARGS_PREFIX)}
    both = sorted(set(top) & {k for k in xargs if k.startswith(EXTRA_ARGS_PREFIX)})
    if both:
        raise BadRequest(f"{both[0]} given both in vllm_xargs and at the top level", both[0])
    try:
        sent = {**xargs, **top}
        overrides = parse_overrides(sent)
        check_overrides(overrides)
        if engine_config is not _UNKNOWN:
            check_honoured(overrides, engine_config, sent)
    except RequestOverrideError as e:
        raise BadRequest(str(e), e.parameter) from None
    return overrides


def sampling_fields(body: dict[str, Any]) -> dict[str, Any]:
    """Validated sampling fields of a completions / chat body."""
    n = _int(body, "n", 1, 1)
    if n != 1:
        raise BadRequest("n > 1 is not supported by the MLX backend", "n")
    if body.get("best_of") not in (None, 1):
        raise BadRequest("best_of is not supported by the MLX backend", "best_of")
    for key in ("logprobs", "top_logprobs", "echo", "suffix", "tools"):
        if body.get(key) not in (None, False, []):
            raise BadRequest(f"{key} is not supported by the MLX backend", key)
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    key = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    max_tokens = _int({key: max_tokens}, key, DEFAULT_MAX_TOKENS, 1)
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and (
        not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop)
    ):
        raise BadRequest("stop must be a string or a list of non-empty strings", "stop")
    stream_options = body.get("stream_options") or {}
    if not isinstance(stream_options, dict):
        raise BadRequest("stream_options must be an object", "stream_options")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("stream must be a boolean", "stream")
    return {
        "max_tokens": max_tokens,
        "temperature": _number(body, "temperature", 1.0, 0.0, 2.0),
        "top_p": _number(body, "top_p", 1.0, 0.0, 1.0),
        "top_k": max(_int(body, "top_k", 0, -1), 0),  # -1 (vLLM's "all") is 0 here
        "seed": _int(body, "seed", None, 0),
        "stop": stop or [],
        "stream": stream,
        "include_usage": bool(stream_options.get("include_usage", False)),
        "ignore_eos": bool(body.get("ignore_eos", False)),
    }


def error_body(message: str, param: str | None, code: int, kind: str) -> dict[str, Any]:
    """vLLM's (OpenAI's) error shape."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


# -- text assembly -----------------------------------------------------------------------------
class TextStream:
    """Token ids in, text deltas out; holds back an incomplete UTF-8 tail and any text that
    could still become a stop string."""

    def __init__(self, tokenizer: Any, stop: list[str]) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.ids: list[int] = []
        self.sent = 0
        self.stopped = False

    def _text(self) -> str:
        return self.tokenizer.decode(self.ids, skip_special_tokens=True)

    def add(self, token: int) -> str:
        self.ids.append(token)
        text = self._text()
        for s in self.stop:
            i = text.find(s)
            if i >= 0:
                self.stopped = True
                out, self.sent = text[self.sent : i], max(self.sent, i)
                return out
        if text.endswith("\ufffd"):
            return ""
        hold = max((len(s) - 1 for s in self.stop), default=0)
        safe = len(text) - hold
        if safe <= self.sent:
            return ""
        out, self.sent = text[self.sent : safe], safe
        return out

    def flush(self) -> str:
        if self.stopped:
            return ""
        text = self._text()
        out, self.sent = text[self.sent :], len(text)
        return out


# -- the server --------------------------------------------------------------------------------
class MlxServer:
    """The engine behind a lock, and the request handling that does not touch HTTP."""

    def __init__(self, engine: Any, served_name: str) -> None:
        self.engine = engine
        self.served_name = served_name
        self.lock = threading.Lock()

    def prompt_ids(self, body: dict[str, Any], chat: bool) -> list[int]:
        tok = self.engine.tokenizer
        if chat:
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                raise BadRequest("messages must be a non-empty list", "messages")
            for m in messages:
                if not isinstance(m, dict) or not isinstance(m.get("content"), str):
                    raise BadRequest("each message needs a string content", "messages")
            text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            return list(tok.encode(text, add_special_tokens=False))
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str) and prompt:
            return list(tok.encode(prompt))
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        raise BadRequest("prompt must be a non-empty string or list of token ids", "prompt")

    def prepare(self, body: Any, chat: bool) -> dict[str, Any]:
        """Everything a request needs, validated before any byte of a response is sent."""
        if not isinstance(body, dict):
            raise BadRequest("the request body must be a JSON object")
        model = body.get("model")
        if model is not None and model != self.served_name:
            raise BadRequest(f"model {model!r} is not served here ({self.served_name!r})", "model")
        fields = sampling_fields(body)
        overrides = adaptive_overrides(body, self.engine.config)
        return {"ids": self.prompt_ids(body, chat), "overrides": overrides, **fields}

    def run(self, req: dict[str, Any]) -> Iterator[tuple[str, str | None]]:
        """(text delta, finish reason) pairs; the last one has the reason."""
        from vllm_adaptive.metal_backend.engine import Sampling

        e = self.engine
        sampling = Sampling(req["temperature"], req["top_p"], req["top_k"], req["seed"])
        stop_ids = set() if req["ignore_eos"] else e.eos_token_ids
        text = TextStream(e.tokenizer, req["stop"])
        n = 0
        reason = "length"
        with self.lock:
            gen = e.generate(req["ids"], req["max_tokens"], sampling, req["overrides"], stop_ids)
            try:
                for tok in gen:
                    n += 1
                    if tok in stop_ids:
                        reason = "stop"
                        break
                    delta = text.add(tok)
                    if text.stopped:
                        reason = "stop"
                        if delta:
                            yield delta, None
                        break
                    if delta:
                        yield delta, None
            finally:
                gen.close()
        req["completion_tokens"] = n
        yield text.flush(), reason


def _usage(req: dict[str, Any]) -> dict[str, int]:
    p, c = len(req["ids"]), req.get("completion_tokens", 0)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


class Handler(BaseHTTPRequestHandler):
    server_version = "vllm-adaptive-mlx"
    protocol_version = "HTTP/1.1"
    app: MlxServer  # set by `make_http_server`

    def log_message(self, fmt: str, *args: Any) -> None:
        logger.info("%s " + fmt, self.address_string(), *args)

    def _json(self, code: int, payload: dict[str, Any]) -> None:
        data = json.dumps(payload).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _error(self, code: int, message: str, param: str | None = None) -> None:
        kind = {400: "BadRequestError", 404: "NotFoundError"}.get(code, "InternalServerError")
        self._json(code, error_body(message, param, code, kind))

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        path = self.path.split("?", 1)[0]
        app = self.app
        if path in ("/health", "/ping"):
            self._json(200, {"status": "ok"})
        elif path == "/v1/models":
            self._json(
                200,
                {
                    "object": "list",
                    "data": [
                        {
                            "id": app.served_name,
                            "object": "model",
                            "created": 0,
                            "owned_by": "vllm-adaptive",
                            "root": app.engine.model_dir,
                        }
                    ],
                },
            )
        elif path.startswith(TELEMETRY_ROUTE):
            tag = unquote(path[len(TELEMETRY_ROUTE) :])
            records = app.engine.request_records(tag)
            if not records:
                self._json(
                    404,
                    {
                        **error_body(
                            f"no adaptive telemetry records for tag {tag!r}",
                            "tag",
                            404,
                            "NotFoundError",
                        ),
                        "tag": tag,
                    },
                )
            else:
                self._json(200, {"tag": tag, "records": records})
        elif path == "/v1/adaptive/engine":
            tel = app.engine.telemetry()
            for section in ("precision", "depth"):
                if section in tel:
                    tel[section] = {k: v for k, v in tel[section].items() if k != "finished"}
            self._json(200, tel)
        else:
            self._error(404, f"no route {path}")

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        path = self.path.split("?", 1)[0]
        chat = path == "/v1/chat/completions"
        if path not in ("/v1/completions", "/v1/chat/completions"):
            self._error(404, f"no route {path}")
            return
        try:
            length = int(self.headers.get("Content-Length", "0"))
            body = json.loads(self.rfile.read(length) or b"null")
            req = self.app.prepare(body, chat)
        except json.JSONDecodeError as e:
            self._error(400, f"the request body is not JSON: {e}")
            return
        except BadRequest as e:
            self._error(400, str(e), e.param)
            return
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        try:
            if req["stream"]:
                self._stream(req, rid, created, chat)
            else:
                parts = list(self.app.run(req))
                text = "".join(delta for delta, _ in parts)
                self._json(200, self._final(req, rid, created, chat, text, parts[-1][1]))
        except (BrokenPipeError, ConnectionResetError):
            logger.info("client went away during %s", rid)
        except Exception as e:  # noqa: BLE001 - a failed request must not kill the server
            logger.exception("request %s failed", rid)
            if not req["stream"]:
                self._error(500, f"{type(e).__name__}: {e}")

    def _final(self, req, rid, created, chat, text, reason) -> dict[str, Any]:
        name = self.app.served_name
        if chat:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": reason,
                "logprobs": None,
            }
            kind = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "finish_reason": reason, "logprobs": None}
            kind = "text_completion"
        return {
            "id": rid,
            "object": kind,
            "created": created,
            "model": name,
            "choices": [choice],
            "usage": _usage(req),
        }

    def _chunk(self, rid, created, chat, delta, reason, first=False) -> dict[str, Any]:
        if chat:
            d: dict[str, Any] = {"content": delta}
            if first:
                d["role"] = "assistant"
            choice = {"index": 0, "delta": d, "finish_reason": reason, "logprobs": None}
            kind = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": delta, "finish_reason": reason, "logprobs": None}
            kind = "text_completion"
        return {
            "id": rid,
            "object": kind,
            "created": created,
            "model": self.app.served_name,
            "choices": [choice],
        }

    def _send_event(self, payload: Any) -> None:
        data = payload if isinstance(payload, str) else json.dumps(payload)
        chunk = f"data: {data}\n\n".encode()
        self.wfile.write(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
        self.wfile.flush()

    def _stream(self, req, rid, created, chat) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        first = True
        for delta, reason in self.app.run(req):
            if delta or reason is not None or (chat and first):
                self._send_event(self._chunk(rid, created, chat, delta, reason, first))
                first = False
        if req["include_usage"]:
            usage = self._chunk(rid, created, chat, "", None)
            usage["choices"] = []
            usage["usage"] = _usage(req)
            self._send_event(usage)
        self._send_event("[DONE]")
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()


def make_http_server(app: MlxServer, host: str, port: int) -> ThreadingHTTPServer:
    handler = type("BoundHandler", (Handler,), {"app": app})
    server = ThreadingHTTPServer((host, port), handler)
    server.daemon_threads = True
    return server


# -- command line ------------------------------------------------------------------------------
def adaptive_section(additional_config: str | None) -> dict[str, Any]:
    """The ``adaptive`` section of a ``--additional-config`` value ({} when absent)."""
    if not additional_config:
        return {}
    text = additional_config
    try:
        value = json.loads(text) if text.strip().startswith("{") else None
    except json.JSONDecodeError as e:
        raise AdaptiveConfigError(f"--additional-config: not valid JSON: {e}") from None
    if value is None:
        from pathlib import Path

        value = json.loads(Path(text).read_text())
    if not isinstance(value, dict):
        raise AdaptiveConfigError("--additional-config: expected a JSON object")
    other = sorted(set(value) - {ADDITIONAL_CONFIG_KEY})
    if other:
        raise AdaptiveConfigError(
            f"--additional-config: unknown keys {other} (the MLX backend reads "
            f'"{ADDITIONAL_CONFIG_KEY}" only)'
        )
    section = value.get(ADDITIONAL_CONFIG_KEY, {})
    return load_config_arg(json.dumps(section))


def run_from_args(args: argparse.Namespace) -> int:
    from pathlib import Path

    from vllm_adaptive.metal_backend import require_mlx

    require_mlx()
    from vllm_adaptive.metal_backend.engine import MlxEngine

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    adaptive = adaptive_section(args.additional_config)
    engine = MlxEngine(
        args.model, adaptive, dtype=args.dtype, num_speculative_tokens=args.num_speculative_tokens
    )
    name = args.served_model_name or Path(args.model).name
    app = MlxServer(engine, name)
    server = make_http_server(app, args.host, args.port)
    logger.info(
        "serving %s (mlx %s, %s, mechanism %s) on http://%s:%d",
        name,
        engine.telemetry()["device"],
        engine.dtype,
        engine.mechanism,
        args.host,
        server.server_address[1],
    )
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0
