"""A Kubernetes API server emulator: ``kmock.KubernetesEmulator`` with the semantics we rely on.

kmock 0.8 parses and records requests, offers the reaction DSL (``emu['get /x'] << 500`` still
overrides anything below) and keeps every object's history in ``emu.objects``. As shipped it
cannot carry a kopf operator or kubectl, so this subclass serves the API itself:

- metadata: ``uid``, ``resourceVersion`` (one global counter), ``generation`` (bumped only when
  something outside ``metadata``/``status`` changes), ``creationTimestamp``; no-op writes change
  nothing and emit no event, as in Kubernetes;
- writes: 409 on a stale ``metadata.resourceVersion`` in PUT/PATCH bodies and on delete
  preconditions, 409 AlreadyExists, 422 on a failed JSON-patch ``test``, 422 on invalid names;
  JSON merge patch, strategic merge patch (see ``semantics.strategic_merge_patch``), JSON patch,
  and server-side apply with field ownership (``ssa``: managedFields, prune, conflicts, force);
- admission (``admission``): custom resources against their CRD's schema and CEL rules
  (``fieldValidation``), CRDs against the API server's CRD-schema rules, Endpoints addresses,
  pod spec warnings; ``generation`` only where a real server keeps one;
- status subresource: the main resource ignores ``.status``, ``/status`` changes only status;
- deletion: finalizers (``deletionTimestamp`` until the last one is removed), ownerReference
  cascades (Background and Foreground delete dependents recursively; a dependent with another
  live owner only loses the reference; Orphan strips the references), namespace contents,
  a CRD's custom objects; an object created with owners that were all deleted already (a
  controller that acted on a stale cache) is collected at once, as the garbage collector
  collects dependents whose owners are verified absent;
- list: real ``metadata.resourceVersion``, ``kind: <Kind>List``, ``limit``/``continue``,
  label selectors (``=``, ``==``, ``!=``, ``in``, ``notin``, exists, ``!``), field selectors (any
  dotted path, ``=``/``!=``); ``kubectl get`` tables (``Accept: ...;as=Table``) with a CRD's
  ``additionalPrinterColumns``;
- watch: takes its snapshot and its position in the event log in one step (nothing is lost),
  honours ``resourceVersion`` (only newer events; 410 Gone when too old), ``labelSelector`` and
  ``fieldSelector`` (objects leaving a selector arrive as DELETED), ``allowWatchBookmarks``,
  ``sendInitialEvents`` with the ``k8s.io/initial-events-end`` bookmark, ``timeoutSeconds``;
  served as ``application/json``;
- discovery: ``/api`` and ``/api/v1`` (``groupVersion: v1``), ``/apis``, ``/apis/<g>[/<v>]``
  for the built-ins in ``resources.BUILTIN`` and for every CRD once created (and gone when
  deleted); a CRD gets ``Established``/``NamesAccepted`` conditions at once; custom objects
  are admitted against their schema (defaults included); ``/openapi/v2`` and ``/openapi/v3``;
- Events: core/v1 and events.k8s.io/v1 are two views of one storage, as in Kubernetes.

Every request is recorded in ``emu.calls`` as an ``ApiCall`` with the Kubernetes verb (get, list,
watch, create, update, patch, delete, deletecollection), API group, resource and subresource,
for comparing an operator's traffic with its RBAC rules.

All state lives in the event loop that serves the requests; the operations that tests call
directly (``create_object``, ``patch_object``, ...) are synchronous and must run in that loop
(``server.EmulatorThread`` does that for tests in other threads).
"""

from __future__ import annotations

import base64
import dataclasses
import json
import random
import re
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp.web
import attrs
import kmock
import yaml
from kmock._internal import apps, rendering

from disagg_operator.gen.crdschema import structural

from . import admission, deletion, openapi, protowire, rbac, ssa
from . import fieldsets as fs
from . import semantics as sem
from .errors import _bad_request, _conflict, _invalid, _not_found, api_error, status_body
from .faults import Faults
from .resources import BUILTIN, INITIAL_NAMESPACES, ResourceType, crd_resource_types
from .store import ObjectStore
from .watch import EventLog, WatchEvent, stream_watch

PROTOBUF = "application/vnd.kubernetes.protobuf"
APPLY_PATCH = "application/apply-patch+yaml"

JSON = dict[str, Any]
ObjKey = tuple[str | None, str]  # (namespace, name)
StorageKey = tuple[str, str]  # (group, plural)

CRD_KEY: StorageKey = ("apiextensions.k8s.io", "customresourcedefinitions")
NAMESPACE_KEY: StorageKey = ("", "namespaces")
NODE_KEY: StorageKey = ("", "nodes")
POD_KEY: StorageKey = ("", "pods")
INITIAL_EVENTS_END = "k8s.io/initial-events-end"
SERVER_VERSION = {
    "major": "1",
    "minor": "37",
    "gitVersion": "v1.37.0-disagg-emulator",
    "gitCommit": "0000000000000000000000000000000000000000",
    "gitTreeState": "clean",
    "buildDate": "2026-01-01T00:00:00Z",
    "goVersion": "go1.25",
    "compiler": "gc",
    "platform": "linux/amd64",
}

_DNS1123_SUBDOMAIN = re.compile(
    r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
)
_DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_DNS1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_GENERATE_ALPHABET = "bcdfghjklmnpqrstvwxz2456789"
_QUALIFIED_NAME = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
_LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?$")


def _qualified_name(key: str) -> bool:
    """``name`` or ``prefix/name``: a DNS subdomain prefix, a name of at most 63 characters."""
    prefix, _, name = key.rpartition("/")
    if prefix and (len(prefix) > 253 or not _DNS1123_SUBDOMAIN.match(prefix)):
        return False
    return 0 < len(name) <= 63 and bool(_QUALIFIED_NAME.match(name))


# --------------------------------------------------------------------------------------------
# Recorded calls


@dataclass
class ApiCall:
    """One request as RBAC sees it (``group``/``resource`` are None for non-resource URLs)."""

    verb: str
    group: str | None
    version: str | None
    resource: str | None
    subresource: str | None
    namespace: str | None
    name: str | None
    method: str
    path: str
    code: int = 0
    user: str | None = None  # who made it, when the emulator authenticates (``auth``)
    implied: list[str] = dataclasses.field(
        default_factory=list
    )  # verbs authorized besides (SSA create)

    @property
    def rbac_resource(self) -> str | None:
        """``statefulsets``, ``pipelines/status``: the ``resources`` entry of an RBAC rule."""
        if self.resource is None:
            return None
        return f"{self.resource}/{self.subresource}" if self.subresource else self.resource

    @property
    def rbac(self) -> tuple[str | None, str | None, str]:
        """``(apiGroup, resource[/subresource], verb)``."""
        return self.group, self.rbac_resource, self.verb

    @property
    def authorizations(self) -> list[tuple[str | None, str | None, str]]:
        """Every ``(apiGroup, resource, verb)`` the API server authorizes for it: its own verb
        and the implied ones (``create`` for a server-side apply that creates)."""
        return [self.rbac] + [(self.group, self.rbac_resource, v) for v in self.implied]


@dataclass
class _Target:
    """A parsed resource URL."""

    group: str
    version: str
    plural: str
    namespace: str | None
    name: str | None
    subresource: str | None
    watch_path: bool  # the legacy /watch/ prefix
    rt: ResourceType | None = None

    def kmock_fields(self) -> dict[str, Any]:
        """What kmock's ``Request`` knows about the resource (for DSL filters)."""
        return {
            "resource": kmock.resource(self.group, self.version, self.plural),
            "namespace": self.namespace,
            "name": self.name,
            "subresource": self.subresource,
        }


def _meta(obj: Mapping[str, Any]) -> JSON:
    meta = obj.get("metadata")
    return meta if isinstance(meta, dict) else {}


def _version_priority(version: str) -> tuple[int, int, int]:
    """Kubernetes version order: v2 > v1 > v1beta2 > v1beta1 > v1alpha1 > anything else."""
    m = re.fullmatch(r"v(\d+)(?:(alpha|beta)(\d+))?", version)
    if not m:
        return (0, 0, 0)
    stage = {"alpha": 1, "beta": 2, None: 3}[m.group(2)]
    return (stage, int(m.group(1)), int(m.group(3) or 0))


# --------------------------------------------------------------------------------------------
# The emulator


