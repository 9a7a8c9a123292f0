"""A reader's 2 s reference recording for the README's cloning commands: a voiced, varying tone
(silence or noise alone is refused as a reference), 24 kHz 16-bit WAV.

    python scripts/lib/reference_voice.py OUT.wav

(used by scripts/readme-clone.sh and scripts/readme-models.sh)."""

import sys

import numpy as np
import soundfile as sf

t = np.arange(48000) / 24000
pitch = 120 + 30 * np.sin(2 * np.pi * 0.7 * t)
voice = sum(np.sin(2 * np.pi * k * np.cumsum(pitch) / 24000) / k for k in range(1, 8))
sf.write(sys.argv[1], 0.2 * voice * (0.6 + 0.4 * np.sin(2 * np.pi * 3 * t)) ** 2, 24000, subtype="PCM_16")
