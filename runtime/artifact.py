"""The artifact: a directory with ``manifest.yaml`` and the files it lists.

Loading checks, before anything runs: the format version, the manifest's fields and
types, every file's size and sha256, and the target board. Each failure says what
was expected and what was found. (A TVM library is native code: an unverified one
must never be loaded, so there is no "skip verification" switch.)
"""
from __future__ import annotations

import hashlib
import logging
import os
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .config import ConfigError, ModelConfig

log = logging.getLogger(__name__)

FORMAT_VERSION = 3  # 3: typed, cross-checked architecture; native artifacts carry their kernel library
MANIFEST = "manifest.yaml"
KV_SCHEME = "int8-absmax-per-token-head"  # the only KV cache scheme (runtime/kv_cache.py)
MAX_FILE_BYTES = 1 << 40


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
    accuracy_level: int | None  # MatMulNBits accuracy level (4 = int8 activations); onnxruntime only


@dataclass(frozen=True)
class Kernels:
    """A native kernel library built for the target CPU (native backend): loaded only after its sha256
    is verified and the CPU is checked for every feature it was compiled for."""
    file: str
    cpu_features: tuple[str, ...]  # board-profile vocabulary: avx2, fma, f16c, neon, dotprod, fullfp16
    cflags: tuple[str, ...]
    simd: str  # what the kernels use: avx2, neon+dotprod, neon, scalar


@dataclass(frozen=True)
class Manifest:
    format_version: int
    tool_version: str
    model_name: str
    architecture: ModelConfig
    source: dict  # where the weights came from: file name, sha256, package
    tokenizer_file: str
    bos_id: int | None
    eos_id: int
    stop_ids: tuple[int, ...]  # ids that end a reply (eos, end-of-turn)
    chat_template: str | None
    quantization: Quantization
    kv_cache: dict  # scheme description: scheme, dtype, scale_dtype, layout (the backend's)
    backend: str
    graph_file: str  # the model: ONNX graph, or the native weights file
    graph_index: str | None  # native: the tensor index of graph_file
    graph_optimized_by: str | None  # "onnxruntime X.Y.Z" when the graph is already optimized
    kernels: Kernels | None
    target: Target
    max_context: int
    files: dict  # name -> {"size": int, "sha256": str}
    tvm: dict | None = None  # tvm backend: device, libraries {host triple: file}, cuda_arch, ptx_isa, cuda_runtime_major


    def to_dict(self) -> dict[str, Any]:
        q = dict(self.quantization.__dict__)
        if q["accuracy_level"] is None:
            del q["accuracy_level"]
        graph = {"file": self.graph_file}
        if self.graph_index:
            graph["index"] = self.graph_index
        if self.graph_optimized_by:
            graph["optimized_by"] = self.graph_optimized_by
        d = {
            "format_version": self.format_version,
            "tool_version": self.tool_version,
            "model": {"name": self.model_name, "architecture": self.architecture.to_dict(), "source": dict(self.source)},
            "tokenizer": {"file": self.tokenizer_file, "bos_id": self.bos_id, "eos_id": self.eos_id,
                          "stop_ids": list(self.stop_ids)},
            "chat_template": self.chat_template,
            "quantization": q,
            "kv_cache": dict(self.kv_cache),
            "backend": self.backend,
            "graph": graph,
        }
        if self.kernels:
            k = self.kernels
            d["kernels"] = {"file": k.file, "cpu_features": list(k.cpu_features), "cflags": list(k.cflags),
                            "simd": k.simd}
        if self.tvm:
            d["tvm"] = dict(self.tvm)
        d.update({"target": dict(self.target.__dict__), "max_context": self.max_context,
                  "files": {k: dict(v) for k, v in self.files.items()}})
        return d