@attrs.define(kw_only=True)
class KubeEmulator(kmock.KubernetesEmulator):
    """kmock's KubernetesEmulator, serving the Kubernetes API semantics listed in the module doc.

    Options: ``require_namespaces`` (namespaced writes need an existing Namespace; ``default``,
    ``kube-system``, ``kube-public`` and ``kube-node-lease`` exist from the start),
    ``keep_history`` (every version of every object in ``objects``; off: only the last),
    ``bookmark_interval`` (seconds between BOOKMARKs on watches that allow them),
    ``event_log_limit`` (events kept per resource for watch resumption), ``keep_requests``
    (kmock's record of every request with its body, for its DSL; off for long runs: ``calls``
    is kept either way), ``faults`` (a slow or failing server: see ``faults.Faults``),
    ``collect_orphans`` (an object created with ownerReferences none of which names a live
    uid is deleted right after, as the garbage collector does: a controller that applies a
    child just after its owner was deleted leaves nothing behind; off by default, because
    tests make children of made-up owners), ``auth`` (an ``rbac.Authenticator``: every
    request needs a bearer token it knows, else 401, and RBAC from the stored Roles,
    ClusterRoles and bindings decides, else 403; None, the default: no authentication).
    Objects live in an indexed ``store.ObjectStore``; watches are served by ``watch``.
    """

    require_namespaces: bool = True
    keep_history: bool = True
    bookmark_interval: float = 30.0
    event_log_limit: int = 10_000
    keep_requests: bool = True
    faults: Faults | None = None
    auth: rbac.Authenticator | None = None

    calls: list[ApiCall] = attrs.field(factory=list, init=False)
    # (kind, name, text) of every warning the API server would send (pod spec warnings)
    warnings: list[tuple[str, str, str]] = attrs.field(factory=list, init=False)
    _types: dict[tuple[str, str, str], ResourceType] = attrs.field(factory=dict, init=False)
    _storage_types: dict[StorageKey, ResourceType] = attrs.field(factory=dict, init=False)
    _storage_res: dict[StorageKey, kmock.resource] = attrs.field(factory=dict, init=False)
    _store: ObjectStore = attrs.field(factory=ObjectStore, init=False)
    _logs: dict[StorageKey, EventLog] = attrs.field(factory=dict, init=False)
    _pending_policy: dict[str, str] = attrs.field(factory=dict, init=False)
    _gone_uids: set[str] = attrs.field(factory=set, init=False)  # of deleted objects
    _rv: int = attrs.field(default=0, init=False)
    _closed: bool = attrs.field(default=False, init=False)

    def __attrs_post_init__(self) -> None:
        # Deliberately not kmock's: its fallback reactions are replaced by _serve() below.
        for rt in BUILTIN:
            self._register(rt)
        for name in INITIAL_NAMESPACES:
            self.create_object(
                {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}}
            )

    # ------------------------------------------------------------------ request entry point

    async def __call__(self, raw_request: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        """kmock's entry point, with our own URL parsing (kmock's fails on /api/v1/namespaces)."""
        raw_response: aiohttp.web.StreamResponse | None = None
        try:
            request = await self._parse_request(raw_request)
            if self.keep_requests:
                self._requests.append(request)
            try:
                return await self._handle(request)
            except rendering.StreamingError as e:  # a kmock DSL stream failed midway
                raw_response = e.args[0]
                raise e.__cause__ or e from None
        except Exception as e:
            if not self._errors:
                raise
            self._errors[-1].append(e)
            if raw_response is None or not raw_response.prepared:
                return await self._render_error(e)
            await self._stream_error(e, raw_response)
            await raw_response.write_eof()
            return raw_response

    async def _parse_request(self, raw: aiohttp.web.BaseRequest) -> rendering.Request:
        body = await raw.read()
        text = body.decode("utf-8", errors="replace")
        try:
            data = json.loads(body) if body else None
        except ValueError:
            data = None
        method = kmock.method(raw.method)
        params = dict(raw.query)
        target = self._parse_path(raw.path)
        action: kmock.action | None = None
        if target is not None:
            watch = target.watch_path or params.get("watch") in ("true", "1")
            reading = kmock.action.FETCH if target.name else kmock.action.LIST
            action = {
                "GET": kmock.action.WATCH if watch else reading,
                "POST": kmock.action.CREATE,
                "PATCH": kmock.action.UPDATE,
                "PUT": kmock.action.UPDATE,
                "DELETE": kmock.action.DELETE,
            }.get(raw.method.upper())
        return rendering.Request(
            id=len(self._requests),
            raw_request=raw,
            url=raw.url,
            method=method,
            params=params,
            headers=dict(raw.headers),
            cookies=dict(raw.cookies),
            body=body,
            text=text,
            data=data,
            action=action,
            **({} if target is None else target.kmock_fields()),
        )

    async def _handle(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        target = self._parse_target(request)
        call = self._record(request, target)
        try:
            if self.auth is not None:
                self._authorize(request, target, call)
            if self._payloads:  # reactions declared through kmock's DSL go first
                try:
                    response = await apps.RawHandler._handle(self, request)
                except NotImplementedError:
                    pass
                else:
                    call.code = response.status
                    return response
            if self.faults is not None and target is not None:
                fault = await self.faults.before(
                    user_agent=request.headers.get("User-Agent", ""), watch=call.verb == "watch"
                )
                if fault is not None:
                    raise fault
            response = await self._serve(request, target, call)
        except kmock.KubernetesError as e:
            response = await self._render_error(e)
        except (sem.PatchError, sem.SelectorError) as e:  # pragma: no cover - mapped earlier
            response = await self._render_error(_bad_request(str(e)))
        call.code = response.status
        return response

    def _authorize(
        self,
        request: rendering.Request,
        target: _Target | None,
        call: ApiCall,
        *,
        verb: str | None = None,
    ) -> None:
        """401 without a known token; 403 when RBAC does not allow the call (see ``rbac``), or
        ``verb`` where the API server authorizes another (an apply that creates: create)."""
        assert self.auth is not None
        who = self.auth.identify(request.headers.get("Authorization"))
        if who is None:
            raise api_error(401, "Unauthorized", "Unauthorized")
        call.user = who.user
        if target is None or call.resource is None:
            return  # discovery, /version, /healthz: open to every authenticated user
        attributes = rbac.Attributes(
            verb=verb or call.verb,
            group=target.group,
            resource=target.plural,
            subresource=target.subresource,
            namespace=target.namespace,
            name=target.name,
        )
        if not rbac.authorize(who, attributes, self._rbac_objects()):
            details = {"group": target.group, "kind": target.plural}
            raise api_error(
                403,
                "Forbidden",
                attributes.describe(who.user),
                **details,
                **({"name": target.name} if target.name else {}),
            )

    def _rbac_objects(self) -> list[JSON]:
        found: list[JSON] = []
        for kind in ("roles", "clusterroles", "rolebindings", "clusterrolebindings"):
            rt = self.resolve(f"rbac.authorization.k8s.io/v1/{kind}")
            found += [{**o, "kind": rt.kind} for o in self._select(rt, None, None, None)]
        return found

    async def _render_error(self, exc: Exception) -> aiohttp.web.StreamResponse:
        if isinstance(exc, kmock.KubernetesError):
            return aiohttp.web.json_response(self._status_body(exc), status=exc.status)
        return await super()._render_error(exc)

    @staticmethod
    def _status_body(exc: kmock.KubernetesError) -> JSON:
        return status_body(exc)

    def _parse_target(self, request: rendering.Request) -> _Target | None:
        return self._parse_path(request.url.path)

    def _parse_path(self, path: str) -> _Target | None:
        parts = [p for p in path.split("/") if p]
        if len(parts) >= 3 and parts[0] == "api":
            group, version, rest = "", parts[1], parts[2:]
        elif len(parts) >= 4 and parts[0] == "apis":
            group, version, rest = parts[1], parts[2], parts[3:]
        else:
            return None
        watch_path = bool(rest) and rest[0] == "watch"
        if watch_path:
            rest = rest[1:]
        namespace = None
        if (
            len(rest) >= 3
            and rest[0] == "namespaces"
            and not (len(rest) == 3 and rest[2] in ("status", "finalize"))
        ):
            namespace, rest = rest[1], rest[2:]
        if not rest:
            return None
        target = _Target(
            group=group,
            version=version,
            plural=rest[0],
            namespace=namespace,
            name=rest[1] if len(rest) > 1 else None,
            subresource="/".join(rest[2:]) or None,
            watch_path=watch_path,
        )
        target.rt = self._types.get((group, version, target.plural))
        return target

    def _record(self, request: rendering.Request, target: _Target | None) -> ApiCall:
        method = str(request.method.value if request.method else "GET").upper()
        if target is None:
            call = ApiCall(
                verb=method.lower(),
                group=None,
                version=None,
                resource=None,
                subresource=None,
                namespace=None,
                name=None,
                method=method,
                path=request.url.path,
            )
        else:
            watch = target.watch_path or request.params.get("watch") in ("true", "1")
            named = target.name is not None
            verb = {
                "GET": "watch" if watch else "get" if named else "list",
                "POST": "create",
                "PUT": "update",
                "PATCH": "patch",
                "DELETE": "delete" if named else "deletecollection",
            }.get(method, method.lower())
            call = ApiCall(
                verb=verb,
                group=target.group,
                version=target.version,
                resource=target.plural,
                subresource=target.subresource,
                namespace=target.namespace,
                name=target.name,
                method=method,
                path=request.url.path,
            )
        self.calls.append(call)
        return call

    # ------------------------------------------------------------------ HTTP dispatch

    async def _serve(
        self, request: rendering.Request, target: _Target | None, call: ApiCall
    ) -> aiohttp.web.StreamResponse:
        if target is None:
            return self._serve_nonresource(request)
        rt = target.rt
        if rt is None:
            raise api_error(404, "NotFound", "the server could not find the requested resource")
        if target.namespace is not None and not rt.namespaced:
            raise api_error(404, "NotFound", "the server could not find the requested resource")
        if target.subresource is not None and target.subresource not in rt.subresources:
            raise api_error(404, "NotFound", "the server could not find the requested resource")
        params = request.params
        dry_run = "dryRun" in params
        writer = self._writer(request)
        ns = target.namespace if rt.namespaced else None
        if rt.namespaced and ns is None and call.verb not in ("list", "watch", "deletecollection"):
            raise api_error(404, "NotFound", "the server could not find the requested resource")
        ctype = request.headers.get("Content-Type", "").split(";")[0].strip()
        if call.verb in ("create", "update") and ctype == PROTOBUF:
            request = protowire.as_json_request(request, rt)
            ctype = "application/json"
        elif call.verb in ("create", "update") and ctype and not ctype.endswith(("json", "yaml")):
            raise api_error(
                415,
                "UnsupportedMediaType",
                f"the emulator speaks JSON, not {ctype}: use `kubectl apply/create -f` "
                "rather than kubectl's generators (`kubectl create namespace`, ...)",
            )
        if target.subresource == "scale":
            raw = self._body(request, yaml_ok=True) if request.body.strip() else None
            scale = self.op_scale(rt, ns, str(target.name), call.verb, ctype, raw, dry_run=dry_run)
            return self._json(scale)
        if call.verb == "watch":
            return await self._stream_watch(request, rt, ns, target.name, call)
        if call.verb == "list":
            body = self.op_list(
                rt,
                ns,
                label_selector=params.get("labelSelector"),
                field_selector=params.get("fieldSelector"),
                limit=params.get("limit"),
                continue_=params.get("continue"),
            )
            if self._wants_table(request):
                body = self._table(rt, body["items"], rv=body["metadata"]["resourceVersion"])
            return self._json(body)
        if call.verb == "get":
            obj = self.op_get(rt, ns, str(target.name))
            if self._wants_table(request):
                return self._json(self._table(rt, [obj], rv=_meta(obj)["resourceVersion"]))
            return self._json(obj)
        if call.verb == "create":
            if target.name is not None:
                raise api_error(405, "MethodNotAllowed", "the server does not allow this method")
            obj = self.op_create(rt, ns, self._body(request), dry_run=dry_run, writer=writer)
            return self._json(obj, 201, writer.warnings)
        if call.verb == "update":
            obj = self.op_update(
                rt,
                ns,
                str(target.name),
                self._body(request),
                target.subresource,
                dry_run=dry_run,
                writer=writer,
            )
            return self._json(obj, 200, writer.warnings)
        if call.verb == "patch":
            if ctype == APPLY_PATCH and self._stored(rt, ns, str(target.name)) is None:
                # an apply that creates is also a create, as the API server authorizes it
                call.implied.append("create")
                if self.auth is not None:
                    self._authorize(request, target, call, verb="create")
            created, obj = self.op_patch(
                rt,
                ns,
                str(target.name),
                ctype,
                self._body(request, yaml_ok=True),
                target.subresource,
                dry_run=dry_run,
                writer=writer,
            )
            return self._json(obj, 201 if created else 200, writer.warnings)
        if call.verb == "delete":
            raw = request.body.strip()
            options = self._body(request) if raw else {}
            options = {**self._delete_params(params), **options}
            code, obj = self.op_delete(rt, ns, str(target.name), options, dry_run=dry_run)
            return self._json(obj, code)
        if call.verb == "deletecollection":
            body = self.op_delete_collection(
                rt,
                ns,
                label_selector=params.get("labelSelector"),
                field_selector=params.get("fieldSelector"),
                options=self._delete_params(params),
                dry_run=dry_run,
            )
            return self._json(body)
        raise api_error(405, "MethodNotAllowed", "the server does not allow this method")

    @staticmethod
    def _delete_params(params: Mapping[str, str]) -> JSON:
        options: JSON = {}
        if "propagationPolicy" in params:
            options["propagationPolicy"] = params["propagationPolicy"]
        if "orphanDependents" in params:
            options["orphanDependents"] = params["orphanDependents"] == "true"
        if "gracePeriodSeconds" in params:
            options["gracePeriodSeconds"] = int(params["gracePeriodSeconds"])
        return options

    @staticmethod
    def _json(
        body: Any, status: int = 200, warnings: list[str] | None = None
    ) -> aiohttp.web.Response:
        response = aiohttp.web.json_response(body, status=status)
        for warning in dict.fromkeys(warnings or ()):
            response.headers.add("Warning", f"299 - {json.dumps(warning)}")
        return response

    @staticmethod
    def _writer(request: rendering.Request) -> ssa.Writer:
        """The request's field manager (``fieldManager``, else its User-Agent's product),
        ``fieldValidation`` and ``force``."""
        params = request.params
        agent = request.headers.get("User-Agent", "").split("/")[0].strip()
        return ssa.Writer(
            manager=params.get("fieldManager") or agent or "unknown",
            validation=admission.field_validation(params),
            force=params.get("force") in ("true", "1"),
        )

    @staticmethod
    def _wants_table(request: rendering.Request) -> bool:
        return "as=Table" in request.headers.get("Accept", "")

    @staticmethod
    def _body(request: rendering.Request, yaml_ok: bool = False) -> Any:
        try:
            return json.loads(request.body or b"null")
        except ValueError:
            if not yaml_ok:
                raise _bad_request("the request body is not valid JSON") from None
        try:
            return yaml.safe_load(request.body.decode())
        except (yaml.YAMLError, UnicodeDecodeError) as e:
            raise _bad_request(f"the request body is not valid YAML: {e}") from None

    def _serve_nonresource(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        path = request.url.path.rstrip("/") or "/"
        method = str(request.method.value if request.method else "GET").upper()
        if method != "GET":
            raise api_error(405, "MethodNotAllowed", "the server does not allow this method")
        parts = [p for p in path.split("/") if p]
        if path in ("/healthz", "/livez", "/readyz"):
            return aiohttp.web.Response(text="ok")
        if path == "/version":
            return self._json(SERVER_VERSION)
        if path == "/metrics":
            return aiohttp.web.Response(text=self._metrics_text())
        if path == "/":
            return self._json({"paths": sorted(self._paths())})
        if path == "/api":
            host = request.headers.get("Host", "127.0.0.1")
            return self._json(
                {
                    "kind": "APIVersions",
                    "versions": ["v1"],
                    "serverAddressByClientCIDRs": [
                        {"clientCIDR": "0.0.0.0/0", "serverAddress": host}
                    ],
                }
            )
        if parts[:1] == ["api"] and len(parts) == 2:
            return self._json(self._resource_list("", parts[1]))
        if path == "/apis":
            return self._json(
                {"kind": "APIGroupList", "apiVersion": "v1", "groups": self._api_groups()}
            )
        if parts[:1] == ["apis"] and len(parts) == 2:
            for group in self._api_groups():
                if group["name"] == parts[1]:
                    return self._json({"kind": "APIGroup", "apiVersion": "v1", **group})
        if parts[:1] == ["apis"] and len(parts) == 3:
            return self._json(self._resource_list(parts[1], parts[2]))
        if parts[:1] == ["openapi"]:
            return self._serve_openapi(parts[1:])
        raise api_error(404, "NotFound", "the server could not find the requested resource")

    def _serve_openapi(self, parts: list[str]) -> aiohttp.web.StreamResponse:
        """``/openapi/v2``, ``/openapi/v3`` and ``/openapi/v3/<group-version>``."""
        served = self.resource_types
        if parts == ["v2"]:
            return self._json(openapi.v2_document(served))
        if parts == ["v3"]:
            return self._json(openapi.v3_root(served))
        if parts[:1] == ["v3"] and len(parts) > 1:
            key = "/".join(parts[1:])
            members = [rt for rt in served if openapi.group_version_key(rt) == key]
            if members:
                return self._json(openapi.v3_document(members))
        raise api_error(404, "NotFound", "the server could not find the requested resource")

    def _metrics_text(self) -> str:
        """Prometheus text: the CPU time of the process, and of the thread that serves (the
        emulator's own share when it runs in a thread of a bigger process), requests served."""
        lines = [
            "# TYPE process_cpu_seconds_total counter",
            f"process_cpu_seconds_total {time.process_time():.6f}",
            "# TYPE emulator_cpu_seconds_total counter",
            f"emulator_cpu_seconds_total {time.thread_time():.6f}",
            "# TYPE apiserver_request_total counter",
            f"apiserver_request_total {len(self.calls)}",
        ]
        return "\n".join(lines) + "\n"

    # ------------------------------------------------------------------ discovery

    def _paths(self) -> set[str]:
        paths = {"/api", "/api/v1", "/apis", "/version", "/healthz", "/livez", "/readyz"}
        for group, version, _ in self._types:
            if group:
                paths |= {f"/apis/{group}", f"/apis/{group}/{version}"}
        return paths

    def _api_groups(self) -> list[JSON]:
        versions: dict[str, list[str]] = {}
        for group, version, _ in self._types:
            if group and version not in versions.setdefault(group, []):
                versions[group].append(version)
        groups = []
        for group, vs in versions.items():
            ordered = sorted(vs, key=_version_priority, reverse=True)
            entries = [{"groupVersion": f"{group}/{v}", "version": v} for v in ordered]
            groups.append({"name": group, "versions": entries, "preferredVersion": entries[0]})
        return groups

    def _resource_list(self, group: str, version: str) -> JSON:
        types = [rt for (g, v, _), rt in self._types.items() if (g, v) == (group, version)]
        if not types:
            raise api_error(404, "NotFound", "the server could not find the requested resource")
        return {
            "kind": "APIResourceList",
            "apiVersion": "v1",
            "groupVersion": f"{group}/{version}" if group else version,
            "resources": [entry for rt in types for entry in rt.discovery()],
        }

    def _register(self, rt: ResourceType) -> None:
        self._types[(rt.group, rt.version, rt.plural)] = rt
        key = rt.storage_key
        if rt.storage is None:  # the first registered version stores (a CRD's storage version)
            self._storage_types.setdefault(key, rt)
        self._storage_res.setdefault(key, kmock.resource(key[0], rt.version, key[1]))
        self._store.ensure(key)
        self.resources[kmock.resource(rt.group, rt.version, rt.plural)] = kmock.ResourceInfo(
            namespaced=rt.namespaced,
            kind=rt.kind,
            singular=rt.singular,
            verbs=set(rt.discovery()[0]["verbs"]),
            shortnames=set(rt.short_names),
            categories=set(rt.categories),
            subresources=set(rt.subresources),
        )

    def _unregister_storage(self, key: StorageKey) -> None:
        for tkey in [k for k, rt in self._types.items() if rt.storage_key == key]:
            rt = self._types.pop(tkey)
            del self.resources[kmock.resource(rt.group, rt.version, rt.plural)]
        self._storage_types.pop(key, None)

    # ------------------------------------------------------------------ resolving references

    @property
    def resource_types(self) -> list[ResourceType]:
        return list(self._types.values())

    def resolve(self, ref: str | ResourceType) -> ResourceType:
        """``apps/v1/statefulsets``, ``v1/pods``, ``statefulsets.apps``, ``statefulsets``,
        ``StatefulSet``, ``sts``: the served resource type (the preferred version)."""
        if isinstance(ref, ResourceType):
            return ref
        parts = ref.split("/")
        if len(parts) == 3 and (rt := self._types.get((parts[0], parts[1], parts[2]))):
            return rt
        if len(parts) == 2 and (rt := self._types.get(("", parts[0], parts[1]))):
            return rt
        plural, _, group = ref.partition(".")
        candidates = [
            rt
            for rt in self._types.values()
            if (group and rt.group == group and rt.plural == plural)
            or (
                not group
                and (ref in (rt.plural, rt.kind, rt.singular) or ref in rt.short_names)
                and rt.storage is None
            )
        ]
        if not candidates:
            raise KeyError(f"unknown resource: {ref!r}")
        return max(candidates, key=lambda rt: (rt.group == "", _version_priority(rt.version)))

    def resolve_kind(self, api_version: str, kind: str) -> ResourceType:
        group, _, version = api_version.rpartition("/")
        for rt in self._types.values():
            if (rt.group, rt.version, rt.kind) == (group, version, kind):
                return rt
        raise api_error(
            404,
            "NotFound",
            f'the server could not find the requested resource: no kind "{kind}" '
            f'is registered for version "{api_version}"',
        )

    # ------------------------------------------------------------------ storage helpers

    def _next_rv(self) -> int:
        self._rv += 1
        return self._rv

    def _log(self, key: StorageKey) -> EventLog:
        if key not in self._logs:
            self._logs[key] = EventLog(self.event_log_limit)
        return self._logs[key]

    def _stored(self, rt: ResourceType, ns: str | None, name: str) -> JSON | None:
        return self._store.get(rt.storage_key, (ns, name))

    def _write(self, key: StorageKey, event_type: str, obj: JSON, old: JSON | None) -> None:
        """Commit one change: the index, kmock's history (``objects``), the event log."""
        meta = _meta(obj)
        okey: ObjKey = (meta.get("namespace"), meta["name"])
        kres = self._storage_res[key]
        hkey = (kres, okey[0], okey[1])
        if event_type == "DELETED":
            self._store.drop(key, obj)
            if hkey in self.objects:
                self.objects[hkey].delete()
        else:
            self._store.put(key, obj)
            if hkey not in self.objects:
                self.objects[hkey] = sem.clone(obj)
            elif event_type == "ADDED" or self.keep_history:
                self.objects[hkey].create(sem.clone(obj))
            else:
                self.objects[hkey].history[-1] = sem.clone(obj)
        self._log(key).append(WatchEvent(int(meta["resourceVersion"]), event_type, obj, old))

    def _view(self, rt: ResourceType, obj: Mapping[str, Any]) -> JSON:
        """A stored object as the client asked for it (its group/version, its field names)."""
        if rt.storage is not None and rt.group == "events.k8s.io":
            return sem.core_event_to_events_v1(sem.clone(dict(obj)))
        result = sem.clone(dict(obj))
        result["apiVersion"] = rt.api_version
        result["kind"] = rt.kind
        return result

    def _incoming(self, rt: ResourceType, body: Any, name_hint: str = "") -> JSON:
        """A request body, checked against the URL and converted to the storage form."""
        if not isinstance(body, dict):
            raise _bad_request("the request body must be a JSON object")
        body = sem.clone(body)
        api_version, kind = body.get("apiVersion"), body.get("kind")
        if api_version is not None and api_version != rt.api_version:
            raise _bad_request(
                f"the API version in the data ({api_version}) does not match "
                f"the expected API version ({rt.api_version})"
            )
        if kind is not None and kind != rt.kind:
            raise _bad_request(
                f"the kind in the data ({kind}) does not match the expected kind ({rt.kind})"
            )
        if not isinstance(body.get("metadata", {}), dict):
            raise _bad_request("metadata must be an object")
        if rt.storage is not None and rt.group == "events.k8s.io":
            body = sem.events_v1_to_core_event(body)
        storage_rt = self._storage_types[rt.storage_key]
        body["apiVersion"] = storage_rt.api_version
        body["kind"] = storage_rt.kind
        body.setdefault("metadata", {})
        result: JSON = body
        return result

    def _check_name(self, rt: ResourceType, name: str) -> None:
        if rt.storage_key in (("", "services"), NAMESPACE_KEY):
            pattern, limit, what = (
                (_DNS1035_LABEL, 63, "a DNS-1035 label")
                if rt.plural == "services"
                else (_DNS1123_LABEL, 63, "a DNS-1123 label")
            )
        else:
            pattern, limit, what = _DNS1123_SUBDOMAIN, 253, "a lowercase RFC 1123 subdomain"
        if len(name) > limit or not pattern.match(name):
            raise _invalid(rt, name, f'metadata.name: Invalid value: "{name}": must be {what}')

    def _check_metadata(self, rt: ResourceType, obj: JSON) -> None:
        """Label keys and values, annotation keys, ownerReferences: what the API server checks."""
        meta = obj["metadata"]
        name = str(meta.get("name", ""))
        for field in ("labels", "annotations"):
            values = meta.get(field) or {}
            if not isinstance(values, dict):
                raise _invalid(rt, name, f"metadata.{field}: Invalid value: must be a map")
            for key, value in values.items():
                if not _qualified_name(key):
                    raise _invalid(
                        rt, name, f'metadata.{field}: Invalid value: "{key}": not a qualified name'
                    )
                if not isinstance(value, str):
                    raise _invalid(rt, name, f"metadata.{field}.{key}: must be a string")
                if field == "labels" and not (len(value) <= 63 and _LABEL_VALUE.match(value)):
                    raise _invalid(
                        rt,
                        name,
                        f'metadata.labels: Invalid value: "{value}": a label value must be at '
                        "most 63 characters, alphanumerics, '-', '_' or '.', and start and end "
                        "with an alphanumeric",
                    )
        for n, ref in enumerate(meta.get("ownerReferences") or []):
            missing = [f for f in ("apiVersion", "kind", "name", "uid") if not ref.get(f)]
            if missing:
                raise _invalid(
                    rt, name, f"metadata.ownerReferences[{n}].{missing[0]}: Required value"
                )

    # ------------------------------------------------------------------ operations

    def op_create(
        self,
        rt: ResourceType,
        namespace: str | None,
        body: Any,
        *,
        dry_run: bool = False,
        writer: ssa.Writer | None = None,
        applying: bool = False,
    ) -> JSON:
        """A create (``applying``: by a server-side apply whose patch is ``body``)."""
        writer = writer or ssa.Writer()
        patch = sem.clone(body) if applying else None
        obj = self._incoming(rt, body)
        meta = obj["metadata"]
        meta.pop("managedFields", None)
        if rt.namespaced:
            ns = namespace or meta.get("namespace") or "default"
            if meta.get("namespace") and namespace and meta["namespace"] != namespace:
                raise _bad_request(
                    "the namespace of the provided object does not match "
                    "the namespace sent on the request"
                )
            meta["namespace"] = ns
            if self.require_namespaces and not self._store.contains(NAMESPACE_KEY, (None, ns)):
                raise api_error(
                    404, "NotFound", f'namespaces "{ns}" not found', name=ns, kind="namespaces"
                )
            namespace_obj = self._store.get(NAMESPACE_KEY, (None, ns))
            if namespace_obj is not None and namespace_obj["metadata"].get("deletionTimestamp"):
                raise deletion.terminating_namespace(ns)
        else:
            meta.pop("namespace", None)
        if not meta.get("name"):
            if not meta.get("generateName"):
                raise _invalid(
                    rt, "", "metadata.name: Required value: name or generateName is required"
                )
            for _ in range(100):
                suffix = "".join(random.choices(_GENERATE_ALPHABET, k=5))
                meta["name"] = f"{meta['generateName']}{suffix}"
                if self._stored(rt, meta.get("namespace"), meta["name"]) is None:
                    break
        name = meta["name"]
        self._check_name(rt, name)
        self._check_metadata(rt, obj)
        if self._stored(rt, meta.get("namespace"), name) is not None:
            raise api_error(
                409,
                "AlreadyExists",
                f'{rt.qualified} "{name}" already exists',
                name=name,
                group=rt.group,
                kind=rt.plural,
            )
        for field in ("resourceVersion", "deletionTimestamp", "deletionGracePeriodSeconds"):
            meta.pop(field, None)
        meta["uid"] = str(uuid.uuid4())
        if rt.has_generation:
            meta["generation"] = 1
        else:
            meta.pop("generation", None)
        meta["creationTimestamp"] = sem.now_rfc3339()
        if rt.has_status:
            obj.pop("status", None)
        if rt.from_crd:
            writer.warnings += admission.admit_custom(rt, obj, validation=writer.validation)
        admission.admit_builtin(rt, obj)
        self._warn(rt, obj, writer, admission.pod_warnings(rt, obj))
        self._own_fields(rt, None, obj, writer, None, patch=patch)
        if rt.storage_key == NODE_KEY:
            admission.node_taints(obj)
        if rt.storage_key == NAMESPACE_KEY:
            obj["status"] = {"phase": "Active"}
        new_types: list[ResourceType] = []
        if rt.storage_key == CRD_KEY:
            new_types = self._crd_accept(obj, rt)
        if dry_run:
            meta["resourceVersion"] = str(self._rv)
            return self._view(rt, obj)
        meta["resourceVersion"] = str(self._next_rv())
        for new_rt in new_types:
            self._register(new_rt)
        self._write(rt.storage_key, "ADDED", obj, None)
        if self._owners_gone(meta):
            self._delete_stored(rt.storage_key, obj, "Background")
        return self._view(rt, obj)

    def _warn(self, rt: ResourceType, obj: JSON, writer: ssa.Writer, found: list[str]) -> None:
        """Warnings for the answer's ``Warning`` headers, also kept in ``warnings``."""
        writer.warnings += found
        meta = obj.get("metadata") or {}
        self.warnings += [(rt.kind, str(meta.get("name", "")), w) for w in found]

    def _own_fields(
        self,
        rt: ResourceType,
        old: JSON | None,
        new: JSON,
        writer: ssa.Writer,
        subresource: str | None,
        *,
        patch: JSON | None = None,
    ) -> None:
        """``new``'s managedFields (in place): an apply's (``patch``) or another write's."""
        shape, now = self._shape(rt), sem.now_rfc3339()
        common: dict[str, Any] = {
            "shape": shape,
            "api_version": rt.api_version,
            "subresource": subresource,
            "has_status": rt.has_status,
            "now": now,
        }
        if patch is not None:
            owned = ssa.apply(old, patch, manager=writer.manager, force=writer.force, **common)
            fields = owned["metadata"].get("managedFields")
            if fields:
                new["metadata"]["managedFields"] = fields
            return
        ssa.record_update(old, new, manager=writer.manager, **common)

    def _owners_gone(self, meta: JSON) -> bool:
        """Every owner this object names was deleted (its creator acted on a stale view, e.g.
        a StatefulSet controller that had not yet seen its StatefulSet deleted)."""
        refs = meta.get("ownerReferences") or []
        uids = [str(r.get("uid")) for r in refs]
        return bool(uids) and all(u in self._gone_uids for u in uids)

    def op_get(self, rt: ResourceType, ns: str | None, name: str) -> JSON:
        obj = self._stored(rt, ns, name)
        if obj is None:
            raise _not_found(rt, name)
        return self._view(rt, obj)

    def _select(
        self,
        rt: ResourceType,
        ns: str | None,
        label_selector: str | None,
        field_selector: str | None,
    ) -> list[JSON]:
        try:
            labels = sem.parse_label_selector(label_selector)
            fields = sem.parse_field_selector(field_selector)
        except sem.SelectorError as e:
            raise _bad_request(str(e)) from None
        return self._store.select(rt.storage_key, ns, labels, fields)

    def op_list(
        self,
        rt: ResourceType,
        ns: str | None,
        *,
        label_selector: str | None = None,
        field_selector: str | None = None,
        limit: str | int | None = None,
        continue_: str | None = None,
    ) -> JSON:
        objs = self._select(rt, ns, label_selector, field_selector)
        rv = str(self._rv)
        start = 0
        if continue_:
            try:
                token = json.loads(base64.urlsafe_b64decode(continue_.encode()))
                start, rv = int(token["start"]), str(token["rv"])
            except (ValueError, KeyError, TypeError):
                raise _bad_request("invalid continue token") from None
        meta: JSON = {"resourceVersion": rv}
        page = objs[start:]
        if limit and int(limit) > 0 and len(page) > int(limit):
            page = page[: int(limit)]
            token = {"start": start + len(page), "rv": rv}
            meta["continue"] = base64.urlsafe_b64encode(json.dumps(token).encode()).decode()
            meta["remainingItemCount"] = len(objs) - start - len(page)
        return {
            "kind": f"{rt.kind}List",
            "apiVersion": rt.api_version,
            "metadata": meta,
            "items": [self._view(rt, obj) for obj in page],
        }

    def op_update(
        self,
        rt: ResourceType,
        ns: str | None,
        name: str,
        body: Any,
        subresource: str | None = None,
        *,
        dry_run: bool = False,
        writer: ssa.Writer | None = None,
    ) -> JSON:
        old = self._stored(rt, ns, name)
        if old is None:
            raise _not_found(rt, name)
        new = self._incoming(rt, body)
        body_name = new["metadata"].get("name")
        if body_name is not None and body_name != name:
            raise _bad_request(
                f"the name of the object ({body_name}) does not match the name on the URL ({name})"
            )
        body_ns = new["metadata"].get("namespace")
        if rt.namespaced and body_ns is not None and body_ns != ns:
            raise _bad_request(
                "the namespace of the provided object does not match "
                "the namespace sent on the request"
            )
        return self._commit_update(rt, old, new, subresource, dry_run=dry_run, writer=writer)

    def op_patch(
        self,
        rt: ResourceType,
        ns: str | None,
        name: str,
        content_type: str,
        body: Any,
        subresource: str | None = None,
        *,
        dry_run: bool = False,
        writer: ssa.Writer | None = None,
    ) -> tuple[bool, JSON]:
        """Returns (created, object): server-side apply creates absent objects."""
        writer = writer or ssa.Writer()
        old = self._stored(rt, ns, name)
        apply = content_type == APPLY_PATCH
        if apply:
            if not isinstance(body, dict) or not body.get("apiVersion") or not body.get("kind"):
                raise _bad_request("apply patches need apiVersion and kind")
            meta = body.setdefault("metadata", {})
            if meta.get("name", name) != name:
                raise _bad_request("the name in the apply patch does not match the URL")
            body = admission.typed_patch(rt, ns, name, body, writer)
            if old is None:
                if subresource is not None:
                    raise _not_found(rt, name)
                meta["name"] = name
                return True, self.op_create(
                    rt, ns, body, dry_run=dry_run, writer=writer, applying=True
                )
            merged = ssa.apply(
                self._view(rt, old),
                sem.clone(body),
                manager=writer.manager,
                force=writer.force,
                shape=self._shape(rt),
                api_version=rt.api_version,
                subresource=subresource,
                has_status=rt.has_status,
                now=sem.now_rfc3339(),
            )
            new = self._incoming(rt, merged)
            return False, self._commit_update(
                rt, old, new, subresource, dry_run=dry_run, writer=writer, owned=True
            )
        if old is None:
            raise _not_found(rt, name)
        patched = self._apply_patch(rt, name, content_type, self._view(rt, old), body)
        new = self._incoming(rt, patched)
        return False, self._commit_update(rt, old, new, subresource, dry_run=dry_run, writer=writer)

    @staticmethod
    def _shape(rt: ResourceType) -> fs.Shape:
        return fs.schema_shape(dict(rt.schema) if rt.from_crd and rt.schema else None)

    @staticmethod
    def _apply_patch(rt: ResourceType, name: str, content_type: str, base: JSON, body: Any) -> Any:
        try:
            if content_type == "application/json-patch+json":
                return sem.json_patch(base, body)
            if content_type == "application/merge-patch+json":
                return sem.json_merge_patch(base, body)
            if content_type == "application/apply-patch+yaml" or (
                content_type == "application/strategic-merge-patch+json" and not rt.from_crd
            ):
                return sem.strategic_merge_patch(base, body)
        except sem.PatchError as e:  # PatchTestFailed included: 422 as in Kubernetes
            raise _invalid(rt, name, str(e)) from None
        raise api_error(
            415,
            "UnsupportedMediaType",
            f"the body of the request was in an unknown format ({content_type}) - accepted "
            "media types include: application/json-patch+json, application/merge-patch+json, "
            "application/apply-patch+yaml"
            + ("" if rt.from_crd else ", application/strategic-merge-patch+json"),
        )

    # ------------------------------------------------------------------ the scale subresource

    def _scale_of(self, rt: ResourceType, obj: JSON) -> JSON:
        assert rt.scale is not None
        spec_path, status_path, selector_path = rt.scale
        view = self._view(rt, obj)
        spec_replicas = next(iter(sem.jsonpath(view, spec_path)), 0)
        status: JSON = {"replicas": next(iter(sem.jsonpath(view, status_path)), 0)}
        if selector_path is None:
            labels = ((view.get("spec") or {}).get("selector") or {}).get("matchLabels") or {}
            selector = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
        else:
            selector = next(iter(sem.jsonpath(view, selector_path)), "")
        if selector:
            status["selector"] = selector
        fields = ("name", "namespace", "uid", "resourceVersion", "creationTimestamp")
        meta = {k: view["metadata"][k] for k in fields if k in view["metadata"]}
        return {
            "kind": "Scale",
            "apiVersion": "autoscaling/v1",
            "metadata": meta,
            "spec": {"replicas": spec_replicas},
            "status": status,
        }

    def op_scale(
        self,
        rt: ResourceType,
        ns: str | None,
        name: str,
        verb: str,
        content_type: str = "",
        body: Any = None,
        *,
        dry_run: bool = False,
    ) -> JSON:
        """GET, PUT or PATCH ``/scale``: an ``autoscaling/v1`` Scale over the replicas paths."""
        assert rt.scale is not None
        old = self._stored(rt, ns, name)
        if old is None:
            raise _not_found(rt, name)
        current = self._scale_of(rt, old)
        if verb == "get":
            return current
        if verb == "update":
            wanted = body
        elif verb == "patch":
            wanted = self._apply_patch(rt, name, content_type, current, body)
        else:
            raise api_error(405, "MethodNotAllowed", "the server does not allow this method")
        replicas = (
            ((wanted or {}).get("spec") or {}).get("replicas") if isinstance(wanted, dict) else None
        )
        if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 0:
            raise _invalid(rt, name, "spec.replicas: Invalid value: must be a non-negative integer")
        updated = self._view(rt, old)
        updated["metadata"]["resourceVersion"] = _meta(wanted).get("resourceVersion")
        target: Any = updated
        parts = rt.scale[0].lstrip(".").split(".")
        for part in parts[:-1]:
            target = target.setdefault(part, {})
        target[parts[-1]] = replicas
        result = self._commit_update(rt, old, self._incoming(rt, updated), None, dry_run=dry_run)
        return self._scale_of(rt, result)

    def _commit_update(
        self,
        rt: ResourceType,
        old: JSON,
        new: JSON,
        subresource: str | None,
        *,
        dry_run: bool = False,
        writer: ssa.Writer | None = None,
        owned: bool = False,
    ) -> JSON:
        """Stores ``new`` over ``old``: admission, field ownership (``owned``: an apply has
        set it), generation, resourceVersion, event."""
        writer = writer or ssa.Writer()
        old_meta = old["metadata"]
        name = old_meta["name"]
        wanted_rv = new["metadata"].get("resourceVersion")
        if wanted_rv and wanted_rv != old_meta["resourceVersion"]:
            raise _conflict(
                rt,
                name,
                "the object has been modified; please apply your changes to the latest version "
                "and try again",
            )
        if subresource == "status":
            result = sem.clone(old)
            if "status" in new:
                result["status"] = new["status"]
            else:
                result.pop("status", None)
        else:
            result = new
            if rt.has_status:
                if "status" in old:
                    result["status"] = sem.clone(old["status"])
                else:
                    result.pop("status", None)
            self._check_metadata(rt, result)
        if rt.from_crd:
            writer.warnings += admission.admit_custom(
                rt, result, validation=writer.validation, old=old
            )
        admission.admit_builtin(rt, result)
        self._warn(rt, result, writer, admission.pod_warnings(rt, result))
        if rt.storage_key == NODE_KEY:
            admission.node_taints(result)
        meta = result.setdefault("metadata", {})
        for field in (
            "uid",
            "name",
            "namespace",
            "creationTimestamp",
            "deletionTimestamp",
            "deletionGracePeriodSeconds",
            "generation",
            "resourceVersion",
        ):
            if field in old_meta:
                meta[field] = old_meta[field]
            else:
                meta.pop(field, None)
        if rt.storage_key == NAMESPACE_KEY and "status" not in result:
            result["status"] = sem.clone(old.get("status", {"phase": "Active"}))
        new_types: list[ResourceType] = []
        if rt.storage_key == CRD_KEY:
            new_types = self._crd_accept(result, rt)
        if subresource == "status":  # the status write's own entries (an apply's), or old's
            fields = (new if owned else old)["metadata"].get("managedFields")
            result["metadata"]["managedFields"] = sem.clone(fields or [])
        if not owned:
            self._own_fields(rt, old, result, writer, subresource)
        if not result["metadata"].get("managedFields"):
            result["metadata"].pop("managedFields", None)
        if result == old:
            return self._view(rt, old)  # a no-op: no new resourceVersion, no event
        if subresource is None and rt.has_generation and sem.spec_changed(old, result):
            meta["generation"] = int(old_meta.get("generation", 1)) + 1
        if dry_run:
            return self._view(rt, result)
        meta["resourceVersion"] = str(self._next_rv())
        if rt.storage_key == CRD_KEY:
            self._unregister_storage((result["spec"]["group"], result["spec"]["names"]["plural"]))
            for new_rt in new_types:
                self._register(new_rt)
        self._write(rt.storage_key, "MODIFIED", result, old)
        done = not meta.get("finalizers") and not meta.get("deletionGracePeriodSeconds")
        if meta.get("deletionTimestamp") and done and rt.storage_key != NAMESPACE_KEY:
            policy = self._pending_policy.pop(meta["uid"], "Background")
            self._remove(rt.storage_key, result, policy)
        return self._view(rt, result)

    def op_delete(
        self,
        rt: ResourceType,
        ns: str | None,
        name: str,
        options: Mapping[str, Any] | None = None,
        *,
        dry_run: bool = False,
    ) -> tuple[int, JSON]:
        """Returns (HTTP code, object): 200 when gone, 202 when finalizers hold it."""
        options = options or {}
        obj = self._stored(rt, ns, name)
        if obj is None:
            raise _not_found(rt, name)
        meta = obj["metadata"]
        preconditions = options.get("preconditions") or {}
        if preconditions.get("uid") and preconditions["uid"] != meta["uid"]:
            raise _conflict(rt, name, "Precondition failed: UID in precondition does not match")
        wanted_rv = preconditions.get("resourceVersion")
        if wanted_rv and wanted_rv != meta["resourceVersion"]:
            raise _conflict(
                rt,
                name,
                "the object has been modified; please apply your changes to the latest version "
                "and try again",
            )
        policy = options.get("propagationPolicy") or (
            "Orphan" if options.get("orphanDependents") else "Background"
        )
        if policy not in ("Orphan", "Background", "Foreground"):
            raise _bad_request(f"unsupported propagationPolicy: {policy!r}")
        if dry_run:
            return 200, self._view(rt, obj)
        if rt.storage_key == POD_KEY:
            grace = deletion.grace_period(obj, options)
            if grace > 0 or meta.get("deletionGracePeriodSeconds"):
                return self._terminate_pod(obj, grace, policy)
        code, result = self._delete_stored(rt.storage_key, obj, policy)
        return code, self._view(rt, result)

    def _terminate_pod(self, obj: JSON, grace: int, policy: str) -> tuple[int, JSON]:
        """A graceful pod delete: Terminating for ``grace`` seconds, until its kubelet
        confirms with grace 0 (then it goes, finalizers aside)."""
        rt = self.resolve("v1/pods")
        meta = obj["metadata"]
        current = meta.get("deletionGracePeriodSeconds")
        if grace == 0 and not meta.get("finalizers"):
            return 200, self._view(rt, self._remove(POD_KEY, obj, policy))
        if current is not None and current <= grace:
            return 200, self._view(rt, obj)  # a shorter period stands
        marked = sem.clone(obj)
        marked["metadata"]["deletionTimestamp"] = meta.get("deletionTimestamp") or (
            deletion.deadline(grace)
        )
        marked["metadata"]["deletionGracePeriodSeconds"] = grace
        marked["metadata"]["resourceVersion"] = str(self._next_rv())
        self._pending_policy[meta["uid"]] = policy
        self._write(POD_KEY, "MODIFIED", marked, obj)
        return 200, self._view(rt, marked)

    def op_delete_collection(
        self,
        rt: ResourceType,
        ns: str | None,
        *,
        label_selector: str | None = None,
        field_selector: str | None = None,
        options: Mapping[str, Any] | None = None,
        dry_run: bool = False,
    ) -> JSON:
        objs = self._select(rt, ns, label_selector, field_selector)
        items = []
        for obj in objs:
            meta = obj["metadata"]
            _, view = self.op_delete(
                rt, meta.get("namespace"), meta["name"], options, dry_run=dry_run
            )
            items.append(view)
        return {
            "kind": f"{rt.kind}List",
            "apiVersion": rt.api_version,
            "metadata": {"resourceVersion": str(self._rv)},
            "items": items,
        }

    def _delete_stored(self, key: StorageKey, obj: JSON, policy: str) -> tuple[int, JSON]:
        meta = obj["metadata"]
        uid = meta["uid"]
        if key == NAMESPACE_KEY:
            return 200, self._terminate_namespace(obj)
        if policy == "Orphan":
            self._orphan(uid)
        if meta.get("finalizers"):
            if not meta.get("deletionTimestamp"):
                marked = sem.clone(obj)
                marked["metadata"]["deletionTimestamp"] = sem.now_rfc3339()
                marked["metadata"]["deletionGracePeriodSeconds"] = 0
                marked["metadata"]["resourceVersion"] = str(self._next_rv())
                self._write(key, "MODIFIED", marked, obj)
                obj = marked
            self._pending_policy[uid] = policy
            if policy == "Foreground":
                self._cascade(uid)
            return 202, obj
        if policy == "Foreground":
            self._cascade(uid)  # dependents first, then the owner
        return 200, self._remove(key, obj, policy)

    def _terminate_namespace(self, obj: JSON) -> JSON:
        """Marks the Namespace Terminating, deletes its contents, and removes it when nothing
        is left (else when its last object goes: ``_remove``)."""
        name = obj["metadata"]["name"]
        if not obj["metadata"].get("deletionTimestamp"):
            marked = sem.clone(obj)
            marked["metadata"]["deletionTimestamp"] = sem.now_rfc3339()
            marked["metadata"]["deletionGracePeriodSeconds"] = 0
            marked["status"] = {"phase": "Terminating"}
            marked["metadata"]["resourceVersion"] = str(self._next_rv())
            self._write(NAMESPACE_KEY, "MODIFIED", marked, obj)
            obj = marked
        for other_key, item in list(self._store.in_namespace(name)):
            current = self._store.get(
                other_key, (_meta(item).get("namespace"), _meta(item)["name"])
            )
            if other_key == NAMESPACE_KEY or current is None:
                continue
            if other_key == POD_KEY:
                self.op_delete(self.resolve("v1/pods"), name, _meta(current)["name"], {})
            elif not _meta(current).get("deletionTimestamp"):
                self._delete_stored(other_key, current, "Background")
        return self._namespace_gone_if_empty(name) or obj

    def _namespace_gone_if_empty(self, name: str) -> JSON | None:
        """Removes the Terminating namespace ``name`` once nothing is left in it."""
        ns = self._store.get(NAMESPACE_KEY, (None, name))
        if (
            ns is None
            or not ns["metadata"].get("deletionTimestamp")
            or ns["metadata"].get("finalizers")
        ):
            return None
        if any(key != NAMESPACE_KEY for key, _ in self._store.in_namespace(name)):
            return None
        return self._remove(NAMESPACE_KEY, ns, "Background")

    def _remove(self, key: StorageKey, obj: JSON, policy: str) -> JSON:
        self._gone_uids.add(obj["metadata"]["uid"])
        gone = sem.clone(obj)
        gone["metadata"]["resourceVersion"] = str(self._next_rv())
        self._write(key, "DELETED", gone, obj)
        if key == CRD_KEY:
            spec = obj.get("spec") or {}
            crd_key = (spec.get("group", ""), (spec.get("names") or {}).get("plural", ""))
            for item in self._store.objects_of(crd_key):
                self._remove(crd_key, item, "Background")
            self._unregister_storage(crd_key)
        if key == NAMESPACE_KEY:
            for other_key, item in self._store.in_namespace(obj["metadata"]["name"]):
                current = self._store.get(
                    other_key, (_meta(item).get("namespace"), _meta(item)["name"])
                )
                if other_key != NAMESPACE_KEY and current is not None:
                    self._delete_stored(other_key, current, "Background")
        if policy != "Orphan":
            self._cascade(obj["metadata"]["uid"])
        namespace = obj["metadata"].get("namespace")
        if namespace and key != NAMESPACE_KEY:
            self._namespace_gone_if_empty(namespace)
        return gone

    def _dependents(self, uid: str) -> list[tuple[StorageKey, JSON]]:
        return self._store.dependents(uid)

    def _orphan(self, uid: str) -> None:
        for key, obj in self._dependents(uid):
            self._drop_owner(key, obj, uid)

    def _drop_owner(self, key: StorageKey, obj: JSON, uid: str) -> None:
        result = sem.clone(obj)
        refs = [r for r in result["metadata"].get("ownerReferences") or [] if r.get("uid") != uid]
        if refs:
            result["metadata"]["ownerReferences"] = refs
        else:
            result["metadata"].pop("ownerReferences", None)
        result["metadata"]["resourceVersion"] = str(self._next_rv())
        self._write(key, "MODIFIED", result, obj)

    def _cascade(self, uid: str) -> None:
        """The garbage collector: dependents of a gone owner go too, unless owned elsewhere."""
        for key, obj in self._dependents(uid):
            current = self._store.get(key, (_meta(obj).get("namespace"), _meta(obj)["name"]))
            if current is None:
                continue
            others = [
                ref
                for ref in _meta(current).get("ownerReferences") or []
                if ref.get("uid") != uid and self._store.live_uid(str(ref.get("uid")))
            ]
            if others:
                self._drop_owner(key, current, uid)
            elif not _meta(current).get("deletionTimestamp"):
                self._delete_stored(key, current, "Background")

    # ------------------------------------------------------------------ CRDs

    def _crd_accept(self, crd: JSON, rt: ResourceType) -> list[ResourceType]:
        """Validate a CRD, fill its status as the controller would, return its resources."""
        name = crd["metadata"].get("name", "")
        spec = crd.get("spec") or {}
        names = spec.get("names") or {}
        for field, value in (
            ("spec.group", spec.get("group")),
            ("spec.names.plural", names.get("plural")),
            ("spec.names.kind", names.get("kind")),
            ("spec.versions", spec.get("versions")),
        ):
            if not value:
                raise _invalid(rt, name, f"{field}: Required value")
        if name != f"{names['plural']}.{spec['group']}":
            raise _invalid(
                rt, name, 'metadata.name: Invalid value: must be spec.names.plural+"."+spec.group'
            )
        storage = [v["name"] for v in spec["versions"] if v.get("storage")]
        if len(storage) != 1:
            raise _invalid(
                rt,
                name,
                "spec.versions: Invalid value: "
                "must have exactly one version marked as storage version",
            )
        refused = structural.check(crd)  # the API server's rules for CRD schemas
        if refused:
            raise admission.invalid(rt, name, refused)
        try:
            types = crd_resource_types(crd)
        except (KeyError, TypeError) as e:
            raise _invalid(rt, name, f"spec: Invalid value: {e!r}") from None
        types.sort(key=lambda t: t.version != storage[0])  # the storage version registers first
        now = sem.now_rfc3339()
        accepted = {"singular": names.get("singular") or names["kind"].lower(), **names}
        accepted.setdefault("listKind", f"{names['kind']}List")
        crd["status"] = {
            "acceptedNames": accepted,
            "storedVersions": storage,
            "conditions": [
                {
                    "type": "NamesAccepted",
                    "status": "True",
                    "reason": "NoConflicts",
                    "message": "no conflicts found",
                    "lastTransitionTime": now,
                },
                {
                    "type": "Established",
                    "status": "True",
                    "reason": "InitialNamesAccepted",
                    "message": "the initial names have been accepted",
                    "lastTransitionTime": now,
                },
            ],
        }
        old = self._store.get(CRD_KEY, (None, name))
        if old is not None and "status" in old:  # keep the original transition times
            crd["status"]["conditions"] = old["status"]["conditions"]
        return types

    # ------------------------------------------------------------------ tables (kubectl get)

    def _table(self, rt: ResourceType, objs: list[JSON], *, rv: str, headers: bool = True) -> JSON:
        columns: list[JSON] = [
            {
                "name": "Name",
                "type": "string",
                "format": "name",
                "description": "Name",
                "priority": 0,
            }
        ]
        extra = list(rt.printer_columns) or [
            {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"}
        ]
        for col in extra:
            columns.append(
                {
                    "name": col["name"],
                    "type": col.get("type", "string"),
                    "format": col.get("format", ""),
                    "description": col.get("description", ""),
                    "priority": col.get("priority", 0),
                }
            )
        rows = [
            {
                "cells": [_meta(obj).get("name")] + [sem.printer_cell(obj, col) for col in extra],
                "object": obj,
            }
            for obj in objs
        ]
        return {
            "kind": "Table",
            "apiVersion": "meta.k8s.io/v1",
            "metadata": {"resourceVersion": rv},
            "columnDefinitions": columns if headers else [],
            "rows": rows,
        }

    # ------------------------------------------------------------------ watch

    async def _stream_watch(
        self,
        request: rendering.Request,
        rt: ResourceType,
        ns: str | None,
        name: str | None,
        call: ApiCall,
    ) -> aiohttp.web.StreamResponse:
        return await stream_watch(self, request, rt, ns, name, call)

    def close_watches(self) -> None:
        """End every open watch stream (before stopping the server)."""
        self._closed = True
        for log in self._logs.values():
            log.wake()

    # ------------------------------------------------------------------ direct access for tests

    def create_object(self, body: Mapping[str, Any], namespace: str | None = None) -> JSON:
        """Create an object as a client would (``apiVersion`` and ``kind`` pick the resource)."""
        rt = self.resolve_kind(str(body.get("apiVersion", "")), str(body.get("kind", "")))
        ns = (namespace or _meta(body).get("namespace")) if rt.namespaced else None
        return self.op_create(rt, ns, dict(body))

    def apply_object(self, body: Mapping[str, Any], namespace: str | None = None) -> JSON:
        """Server-side apply: create, or merge into the existing object."""
        rt = self.resolve_kind(str(body.get("apiVersion", "")), str(body.get("kind", "")))
        ns = (namespace or _meta(body).get("namespace") or "default") if rt.namespaced else None
        name = str(_meta(body).get("name", ""))
        return self.op_patch(rt, ns, name, "application/apply-patch+yaml", sem.clone(dict(body)))[1]

    def get_object(
        self, ref: str | ResourceType, name: str, namespace: str | None = None
    ) -> JSON | None:
        rt = self.resolve(ref)
        obj = self._stored(rt, namespace if rt.namespaced else None, name)
        return None if obj is None else self._view(rt, obj)

    def list_objects(
        self,
        ref: str | ResourceType,
        namespace: str | None = None,
        label_selector: str | None = None,
        field_selector: str | None = None,
    ) -> list[JSON]:
        rt = self.resolve(ref)
        return [
            self._view(rt, o) for o in self._select(rt, namespace, label_selector, field_selector)
        ]

    def patch_object(
        self,
        ref: str | ResourceType,
        name: str,
        patch: Any,
        namespace: str | None = None,
        *,
        subresource: str | None = None,
        patch_type: str = "merge",
    ) -> JSON:
        """``patch_type``: merge, strategic, json, apply."""
        rt = self.resolve(ref)
        ctype = {
            "merge": "application/merge-patch+json",
            "strategic": "application/strategic-merge-patch+json",
            "json": "application/json-patch+json",
            "apply": "application/apply-patch+yaml",
        }[patch_type]
        return self.op_patch(
            rt, namespace if rt.namespaced else None, name, ctype, patch, subresource
        )[1]

    def delete_object(
        self,
        ref: str | ResourceType,
        name: str,
        namespace: str | None = None,
        propagation: str = "Background",
    ) -> JSON:
        rt = self.resolve(ref)
        ns = namespace if rt.namespaced else None
        return self.op_delete(rt, ns, name, {"propagationPolicy": propagation})[1]

    @property
    def resource_version(self) -> int:
        return self._rv
