"""The voice loop: mic -> VAD -> streaming ASR -> LLM -> clause chunks -> TTS -> speaker (issue #8).

    runtime/voice/engines.py   the VAD / ASR / TTS interfaces and their registry
    runtime/voice/assets.py    engine model files from PyPI wheels, sha256-checked
    runtime/voice/audio.py     sounddevice I/O: callbacks only move frames through ring buffers
    runtime/voice/pipeline.py  the turn loop, its timeline and the file mode
"""
