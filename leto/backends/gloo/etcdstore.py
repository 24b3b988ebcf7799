"""The job's records in etcd: the replicated store of a multi-node job (``--rdzv-backend etcd``).

Why etcd: it is what torchelastic's etcd rendezvous already uses, Debian ships it
(``etcd-server``), and a 3-member cluster survives the loss of any one member with
linearizable reads and writes, leases and compare-and-swap. Why the ``etcd3gw``
client (OpenStack, maintained): it talks to etcd's v3 JSON gateway over HTTP with
``requests`` (no grpc or protobuf pins, unlike ``etcd3``, unmaintained since 2020).
leto takes from it the endpoint's URLs and the HTTP session (etcd 3.4 or later: ``/v3/``), and
sends the v3 requests itself (``kv/range``, ``kv/txn``, ``lease/*``: each a small
JSON body) so that a response is read with a bound and checked field by field.

One :class:`EtcdStore` per agent, holding every endpoint the user gave. A call goes
to the current endpoint; when it cannot answer (refused, timed out, a 5xx, a
response that is not what etcd sends) the store drops that endpoint's connection
and tries the next one, until one answers or ``patience`` seconds have passed: then
:class:`StoreError`, one line naming the endpoints and the last reason. So the loss
of one member of three costs one failed request, not the job.

Every key is under ``/leto/<job id>/``. Every value is JSON signed with the job's
secret (HMAC-SHA256 over the key and the value, ``docs/security.md``): whoever can
reach etcd but does not hold the secret can delete or overwrite a record, which the
job then refuses in one line (:class:`StoreError`), but cannot forge one that a
node obeys. Compare-and-swap is by a key's ``mod_revision`` (0: the key must not
exist), the fencing primitive: a write guarded by the revision of the generation
record fails once anyone has moved the generation on.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "MAX_RESPONSE",
    "MAX_VALUE",
    "NOT_FOUND",
    "Entry",
    "EtcdStore",
    "Refused",
    "StoreError",
    "valid_job_id",
]

MAX_VALUE = 256 << 10  # a record (etcd's own default limit on a request is 1.5 MiB)
SCAN_PAGE = 8  # records per answer of a scan
MAX_RESPONSE = 4 << 20  # a page of records, base64: a larger answer is not etcd's
_JOB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


class StoreError(RuntimeError):
    """etcd could not do what was asked, or answered what etcd does not: one line."""


class Refused(StoreError):
    """etcd answered, and refused: its gRPC status ``code`` (5: not found)."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


NOT_FOUND = 5


class _Retry(Exception):
    """This endpoint failed: drop its connection, try the next one."""


def valid_job_id(text: str) -> bool:
    """A job id is 1-64 letters, digits, ``_ . -``, starting with a letter or a digit."""
    return _JOB_ID.fullmatch(text) is not None


@dataclass(frozen=True)
class Entry:
    value: dict[str, Any]
    mod_revision: int


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _int(obj: Any, name: str) -> int:
    """An int64 of the gateway's JSON (a string, or absent for 0)."""
    v = obj.get(name, "0") if isinstance(obj, dict) else None
    if isinstance(v, int) and not isinstance(v, bool):
        return v
    if isinstance(v, str) and v.lstrip("-").isdecimal() and len(v) <= 20:
        return int(v)
    raise _Retry(f"field {name!r} is not an integer")


def _revision(answer: dict[str, Any]) -> int:
    """The store's revision in an answer's header: etcd sends one with every answer."""
    header = answer.get("header")
    if not isinstance(header, dict) or "revision" not in header:
        raise _Retry("an answer without etcd's header")
    return _int(header, "revision")


