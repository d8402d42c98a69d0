"""Kubernetes' metav1.Time: RFC 3339 in UTC, whole seconds (status times, scale decisions)."""

from __future__ import annotations

import datetime
from typing import Final

TIME_FORMAT: Final = "%Y-%m-%dT%H:%M:%SZ"


def format_time(moment: datetime.datetime) -> str:
    """RFC 3339 in UTC, whole seconds, as Kubernetes writes metav1.Time."""
    if moment.tzinfo is None:
        raise ValueError("a timezone-aware datetime is required")
    return moment.astimezone(datetime.UTC).strftime(TIME_FORMAT)


def parse_time(value: object) -> datetime.datetime | None:
    """A metav1.Time string as a UTC datetime; None when absent or malformed."""
    if not isinstance(value, str):
        return None
    try:
        parsed = datetime.datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=datetime.UTC)
