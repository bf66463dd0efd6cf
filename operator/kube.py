"""A small asyncio Kubernetes client for what kopf does not do: server-side apply and reads.

kopf watches and patches the resources it handles; applying children with server-side apply,
listing them and patching scale subresources needs plain API calls. This client reuses kopf's
login (a `kopf.ConnectionInfo`), so the operator authenticates once, the same way, against a
real cluster or the KMock emulator in tests. On 401 it logs in again once (service-account
tokens rotate).

Errors are `ApiError` (status and the API's own message, truncated), chained from aiohttp's.
"""

from __future__ import annotations

import base64
import json
import ssl
import tempfile
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import kopf

from mooncake_k8s.operator.naming import MANAGER

Obj = dict[str, Any]
Login = Callable[[], Awaitable[kopf.ConnectionInfo]]

# (apiVersion, kind) -> plural. Everything here is namespaced.
PLURALS: dict[tuple[str, str], str] = {
    ("v1", "ConfigMap"): "configmaps",
    ("v1", "Service"): "services",
    ("v1", "Secret"): "secrets",
    ("v1", "Pod"): "pods",
    ("apps/v1", "StatefulSet"): "statefulsets",
    ("apps/v1", "Deployment"): "deployments",
    ("policy/v1", "PodDisruptionBudget"): "poddisruptionbudgets",
    ("networking.k8s.io/v1", "NetworkPolicy"): "networkpolicies",
    ("gateway.networking.k8s.io/v1", "HTTPRoute"): "httproutes",
    ("mooncake.io/v1alpha1", "MooncakeCluster"): "mooncakeclusters",
    ("mooncake.io/v1alpha1", "MooncakeRoleScaler"): "mooncakerolescalers",
}


class ApiError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message[:500]}")
        self.status = status

    @property
    def retryable(self) -> bool:
        return self.status in (408, 409, 429) or self.status >= 500


def collection_path(api_version: str, kind: str, namespace: str) -> str:
    plural = PLURALS[(api_version, kind)]
    root = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    return f"{root}/namespaces/{namespace}/{plural}"


def object_path(api_version: str, kind: str, namespace: str, name: str) -> str:
    return f"{collection_path(api_version, kind, namespace)}/{name}"


def _ssl_context(info: kopf.ConnectionInfo) -> ssl.SSLContext | bool:
    if info.insecure:
        return False
    ctx = ssl.create_default_context()
    if info.ca_path:
        ctx.load_verify_locations(cafile=info.ca_path)
    elif info.ca_data:
        data = info.ca_data
        ctx.load_verify_locations(cadata=data.decode() if isinstance(data, bytes) else data)
    cert, key = info.certificate_path, info.private_key_path
    if info.certificate_data and info.private_key_data:
        # ssl can only load client certificates from files.
        files = []
        for blob in (info.certificate_data, info.private_key_data):
            f = tempfile.NamedTemporaryFile(delete=False)  # noqa: SIM115
            f.write(blob if isinstance(blob, bytes) else blob.encode())
            f.close()
            files.append(f.name)
        cert, key = files
    if cert:
        ctx.load_cert_chain(certfile=cert, keyfile=key)
    return ctx


def _auth_headers(info: kopf.ConnectionInfo) -> dict[str, str]:
    if info.token:
        return {"Authorization": f"{info.scheme or 'Bearer'} {info.token}"}
    if info.username and info.password:
        raw = f"{info.username}:{info.password}".encode()
        return {"Authorization": f"Basic {base64.b64encode(raw).decode()}"}
    return {}


