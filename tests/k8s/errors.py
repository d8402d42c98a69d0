"""Kubernetes ``Status`` failures as the emulator raises and renders them."""

from __future__ import annotations

from typing import Any

import kmock

from .resources import ResourceType

JSON = dict[str, Any]


def api_error(code: int, reason: str, message: str, **details: Any) -> kmock.KubernetesError:
    """A Kubernetes ``Status`` failure (kmock's error type, rendered by ``_render_error``)."""
    return kmock.KubernetesError(status=code, reason=reason, message=message, details=details)


def _not_found(rt: ResourceType, name: str) -> kmock.KubernetesError:
    return api_error(
        404,
        "NotFound",
        f'{rt.qualified} "{name}" not found',
        name=name,
        group=rt.group,
        kind=rt.plural,
    )


def _conflict(rt: ResourceType, name: str, why: str) -> kmock.KubernetesError:
    return api_error(
        409,
        "Conflict",
        f'Operation cannot be fulfilled on {rt.qualified} "{name}": {why}',
        name=name,
        group=rt.group,
        kind=rt.plural,
    )


def _invalid(rt: ResourceType, name: str, message: str) -> kmock.KubernetesError:
    return api_error(
        422,
        "Invalid",
        f'{rt.kind} "{name}" is invalid: {message}',
        name=name,
        group=rt.group,
        kind=rt.kind,
    )


def _bad_request(message: str) -> kmock.KubernetesError:
    return api_error(400, "BadRequest", message)


def status_body(exc: kmock.KubernetesError) -> JSON:
    """The ``Status`` object a failed request answers with."""
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": exc.message or "",
        "reason": exc.reason or "",
        "details": exc.details or {},
        "code": exc.status,
    }
