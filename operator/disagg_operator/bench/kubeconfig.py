"""A kubeconfig's current context as kopf's connection info, without the kubernetes client
(which reads KUBECONFIG at import time): tokens, token files, client certificates (files or
data), basic auth, and client-go exec credential plugins. Paths are relative to the file
that holds them; with several files (os.pathsep), the first definition of a name wins, as
kubectl does."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
from collections.abc import Mapping
from typing import Any

import kopf
import yaml

Json = dict[str, Any]


class KubeconfigError(Exception):
    """The kubeconfig cannot be read or names no usable context."""


def load_connection(kubeconfig: str) -> kopf.ConnectionInfo:
    """The current context of `kubeconfig` (paths joined by os.pathsep; for each name the
    first file that defines it wins, as kubectl does) as kopf's connection info."""
    paths = [pathlib.Path(p).expanduser() for p in kubeconfig.split(os.pathsep) if p]
    if not paths:
        raise KubeconfigError("no kubeconfig given")
    current: str | None = None
    sections: dict[str, dict[str, Json]] = {"contexts": {}, "clusters": {}, "users": {}}
    for path in paths:
        try:
            doc = yaml.safe_load(path.read_text()) or {}
        except (OSError, yaml.YAMLError) as error:
            raise KubeconfigError(f"cannot read kubeconfig {path}: {error}") from error
        current = current or doc.get("current-context")
        key = {"contexts": "context", "clusters": "cluster", "users": "user"}
        for section, inner in key.items():
            for item in doc.get(section) or []:
                entry = dict(item.get(inner) or {})
                entry["_dir"] = str(path.parent)
                sections[section].setdefault(item["name"], entry)
    if not current or current not in sections["contexts"]:
        raise KubeconfigError(f"kubeconfig {kubeconfig}: no current context")
    context = sections["contexts"][current]
    cluster = sections["clusters"].get(context.get("cluster", ""))
    if cluster is None:
        raise KubeconfigError(f"kubeconfig {kubeconfig}: context {current} has no cluster")
    user = sections["users"].get(context.get("user", ""), {})
    token = user.get("token")
    if not token and user.get("tokenFile"):
        try:
            token = _relative(user, user["tokenFile"]).read_text().strip()
        except OSError as error:
            raise KubeconfigError(f"kubeconfig tokenFile: {error}") from error
    cert_data, key_data = user.get("client-certificate-data"), user.get("client-key-data")
    if user.get("exec"):
        token, cert_data, key_data = _exec_credential(user["exec"], token, cert_data, key_data)
    return kopf.ConnectionInfo(
        server=str(cluster["server"]),
        ca_path=_path_of(cluster, "certificate-authority"),
        ca_data=cluster.get("certificate-authority-data"),
        insecure=cluster.get("insecure-skip-tls-verify"),
        certificate_path=_path_of(user, "client-certificate"),
        certificate_data=cert_data,
        private_key_path=_path_of(user, "client-key"),
        private_key_data=key_data,
        username=user.get("username"),
        password=user.get("password"),
        token=token,
        default_namespace=context.get("namespace"),
        proxy_url=cluster.get("proxy-url"),
    )


def _relative(section: Mapping[str, Any], value: str) -> pathlib.Path:
    """Paths in a kubeconfig are relative to the file that holds them."""
    return pathlib.Path(section["_dir"]) / pathlib.Path(value).expanduser()


def _path_of(section: Mapping[str, Any], key: str) -> str | None:
    value = section.get(key)
    return None if not value else str(_relative(section, str(value)))


def _exec_credential(
    plugin: Mapping[str, Any], token: str | None, cert: str | None, key: str | None
) -> tuple[str | None, str | None, str | None]:
    """Run a client-go credential plugin (`users[].user.exec`): its ExecCredential status."""
    info = {
        "apiVersion": plugin.get("apiVersion", "client.authentication.k8s.io/v1"),
        "kind": "ExecCredential",
        "spec": {"interactive": False},
    }
    env = {**os.environ, "KUBERNETES_EXEC_INFO": json.dumps(info)}
    env.update({str(e["name"]): str(e["value"]) for e in plugin.get("env") or []})
    argv = [str(plugin["command"]), *map(str, plugin.get("args") or [])]
    try:
        done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise KubeconfigError(f"kubeconfig exec plugin {argv[0]}: {error}") from error
    if done.returncode != 0:
        raise KubeconfigError(f"kubeconfig exec plugin {argv[0]} failed: {done.stderr.strip()}")
    status = (json.loads(done.stdout or "{}") or {}).get("status") or {}
    return (
        status.get("token") or token,
        status.get("clientCertificateData") or cert,
        status.get("clientKeyData") or key,
    )
