"""Audio bytes and waveforms: encode/decode (WAV, FLAC, Ogg Opus), resampling, speed change.

`cat.audio.codec` turns mono waveforms into the bytes stored in audio shards and back;
`cat.audio.speed` changes speed online as `sox speed` does. This package depends only on
numpy, soundfile and soxr, so every floor above it (formats, loading, decoding) can use it.
"""
