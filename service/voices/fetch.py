"""``ref_audio`` given as a URL (vllm-omni's ``http(s)://`` and ``file://`` references), read
only from the prefixes an operator allows with ``--ref-audio-url-prefixes``.

Fetching on a client's behalf is a server-side request forgery risk, so by default nothing is
fetched. An allowed prefix is a whole directory: ``https://host[:port]/path/`` or
``file:///dir/``, always ending in ``/`` (``https://media.example.com`` would also match
``https://media.example.com.evil.org``). A URL is normalised (``..`` resolved) before it is
compared, redirects are not followed (they could leave the prefix), the body is read up to
``--max-ref-audio-mb`` and the whole fetch is bounded in time. A ``file://`` path is resolved
(symlinks too) and must stay inside the allowed directory; only a regular file is read (a FIFO,
a device or a directory is refused before any read could block), and the read is bounded in time
like a fetch.
"""

from __future__ import annotations

import asyncio
import os
import stat
from pathlib import Path

import aiohttp
from yarl import URL

from service.errors import ApiError, invalid_field

FETCH_TIMEOUT_S = 10.0
URL_SCHEMES = ("http://", "https://", "file:", "ftp://")  # ftp: recognised, to be refused as a URL


def is_url(value: str) -> bool:
    return value.lstrip()[:8].lower().startswith(URL_SCHEMES)


def _allowed(value: str, prefixes: tuple[str, ...]) -> URL:
    if not prefixes:
        raise _refused("URLs are not fetched on this server (the operator allows none: --ref-audio-url-prefixes); "
                       "send the audio as base64 or a data: URL, or upload it once with POST /v1/audio/voices")
    try:
        url = URL(value.strip())
    except (ValueError, TypeError):
        raise _refused("not a valid URL") from None
    if url.user is not None or url.password is not None:
        raise _refused("URLs with credentials are not fetched")
    if not any(str(url).startswith(prefix) for prefix in prefixes):
        raise _refused("this URL is outside the allowed prefixes (--ref-audio-url-prefixes)")
    return url


async def fetch_reference(value: str, prefixes: tuple[str, ...], max_bytes: int) -> bytes:
    """The bytes behind an allowed ``ref_audio`` URL; a 4xx ApiError naming ``ref_audio`` otherwise."""
    url = _allowed(value, prefixes)
    if url.scheme == "file":
        try:
            return await asyncio.wait_for(asyncio.to_thread(_read_file, url, prefixes, max_bytes), FETCH_TIMEOUT_S)
        except asyncio.TimeoutError:  # a stalled file system: the thread finishes on its own, the client is answered
            raise _refused(f"reading the file took longer than {FETCH_TIMEOUT_S:g} s") from None
    return await _fetch_http(url, max_bytes)


def _read_file(url: URL, prefixes: tuple[str, ...], max_bytes: int) -> bytes:
    try:
        path = Path(url.path).resolve()
    except (OSError, ValueError):  # ValueError: a NUL byte (%00) in the path
        raise _refused("not a usable file path") from None
    roots = [Path(URL(p).path).resolve() for p in prefixes if p.startswith("file:")]
    if not any(path.is_relative_to(root) for root in roots):  # a symlink out of the directory
        raise _refused("this path is outside the allowed directories (--ref-audio-url-prefixes)")
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):  # never open a FIFO, a device or a directory
            raise _refused("not a regular file")
        # O_NONBLOCK: should a FIFO be swapped in after the check, opening it must not wait for a
        # writer; the type is checked again on the open descriptor, which is what gets read.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0))
    except OSError:
        raise _refused("no readable file at this path") from None
    with os.fdopen(fd, "rb") as handle:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise _refused("not a regular file")
        os.set_blocking(fd, True)
        try:
            data = handle.read(max_bytes + 1)
        except OSError:
            raise _refused("no readable file at this path") from None
    if len(data) > max_bytes:
        raise _too_large(max_bytes)
    return data


def _refused(message: str) -> ApiError:
    return invalid_field("ref_audio", message)


def _too_large(max_bytes: int) -> ApiError:
    return ApiError(413, "ref_audio_too_large", f"ref_audio: more than {max_bytes / (1 << 20):g} MiB of audio")


async def _fetch_http(url: URL, max_bytes: int) -> bytes:
    timeout = aiohttp.ClientTimeout(total=FETCH_TIMEOUT_S)
    try:
        async with aiohttp.ClientSession(timeout=timeout) as http:
            async with http.get(url, allow_redirects=False) as response:
                if 300 <= response.status < 400:
                    raise _refused(f"the URL answered a redirect ({response.status}); redirects are not followed")
                if response.status != 200:
                    raise _refused(f"fetching the URL answered HTTP {response.status}")
                if response.content_length is not None and response.content_length > max_bytes:
                    raise _too_large(max_bytes)
                data = bytearray()
                async for block in response.content.iter_chunked(64 * 1024):
                    data += block
                    if len(data) > max_bytes:
                        raise _too_large(max_bytes)
                return bytes(data)
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        raise _refused(f"could not fetch the URL ({type(exc).__name__})") from None
