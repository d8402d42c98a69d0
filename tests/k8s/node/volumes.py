"""Pod volumes, as the kubelet lays them out under the pod's directory on the node:

    <pod dir>/volumes/<name>/          configMap, secret, downwardAPI, projected: files
                                       written by `write_atomic`; emptyDir: an empty dir
                                       (mode 0777), or for medium Memory the mount point of
                                       a tmpfs of sizeLimit that the pod sandbox mounts in
                                       its own mount namespace (the host never sees it)

`write_atomic` is the kubelet's AtomicWriter: files live in a timestamped `..<ts>` dir,
`..data` is a symlink to it and each key a symlink `key -> ..data/key`; an update writes a
new dir and renames a fresh `..data` link over the old one, so a reader sees the old or the
new set, never a mix. The kubelet calls `refresh` periodically: ConfigMap and Secret
changes reach running pods the same way.
"""

from __future__ import annotations

import base64
import os
import shutil
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field

from disagg_core.quantity import parse_bytes

from .api import Obj

Fetch = Callable[[str, str], Awaitable[Obj | None]]  # (resource, name) in the pod's namespace


class VolumeError(RuntimeError):
    """The pod cannot start yet (e.g. a ConfigMap it mounts is missing)."""


@dataclass
class PodVolumes:
    paths: dict[str, str] = field(default_factory=dict)  # volume name -> host path
    tmpfs: list[dict[str, object]] = field(default_factory=list)  # for the sandbox


def write_atomic(
    target: str, files: Mapping[str, bytes], mode: int, group: int | None = None
) -> bool:
    """Make `target` hold exactly `files` (relative paths); False when already so. With a
    `group` (the pod's fsGroup) the files belong to it, as the kubelet makes them."""
    data = os.path.join(target, "..data")
    if os.path.isdir(data):
        current = {}
        for root, _dirs, names in os.walk(os.path.realpath(data)):
            for n in names:
                full = os.path.join(root, n)
                with open(full, "rb") as f:
                    current[os.path.relpath(full, os.path.realpath(data))] = f.read()
        if current == dict(files):
            return False
    os.makedirs(target, mode=0o755, exist_ok=True)
    stamp = time.strftime("..%Y_%m_%d_%H_%M_%S.") + f"{time.monotonic_ns() % 10**9}"
    fresh = os.path.join(target, stamp)
    os.mkdir(fresh, 0o755)
    for rel, content in files.items():
        full = os.path.join(fresh, rel)
        os.makedirs(os.path.dirname(full), mode=0o755, exist_ok=True)
        with open(full, "wb") as f:
            f.write(content)
        if group is not None:
            os.chown(full, -1, group)
        os.chmod(full, mode)
    old = os.path.realpath(data) if os.path.islink(data) else None
    tmp_link = os.path.join(target, "..data_tmp")
    os.symlink(stamp, tmp_link)
    os.rename(tmp_link, data)
    for top in {rel.split("/", 1)[0] for rel in files}:
        link = os.path.join(target, top)
        if not os.path.lexists(link):
            os.symlink(os.path.join("..data", top), link)
    for entry in os.listdir(target):
        full = os.path.join(target, entry)
        if entry.startswith("..") or not os.path.islink(full):
            continue
        if not os.path.exists(full):
            os.unlink(full)  # a key that went away
    if old is not None and old != os.path.realpath(data):
        shutil.rmtree(old, ignore_errors=True)
    return True


def _items(data: Mapping[str, bytes], items: list[Obj] | None) -> dict[str, bytes]:
    if not items:
        return dict(data)
    return {str(i["path"]): data[str(i["key"])] for i in items if str(i["key"]) in data}


def field_value(pod: Obj, path: str) -> str:
    """A downward-API fieldPath of the pod (metadata.name, metadata.labels['x'], ...)."""
    meta, spec, status = pod["metadata"], pod.get("spec") or {}, pod.get("status") or {}
    simple = {
        "metadata.name": meta.get("name"),
        "metadata.namespace": meta.get("namespace"),
        "metadata.uid": meta.get("uid"),
        "spec.nodeName": spec.get("nodeName"),
        "spec.serviceAccountName": spec.get("serviceAccountName", "default"),
        "status.podIP": status.get("podIP"),
        "status.hostIP": status.get("hostIP"),
    }
    if path in simple:
        return str(simple[path] or "")
    for prefix, source in (("metadata.labels", "labels"), ("metadata.annotations", "annotations")):
        values = meta.get(source) or {}
        if path == prefix:
            return "\n".join(f'{k}="{v}"' for k, v in sorted(values.items()))
        if path.startswith(prefix + "['") and path.endswith("']"):
            return str(values.get(path[len(prefix) + 2 : -2], ""))
    raise VolumeError(f"unsupported downward API fieldPath {path!r}")


