"""Where artifacts live on disk: safe output directories, build locks, atomic installs.

Rules (docs/artifact-store.md says the same for users):

- Never delete or overwrite anything that is not a boardtalk artifact. An output directory is
  replaced only when it is new, empty, or an artifact (``is_artifact_dir``: its manifest.yaml is a
  boardtalk manifest, or unparseable beside only names a build writes); otherwise the build is
  refused with a message. Never build inside an artifact (``--out art/sub``).
- Never write into an artifact that may be in use. Its files are memory-mapped by running models;
  truncating or rewriting one in place kills them with SIGBUS. A build writes a fresh staging
  directory beside the output and switches it in with one atomic rename (over a missing or empty
  output) or ``renameat2(RENAME_EXCHANGE)`` (over an existing artifact); the old copy is then
  removed. Removing is safe: a process that has the old files open or mapped keeps reading them
  (unlinked inodes live until the last mapping goes); only writing into them is not.
- Two builds of one output serialize on an flock beside it (``.<name>.lock``); staging dirs of
  builds that died (their pid is gone) are removed by the next build of that output.
- Tarballs are runtime/tarball.py's: checked from their headers, unpacked once into the cache.

Board side: stdlib and pyyaml only; nothing here imports models/.
"""
from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import os
import re
import secrets
import shutil
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

log = logging.getLogger(__name__)

MANIFEST = "manifest.yaml"
SIGNATURE = "manifest.sig"
STORE_FILES = frozenset({MANIFEST, SIGNATURE})  # files an artifact may hold besides those its manifest lists
# Every file name a boardtalk build writes: a directory with an unreadable manifest.yaml and only
# these files is still an artifact (a damaged one, which a build may replace).
KNOWN_FILES = STORE_FILES | {"tokenizer.bpe", "weights.bin", "native.json", "model.onnx", "model.onnx.data",
                             "model.opt.onnx", "model.opt.onnx.data"}
KNOWN_PATTERN = re.compile(r"bt_native-[A-Za-z0-9._-]+\.so")  # the native kernels built for a board
MAX_MANIFEST_BYTES = 4 << 20  # a manifest is a few KiB; a larger "manifest" is not one


class StoreError(ValueError):
    """An output or tarball the store refuses to touch; the message is one line and says why."""


# ---------------------------------------------------------------------------------------------
# What counts as an artifact

_UNPARSEABLE = object()  # manifest.yaml could not be read or parsed (a damaged artifact, maybe)
_FOREIGN = object()  # manifest.yaml parses, but is not a boardtalk manifest: someone else's file


def _manifest_kind(manifest_path: Path):
    """What manifest.yaml says about its directory:

    - a set of file names: a boardtalk manifest (a mapping with an integer ``format_version`` and a
      ``tool_version`` starting with "boardtalk") with a ``files`` mapping; the names it lists.
    - _UNPARSEABLE: not readable as YAML (truncated, binary, too large), or a boardtalk manifest
      without a ``files`` mapping: damaged; only names a build writes may be beside it.
    - _FOREIGN: valid YAML that is not a boardtalk manifest (a Kubernetes manifest, an empty file):
      the directory is not an artifact, whatever else it holds.
    """
    import yaml

    try:
        if manifest_path.stat().st_size > MAX_MANIFEST_BYTES:
            return _UNPARSEABLE
        d = yaml.safe_load(manifest_path.read_bytes())
    except Exception:  # noqa: BLE001  (damaged: any parse failure means "unreadable", never a crash)
        return _UNPARSEABLE
    if not _is_boardtalk_manifest(d):
        return _FOREIGN
    files = d.get("files")
    if not isinstance(files, dict):
        return _UNPARSEABLE
    return {n for n in files if isinstance(n, str) and _plain_name(n)}


def _is_boardtalk_manifest(d) -> bool:
    if not isinstance(d, dict):
        return False
    version, tool = d.get("format_version"), d.get("tool_version")
    return (isinstance(version, int) and not isinstance(version, bool)
            and isinstance(tool, str) and tool.startswith("boardtalk"))


def _plain_name(name: str) -> bool:
    return bool(name) and "/" not in name and "\\" not in name and name not in (".", "..")


