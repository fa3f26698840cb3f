from setuptools import setup

CORE = ["numpy>=1.26", "onnxruntime>=1.20", "onnx>=1.17", "gguf>=0.17", "regex>=2023.0", "pyyaml>=6", "jinja2>=3.1"]

setup(
    name="boardtalk",
    version="0.1.0",
    description="On-device streaming LLM runtime for ARM edge boards (Raspberry Pi 5, Jetson Orin)",
    python_requires=">=3.10",
    packages=["runtime", "runtime.backends", "runtime.native", "models", "boards", "voice_demo"],
    # The native kernels' source ships with the runtime; the artifact builder (models/native_build.py)
    # compiles it for the artifact's board and the artifact carries the library. Nothing compiles at install.
    package_data={"runtime.native": ["*.c"]},
    install_requires=CORE,
    extras_require={
        "dev": ["pytest>=7", "psutil>=5", "tokenizers>=0.20"],  # tokenizers: the reference the tests compare with
        "tvm": ["apache-tvm==0.27.*"],
        "voice": ["sounddevice", "faster-whisper", "piper-tts"],
        # llama.cpp as the comparison peer; compiles from source (~20 min on 2 cores)
        "bench": ["llama-cpp-python==0.3.36", "psutil>=5"],
    },
    entry_points={"console_scripts": ["boardtalk=runtime.cli:main"]},
)
