"""A voice-agent dialect's HTTP speech call: a route of the one HTTP speech service (service/speech.py).

ElevenLabs' ``POST /v1/text-to-speech/{voice}``, Cartesia's ``POST /tts/bytes`` and Deepgram's
``POST /v1/speak`` carry the whole text in one body and answer with the audio. Each is planned
and spoken as ``POST /v1/audio/speech`` speaks a text, one utterance per sentence (as the
dialect's socket speaks it), its audio in one HTTP response through one encoder (one WAV
header, one MP3 stream): the samples are those of ``POST /v1/audio/speech`` for the same text
and voice.

A dialect subclasses :class:`DialectSpeech`: :meth:`read` turns its body and query into a
:class:`Speech`, and the ``write_*`` methods frame the audio in its response (raw bytes,
server-sent events, JSON lines, one JSON object). Errors before the first audio are HTTP errors,
which the error middleware writes in the dialect's shape (its ``ForeignApi``,
service/http/middleware.py); after it, :meth:`write_failure` says so in-stream where the framing can.
The events the dialect has no message for (the listener running behind, a truncated utterance)
are logged (/metrics counts them too).

    class MySpeech(DialectSpeech):
        ENDPOINT = "/my/speech"
        async def read(self, body): return Speech(text=body["text"], voice=..., encoding="pcm_s16le")
    app.router.add_post(MySpeech.ENDPOINT, handler(MySpeech))   # service/speech.py handler
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from service.errors import ApiError
from service.speech import SpeechDone, SpeechOrder, SpeechRoute
from service.state import REQUEST_ID
from service.synthesis.audio import StreamEncoder
from service.synthesis.events import AlignmentReady, Audio, StreamBehind, UtteranceTruncated
from service.synthesis.params import SynthesisParams, check_text, update_params
from service.voices.clones import Voice
from service.ws.dialects.wire_audio import wav_header

log = logging.getLogger("streamvox.dialects")


@dataclass
class Speech:
    """What one HTTP speech request asks for, in streamvox's terms."""

    text: str
    voice: Voice  # as the dialect found it (service/ws/dialects/common.py), refused in its own words
    encoding: str  # a wire encoding (service/ws/dialects/wire_audio.py)
    rate: int = 24000
    bit_rate: int | None = None  # mp3
    wav: bool = False  # a WAV header before the samples
    timestamps: bool = False  # word timestamps (with --aligner)
    speed: object = None  # the dialect's speed field, checked as every speed is (None: 1.0)
    text_field: str = "text"  # the text's name in the dialect's body, for error messages


class DialectSpeech(SpeechRoute):
    """One HTTP speech request of a dialect."""

    FOREIGN_API = True
    CONTENT_TYPE = "application/octet-stream"
    RESPOND_AT_END = False  # True: the status line waits for the whole audio (one JSON answer)

    def __init__(self, request, state):
        super().__init__(request, state)
        self.speech: Speech | None = None
        self.encoder: StreamEncoder | None = None
        self.respond_at_end = self.RESPOND_AT_END

    # -- what a dialect provides (its errors' body: its ForeignApi, service/http/middleware.py) --
    async def read(self, body: dict) -> Speech:
        """The request (body and query) in streamvox's terms; ApiError(4xx) for what the dialect refuses."""
        raise NotImplementedError

    def content_type(self) -> str:
        return self.CONTENT_TYPE

    async def write_audio(self, data: bytes) -> None:
        """``data``: the next encoded bytes (never empty)."""
        await self.response.write(data)

    async def write_alignment(self, alignment, offset_ms: float) -> None:
        """An utterance's word times (``offset_ms``: where it starts in the response's audio)."""

    async def write_end(self) -> None:
        """Everything was spoken: the dialect's last message, if it has one."""

    async def write_failure(self, error: ApiError) -> None:
        """The request failed after its first audio (raw audio cannot say so: it just ends)."""

    # -- the service's side ----------------------------------------------------------------
    async def parse(self, body: dict) -> SpeechOrder:
        speech = self.speech = await self.read(body)
        check_text(speech.text_field, speech.text, self.state.settings.max_input_chars)  # as every route checks its text
        params = update_params(SynthesisParams(), {"voice": speech.voice.name, "speed": speech.speed})
        self.encoder = StreamEncoder(speech.encoding, speech.rate, speech.bit_rate)
        return SpeechOrder(speech.text, params, speech.voice, timestamps=speech.timestamps, sentences=True)

    def headers(self) -> dict[str, str]:
        return {"Content-Type": self.content_type(), "Cache-Control": "no-cache"}

    async def begin(self) -> None:
        if self.speech.wav:
            await self.write_audio(wav_header(self.speech.encoding, self.speech.rate))

    async def audio(self, event: Audio) -> None:
        data = await self.encoder.encode_async(event.pcm)  # mp3 / resampling off the loop
        if data:  # the resampler or the MP3 frame may hold the chunk's samples back
            await self.write_audio(data)

    async def stream_behind(self, event: StreamBehind) -> None:
        log.info("speech %s: the audio is %.3f s behind its listener", self.request[REQUEST_ID], event.gap_s)

    async def utterance_truncated(self, event: UtteranceTruncated) -> None:
        log.info("speech %s: utterance %d ended early (%s)", self.request[REQUEST_ID], event.index, event.reason)

    async def alignment(self, event: AlignmentReady) -> None:
        await self.write_alignment(event.alignment, event.offset_ms)

    async def done(self, event: SpeechDone) -> None:
        await self.start()
        tail = await self.encoder.finish_async()
        if tail:
            await self.write_audio(tail)
        await self.write_end()

    async def failed(self, error: ApiError) -> None:
        await self.write_failure(error)


__all__ = ["DialectSpeech", "Speech"]