def _get(d: Any, path: str, typ, where: str = MANIFEST, default=...):
    cur = d
    for key in path.split("."):
        if not isinstance(cur, dict) or key not in cur:
            if default is not ...:
                return default
            raise ArtifactError(f"{where}: missing field '{path}'")
        cur = cur[key]
    if default is not ... and cur is None:
        return default
    if typ is not None and (not isinstance(cur, typ) or (isinstance(cur, bool) and typ in (int, (int, float)))):
        tname = typ.__name__ if isinstance(typ, type) else "/".join(t.__name__ for t in typ)
        raise ArtifactError(f"{where}: field '{path}' should be {tname}, found {type(cur).__name__} {cur!r:.60}")
    return cur


def _int_in(d: Any, path: str, lo: int, hi: int, where: str = MANIFEST, default=...) -> int:
    v = _get(d, path, int, where, default)
    if v is not None and not lo <= v <= hi:
        raise ArtifactError(f"{where}: {path} = {v} is out of range [{lo}, {hi}]")
    return v


def _str_list(d: Any, path: str, where: str) -> tuple[str, ...]:
    v = _get(d, path, list, where)
    if any(not isinstance(x, str) for x in v):
        raise ArtifactError(f"{where}: {path} should be a list of strings")
    return tuple(v)


