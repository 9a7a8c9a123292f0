"""Deepgram's ``POST /v1/speak`` (the SDK's ``speak.v1.audio.generate``, Pipecat's
``DeepgramHttpTTSService``), a route of the one HTTP speech service (service/ws/dialects/http_speech.py).

Body ``{"text"}``; query ``model`` (as on the socket: a voice, an alias such as
``aura-2-thalia-en``, or ``aura-<voice>-en``), ``encoding`` (``mp3``, Deepgram's default,
``linear16`` or ``mulaw``), ``container`` (``wav``, the default for linear16 and mulaw, or
``none``: bare samples; mp3 has none), ``sample_rate`` (linear16 8000-48000, default 24000;
mulaw 8000 or 16000, default 8000; mp3 22050 only), ``bit_rate`` (mp3: 32000 or 48000, the
default), ``speed`` (0.7-1.5); ``mip_opt_out`` and ``tag`` are accepted and ignored, a
``callback`` (asynchronous delivery) is refused. The audio streams as it is generated. Errors
are Deepgram's ``{"err_code", "err_msg", "request_id"}``; the key as on the socket
(``Authorization: Token KEY``).
"""

from __future__ import annotations

from aiohttp import web

from service.errors import ApiError
from service.http.middleware import ForeignApi
from service.speech import handler
from service.synthesis.numbers import shown, whole_number
from service.ws.dialects.deepgram import deepgram_key, deepgram_voice, query_rate, query_speed
from service.ws.dialects.http_speech import DialectSpeech, Speech
from service.ws.dialects.wire_audio import CONTENT_TYPES, MAX_RATE, MIN_RATE

PREFIX = "/v1/speak"
ENCODINGS = {"linear16": "pcm_s16le", "mulaw": "pcm_mulaw", "mp3": "mp3"}
RATES = {"linear16": (MIN_RATE, MAX_RATE), "mulaw": (8000, 16000), "mp3": (22050, 22050)}
DEFAULT_RATES = {"linear16": 24000, "mulaw": 8000, "mp3": 22050}
MP3_BIT_RATES = (32000, 48000)


def error_body(status: int, code: str, message: str, request_id: str) -> dict:
    return {"err_code": code.upper(), "err_msg": message, "request_id": request_id}


API = ForeignApi("Deepgram", (PREFIX,), deepgram_key, "Authorization: Token KEY", error_body)


def bad_query(message: str) -> ApiError:
    return ApiError(400, "invalid_query_parameter", message)


class DeepgramSpeak(DialectSpeech):
    ENDPOINT = PREFIX

    async def read(self, body: dict) -> Speech:
        query = self.request.query
        if "callback" in query:
            raise bad_query("callback: asynchronous delivery is not served; read the audio from this response")
        encoding = query.get("encoding", "mp3")
        if encoding not in ENCODINGS:
            raise ApiError(400, "unsupported_encoding", f"encoding: choose one of {', '.join(ENCODINGS)}")
        rate = query_rate(query, "sample_rate", DEFAULT_RATES[encoding], *RATES[encoding])
        container = query.get("container", "none" if encoding == "mp3" else "wav")
        if container not in (("none",) if encoding == "mp3" else ("wav", "none")):
            raise bad_query(f"container: {encoding} takes " + ("none" if encoding == "mp3" else "wav or none"))
        bit_rate = None
        if encoding == "mp3":
            bit_rate = whole_number(query.get("bit_rate", "48000"))
            if bit_rate not in MP3_BIT_RATES:
                raise bad_query(f"bit_rate: mp3 takes {' or '.join(map(str, MP3_BIT_RATES))}, "
                                f"got {shown(query['bit_rate'])}")
        elif "bit_rate" in query:
            raise bad_query(f"bit_rate: only for mp3, not {encoding}")
        speed = query_speed(query)
        voice = await deepgram_voice(self.request, query.get("model", "default"))
        text = body.get("text")
        if not isinstance(text, str) or not text.strip():
            raise ApiError(400, "invalid_request_body", "text: must be a non-empty string")
        return Speech(text=text, voice=voice, encoding=ENCODINGS[encoding], rate=rate, bit_rate=bit_rate,
                      wav=container == "wav", speed=speed)

    def content_type(self) -> str:
        return "audio/wav" if self.speech.wav else CONTENT_TYPES[self.speech.encoding]


def add_routes(app: web.Application) -> None:
    app.router.add_post(DeepgramSpeak.ENDPOINT, handler(DeepgramSpeak))
