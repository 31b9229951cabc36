"""Who may talk to the server: the Host a request names, the Origin a browser sends, and the API key.

- **Host** (every path): a DNS-rebinding page reaches a loopback server under its own name, so a Host the
  server does not answer to is a 403. Loopback always passes; bound elsewhere, this machine's names and any IP
  address too (an address cannot be rebound); ``--allowed-hosts`` replaces that wider set.
- **Origin** (state-changing methods): another site's page is a 403 unless in ``--allowed-origins``, the only
  origins CORS answers; clients that are not browsers send none.
- **API key** (``--api-key``): ``Authorization: Bearer KEY`` everywhere but the open paths, or on GET and HEAD
  from the page itself, its cookie (an event stream, a ``<video>`` or a download carries no header)."""

from __future__ import annotations

import hashlib
import ipaddress
import json
import re
import secrets
import socket
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote

from layerstream.errors import LayerstreamError

API_KEY_ENV = "LAYERSTREAM_API_KEY"
KEY_COOKIE = "layerstream_api_key"  # cookies ignore the port: servers on one host with one key share it
OPEN_PATHS = frozenset({"/", "/health", "/metrics", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"})
OPEN_PREFIXES = ("/ui/",)
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
_DEFAULT_PORTS = {"http": 80, "https": 443}
_ORIGIN = re.compile(r"([a-z][a-z0-9+.-]*)://([^/?#@\s]+)")
_PORT = re.compile(r":[0-9]{1,5}")
_SHOWN_CHARS = 100  # of a stranger's Host or Origin, in a refusal


class AccessSettingsError(LayerstreamError, ValueError):
    """An access setting that cannot be used; names the setting, the value and what is allowed."""


@dataclass(frozen=True)
class HostRule:
    """Which Host names a request may carry, beyond loopback names and addresses (always served)."""

    names: frozenset[str] = frozenset()
    domains: tuple[str, ...] = ()  # ``.example.com``: that domain and every name under it
    networks: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...] = ()
    any_host: bool = False

    def allows(self, host: str) -> bool:
        """Whether `host` (a Host header's name or address, lower case, no port) is served."""
        address = _address(host)
        if address is not None:
            return address.is_loopback or self.any_host or any(address in n for n in self.networks)
        if host == "localhost" or host.endswith(".localhost") or self.any_host or host in self.names:
            return True
        return any(host == d[1:] or host.endswith(d) for d in self.domains)


@dataclass(frozen=True, kw_only=True)
class AccessSettings:
    """The server's access rules, validated when built (the command line names its own flags in errors)."""

    bind_host: str = "127.0.0.1"
    allowed_hosts: tuple[str, ...] | None = None  # None: the default for `bind_host`
    allowed_origins: tuple[str, ...] = ()  # may make state-changing requests and get CORS headers; ``*``: any
    api_key: str | None = None
    hosts: HostRule = field(init=False, repr=False)

    def __post_init__(self) -> None:
        entries = self.allowed_hosts if self.allowed_hosts is not None else _default_hosts(self.bind_host)
        object.__setattr__(self, "hosts", _host_rule(entries))
        for origin in self.allowed_origins:
            if origin != "*" and _split_origin(origin) is None:
                raise AccessSettingsError(
                    f"allowed_origins = {origin!r} is not valid; expected an origin such as https://app.example or"
                    " http://192.168.1.5:3000 (scheme, host, optional port; no path), or *"
                )
        if self.api_key is not None and not re.fullmatch(r"[\x21-\x7e]+", self.api_key):
            raise AccessSettingsError(
                "api_key is not valid; expected printable ASCII without spaces (it travels in a header)"
            )

    def origin_allowed(self, origin: str) -> bool:
        return "*" in self.allowed_origins or _normal_origin(origin) in {_normal_origin(o) for o in self.allowed_origins}


def _default_hosts(bind_host: str) -> tuple[str, ...]:
    """Bound to loopback: nothing beyond loopback. Else this machine's names and any address."""
    address = _address(bind_host.strip("[]").lower())
    if address is not None and address.is_loopback or bind_host.lower() == "localhost":
        return ()
    names = {socket.gethostname(), socket.getfqdn(), f"{socket.gethostname()}.local", bind_host}
    # the machine's own names as they come: one a Host header could not carry is skipped, not a refusal to start
    return ("0.0.0.0/0", "::/0", *sorted(n for n in (n.lower().rstrip(".") for n in names) if _NAME.fullmatch(n) or _address(n)))


def _host_rule(entries: Iterable[str]) -> HostRule:
    names, domains, networks, any_host = set(), [], [], False
    for entry in entries:
        text = entry.strip().lower().rstrip(".")
        if text == "*":
            any_host = True
        elif text.startswith(".") and _NAME.fullmatch(text[1:]):
            domains.append(text)
        elif _network(text) is not None:
            networks.append(_network(text))
        elif _NAME.fullmatch(text):
            names.add(text)
        else:
            raise AccessSettingsError(
                f"allowed_hosts = {entry!r} is not valid; expected a host name (gpu.example.com), a domain with its"
                " names (.example.com), an IP address or network (10.0.0.0/8), or *"
            )
    return HostRule(frozenset(names), tuple(domains), tuple(networks), any_host)


_NAME = re.compile(r"(?=.{1,253}$)[a-z0-9_]([a-z0-9_-]{0,61}[a-z0-9_])?(\.[a-z0-9_]([a-z0-9_-]{0,61}[a-z0-9_])?)*")


def _network(text: str) -> ipaddress.IPv4Network | ipaddress.IPv6Network | None:
    try:
        return ipaddress.ip_network(text.strip("[]"), strict=False)
    except ValueError:
        return None


def _address(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return None
    mapped = getattr(address, "ipv4_mapped", None)  # ::ffff:127.0.0.1 is 127.0.0.1
    return mapped or address


def split_host(value: str) -> tuple[str, int | None] | None:
    """A Host header's (name or address, port), lower case, a trailing dot dropped; None if it is not one."""
    value = value.strip().lower()
    if value.startswith("["):
        host, closed, rest = value[1:].partition("]")
        if not closed or _address(host) is None or ":" not in host:
            return None
    elif value.count(":") > 1:
        return None  # an IPv6 address without brackets
    else:
        host, colon, port = value.partition(":")
        rest = colon + port
    if rest and not _PORT.fullmatch(rest) or int(rest[1:] or 0) > 65535:
        return None
    host = host[:-1] if host.endswith(".") else host  # "localhost." is localhost
    if not host or (_address(host) is None and not _NAME.fullmatch(host)):
        return None
    return host, int(rest[1:]) if rest else None


def _split_origin(origin: str) -> tuple[str, str, int] | None:
    """An Origin's (scheme, host, port: the scheme's default if none is written); None if it is not one."""
    match = _ORIGIN.fullmatch(origin.strip().lower())
    if match is None:
        return None
    scheme, authority = match.groups()
    split = split_host(authority)
    if split is None:
        return None
    host, port = split
    return scheme, host, port if port is not None else _DEFAULT_PORTS.get(scheme, 0)


def _normal_origin(origin: str) -> str:
    split = _split_origin(origin)
    return origin.strip().lower() if split is None else "{}://{}:{}".format(*split)


def _browser_origin(origin: str) -> str:
    """An origin as a browser writes it in ``Origin`` (lower case, no default port), for CORS's exact match."""
    scheme, host, port = _split_origin(origin) or ("", origin, 0)
    host = f"[{host}]" if ":" in host else host
    return f"{scheme}://{host}" + ("" if port in (0, _DEFAULT_PORTS.get(scheme)) else f":{port}")


def same_origin(origin: str, host_header: str | None) -> bool:
    """Whether `origin` names the server the request reached (its Host, the port the origin's scheme implies)."""
    split, host = _split_origin(origin), split_host(host_header) if host_header else None
    if split is None or host is None:
        return False
    scheme, origin_host, origin_port = split
    if scheme not in _DEFAULT_PORTS:  # a browser extension, a file: never this server's own page
        return False
    return origin_host == host[0] and origin_port == (host[1] if host[1] is not None else _DEFAULT_PORTS[scheme])


def is_open_path(path: str) -> bool:
    """Paths served without the API key: health, metrics, the page and its files, the OpenAPI document."""
    return path in OPEN_PATHS or path.startswith(OPEN_PREFIXES)


def cookie_keys(cookie_header: str | None) -> list[str]:
    """The values of the page's key cookie in a Cookie header (a browser may send several of one name)."""
    keys = []
    for part in (cookie_header or "").split(";"):
        name, equals, value = part.strip().partition("=")
        if equals and name == KEY_COOKIE:
            keys.append(unquote(value.strip().strip('"')))
    return keys


def refusals(settings: AccessSettings, method: str, path: str) -> dict[int, str]:
    """What the checks may answer `method` `path` (status -> when), for the OpenAPI document."""
    forbidden = "The request's Host is not a name or address this server answers to (--allowed-hosts)"
    if method.upper() not in SAFE_METHODS and "*" not in settings.allowed_origins:
        forbidden += ", or a page of another site sent it (its Origin; --allowed-origins)"
    answers = {403: forbidden}
    if settings.api_key is not None and not is_open_path(path):
        answers[401] = f"The API key is missing or wrong (Authorization: Bearer KEY; --api-key or {API_KEY_ENV})"
    return answers


# the ASGI side ----------------------------------------------------------------------------------------------------
def add_access_checks(app: Any, settings: AccessSettings) -> None:
    """Install the checks on `app`: Host outermost, then CORS, then Origin and key, so that a preflight never
    needs the key and every refusal carries CORS."""
    app.add_middleware(RequestGate, settings=settings)
    if settings.allowed_origins:
        from starlette.middleware.cors import CORSMiddleware

        allow = ["*"] if "*" in settings.allowed_origins else [_browser_origin(o) for o in settings.allowed_origins]
        app.add_middleware(
            CORSMiddleware, allow_origins=allow, allow_methods=["GET", "HEAD", "POST", "DELETE"],
            allow_headers=["Authorization", "Content-Type"], max_age=600,
        )  # fmt: skip
    app.add_middleware(HostGate, settings=settings)


def _headers(scope: dict[str, Any]) -> dict[str, str]:
    headers: dict[str, str] = {}
    for name, value in scope.get("headers", ()):
        headers.setdefault(name.decode("latin-1").lower(), value.decode("latin-1"))
    return headers


def _shown(text: str) -> str:
    return repr(text if len(text) <= _SHOWN_CHARS else text[:_SHOWN_CHARS] + "...")


async def _refuse(send: Any, status: int, code: str, message: str, headers: dict[str, str] | None = None) -> None:
    error = {"message": message, "type": "authentication_error" if status == 401 else "permission_error",
             "param": None, "code": code, "details": []}  # fmt: skip
    body = json.dumps({"error": error}).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


class HostGate:
    """403 to a Host this server does not answer to; a request without one (HTTP/1.0) names no site and passes."""

    def __init__(self, app: Any, *, settings: AccessSettings):
        self.app, self.rule = app, settings.hosts

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            host = _headers(scope).get("host")
            split = split_host(host) if host is not None else None
            if host is not None and (split is None or not self.rule.allows(split[0])):
                message = (
                    f"Host {_shown(host)} is not served here (a guard against DNS rebinding); the server answers its own"
                    " names and addresses: allow this one with --allowed-hosts"
                )
                await _refuse(send, 403, "host_not_allowed", message)
                return
        await self.app(scope, receive, send)


class RequestGate:
    """403 to a state-changing request from another site's page; 401 without the API key where one is needed."""

    def __init__(self, app: Any, *, settings: AccessSettings):
        self.app, self.settings = app, settings
        # the key as its SHA-256: every comparison takes the same time whatever is sent (vllm's way)
        self.key = _digest(settings.api_key) if settings.api_key is not None else None

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers, method = _headers(scope), scope["method"]
        origin = headers.get("origin")
        if method not in SAFE_METHODS and origin is not None and not self._origin_passes(origin, headers.get("host")):
            message = (
                f"{method} from origin {_shown(origin)} is refused: a page of another site may not change this server;"
                f" allow it with --allowed-origins {origin if _split_origin(origin) else 'ORIGIN'}"
            )
            await _refuse(send, 403, "origin_not_allowed", message)
            return
        if self.key is not None and method != "OPTIONS" and not is_open_path(scope["path"]) and not self._has_key(headers, method):
            message = (
                "missing or wrong API key: send the header Authorization: Bearer KEY, with the key the server was"
                f" started with (--api-key or {API_KEY_ENV})"
            )
            await _refuse(send, 401, "invalid_api_key", message, {"WWW-Authenticate": "Bearer"})
            return
        await self.app(scope, receive, send)

    def _origin_passes(self, origin: str, host: str | None) -> bool:
        return same_origin(origin, host) or self.settings.origin_allowed(origin)

    def _has_key(self, headers: dict[str, str], method: str) -> bool:
        assert self.key is not None
        scheme, _, token = headers.get("authorization", "").strip().partition(" ")
        if scheme.lower() == "bearer" and self._matches(token.strip() or None):
            return True
        # the page's cookie, on reads only and only from the page itself (Fetch Metadata; browsers that send none
        # still keep a SameSite=Strict cookie from other sites): a write always needs the header, so no other
        # page can make the browser write with it
        if method not in ("GET", "HEAD") or headers.get("sec-fetch-site", "same-origin") not in ("same-origin", "none"):
            return False
        return any(self._matches(key) for key in cookie_keys(headers.get("cookie")))

    def _matches(self, candidate: str | None) -> bool:
        return candidate is not None and secrets.compare_digest(_digest(candidate), self.key)


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "replace")).digest()