def is_artifact_dir(path: str | os.PathLike) -> bool:
    """True for a real directory (not a symlink) holding a regular manifest.yaml and nothing but
    regular files that belong to an artifact:

    - manifest is a boardtalk manifest (a mapping with an integer ``format_version``, a
      ``tool_version`` starting with "boardtalk" and a ``files`` mapping): the files it lists,
      manifest.yaml and manifest.sig; listed files may be missing or corrupt (a damaged artifact is
      still one).
    - manifest unparseable (truncated, binary, not YAML; or a boardtalk manifest without ``files``):
      only names a boardtalk build writes (KNOWN_FILES, KNOWN_PATTERN), so a half-written artifact
      can be rebuilt while a user's directory that merely has a manifest.yaml among other files is not.
    - manifest parses as YAML but is not a boardtalk manifest (a user's own manifest.yaml, even
      beside files named weights.bin or model.onnx): not an artifact.

    Subdirectories, symlinks and any other name mean "not an artifact": never delete it.
    """
    p = Path(path)
    if p.is_symlink() or not p.is_dir():
        return False
    mpath = p / MANIFEST
    if mpath.is_symlink() or not mpath.is_file():
        return False
    kind = _manifest_kind(mpath)
    if kind is _FOREIGN:
        return False
    if kind is _UNPARSEABLE:
        allowed = lambda n: n in KNOWN_FILES or KNOWN_PATTERN.fullmatch(n) is not None  # noqa: E731
    else:
        allowed = (kind | STORE_FILES).__contains__
    try:
        with os.scandir(p) as it:
            return all(allowed(e.name) and e.is_file(follow_symlinks=False) for e in it)
    except OSError:
        return False


def _resolve(out: str | os.PathLike) -> Path:
    return Path(os.path.normpath(os.path.abspath(os.fspath(out))))


def _is_same_or_ancestor(p: Path, other: Path) -> bool:
    return p == other or p in other.parents


def _artifact_ancestors(p: Path) -> Iterator[Path]:
    """Directories above ``p`` (as written, and with symlinks resolved) that are artifacts."""
    seen = set()
    for q in (p, Path(os.path.realpath(p))):
        for a in q.parents:
            if a not in seen:
                seen.add(a)
                if is_artifact_dir(a):
                    yield a


def prepare_output(out: str | os.PathLike) -> Path:
    """The absolute, normalized output path (``outer/inner/..`` is ``outer``), after checking that a
    build may replace it: new, an empty directory, or an artifact, and not inside an artifact (a
    build there would add a directory and a lock file to it: never again an artifact, nor
    rebuildable). Raises StoreError otherwise."""
    p = _resolve(out)
    protected = {"the filesystem root": Path(p.anchor), "your home directory": _resolve(os.path.expanduser("~")),
                 "the current directory": _resolve(os.getcwd())}
    for what, q in protected.items():
        if _is_same_or_ancestor(p, q):
            raise StoreError(f"refusing to build into {p}: it is {what} or holds it; choose an empty or new directory")
    for ancestor in _artifact_ancestors(p):
        raise StoreError(f"refusing to build inside the artifact {ancestor}: choose a directory outside it")
    if p.is_symlink():
        raise StoreError(f"refusing to replace {p}: it is a symlink; build into a new directory and point the link "
                         "at it (or pass the link's target)")
    if not p.exists():
        return p
    if not p.is_dir():
        raise StoreError(f"refusing to replace {p}: it exists and is not a directory; choose an empty or new directory")
    try:
        names = sorted(os.listdir(p))
    except OSError as e:
        raise StoreError(f"cannot read {p}: {e.strerror}") from e
    if names and not is_artifact_dir(p):
        shown = ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")
        raise StoreError(f"refusing to replace {p}: it is not a boardtalk artifact (it holds {shown}); "
                         "choose an empty or new directory")
    return p


# ---------------------------------------------------------------------------------------------
# Locking

@dataclass
class _Held:
    rlock: threading.RLock = field(default_factory=threading.RLock)
    fd: int | None = None
    depth: int = 0


_held: dict[str, _Held] = {}  # lock file -> this process's hold on it (flock is per open file, not per thread)
_held_guard = threading.Lock()


def lock_path(out: str | os.PathLike) -> Path:
    p = _resolve(out)
    return p.with_name(f".{p.name}.lock")


