"""Protobuf request bodies, as kubectl's generators send them (``kubectl create namespace``,
``create configmap``, ``create secret generic``, ``create serviceaccount``): the
``k8s\\x00`` envelope (runtime.Unknown) around the object's protobuf, decoded for the few
kinds they make, with the field numbers of k8s.io/api's generated.proto. The emulator
answers in JSON, which these clients accept as well."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from typing import Any, Final

import attrs
from kmock._internal import rendering

from .errors import api_error
from .resources import ResourceType

JSON = dict[str, Any]
MAGIC: Final = b"k8s\x00"
Fields = list[tuple[int, int, Any]]  # (number, wire type, value: int or bytes)


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    shift = result = 0
    while True:
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7


def fields(data: bytes) -> Iterator[tuple[int, int, Any]]:
    """The (number, wire type, value) of each field of one message."""
    pos = 0
    while pos < len(data):
        key, pos = _varint(data, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(data, pos)
            yield number, wire, value
        elif wire == 2:
            size, pos = _varint(data, pos)
            yield number, wire, data[pos : pos + size]
            pos += size
        elif wire == 1:
            yield number, wire, data[pos : pos + 8]
            pos += 8
        elif wire == 5:
            yield number, wire, data[pos : pos + 4]
            pos += 4
        else:
            raise ValueError(f"unsupported protobuf wire type {wire}")


def _text(value: bytes) -> str:
    return value.decode("utf-8")


def _string_map(entries: list[bytes], *, binary: bool = False) -> dict[str, str]:
    out: dict[str, str] = {}
    for entry in entries:
        parts = {n: v for n, _, v in fields(entry)}
        key = _text(parts.get(1, b""))
        raw = parts.get(2, b"")
        out[key] = base64.b64encode(raw).decode() if binary else _text(raw)
    return out


def _grouped(data: bytes) -> dict[int, list[Any]]:
    grouped: dict[int, list[Any]] = {}
    for number, _, value in fields(data):
        grouped.setdefault(number, []).append(value)
    return grouped


def object_meta(data: bytes) -> JSON:
    """ObjectMeta: name 1, generateName 2, namespace 3, labels 11, annotations 12,
    finalizers 14."""
    g = _grouped(data)
    meta: JSON = {}
    for number, key in ((1, "name"), (2, "generateName"), (3, "namespace")):
        if number in g and g[number][-1]:
            meta[key] = _text(g[number][-1])
    if 11 in g:
        meta["labels"] = _string_map(g[11])
    if 12 in g:
        meta["annotations"] = _string_map(g[12])
    if 14 in g:
        meta["finalizers"] = [_text(v) for v in g[14]]
    return meta


def decode(body: bytes, rt: ResourceType) -> JSON:
    """The JSON form of a protobuf body for ``rt`` (Namespace, ConfigMap, Secret,
    ServiceAccount); 415 for other kinds, as a server without their protobuf would."""
    if not body.startswith(MAGIC):
        raise api_error(400, "BadRequest", "the protobuf body lacks the k8s envelope")
    envelope = _grouped(body[len(MAGIC) :])
    type_meta = _grouped(envelope.get(1, [b""])[-1])
    api_version = _text(type_meta.get(1, [b""])[-1])
    kind = _text(type_meta.get(2, [b""])[-1])
    raw = envelope.get(2, [b""])[-1]
    if kind not in ("Namespace", "ConfigMap", "Secret", "ServiceAccount"):
        raise api_error(
            415,
            "UnsupportedMediaType",
            f"the emulator decodes protobuf bodies of Namespaces, ConfigMaps, Secrets and "
            f"ServiceAccounts only, not {kind or rt.kind}: send JSON",
        )
    g = _grouped(raw)
    obj: JSON = {"apiVersion": api_version or rt.api_version, "kind": kind}
    obj["metadata"] = object_meta(g.get(1, [b""])[-1])
    if kind == "ConfigMap":
        if 2 in g:
            obj["data"] = _string_map(g[2])
        if 3 in g:
            obj["binaryData"] = _string_map(g[3], binary=True)
        if 4 in g:
            obj["immutable"] = bool(g[4][-1])
    elif kind == "Secret":
        if 2 in g:
            obj["data"] = _string_map(g[2], binary=True)
        if 3 in g:
            obj["type"] = _text(g[3][-1])
        if 4 in g:
            obj["stringData"] = _string_map(g[4])
        if 5 in g:
            obj["immutable"] = bool(g[5][-1])
    return obj


def as_json_request(request: rendering.Request, rt: ResourceType) -> rendering.Request:
    """``request`` with its protobuf body decoded to JSON."""
    body = json.dumps(decode(request.body, rt)).encode()
    headers = {**request.headers, "Content-Type": "application/json"}
    return attrs.evolve(request, body=body, text=body.decode(), headers=headers)
