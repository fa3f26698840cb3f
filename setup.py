import platform

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

CORE = ["numpy>=1.26", "onnxruntime>=1.20", "onnx>=1.17", "gguf>=0.17", "regex>=2023.0", "pyyaml>=6", "jinja2>=3.1"]
ARCH_FLAG = "-mcpu=native" if platform.machine().lower() in ("aarch64", "arm64") else "-march=native"


class OptionalBuildExt(build_ext):
    """The native kernels are optional: without a C compiler the onnxruntime backend still works."""

    def run(self):
        try:
            super().run()
        except Exception as e:  # noqa: BLE001
            print(f"WARNING: native kernels not built ({e}); the native backend will try to compile on first use")

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception as e:  # noqa: BLE001
            print(f"WARNING: native kernels not built ({e}); the native backend will try to compile on first use")


setup(
    name="boardtalk",
    version="0.1.0",
    description="On-device streaming LLM runtime for ARM edge boards (Raspberry Pi 5, Jetson Orin)",
    python_requires=">=3.10",
    packages=["runtime", "runtime.backends", "runtime.native", "models", "boards", "voice_demo"],
    package_data={"runtime.native": ["*.c"]},
    # A plain C shared library (loaded with ctypes, not imported), built for this machine's CPU.
    ext_modules=[Extension("runtime._bt_native", ["runtime/native/bt_native.c"],
                           extra_compile_args=["-O3", ARCH_FLAG, "-fopenmp"], extra_link_args=["-fopenmp"])],
    cmdclass={"build_ext": OptionalBuildExt},
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
