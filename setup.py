from setuptools import setup

CORE = ["numpy>=1.26", "onnxruntime>=1.20", "onnx>=1.17", "gguf>=0.17", "tokenizers>=0.20", "pyyaml>=6", "jinja2>=3.1"]

setup(
    name="boardtalk",
    version="0.1.0",
    description="On-device streaming LLM runtime for ARM edge boards (Raspberry Pi 5, Jetson Orin)",
    python_requires=">=3.10",
    packages=["runtime", "runtime.backends", "models", "boards", "voice_demo"],
    install_requires=CORE,
    extras_require={
        "dev": ["pytest>=7", "psutil>=5"],
        "tvm": ["apache-tvm==0.27.*"],
        "voice": ["sounddevice", "faster-whisper", "piper-tts"],
        # llama.cpp as the comparison peer; compiles from source (~20 min on 2 cores)
        "bench": ["llama-cpp-python==0.3.36", "psutil>=5"],
    },
    entry_points={"console_scripts": ["boardtalk=runtime.cli:main"]},
)
