"""The artifact: a directory with ``manifest.yaml`` and the files it lists.

Loading checks, before anything runs: the format version, the manifest's fields and
types, every file's size and sha256, and the target board. Each failure says what
was expected and what was found. (A TVM library is native code: an unverified one
must never be loaded, so there is no "skip verification" switch.)
"""
from __future__ import annotations

import atexit
import hashlib
import logging
import os
import shutil
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

FORMAT_VERSION = 2  # 2: native artifacts carry weights.bin (8-row groups) instead of the GGUF
MANIFEST = "manifest.yaml"
BACKENDS = ("onnxruntime", "native", "tvm")


def cache_dir() -> Path:
    """Where boardtalk keeps model files, compiled kernels and default artifacts ($BOARDTALK_CACHE or XDG cache)."""
    env = os.environ.get("BOARDTALK_CACHE")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(xdg) / "boardtalk"


class ArtifactError(ValueError):
    """The artifact is missing, corrupt, tampered with, or not for this board."""


@dataclass(frozen=True)
class Target:
    board: str  # board profile name (boards.PROFILES)
    triple: str  # e.g. "x86_64-linux-gnu", "aarch64-linux-gnu"
    cuda_arch: str | None  # e.g. "sm_87", None for CPU


@dataclass(frozen=True)
class Quantization:
    scheme: str  # models.quant.SCHEMES key
    bits: int
    group_size: int
    symmetric: bool
    embedding: str  # "q8_0" or "rtn-int4" (tied lm_head)
    accuracy_level: int  # MatMulNBits accuracy level (4 = int8 activations)


@dataclass(frozen=True)
class Manifest:
    format_version: int
    tool_version: str
    model_name: str
    architecture: dict  # models.arch.LlamaConfig.to_dict()
    source: dict  # where the weights came from: file name, sha256, package
    tokenizer_file: str
    bos_id: int | None
    eos_id: int
    stop_ids: tuple[int, ...]  # ids that end a reply (eos, end-of-turn)
    chat_template: str | None
    quantization: Quantization
    kv_cache: dict  # scheme description: dtype, scale, layout
    backend: str
    graph_file: str
    graph_optimized_by: str | None  # "onnxruntime X.Y.Z" when the graph is already optimized
    target: Target
    max_context: int
    files: dict  # name -> {"size": int, "sha256": str}

    def to_dict(self) -> dict[str, Any]:
        return {
            "format_version": self.format_version,
            "tool_version": self.tool_version,
            "model": {"name": self.model_name, "architecture": dict(self.architecture), "source": dict(self.source)},
            "tokenizer": {"file": self.tokenizer_file, "bos_id": self.bos_id, "eos_id": self.eos_id,
                          "stop_ids": list(self.stop_ids)},
            "chat_template": self.chat_template,
            "quantization": dict(self.quantization.__dict__),
            "kv_cache": dict(self.kv_cache),
            "backend": self.backend,
            "graph": {"file": self.graph_file, **({"optimized_by": self.graph_optimized_by}
                                                   if self.graph_optimized_by else {})},
            "target": dict(self.target.__dict__),
            "max_context": self.max_context,
            "files": {k: dict(v) for k, v in self.files.items()},
        }


def _get(d: Any, path: str, typ, where: str = MANIFEST):
    cur = d
    for key in path.split("."):
        if not isinstance(cur, dict) or key not in cur:
            raise ArtifactError(f"{where}: missing field '{path}'")
        cur = cur[key]
    if typ is not None and not isinstance(cur, typ) or (typ is int and isinstance(cur, bool)):
        tname = typ.__name__ if isinstance(typ, type) else "/".join(t.__name__ for t in typ)
        raise ArtifactError(f"{where}: field '{path}' should be {tname}, found {type(cur).__name__} {cur!r:.60}")
    return cur


def parse_manifest(d: Any) -> Manifest:
    if not isinstance(d, dict):
        raise ArtifactError(f"{MANIFEST}: expected a mapping at the top level, found {type(d).__name__}")
    version = _get(d, "format_version", int)
    if version != FORMAT_VERSION:
        raise ArtifactError(f"{MANIFEST}: format_version {version} is not supported; this runtime reads version "
                            f"{FORMAT_VERSION} (rebuild the artifact with this boardtalk)")
    backend = _get(d, "backend", str)
    if backend not in BACKENDS:
        raise ArtifactError(f"{MANIFEST}: backend {backend!r} unknown; expected one of {', '.join(BACKENDS)}")
    files = _get(d, "files", dict)
    for name, info in files.items():
        if not isinstance(name, str) or "/" in name or "\\" in name or name in ("", ".", ".."):
            raise ArtifactError(f"{MANIFEST}: file name {name!r} is not a plain file name")
        _get(info, "size", int, f"{MANIFEST} files.{name}")
        _get(info, "sha256", str, f"{MANIFEST} files.{name}")
    q = _get(d, "quantization", dict)
    t = _get(d, "target", dict)
    stop = _get(d, "tokenizer.stop_ids", list)
    bos = _get(d, "tokenizer", dict).get("bos_id")
    tmpl = d.get("chat_template")
    m = Manifest(
        format_version=version,
        tool_version=_get(d, "tool_version", str),
        model_name=_get(d, "model.name", str),
        architecture=_get(d, "model.architecture", dict),
        source=_get(d, "model.source", dict),
        tokenizer_file=_get(d, "tokenizer.file", str),
        bos_id=bos if isinstance(bos, int) else None,
        eos_id=_get(d, "tokenizer.eos_id", int),
        stop_ids=tuple(int(x) for x in stop),
        chat_template=tmpl if isinstance(tmpl, str) else None,
        quantization=Quantization(
            scheme=_get(q, "scheme", str, "quantization"), bits=_get(q, "bits", int, "quantization"),
            group_size=_get(q, "group_size", int, "quantization"), symmetric=_get(q, "symmetric", bool, "quantization"),
            embedding=_get(q, "embedding", str, "quantization"), accuracy_level=_get(q, "accuracy_level", int, "quantization")),
        kv_cache=_get(d, "kv_cache", dict),
        backend=backend,
        graph_file=_get(d, "graph.file", str),
        graph_optimized_by=_get(d, "graph", dict).get("optimized_by"),
        target=Target(board=_get(t, "board", str, "target"), triple=_get(t, "triple", str, "target"),
                      cuda_arch=t.get("cuda_arch")),
        max_context=_get(d, "max_context", int),
        files=files,
    )
    for f in (m.tokenizer_file, m.graph_file):
        if f not in files:
            raise ArtifactError(f"{MANIFEST}: {f} is used but not listed under 'files' (so it cannot be verified)")
    return m


