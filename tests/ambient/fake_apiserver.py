"""A fake of the Kubernetes API server's list/watch protocol (aiohttp), kept only for the
faults a real kube-apiserver cannot be made to produce (tests/ambient/test_source_kube.py):
objects that fail validation, 5xx answers to LIST (``fail_lists``), bytes that are not a
watch stream (``inject``: sent once on the open watch, which then ends), watches that end at
once (``watch_closes_at_once``). Everything else is tested against the real server
(tests/kube/). What it implements, from the Kubernetes API concepts documentation
("Efficient detection of changes", "Watch bookmarks", "410 Gone"):
- ``GET <collection>``: ``{"kind": "<Kind>List", "metadata": {"resourceVersion"}, "items"}``
  (items without kind/apiVersion, as the real server sends them);
- ``GET <collection>?watch=true&resourceVersion=N[&allowWatchBookmarks=true]
  [&timeoutSeconds=T]``: a chunked stream of JSON lines ``{"type", "object"}`` for every
  change after N, then live changes until the timeout; a BOOKMARK event carries only
  ``metadata.resourceVersion``; a version older than the compaction point yields one
  ``ERROR`` event with a ``Status`` of code 410 (Gone);
- ``PATCH /api/v1/namespaces/<ns>/pods/<name>/status`` with
  ``application/merge-patch+json`` (RFC 7386) on ``metadata.annotations``;
- 404 ``Status`` for collections not served (an Istio CRD not installed).
"""

from __future__ import annotations

import asyncio
import copy
import json

from aiohttp import web

CORE = {"namespaces": "Namespace", "nodes": "Node", "pods": "Pod", "services": "Service"}


class FakeApiServer:
    def __init__(self, served: dict[str, str] | None = None):
        # collection path -> Kind
        self.served = served or {f"/api/v1/{p}": k for p, k in CORE.items()}
        self.objects: dict[str, dict[tuple[str, str], dict]] = {p: {} for p in self.served}
        self.events: list[tuple[int, str, str, dict]] = []
        self.rv = 100
        self.compacted = 0
        self.fail_lists = 0
        self.inject: bytes | None = None
        self.watch_closes_at_once = False
        self.requests: list[str] = []
        self._changed = asyncio.Condition()
        self._close_watches = asyncio.Event()
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> str:
        app = web.Application()
        app.router.add_route("GET", "/{tail:.*}", self._get)
        app.router.add_route("PATCH", "/{tail:.*}", self._patch)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self.url

    async def stop(self) -> None:
        self._close_watches.set()
        if self.runner:
            await self.runner.cleanup()

    # --- mutations (test side) ---

    async def put(self, path: str, obj: dict) -> None:
        key = (obj["metadata"].get("namespace", ""), obj["metadata"]["name"])
        etype = "MODIFIED" if key in self.objects[path] else "ADDED"
        await self._record(path, etype, key, copy.deepcopy(obj))

    async def delete(self, path: str, namespace: str, name: str) -> None:
        obj = self.objects[path].get((namespace, name))
        if obj is not None:
            await self._record(path, "DELETED", (namespace, name), copy.deepcopy(obj))

    async def compact_and_drop_watches(self) -> None:
        """Forget history up to now and end open watches (like an etcd compaction + restart)."""
        self.compacted = self.rv + 1
        self._close_watches.set()
        await asyncio.sleep(0.05)
        self._close_watches = asyncio.Event()

    async def _record(self, path: str, etype: str, key: tuple[str, str], obj: dict) -> None:
        self.rv += 1
        obj["metadata"]["resourceVersion"] = str(self.rv)
        if etype == "DELETED":
            self.objects[path].pop(key, None)
        else:
            self.objects[path][key] = obj
        self.events.append((self.rv, path, etype, obj))
        async with self._changed:
            self._changed.notify_all()

    # --- HTTP ---

    @staticmethod
    def _status(code: int, reason: str, message: str) -> web.Response:
        return web.json_response({"kind": "Status", "apiVersion": "v1", "status": "Failure",
                                  "message": message, "reason": reason, "code": code},
                                 status=code)

    async def _get(self, request: web.Request) -> web.StreamResponse:
        path = "/" + request.match_info["tail"]
        self.requests.append(f"GET {path}?{request.query_string}")
        if path not in self.served:
            return self._status(404, "NotFound", f"the server could not find the requested "
                                                 f"resource ({path})")
        if request.query.get("watch") in ("true", "1"):
            return await self._watch(request, path)
        if self.fail_lists:
            self.fail_lists -= 1
            return self._status(500, "InternalError", "etcdserver: request timed out")
        items = []
        for obj in self.objects[path].values():
            item = copy.deepcopy(obj)
            item.pop("kind", None)
            item.pop("apiVersion", None)
            items.append(item)
        return web.json_response({"kind": self.served[path] + "List", "apiVersion": "v1",
                                  "metadata": {"resourceVersion": str(self.rv)}, "items": items})

    async def _watch(self, request: web.Request, path: str) -> web.StreamResponse:
        since = int(request.query.get("resourceVersion") or self.rv)
        timeout = float(request.query.get("timeoutSeconds") or 300)
        bookmarks = request.query.get("allowWatchBookmarks") == "true"
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        if self.watch_closes_at_once:
            await resp.write_eof()
            return resp

        async def send(event: dict) -> None:
            await resp.write(json.dumps(event).encode() + b"\n")

        if since < self.compacted:
            await send({"type": "ERROR", "object": {
                "kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 410,
                "reason": "Expired", "message": f"too old resource version: {since} "
                                                f"({self.compacted})"}})
            await resp.write_eof()
            return resp
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        closing = self._close_watches
        sent = since
        if bookmarks:
            await send({"type": "BOOKMARK", "object": {
                "kind": self.served[path], "metadata": {"resourceVersion": str(self.rv)}}})
        while loop.time() < deadline and not closing.is_set():
            if self.inject is not None:
                junk, self.inject = self.inject, None
                await resp.write(junk)
                break
            for rv, p, etype, obj in list(self.events):
                if rv > sent and p == path:
                    await send({"type": etype, "object": obj})
                if rv > sent:
                    sent = rv
            async with self._changed:
                try:
                    await asyncio.wait_for(self._changed.wait(),
                                           timeout=min(0.2, max(0.01, deadline - loop.time())))
                except asyncio.TimeoutError:
                    pass
        await resp.write_eof()
        return resp

    async def _patch(self, request: web.Request) -> web.Response:
        path = "/" + request.match_info["tail"]
        self.requests.append(f"PATCH {path}")
        parts = path.strip("/").split("/")
        if (len(parts) != 7 or parts[:3] != ["api", "v1", "namespaces"] or parts[4] != "pods"
                or parts[6] != "status"):
            return self._status(404, "NotFound", f"no route {path}")
        if request.headers.get("Content-Type") != "application/merge-patch+json":
            return self._status(415, "UnsupportedMediaType", "want merge-patch+json")
        ns, name = parts[3], parts[5]
        pod = self.objects["/api/v1/pods"].get((ns, name))
        if pod is None:
            return self._status(404, "NotFound", f'pods "{name}" not found')
        patch = await request.json()
        pod = copy.deepcopy(pod)
        ann = pod["metadata"].setdefault("annotations", {})
        for k, v in ((patch.get("metadata") or {}).get("annotations") or {}).items():
            if v is None:
                ann.pop(k, None)
            else:
                ann[k] = v
        await self._record("/api/v1/pods", "MODIFIED", (ns, name), pod)
        return web.json_response(self.objects["/api/v1/pods"][(ns, name)])