def parse_manifest(d: Any) -> Manifest:
    """Every field's type and range, and the rules between them; nothing is sized from a number before this."""
    from .backends import BACKENDS

    if not isinstance(d, dict):
        raise ArtifactError(f"{MANIFEST}: expected a mapping at the top level, found {type(d).__name__}")
    version = _get(d, "format_version", int)
    if version != FORMAT_VERSION:
        raise ArtifactError(f"{MANIFEST}: format_version {version} is not supported; this runtime reads version "
                            f"{FORMAT_VERSION} (rebuild the artifact with this boardtalk)")
    backend = _get(d, "backend", str)
    if backend not in BACKENDS:
        raise ArtifactError(f"{MANIFEST}: backend {backend!r:.40} is not in this runtime; known: {', '.join(BACKENDS)}")
    files = _get(d, "files", dict)
    for name, info in files.items():
        if not isinstance(name, str) or "/" in name or "\\" in name or name in ("", ".", "..", MANIFEST):
            raise ArtifactError(f"{MANIFEST}: file name {name!r:.60} is not a plain file name")
        _int_in(info, "size", 0, MAX_FILE_BYTES, f"{MANIFEST} files.{name}")
        digest = _get(info, "sha256", str, f"{MANIFEST} files.{name}")
        if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
            raise ArtifactError(f"{MANIFEST}: files.{name}.sha256 is not a sha256 hex digest")
    try:
        arch = ModelConfig.from_dict(_get(d, "model.architecture", dict), f"{MANIFEST} model.architecture")
    except ConfigError as e:
        raise ArtifactError(str(e)) from None
    vocab = arch.vocab

    def token_id(path, default=...):
        return _int_in(d, path, 0, vocab - 1, MANIFEST, default)

    stop = _get(d, "tokenizer.stop_ids", list)
    if not all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x < vocab for x in stop):
        raise ArtifactError(f"{MANIFEST}: tokenizer.stop_ids should be token ids in [0, {vocab}), found {stop!r:.80}")
    q = _get(d, "quantization", dict)
    t = _get(d, "target", dict)
    tmpl = d.get("chat_template")
    k = d.get("kernels")
    kernels = None
    if k is not None:
        w = f"{MANIFEST} kernels"
        kernels = Kernels(file=_get(k, "file", str, w), cpu_features=_str_list(k, "cpu_features", w),
                          cflags=_str_list(k, "cflags", w), simd=_get(k, "simd", str, w))
    kv = _get(d, "kv_cache", dict)
    if kv.get("scheme") != KV_SCHEME:
        raise ArtifactError(f"{MANIFEST}: kv_cache.scheme {kv.get('scheme')!r:.40} is not supported (this runtime: "
                            f"{KV_SCHEME})")
    if kv.get("layout") != BACKENDS[backend].kv_layout:
        raise ArtifactError(f"{MANIFEST}: kv_cache.layout {kv.get('layout')!r:.40} is not the {backend} backend's "
                            f"({BACKENDS[backend].kv_layout})")
    cuda = t.get("cuda_arch")
    if cuda is not None and not isinstance(cuda, str):
        raise ArtifactError(f"{MANIFEST}: target.cuda_arch should be a string or null, found {cuda!r:.40}")
    m = Manifest(
        format_version=version,
        tool_version=_get(d, "tool_version", str),
        model_name=_get(d, "model.name", str),
        architecture=arch,
        source=_get(d, "model.source", dict),
        tokenizer_file=_get(d, "tokenizer.file", str),
        bos_id=token_id("tokenizer.bos_id", None),
        eos_id=token_id("tokenizer.eos_id"),
        stop_ids=tuple(stop),
        chat_template=tmpl if isinstance(tmpl, str) else None,
        quantization=Quantization(
            scheme=_get(q, "scheme", str, "quantization"), bits=_int_in(q, "bits", 1, 16, "quantization"),
            group_size=_int_in(q, "group_size", 1, 1 << 16, "quantization"),
            symmetric=_get(q, "symmetric", bool, "quantization"), embedding=_get(q, "embedding", str, "quantization"),
            accuracy_level=_int_in(q, "accuracy_level", 0, 4, "quantization", None)),
        kv_cache=kv,
        backend=backend,
        graph_file=_get(d, "graph.file", str),
        graph_index=_get(d, "graph.index", str, MANIFEST, None),
        graph_optimized_by=_get(d, "graph.optimized_by", str, MANIFEST, None),
        kernels=kernels,
        target=Target(board=_get(t, "board", str, "target"), triple=_get(t, "triple", str, "target"), cuda_arch=cuda),
        max_context=_int_in(d, "max_context", 1, arch.context_length),
        files=files,
        tvm=_get(d, "tvm", dict, MANIFEST, None),
    )
    if backend == "tvm" and (m.graph_index is None or not m.tvm or not isinstance(m.tvm.get("libraries"), dict)):
        raise ArtifactError(f"{MANIFEST}: a tvm artifact needs graph.index and tvm.libraries (rebuild it with this boardtalk)")
    if backend == "native" and (m.graph_index is None or m.kernels is None):
        raise ArtifactError(f"{MANIFEST}: a native artifact needs graph.index and kernels (rebuild it with this boardtalk)")
    for f in (m.tokenizer_file, m.graph_file, m.graph_index, m.kernels and m.kernels.file,
              *((m.tvm or {}).get("libraries") or {}).values()):
        if f and f not in files:
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
    """The artifact directory; a .tar / .tar.gz is unpacked once into the cache (runtime/tarball.py checks its
    members against its manifest from the headers alone, before extracting anything)."""
    path = Path(path)
    if path.is_file() and tarfile.is_tarfile(path):
        from .store import StoreError
        from .tarball import unpack_tarball

        try:
            return unpack_tarball(path)
        except StoreError as e:
            raise ArtifactError(str(e)) from None
    if not path.is_dir():
        raise ArtifactError(f"artifact not found: {path} (expected a directory with {MANIFEST}, or a tarball of one)")
    return path


def read_manifest_bytes(art_dir: Path) -> bytes:
    mpath = art_dir / MANIFEST
    if not mpath.is_file():
        raise ArtifactError(f"{art_dir}: no {MANIFEST}; is this a boardtalk artifact?")
    data = mpath.read_bytes()
    if len(data) > 1 << 20:
        raise ArtifactError(f"{mpath}: {len(data)} bytes is too large for a manifest")
    return data


def load_manifest(art_dir: Path, verify_files: bool = True, data: bytes | None = None) -> Manifest:
    """Parse (and optionally verify the files of) an artifact's manifest; ``data``: its bytes as already
    read (the loader reads them once, checks their signature, then parses exactly those)."""
    import yaml

    if data is None:
        data = read_manifest_bytes(art_dir)
    try:
        raw = yaml.safe_load(data.decode("utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise ArtifactError(f"{art_dir / MANIFEST}: not valid YAML ({str(e).splitlines()[0]})") from None
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