@contextlib.contextmanager
def build_lock(out: str | os.PathLike) -> Iterator[Path]:
    """Exclusive lock on ``out`` for builds, unpacks and downloads: an flock on ``<parent>/.<name>.lock``
    (the file stays; removing it would let two holders lock two different files). Serializes
    processes and threads; re-entrant in one thread (a caller may hold it around build_artifact)."""
    import fcntl

    path = lock_path(out)
    with _held_guard:
        held = _held.setdefault(str(path), _Held())
    if not held.rlock.acquire(blocking=False):
        log.info("waiting for another build of %s in this process", path.with_name(path.name[1:-5]))
        held.rlock.acquire()
    try:
        if held.depth == 0:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    log.info("waiting for another build of %s (lock %s)", path.with_name(path.name[1:-5]), path)
                    fcntl.flock(fd, fcntl.LOCK_EX)
            except BaseException:
                os.close(fd)
                raise
            held.fd = fd
        held.depth += 1
        try:
            yield path
        finally:
            held.depth -= 1
            if held.depth == 0 and held.fd is not None:
                os.close(held.fd)  # releases the flock
                held.fd = None
    finally:
        held.rlock.release()


# ---------------------------------------------------------------------------------------------
# Staging and installing

_LEFTOVER = re.compile(r"\.(?:building|old)-(\d+)-[0-9a-f]+$")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_dead_leftovers(out: Path) -> None:
    """Staging dirs and set-aside old copies of ``out`` whose builder process is gone."""
    prefix = f".{out.name}."
    try:
        entries = list(os.scandir(out.parent))
    except OSError:
        return
    for e in entries:
        if not e.name.startswith(prefix):
            continue
        m = _LEFTOVER.fullmatch(e.name[len(prefix) - 1:])
        if m and e.is_dir(follow_symlinks=False) and not _pid_alive(int(m.group(1))):
            log.info("removing %s, left by a build that did not finish (pid %s)", e.path, m.group(1))
            shutil.rmtree(e.path, ignore_errors=True)


def _sibling(out: Path, kind: str) -> Path:
    return out.with_name(f".{out.name}.{kind}-{os.getpid()}-{secrets.token_hex(4)}")


@contextlib.contextmanager
def staging_dir(out: str | os.PathLike) -> Iterator[Path]:
    """A fresh empty directory beside ``out`` (same filesystem, so install() can rename it), named
    ``.<name>.building-<pid>-<rand>``. Removed when the block ends, however it ends (an exception,
    KeyboardInterrupt; after install() it holds the old copy, or nothing)."""
    out = _resolve(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    _remove_dead_leftovers(out)
    tmp = _sibling(out, "building")
    tmp.mkdir()
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


RENAME_EXCHANGE = 2  # linux/fs.h
_AT_FDCWD = -100


def _renameat2_exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically; False when this libc/kernel/filesystem cannot (caller falls back)."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        log.info("renameat2 is not available in this C library; replacing %s in two renames", b)
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        log.info("renameat2(RENAME_EXCHANGE) refused here (%s); replacing %s in two renames", os.strerror(err), b)
        return False
    raise OSError(err, f"cannot swap {a} and {b}: {os.strerror(err)}")


def install(staged: str | os.PathLike, out: str | os.PathLike) -> Path:
    """Switch the complete artifact in ``staged`` into place at ``out`` atomically (the caller holds
    build_lock(out)). A missing or empty ``out`` is replaced by one rename; an existing artifact is
    swapped with renameat2(RENAME_EXCHANGE) (or, where that is refused, moved aside and replaced:
    a moment with no ``out``) and the old copy removed, which running models that map its files
    survive. Anything else at ``out`` is refused. Returns ``out``."""
    staged, out = _resolve(staged), _resolve(out)
    if not (staged / MANIFEST).is_file():
        raise StoreError(f"{staged} has no {MANIFEST}; nothing to install")
    if os.path.lexists(out):
        if out.is_symlink() or not out.is_dir():
            raise StoreError(f"refusing to replace {out}: it is not a directory; choose an empty or new directory")
        if os.listdir(out):
            if not is_artifact_dir(out):
                raise StoreError(f"refusing to replace {out}: it is not a boardtalk artifact; "
                                 "choose an empty or new directory")
            if _renameat2_exchange(staged, out):
                old = staged
            else:
                old = _sibling(out, "old")
                os.rename(out, old)
                try:
                    os.rename(staged, out)
                except BaseException:
                    os.rename(old, out)
                    raise
            shutil.rmtree(old, ignore_errors=True)  # safe for mappings of its files; never written into
            log.info("replaced artifact %s", out)
            return out
    os.rename(staged, out)  # atomic; also over an empty directory
    log.info("installed artifact %s", out)
    return out
