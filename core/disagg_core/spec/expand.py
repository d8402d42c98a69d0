"""`${NAME}` and `${NAME:-default}` in a pipeline file's strings, from the environment.

`disagg up` and `disagg validate` read pipeline files on the user's machine, where a model
directory (or any other local setting) differs from one machine to the next; the examples
name theirs as `${DISAGG_TINY_LLM:-/tmp/disagg-tiny-llm}`. Expansion runs on the parsed
document's string values, never on its text, so a variable's value is always one string
and cannot add YAML structure; keys are not expanded. `$${` is a literal `${`. A variable
that is unset and has no default is a problem at the field's path. The operator does not
expand: what the API server holds is what runs.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from disagg_core.spec.fields import Collector, child

_REFERENCE = re.compile(r"\$\$\{|\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


def expand(doc: object, environ: Mapping[str, str], out: Collector, path: str = "") -> object:
    """`doc` with every string value's references replaced (a new tree; `doc` is kept)."""
    if isinstance(doc, str):
        return _expand_text(doc, environ, out, path)
    if isinstance(doc, dict):
        return {
            key: expand(value, environ, out, child(path, key) if isinstance(key, str) else path)
            for key, value in doc.items()
        }
    if isinstance(doc, list):
        return [expand(item, environ, out, f"{path}[{i}]") for i, item in enumerate(doc)]
    return doc


def _expand_text(text: str, environ: Mapping[str, str], out: Collector, path: str) -> str:
    if "$" not in text:
        return text

    def value(match: re.Match[str]) -> str:
        if match.group(0) == "$${":
            return "${"
        name, default = match.group(1), match.group(2)
        found = environ.get(name)
        if found is not None and (found or default is None):
            return found
        if default is not None:
            return default
        out.add(path, f"${{{name}}} is not set (give it a default: ${{{name}:-VALUE}})")
        return match.group(0)

    return _REFERENCE.sub(value, text)
