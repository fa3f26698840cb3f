from setuptools import setup

# The board needs only the runtime: load an artifact, run it, stream text (jinja2 renders the chat template).
RUNTIME = ["numpy>=1.26", "regex>=2023.0", "pyyaml>=6", "jinja2>=3.1"]
ONNXRUNTIME = ["onnxruntime>=1.20"]  # the portable backend (and the build's graph optimizer)
SIGN = ["cryptography>=42"]  # Ed25519 signed artifacts: signing at build, checking on boards that trust a key
# Building artifacts (GGUF reading, ONNX export) happens on a laptop or the dev host, never on the board.
BUILD = ["onnx>=1.17", "gguf>=0.17", *ONNXRUNTIME, *SIGN]
# The voice loop (runtime/voice/): PortAudio devices, a resampler (soxr: LGPL-2.1, dynamically linked), Silero
# VAD and hibari TTS on onnxruntime, Whisper on CTranslate2; models from pinned PyPI wheels (runtime/voice/assets.py)
VOICE = ["sounddevice>=0.4", "soxr>=0.3", *ONNXRUNTIME, "ctranslate2>=4.4", "hibari-tts==0.2.1", "jellyfish>=1.0"]
SERVE = ["aiohttp>=3.9", "wyoming>=1.7", *VOICE]  # boardtalk serve: HTTP API (aiohttp), Wyoming server, voice loop

setup(
    name="boardtalk",
    version="0.1.0",
    description="On-device streaming LLM runtime for ARM edge boards (Raspberry Pi 5, Jetson Orin)",
    python_requires=">=3.10",
    packages=["runtime", "runtime.backends", "runtime.native", "runtime.voice", "runtime.serve", "models", "boards", "voice_demo"],
    # The native kernels' source ships with the runtime; the artifact builder (models/native_build.py)
    # compiles it for the artifact's board and the artifact carries the library. Nothing compiles at install.
    package_data={"runtime.native": ["*.c"], "voice_demo": ["personas/*.yaml", "blocklist.txt"]},
    install_requires=RUNTIME,
    extras_require={
        "onnxruntime": ONNXRUNTIME,
        "sign": SIGN,
        "build": BUILD,
        # tests run the real voice engines and audio devices too; tokenizers: the reference tests compare with
        "dev": [*BUILD, *SERVE, "pytest>=7", "psutil>=5", "tokenizers>=0.20", "openai>=1.0", "apache-tvm==0.27.*"],
        "tvm": ["apache-tvm==0.27.*"],
        "voice": VOICE,
        "serve": SERVE,
        # opt-in GPL-3.0: piper-tts embeds espeak-ng; installs the "piper" TTS engine
        "voice-gpl": ["piper-tts>=1.3"],
        # llama.cpp as the comparison peer; compiles from source (~20 min on 2 cores)
        "bench": ["llama-cpp-python==0.3.36", "psutil>=5"],
    },
    entry_points={"console_scripts": ["boardtalk=runtime.cli:main"]},
)