def file_digest(path: Path) -> tuple[int, str]:
    """(size, sha256) of a file, hashed straight from the page cache through a read-only mapping (no
    copies, no fresh buffers to fault in; hashlib releases the GIL while it works)."""
    import mmap

    h = hashlib.sha256()
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size:
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                h.update(mm)
    return size, h.hexdigest()


def open_artifact(path: str | Path) -> Path:
    """The artifact directory; a .tar / .tar.gz is unpacked (safely) to a temporary directory first."""
    path = Path(path)
    if path.is_file() and tarfile.is_tarfile(path):
        dest = Path(tempfile.mkdtemp(prefix="boardtalk-artifact-"))
        atexit.register(shutil.rmtree, dest, True)  # the unpacked copy lives as long as this process
        with tarfile.open(path) as tf:
            tf.extractall(dest, filter="data")
        subdirs = [p for p in dest.iterdir() if p.is_dir()]
        return subdirs[0] if not (dest / MANIFEST).exists() and len(subdirs) == 1 else dest
    if not path.is_dir():
        raise ArtifactError(f"artifact not found: {path} (expected a directory with {MANIFEST}, or a tarball of one)")
    return path


def load_manifest(art_dir: Path, verify_files: bool = True) -> Manifest:
    import yaml

    mpath = art_dir / MANIFEST
    if not mpath.is_file():
        raise ArtifactError(f"{art_dir}: no {MANIFEST}; is this a boardtalk artifact?")
    try:
        raw = yaml.safe_load(mpath.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise ArtifactError(f"{mpath}: not valid YAML ({e})") from e
    m = parse_manifest(raw)
    if verify_files:
        verify_files_of(art_dir, m)
    return m


def _verify_one(art_dir: Path, name: str, info: dict) -> None:
    p = art_dir / name
    if not p.is_file():
        raise ArtifactError(f"{art_dir}: file {name} listed in the manifest is missing")
    actual = p.stat().st_size
    if actual != info["size"]:
        raise ArtifactError(f"{name}: size {actual} bytes, manifest says {info['size']} (truncated or replaced?)")
    _, digest = file_digest(p)
    if digest != info["sha256"]:
        raise ArtifactError(f"{name}: sha256 {digest}, manifest says {info['sha256']} (corrupt or tampered with)")


class FileVerifier:
    """Hashes every listed file in background threads (hashlib releases the GIL), so a small file
    can be verified and used while the large ones are still being checked. wait(name) before using
    a file; wait_all() before running anything."""

    def __init__(self, art_dir: Path, m: Manifest):
        from concurrent.futures import ThreadPoolExecutor

        self.art_dir, self.m = art_dir, m
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="verify")
        order = sorted(m.files, key=lambda n: m.files[n]["size"])  # small files first
        self._futures = {n: self._pool.submit(_verify_one, art_dir, n, m.files[n]) for n in order}

    def wait(self, name: str) -> Path:
        self._futures[name].result()
        return self.art_dir / name

    def wait_all(self) -> None:
        try:
            for f in self._futures.values():
                f.result()
        finally:
            self._pool.shutdown(wait=True, cancel_futures=True)
        log.info("artifact %s verified: %d files, sha256 ok", self.art_dir, len(self.m.files))


def verify_files_of(art_dir: Path, m: Manifest) -> None:
    FileVerifier(art_dir, m).wait_all()


def write_manifest(art_dir: Path, fields: dict[str, Any], file_names: list[str]) -> Manifest:
    """Hash the listed files, add them to ``fields`` and write manifest.yaml; returns the parsed Manifest."""
    import yaml

    files = {}
    for name in file_names:
        size, digest = file_digest(art_dir / name)
        files[name] = {"size": size, "sha256": digest}
    d = dict(fields, format_version=FORMAT_VERSION, files=files)
    m = parse_manifest(d)  # the same checks a loader makes
    (art_dir / MANIFEST).write_text(yaml.safe_dump(m.to_dict(), sort_keys=False, allow_unicode=True, width=120),
                                    encoding="utf-8")
    return m