async def _configmap(fetch: Fetch, src: Obj) -> dict[str, bytes]:
    cm = await fetch("configmaps", src["name"])
    if cm is None:
        if src.get("optional"):
            return {}
        raise VolumeError(f'configmap "{src["name"]}" not found')
    data = {k: v.encode() for k, v in (cm.get("data") or {}).items()}
    data.update({k: base64.b64decode(v) for k, v in (cm.get("binaryData") or {}).items()})
    return _items(data, src.get("items"))


async def _secret(fetch: Fetch, src: Obj, name_key: str) -> dict[str, bytes]:
    secret = await fetch("secrets", src[name_key])
    if secret is None:
        if src.get("optional"):
            return {}
        raise VolumeError(f'secret "{src[name_key]}" not found')
    data = {k: base64.b64decode(v) for k, v in (secret.get("data") or {}).items()}
    data.update({k: v.encode() for k, v in (secret.get("stringData") or {}).items()})
    return _items(data, src.get("items"))


def _downward(pod: Obj, items: list[Obj]) -> dict[str, bytes]:
    out = {}
    for item in items:
        if "fieldRef" in item:
            out[str(item["path"])] = field_value(pod, item["fieldRef"]["fieldPath"]).encode()
    return out


async def _projected(pod: Obj, fetch: Fetch, sources: list[Obj]) -> dict[str, bytes]:
    out: dict[str, bytes] = {}
    for source in sources:
        if "configMap" in source:
            out.update(await _configmap(fetch, source["configMap"]))
        elif "secret" in source:
            out.update(await _secret(fetch, source["secret"], "name"))
        elif "downwardAPI" in source:
            out.update(_downward(pod, source["downwardAPI"].get("items") or []))
        elif "serviceAccountToken" in source:
            account = (pod.get("spec") or {}).get("serviceAccountName", "default")
            token = f"test-node-token:{pod['metadata']['namespace']}:{account}"
            out[str(source["serviceAccountToken"].get("path", "token"))] = token.encode()
    return out


async def files_of(pod: Obj, volume: Obj, fetch: Fetch) -> dict[str, bytes] | None:
    """The files of a file-backed volume (None for other kinds)."""
    if "configMap" in volume:
        return await _configmap(fetch, volume["configMap"])
    if "secret" in volume:
        return await _secret(fetch, volume["secret"], "secretName")
    if "downwardAPI" in volume:
        return _downward(pod, volume["downwardAPI"].get("items") or [])
    if "projected" in volume:
        return await _projected(pod, fetch, volume["projected"].get("sources") or [])
    return None


def fs_group(pod: Obj) -> int | None:
    group = ((pod.get("spec") or {}).get("securityContext") or {}).get("fsGroup")
    return None if group is None else int(group)


def _mode(volume: Obj) -> int:
    for kind in ("configMap", "secret", "downwardAPI", "projected"):
        if kind in volume:
            return int(volume[kind].get("defaultMode", 0o644))
    return 0o644


async def prepare(pod: Obj, pod_dir: str, fetch: Fetch) -> PodVolumes:
    """Lay out every volume of `pod` under `pod_dir`/volumes (raises VolumeError when a
    source is missing; unsupported kinds are refused by name)."""
    out = PodVolumes()
    for volume in (pod.get("spec") or {}).get("volumes") or []:
        name = str(volume["name"])
        target = os.path.join(pod_dir, "volumes", name)
        out.paths[name] = target
        if "emptyDir" in volume:
            os.makedirs(target, exist_ok=True)
            os.chmod(target, 0o777)
            empty = volume["emptyDir"] or {}
            if empty.get("medium") == "Memory":
                size = empty.get("sizeLimit")
                out.tmpfs.append(
                    {"path": target, "size": parse_bytes(size, where="sizeLimit") if size else 0}
                )
            continue
        files = await files_of(pod, volume, fetch)
        if files is None:
            kinds = sorted(k for k in volume if k != "name")
            raise VolumeError(f"volume {name!r}: unsupported kind {kinds} on this node")
        write_atomic(target, files, _mode(volume), fs_group(pod))
    return out


async def refresh(pod: Obj, pod_dir: str, fetch: Fetch) -> None:
    """Bring file-backed volumes up to date (the kubelet's periodic sync)."""
    for volume in (pod.get("spec") or {}).get("volumes") or []:
        if "emptyDir" in volume:
            continue
        try:
            files = await files_of(pod, volume, fetch)
        except VolumeError:
            continue  # a source that went away: keep the last files, as the kubelet does
        if files is not None:
            path = os.path.join(pod_dir, "volumes", volume["name"])
            write_atomic(path, files, _mode(volume), fs_group(pod))
