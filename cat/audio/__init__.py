"""Audio bytes and waveforms: encode/decode (WAV, FLAC, Ogg Opus), resampling, speed change.

`cat.audio.codec` turns mono waveforms into the bytes stored in audio shards and back;
`cat.audio.speed` changes speed online as `sox speed` does; `cat.audio.vad` finds speech
with Silero VAD's model (onnxruntime, imported only when a detector is made). This package
depends only on numpy, soundfile and soxr otherwise, so every floor above it (formats,
loading, decoding) can use it.
"""
