"""`/openapi.json`: the gateway's API as an OpenAPI 3.1 document (docs/api.md explains it)."""

from __future__ import annotations

from typing import Any

from disagg_runtime.wire.codec import DTYPES

_ERROR = {"$ref": "#/components/schemas/Error"}
_TENSOR = {
    "type": "object",
    "required": ["dtype", "shape", "data"],
    "additionalProperties": False,
    "properties": {
        "dtype": {
            "type": "string",
            "enum": list(DTYPES),  # the codec's allow-list
        },
        "shape": {"type": "array", "items": {"type": "integer", "minimum": 0}},
        "data": {"type": "string", "contentEncoding": "base64", "description": "C order bytes"},
    },
}


def _errors(*codes: int) -> dict[str, Any]:
    text = {
        400: "malformed input; error.param is its JSON path",
        401: "missing or wrong bearer token",
        404: "unknown model",
        408: "the request body did not arrive in time, or stalled (no byte for 5 s)",
        411: "safetensors body without Content-Length",
        413: "body over the size limit (JSON: 16 MiB), or a payload no entry pool can hold",
        415: "unsupported Content-Type",
        429: "the entry role or the gateway refused for load; see Retry-After",
        502: "a role failed: error.role, error.replica, error.exception",
        503: "no entry role reachable; see Retry-After",
        504: "no result within the pipeline's request timeout",
    }
    return {
        str(c): {"description": text[c], "content": {"application/json": {"schema": _ERROR}}}
        for c in codes
    }


def _json(schema: dict[str, Any]) -> dict[str, Any]:
    return {"application/json": {"schema": schema}}


def document(api: str, model: str) -> dict[str, Any]:
    failures = _errors(400, 401, 408, 413, 429, 502, 503, 504)
    paths: dict[str, Any] = {
        "/v1/infer": {
            "post": {
                "summary": "Run one request through the pipeline",
                "requestBody": {
                    "required": True,
                    "content": {
                        **_json(
                            {
                                "type": "object",
                                "required": ["inputs"],
                                "properties": {"inputs": {"$ref": "#/components/schemas/Value"}},
                            }
                        ),
                        "application/vnd.safetensors": {
                            "schema": {"type": "string", "format": "binary"},
                            "description": "tensors by dotted path; other values as JSON "
                            "text in the metadata, by dotted path",
                        },
                    },
                },
                "responses": {
                    "200": {
                        "description": "the exit role's result, encoded as chosen by Accept",
                        "content": {
                            **_json(
                                {
                                    "type": "object",
                                    "properties": {
                                        "outputs": {"$ref": "#/components/schemas/Value"}
                                    },
                                }
                            ),
                            "application/vnd.safetensors": {
                                "schema": {"type": "string", "format": "binary"}
                            },
                            "text/event-stream": {
                                "schema": {"type": "string"},
                                "description": "event `chunk` per chunk (data: a Value), then "
                                '`end` (data: {"chunks": n}); a failure after the first '
                                "chunk is an `error` event carrying the error object and status",
                            },
                        },
                    },
                    **failures,
                    **_errors(411, 415),
                },
            }
        },
        "/healthz": {"get": {"summary": "liveness", "responses": {"200": {"description": "ok"}}}},
        "/readyz": {
            "get": {
                "summary": "ready when every entry role is reachable",
                "responses": {"200": {"description": "ready"}, "503": {"description": "not"}},
            }
        },
        "/metrics": {
            "get": {"summary": "Prometheus metrics", "responses": {"200": {"description": "text"}}}
        },
    }
    if api == "openai":
        body = {
            "type": "object",
            "required": ["model"],
            "additionalProperties": True,
            "properties": {
                "model": {"type": "string", "enum": [model]},
                "max_tokens": {"type": "integer", "minimum": 1},
                "temperature": {"type": "number", "minimum": 0, "maximum": 2},
                "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
                "seed": {"type": "integer"},
                "stop": {
                    "oneOf": [
                        {"type": "string"},
                        {"type": "array", "maxItems": 4, "items": {"type": "string"}},
                    ]
                },
                "stream": {"type": "boolean"},
            },
        }
        ok = {
            "200": {
                "description": "an OpenAI completion object, or with stream=true its "
                "chunks as server-sent events ending with `data: [DONE]`"
            }
        }
        paths["/v1/models"] = {
            "get": {
                "summary": "the served model",
                "responses": {"200": {"description": "model list"}},
            }
        }
        paths["/v1/completions"] = {
            "post": {
                "summary": "OpenAI text completion",
                "requestBody": {"content": _json(body)},
                "responses": {**ok, **failures, **_errors(404)},
            }
        }
        paths["/v1/chat/completions"] = {
            "post": {
                "summary": "OpenAI chat completion",
                "requestBody": {"content": _json(body)},
                "responses": {**ok, **failures, **_errors(404)},
            }
        }
    return {
        "openapi": "3.1.0",
        "info": {"title": "disagg gateway", "version": "v1"},
        "components": {
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
            "schemas": {
                "Tensor": _TENSOR,
                "Value": {
                    "description": "JSON; an object with exactly dtype, shape and data is a tensor",
                    "oneOf": [{"$ref": "#/components/schemas/Tensor"}, {}],
                },
                "Error": {
                    "type": "object",
                    "properties": {
                        "error": {
                            "type": "object",
                            "properties": {
                                "message": {"type": "string"},
                                "type": {"type": "string"},
                                "code": {"type": ["string", "null"]},
                                "param": {"type": ["string", "null"]},
                                "role": {"type": "string"},
                                "replica": {"type": "string"},
                                "exception": {"type": "string"},
                            },
                        }
                    },
                },
            },
        },
        "security": [{"bearer": []}, {}],
        "paths": paths,
    }
