"""Voice-toy demo app (mic -> VAD -> ASR -> LLM -> TTS -> speaker); built in its own issue."""
