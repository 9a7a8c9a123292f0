"""A server address as a user types it -> the HTTP base and the WebSocket base.

One server answers REST on ``http(s)://`` and WebSockets on ``ws(s)://`` at the same host,
port and path prefix, so any of these names the same server::

    http://127.0.0.1:8000   https://tts.example.com   ws://127.0.0.1:8000/   wss://tts.example.com
    127.0.0.1:8000          localhost:8000/            http://127.0.0.1:8000/v1 (an OpenAI base_url)

A bare address needs its port (``localhost`` alone could mean port 80 or the server's 8000).

A path is kept as a prefix (a server behind a reverse proxy at ``/tts``), except that
everything from a ``/v1`` segment on is dropped: users paste endpoint URLs
(``ws://host:8000/v1/stream``, ``http://host:8000/v1``) as often as base URLs. Anything
else raises ``AddressError`` with one line saying what is wrong; nothing here touches the
network.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# scheme typed -> (HTTP scheme, WebSocket scheme) of the same server
SCHEMES = {"http": ("http", "ws"), "https": ("https", "wss"), "ws": ("http", "ws"), "wss": ("https", "wss")}
# a host name / IPv4 address, or a bracketed IPv6 address
_HOST = r"[A-Za-z0-9_](?:[A-Za-z0-9_.-]*[A-Za-z0-9_])?|\[[0-9A-Fa-f:.]+\]"
_HOST_PORT = re.compile(rf"(?P<host>{_HOST})(?::(?P<port>\d+))?")
FORMS = "http://HOST:PORT, https://HOST, ws://HOST:PORT, wss://HOST or HOST:PORT"


class AddressError(ValueError):
    """The address is not one of the accepted forms; ``str()`` is the one-line reason."""


@dataclass(frozen=True)
class ServerAddress:
    http: str  # e.g. http://127.0.0.1:8000 (no trailing slash): REST paths are appended
    ws: str    # e.g. ws://127.0.0.1:8000: WebSocket paths are appended

    @property
    def stream_url(self) -> str:
        return self.ws + "/v1/stream"


def parse_address(address: str) -> ServerAddress:
    """``address`` in any accepted form -> its ServerAddress; AddressError otherwise."""
    text = (address or "").strip()
    if not text:
        raise AddressError(f"empty server address (expected {FORMS})")
    scheme, sep, rest = text.partition("://")
    if not sep:  # bare HOST:PORT[/path]
        scheme, rest = "http", text
    if scheme.lower() not in SCHEMES:
        raise AddressError(f"{address!r}: unsupported scheme {scheme!r} (expected {FORMS})")
    if "?" in rest or "#" in rest:
        raise AddressError(f"{address!r}: a server address takes no query or fragment")
    hostport, slash, path = rest.partition("/")
    if "@" in hostport:
        # the address is not said back: it holds a password
        raise AddressError("credentials in the server address are not supported (use --api-key)")
    match = _HOST_PORT.fullmatch(hostport)
    if match is None or re.search(r"\s", path):
        raise AddressError(f"{address!r} is not a server address (expected {FORMS})")
    port = match.group("port")
    if not sep and port is None:  # `localhost` alone: port 80 or the server's 8000? Ask, not guess
        raise AddressError(f"{address!r}: give the port ({text}:PORT) or the scheme (http://{text})")
    if port is not None and not 0 < int(port) < 65536:
        raise AddressError(f"{address!r}: port {port} is out of range (1-65535)")
    http_scheme, ws_scheme = SCHEMES[scheme.lower()]
    netloc = match.group("host") + (f":{int(port)}" if port is not None else "")
    prefix = _prefix(slash + path)
    return ServerAddress(f"{http_scheme}://{netloc}{prefix}", f"{ws_scheme}://{netloc}{prefix}")


def _prefix(path: str) -> str:
    """The path the server is mounted at: no trailing slash, nothing from ``/v1`` on."""
    segments = [segment for segment in path.split("/") if segment]
    if "v1" in segments:
        segments = segments[:segments.index("v1")]
    return "".join("/" + segment for segment in segments)
