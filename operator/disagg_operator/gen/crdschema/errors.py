"""Field errors as the API server words them (k8s.io/apimachinery's field.Error):
`<path>: <type>: <detail>`, and the 422 message that lists them."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

REQUIRED: Final = "FieldValueRequired"
INVALID: Final = "FieldValueInvalid"
FORBIDDEN: Final = "FieldValueForbidden"
NOT_SUPPORTED: Final = "FieldValueNotSupported"
TOO_LONG: Final = "FieldValueTooLong"
TOO_MANY: Final = "FieldValueTooMany"
DUPLICATE: Final = "FieldValueDuplicate"
TYPE_INVALID: Final = "FieldValueTypeInvalid"

_WORDS: Final = {
    REQUIRED: "Required value",
    INVALID: "Invalid value",
    FORBIDDEN: "Forbidden",
    NOT_SUPPORTED: "Unsupported value",
    TOO_LONG: "Too long",
    TOO_MANY: "Too many",
    DUPLICATE: "Duplicate value",
    TYPE_INVALID: "Invalid value",
}
_NO_VALUE: Final = object()


def show(value: Any) -> str:
    """A value as field errors print it: strings quoted, numbers plain, nil as "null", the
    rest as JSON."""
    if value is None:
        return '"null"'
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


@dataclass(frozen=True)
class FieldError:
    """One field error: `kind` (a cause reason, e.g. FieldValueInvalid), `path`
    (`spec.roles[0].name`), `detail`, and the offending `value` when the wording shows it."""

    kind: str
    path: str
    detail: str = ""
    value: Any = _NO_VALUE

    def __str__(self) -> str:
        words = _WORDS[self.kind]
        if (
            self.kind in (INVALID, TYPE_INVALID, NOT_SUPPORTED, DUPLICATE)
            and self.value is not _NO_VALUE
        ):
            text = f"{self.path}: {words}: {show(self.value)}"
        else:
            text = f"{self.path}: {words}"
        return f"{text}: {self.detail}" if self.detail else text

    def cause(self) -> dict[str, str]:
        """The entry of a Status' details.causes."""
        message = str(self)[len(self.path) + 2 :]
        return {"reason": self.kind, "message": message, "field": self.path}


def aggregate(errors: Sequence[FieldError]) -> str:
    """field.ErrorList.ToAggregate(): one error as is, several as `[a, b]`."""
    texts = list(dict.fromkeys(str(e) for e in errors))
    return texts[0] if len(texts) == 1 else "[" + ", ".join(texts) + "]"


def invalid_message(kind: str, name: str, errors: Sequence[FieldError], group: str = "") -> str:
    """`DisaggregatedPipeline.disagg.dev "x" is invalid: <errors>` (a 422's message; kubectl
    shows it as `The DisaggregatedPipeline "x" is invalid: <errors>`)."""
    qualified = f"{kind}.{group}" if group else kind
    return f'{qualified} "{name}" is invalid: {aggregate(errors)}'


def child(path: str, key: str) -> str:
    """`path.key`, or `key` at the root."""
    return f"{path}.{key}" if path else key