class EtcdStore:
    """See the module docstring. ``secret`` signs and checks every value."""

    def __init__(
        self,
        endpoints: Sequence[tuple[str, int]],
        job: str,
        secret: bytes,
        *,
        timeout: float = 2.0,
        patience: float = 15.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not endpoints:
            raise ValueError("no etcd endpoint")
        if not valid_job_id(job):
            raise ValueError(f"not a job id: {job!r}")
        self.endpoints = list(endpoints)
        self.prefix = f"/leto/{job}/"
        self.secret = secret
        self.timeout = timeout
        self.patience = patience
        self.clock = clock
        self.current = 0
        self._clients: dict[int, Any] = {}
        self.calls = 0  # requests that succeeded
        self.failovers = 0  # endpoints given up on
        self.seconds = 0.0  # spent in requests that succeeded

    # ------------------------------------------------------------------ transport

    def where(self) -> str:
        return ",".join(f"{h}:{p}" for h, p in self.endpoints)

    def _client(self, i: int) -> Any:
        c = self._clients.get(i)
        if c is None:
            import etcd3gw

            host, port = self.endpoints[i]
            # etcd 3.4 or later (/v3/): no version request, whose answer etcd3gw reads unbounded
            c = etcd3gw.Etcd3Client(host=host, port=port, timeout=self.timeout, api_path="/v3/")
            c.session.trust_env = False  # no proxy from the environment: the address given
            self._clients[i] = c
        return c

    def _drop(self, i: int) -> None:
        c = self._clients.pop(i, None)
        if c is not None:
            c.session.close()

    def _post_once(self, i: int, path: str, body: dict[str, Any]) -> dict[str, Any]:
        import requests
        from etcd3gw import exceptions as E

        c = self._client(i)
        try:
            url = c.get_url(path)
            resp = c.session.post(url, json=body, timeout=self.timeout, stream=True)
        except (requests.RequestException, E.Etcd3Exception, ValueError) as e:
            first = str(e).splitlines()[0][:120] if str(e) else ""
            raise _Retry(f"{type(e).__name__}: {first}") from None
        try:
            data = resp.raw.read(MAX_RESPONSE + 1, decode_content=True)
        except (requests.RequestException, OSError, Exception) as e:  # noqa: BLE001 - urllib3's
            raise _Retry(f"reading the answer: {type(e).__name__}") from None
        finally:
            resp.close()
        if len(data) > MAX_RESPONSE:
            raise _Retry(f"an answer of more than {MAX_RESPONSE} bytes")
        if resp.status_code >= 500 or resp.status_code in (408, 429):
            raise _Retry(f"HTTP {resp.status_code}: {data[:120].decode(errors='replace')}")
        try:
            obj = json.loads(data)
        except (ValueError, RecursionError):
            raise _Retry("an answer that is not JSON") from None
        if not isinstance(obj, dict):
            raise _Retry("an answer that is not a JSON object")
        if resp.status_code != 200:
            msg = obj.get("error") or obj.get("message") or ""
            code = obj.get("code")
            if not isinstance(code, int) or isinstance(code, bool):
                raise _Retry(f"HTTP {resp.status_code} without etcd's error code")
            raise Refused(
                f"etcd at {c.host}:{c.port} refused {path} (HTTP {resp.status_code}): "
                f"{str(msg).splitlines()[0][:160] if msg else ''}",
                code,
            )
        return obj

    def _post(self, path: str, body: dict[str, Any], check: Callable[[dict[str, Any]], Any]) -> Any:
        """``check(answer)`` of the first endpoint that answers well; failover on error."""
        start = self.clock()
        last = "no endpoint tried"
        tried = 0
        while True:
            i = self.current
            t0 = self.clock()
            try:
                out = check(self._post_once(i, path, body))
            except _Retry as e:
                host, port = self.endpoints[i]
                last = f"{host}:{port}: {e}"
                self._drop(i)
                self.failovers += 1
                self.current = (i + 1) % len(self.endpoints)
                tried += 1
                if self.clock() - start > self.patience:
                    raise StoreError(
                        f"etcd at {self.where()}: no member answered {path} within "
                        f"{self.patience:g} s (last: {last})"
                    ) from None
                if tried % len(self.endpoints) == 0:
                    time.sleep(0.1)  # every member failed once: an election may be under way
                continue
            self.calls += 1
            self.seconds += self.clock() - t0
            return out

    # ------------------------------------------------------------------ values

    def key(self, name: str) -> str:
        return self.prefix + name

    def _mac(self, key: str, body: bytes) -> str:
        return hmac.new(
            self.secret, b"leto-etcd\0" + key.encode() + b"\0" + body, hashlib.sha256
        ).hexdigest()

    def _seal(self, name: str, value: dict[str, Any]) -> str:
        body = json.dumps(value, sort_keys=True, separators=(",", ":")).encode()
        if len(body) > MAX_VALUE:
            raise ValueError(f"a record of {len(body)} bytes (at most {MAX_VALUE})")
        sealed = {"v": body.decode(), "mac": self._mac(self.key(name), body)}
        return _b64(json.dumps(sealed, separators=(",", ":")).encode())

    def _open(self, name: str, b64: Any) -> dict[str, Any]:
        """The value of ``name`` as stored, checked: signed with the job's secret."""
        bad = f"etcd record {self.key(name)} "
        try:
            raw = base64.b64decode(b64, validate=True) if isinstance(b64, str) else None
            sealed = json.loads(raw) if raw is not None and len(raw) <= MAX_VALUE * 2 else None
        except (ValueError, RecursionError):
            sealed = None
        if not isinstance(sealed, dict) or not isinstance(sealed.get("v"), str):
            raise StoreError(bad + "is not a leto record (someone else wrote it)")
        body = sealed["v"].encode()
        mac = sealed.get("mac")
        if not isinstance(mac, str) or not hmac.compare_digest(
            mac, self._mac(self.key(name), body)
        ):
            raise StoreError(bad + "is not signed with this job's secret (someone else wrote it)")
        value = json.loads(body)
        if not isinstance(value, dict):
            raise StoreError(bad + "is not a JSON object")
        return value

    # ------------------------------------------------------------------ operations

    def ping(self) -> None:
        """Any member answers (a read of nothing): the cluster is reachable."""
        self._post("kv/range", {"key": _b64(self.key("ping").encode())}, _revision)

    def get(self, name: str) -> Entry | None:
        """The record ``name``, checked; None if there is none."""
        key = self.key(name)

        def check(a: dict[str, Any]) -> tuple[Any, int] | None:
            _revision(a)
            kvs = a.get("kvs") or []
            if not isinstance(kvs, list) or len(kvs) > 1 or (kvs and not isinstance(kvs[0], dict)):
                raise _Retry("a range answer that is not one key")
            if not kvs:
                return None
            return kvs[0].get("value", ""), _int(kvs[0], "mod_revision")

        got = self._post("kv/range", {"key": _b64(key.encode())}, check)
        if got is None:
            return None
        return Entry(self._open(name, got[0]), got[1])

    def scan(self, prefix: str) -> list[tuple[str, Entry]]:
        """Every record whose name starts with ``prefix``, in key order, checked (read
        in pages of :data:`SCAN_PAGE`)."""
        start = self.key(prefix).encode()
        end = start[:-1] + bytes([start[-1] + 1])
        out: list[tuple[str, Entry]] = []

        def check(a: dict[str, Any]) -> tuple[list[tuple[str, Any, int]], bool]:
            _revision(a)
            kvs = a.get("kvs") or []
            if not isinstance(kvs, list) or len(kvs) > SCAN_PAGE:
                raise _Retry("a range answer that is not a page of keys")
            page = []
            for kv in kvs:
                if not isinstance(kv, dict) or not isinstance(kv.get("key"), str):
                    raise _Retry("a key of a range answer that is not one")
                try:
                    key = base64.b64decode(kv["key"], validate=True).decode()
                except (ValueError, UnicodeDecodeError):
                    raise _Retry("a key that is not base64 of UTF-8") from None
                if not key.startswith(self.key(prefix)):
                    raise _Retry(f"a key outside the range asked for: {key[:80]!r}")
                page.append((key, kv.get("value", ""), _int(kv, "mod_revision")))
            return page, a.get("more") is True

        while True:
            body = {"key": _b64(start), "range_end": _b64(end), "limit": str(SCAN_PAGE)}
            page, more = self._post("kv/range", body, check)
            for key, value, rev in page:
                name = key[len(self.prefix) :]
                out.append((name, Entry(self._open(name, value), rev)))
            if not more or not page:
                return out
            start = page[-1][0].encode() + b"\0"

    def put(self, name: str, value: dict[str, Any], *, lease: int = 0) -> int:
        """Write ``name``; the revision it was written at."""
        return self.write({}, [(name, value)], lease=lease) or 0

    def write(
        self,
        guards: dict[str, int],
        puts: Sequence[tuple[str, dict[str, Any]]],
        *,
        lease: int = 0,
        clear: str | None = None,
        drop: tuple[str, str] | None = None,
    ) -> int | None:
        """One transaction: when every guard ``name -> mod_revision`` holds (0: the key
        does not exist), delete the keys under ``clear`` (a sub-prefix) and those from
        ``drop[0]`` up to ``drop[1]`` (excluded), and put every value; the revision it
        took effect at, or None when a guard failed."""
        compare = [
            {
                "key": _b64(self.key(n).encode()),
                "result": "EQUAL",
                "target": "MOD",
                "mod_revision": str(rev),
            }
            for n, rev in guards.items()
        ]
        success: list[dict[str, Any]] = []
        if clear is not None:
            start = self.key(clear).encode()
            end = start[:-1] + bytes([start[-1] + 1])
            success.append({"request_delete_range": {"key": _b64(start), "range_end": _b64(end)}})
        if drop is not None:
            lo, hi = (self.key(n).encode() for n in drop)
            success.append({"request_delete_range": {"key": _b64(lo), "range_end": _b64(hi)}})
        for n, v in puts:
            put: dict[str, Any] = {"key": _b64(self.key(n).encode()), "value": self._seal(n, v)}
            if lease:
                put["lease"] = str(lease)
            success.append({"request_put": put})

        def check(a: dict[str, Any]) -> int | None:
            rev = _revision(a)
            return rev if a.get("succeeded") is True else None

        return self._post("kv/txn", {"compare": compare, "success": success, "failure": []}, check)  # type: ignore[no-any-return]

    def clear_all(self) -> None:
        """Delete every key of the job (its end)."""
        start = self.prefix.encode()
        end = start[:-1] + bytes([start[-1] + 1])
        self._post(
            "kv/deleterange",
            {"key": _b64(start), "range_end": _b64(end)},
            _revision,
        )

    def grant(self, ttl: int) -> int:
        """A lease of ``ttl`` seconds; its id."""

        def check(a: dict[str, Any]) -> int:
            lid = _int(a, "ID")
            if lid == 0:
                raise StoreError(f"etcd granted no lease: {str(a.get('error', ''))[:120]}")
            return lid

        return self._post("lease/grant", {"TTL": str(ttl), "ID": "0"}, check)  # type: ignore[no-any-return]

    def refresh(self, lease: int) -> int:
        """Keep ``lease`` alive; its remaining TTL (StoreError once it has expired)."""

        def check(a: dict[str, Any]) -> int:
            res = a.get("result", a)
            ttl = _int(res, "TTL")
            if ttl <= 0:
                raise StoreError(f"the etcd lease {lease:x} has expired")
            return ttl

        return self._post("lease/keepalive", {"ID": str(lease)}, check)  # type: ignore[no-any-return]

    def revoke(self, lease: int) -> bool:
        """End ``lease`` and delete its keys; False if it had ended already."""
        try:
            self._post("lease/revoke", {"ID": str(lease)}, _revision)
        except Refused as e:
            if e.code == NOT_FOUND:
                return False
            raise
        return True

    def close(self) -> None:
        for i in list(self._clients):
            self._drop(i)