class KubeClient:
    def __init__(self, login: Login, *, timeout_s: float = 30.0) -> None:
        self._login = login
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session: aiohttp.ClientSession | None = None
        self._server = ""
        self._stopped = False

    async def _connect(self) -> aiohttp.ClientSession:
        if self._stopped:  # a handler outliving the operator's cleanup must not reconnect
            raise ApiError(503, "the operator is stopping")
        if self._session is None:
            info = await self._login()
            self._server = info.server.rstrip("/")
            self._session = aiohttp.ClientSession(
                headers=_auth_headers(info), timeout=self._timeout,
                connector=aiohttp.TCPConnector(ssl=_ssl_context(info)))
        return self._session

    async def close(self) -> None:
        """Drop the connection (the next request logs in again)."""
        if self._session is not None:
            session, self._session = self._session, None
            await session.close()

    async def stop(self) -> None:
        """Close for good: later requests fail instead of opening a new session."""
        self._stopped = True
        await self.close()

    async def request(self, method: str, path: str, *, body: Any = None,
                      params: dict[str, str] | None = None,
                      content_type: str = "application/json") -> Any:
        for attempt in (0, 1):
            session = await self._connect()
            data = None if body is None else json.dumps(body)
            headers = {"Content-Type": content_type} if body is not None else {}
            try:
                async with session.request(method, self._server + path, data=data,
                                           params=params, headers=headers) as resp:
                    text = await resp.text()
                    if resp.status == 401 and attempt == 0:
                        await self.close()  # token rotated: log in again, retry once
                        continue
                    if resp.status >= 400:
                        raise ApiError(resp.status, _message(text))
                    return json.loads(text) if text else None
            except aiohttp.ClientError as e:
                raise ApiError(503, f"{method} {path}: {e}") from e
        raise ApiError(401, f"{method} {path}: unauthorized")

    async def apply(self, obj: Obj, *, manager: str = MANAGER) -> Obj:
        """Server-side apply with one field manager; `force` takes fields from other writers."""
        meta = obj["metadata"]
        path = object_path(obj["apiVersion"], obj["kind"], meta["namespace"], meta["name"])
        out: Obj = await self.request(
            "PATCH", path, body=obj, params={"fieldManager": manager, "force": "true"},
            content_type="application/apply-patch+yaml")
        return out

    async def get(self, api_version: str, kind: str, namespace: str, name: str) -> Obj | None:
        try:
            out: Obj = await self.request("GET", object_path(api_version, kind, namespace, name))
            return out
        except ApiError as e:
            if e.status == 404:
                return None
            raise

    async def list(self, api_version: str, kind: str, namespace: str,
                   labels: dict[str, str]) -> list[Obj]:
        selector = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
        out = await self.request("GET", collection_path(api_version, kind, namespace),
                                 params={"labelSelector": selector})
        items: list[Obj] = out.get("items", []) if out else []
        # Filter again: a selector the server ignored must never leak foreign objects in.
        return [o for o in items
                if all(o.get("metadata", {}).get("labels", {}).get(k) == v
                       for k, v in labels.items())]

    async def create(self, obj: Obj) -> Obj:
        meta = obj["metadata"]
        out: Obj = await self.request(
            "POST", collection_path(obj["apiVersion"], obj["kind"], meta["namespace"]),
            body=obj, params={"fieldManager": MANAGER})
        return out

    async def delete(self, api_version: str, kind: str, namespace: str, name: str,
                     uid: str | None = None) -> bool:
        """Delete one object (only the incarnation `uid`, when given); False when it is
        already gone (or was replaced by another incarnation meanwhile)."""
        body = {"kind": "DeleteOptions", "apiVersion": "v1",
                "preconditions": {"uid": uid}} if uid else None
        try:
            await self.request("DELETE", object_path(api_version, kind, namespace, name),
                               body=body)
        except ApiError as e:
            if e.status in (404, 409):
                return False
            raise
        return True

    async def patch_merge(self, api_version: str, kind: str, namespace: str, name: str,
                          body: Obj, subresource: str | None = None) -> Obj:
        path = object_path(api_version, kind, namespace, name)
        if subresource:
            path += f"/{subresource}"
        out: Obj = await self.request("PATCH", path, body=body,
                                      params={"fieldManager": MANAGER},
                                      content_type="application/merge-patch+json")
        return out


def _message(text: str) -> str:
    try:
        return str(json.loads(text).get("message") or text)
    except (ValueError, AttributeError):
        return text
