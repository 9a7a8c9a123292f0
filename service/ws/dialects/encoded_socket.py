"""The audio half the voice-agent dialects share: each utterance of a context gets its own
:class:`~service.synthesis.audio.StreamEncoder` (the client's encoding and rate); its
chunks, and the encoder's tail unless the utterance was cancelled, go out in the dialect's
audio message; a failed utterance is the dialect's ``generation_failed`` error."""

from __future__ import annotations

import numpy as np

from service.synthesis.audio import StreamEncoder
from service.ws.contexts import Context, ContextSocket


class EncodedAudioSocket(ContextSocket):
    """A dialect socket that writes its audio through a StreamEncoder. Subclasses give
    :meth:`send_encoded` (and :meth:`wire_format` when the format is per context)."""

    def wire_format(self, context: Context) -> tuple:
        """The encoding and sample rate of ``context``'s audio (the socket's, set at the handshake),
        and an mp3 bit rate where the dialect names one: ``StreamEncoder(*wire_format)``."""
        return self.encoding, self.rate

    async def send_encoded(self, context: Context, data: bytes) -> None:
        """Write ``data`` (encoded audio, never empty) in the dialect's audio message."""
        raise NotImplementedError

    async def utterance_start(self, context: Context, text: str) -> None:
        context.extra["encoder"] = StreamEncoder(*self.wire_format(context))

    async def audio(self, context: Context, pcm: np.ndarray) -> None:
        data = await context.extra["encoder"].encode_async(pcm)  # mp3 / resampling off the loop
        if data:  # the resampler or the MP3 frame may hold the chunk's samples back
            await self.send_encoded(context, data)

    async def utterance_done(self, context: Context, cancelled: bool, failed: bool) -> None:
        encoder = context.extra.pop("encoder", None)
        if encoder is not None and not cancelled:
            tail = await encoder.finish_async()
            if tail:
                await self.send_encoded(context, tail)
        if failed:
            await self.context_error(context, "generation_failed", "synthesis of an utterance failed")
