"""Where artifacts live on disk: safe output directories, build locks, atomic installs, tarballs.

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
- A tarball is unpacked once per distinct tarball file (``<id>`` is from the sha256 of its bytes)
  into ``cache_dir()/unpacked/<id>``, only after every member header has been checked against the
  manifest (names, types, sizes), so a decompression bomb is refused before any of its data is
  written, and a corrupt tarball never shares a directory with a good one.
  ``discard_unpacked`` removes a copy that failed verification, so it is unpacked again.

Board side: stdlib and pyyaml only; nothing here imports models/.
"""
from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import logging
import os
import re
import secrets
import shutil
import tarfile
import threading
import zlib
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
MAX_SIGNATURE_BYTES = 64 << 10
PRE_MANIFEST_LIMIT = 64 << 20  # bytes of tarball members allowed before manifest.yaml is seen
# Quantized weights barely compress (~1.1x): a tarball whose manifest promises more than this many
# times its own size (and more than EXPANSION_FLOOR) is a decompression bomb, even if the sizes agree.
MAX_EXPANSION = 50
EXPANSION_FLOOR = 64 << 20


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


# ---------------------------------------------------------------------------------------------
# Tarballs

def _member_name(name: str, where: Path) -> tuple[str, str]:
    """(top-level prefix or "", file name or "") of a member; refuses anything deeper or outside."""
    parts = [p for p in name.replace("\\", "/").split("/") if p not in ("", ".")]
    if name.startswith("/") or ".." in parts or len(parts) > 2:
        raise StoreError(f"tarball {where}: member {name!r} is not a file at the top level of the artifact")
    if len(parts) == 2:
        return parts[0], parts[1]
    return "", parts[0] if parts else ""


def _read_member(tf: tarfile.TarFile, m: tarfile.TarInfo, limit: int, where: Path) -> bytes:
    if m.size > limit:
        raise StoreError(f"tarball {where}: {m.name} is {m.size} bytes, more than {limit} allowed for it")
    f = tf.extractfile(m)
    data = f.read(m.size + 1) if f else b""
    if len(data) != m.size:
        raise StoreError(f"tarball {where}: {m.name} is truncated")
    return data


def _parse_tar_manifest(data: bytes, where: Path) -> dict[str, int]:
    import yaml

    try:
        d = yaml.safe_load(data)
    except Exception as e:  # noqa: BLE001
        raise StoreError(f"tarball {where}: {MANIFEST} is not valid YAML ({str(e).splitlines()[0]})") from e
    files = d.get("files") if isinstance(d, dict) else None
    if not isinstance(files, dict):
        raise StoreError(f"tarball {where}: {MANIFEST} has no 'files' mapping; is this a boardtalk artifact?")
    sizes = {}
    for name, info in files.items():
        size = info.get("size") if isinstance(info, dict) else None
        if not isinstance(name, str) or not _plain_name(name) or name in STORE_FILES \
                or not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise StoreError(f"tarball {where}: {MANIFEST} entry {name!r} is not a plain file name with a size")
        sizes[name] = size
    return sizes


class _TarPlan:
    """What one pass over the member headers found: the manifest, and members checked against it."""

    def __init__(self, where: Path):
        self.where = where
        self.packed_size = where.stat().st_size
        self.prefix: str | None = None
        self.manifest: bytes | None = None
        self.sizes: dict[str, int] = {}  # listed file -> size, from the manifest
        self.members: dict[str, tarfile.TarInfo] = {}  # file name -> member (listed files and manifest.sig)
        self.before: list[tarfile.TarInfo] = []  # file members seen before the manifest
        self.before_bytes = 0

    def check(self, m: tarfile.TarInfo) -> None:
        """Checks one member header against the manifest (if seen); raises StoreError."""
        where = self.where
        if not (m.isreg() or m.isdir()):
            raise StoreError(f"tarball {where}: member {m.name!r} is not a regular file or directory")
        prefix, name = _member_name(m.name, where)
        if m.isdir():
            if name and prefix:
                raise StoreError(f"tarball {where}: directory {m.name!r} inside the artifact")
            prefix = prefix or name
            name = ""
        if prefix or name:
            if self.prefix is None:
                self.prefix = prefix
            elif prefix != self.prefix:
                raise StoreError(f"tarball {where}: members under both {self.prefix or '.'!r} and {prefix or '.'!r}; "
                                 "expected one artifact directory")
        if not name:
            return
        if name in self.members or (name == MANIFEST and self.manifest is not None):
            raise StoreError(f"tarball {where}: {name} appears twice")
        if self.manifest is None and name != MANIFEST:
            if self.before_bytes + m.size > PRE_MANIFEST_LIMIT:
                raise StoreError(f"tarball {where}: no {MANIFEST} among its first {PRE_MANIFEST_LIMIT >> 20} MiB; "
                                 f"pack {MANIFEST} first (tar --sort=name does)")
            self.before_bytes += m.size
            self.before.append(m)
            return
        if name == MANIFEST:
            return
        self._check_listed(m, name)

    def _check_listed(self, m: tarfile.TarInfo, name: str) -> None:
        if name == SIGNATURE:
            if m.size > MAX_SIGNATURE_BYTES:
                raise StoreError(f"tarball {self.where}: {SIGNATURE} is {m.size} bytes; a signature is a few hundred")
        elif name not in self.sizes:
            raise StoreError(f"tarball {self.where}: {name} is not listed in its {MANIFEST}; refused before unpacking")
        elif m.size != self.sizes[name]:
            raise StoreError(f"tarball {self.where}: {name} is {m.size} bytes in the tarball, its {MANIFEST} says "
                             f"{self.sizes[name]}; refused before unpacking")
        if name in self.members:
            raise StoreError(f"tarball {self.where}: {name} appears twice")
        self.members[name] = m

    def set_manifest(self, data: bytes) -> None:
        self.manifest = data
        self.sizes = _parse_tar_manifest(data, self.where)
        total = sum(self.sizes.values())
        if total > max(EXPANSION_FLOOR, MAX_EXPANSION * self.packed_size):
            raise StoreError(f"tarball {self.where}: its {MANIFEST} lists {total} bytes from a {self.packed_size}-byte "
                             f"file (over {MAX_EXPANSION}x; quantized weights barely compress); "
                             "refused before unpacking")
        for m in self.before:
            self._check_listed(m, _member_name(m.name, self.where)[1])
        self.before = []


def _copy_member(tf: tarfile.TarFile, m: tarfile.TarInfo, dest: Path) -> None:
    src = tf.extractfile(m)
    left = m.size
    with open(dest, "xb") as w:
        while left:
            chunk = src.read(min(left, 1 << 22)) if src else b""
            if not chunk:
                raise StoreError(f"{dest.name}: the tarball ends inside it (truncated)")
            w.write(chunk)
            left -= len(chunk)
    os.chmod(dest, 0o644)


def _sha256_of_open_file(f) -> str:
    """sha256 of the whole file; its position is left where it was (a decompressor reading it keeps
    its place)."""
    h = hashlib.sha256()
    pos = f.tell()
    f.seek(0)
    while chunk := f.read(1 << 22):
        h.update(chunk)
    f.seek(pos)
    return h.hexdigest()


def unpacked_root() -> Path:
    """``cache_dir()/unpacked``: one directory per distinct tarball; refuses (one line) when that
    path exists and is not a directory."""
    from .artifact import cache_dir  # lazy: artifact.py calls this module

    root = cache_dir() / "unpacked"
    if os.path.lexists(root) and not root.is_dir():
        raise StoreError(f"{root} is not a directory (the cache of unpacked tarballs); delete it and try again")
    return root


def _clear_entry(dest: Path) -> None:
    """Remove whatever is at ``dest`` (a cache entry: ours to delete): a symlink or file is unlinked
    (never its target), a directory removed."""
    try:
        if dest.is_symlink() or not dest.is_dir():
            os.unlink(dest)
        else:
            shutil.rmtree(dest)
    except FileNotFoundError:
        pass
    except OSError as e:
        raise StoreError(f"cannot remove the damaged cache entry {dest} ({e.strerror}); delete it and try again") from e


def unpack_tarball(path: str | os.PathLike) -> Path:
    """The artifact in a .tar / .tar.gz / .tar.xz, unpacked once into
    ``cache_dir()/unpacked/<first 32 hex of sha256(the tarball file)>`` and reused by later loads.
    Keyed by the whole tarball, so two tarballs that differ anywhere (a corrupt copy and a good one
    with the same manifest) never share a directory.

    Every member header is checked before its data is read: a regular file or directory, at the top
    level or under one directory, listed in manifest.yaml (or manifest.sig) with exactly the size the
    manifest gives; so the total written is at most the manifest's sum and a bomb is refused after
    reading headers only. Only then is the tarball hashed and unpacked. The loader still verifies
    every file's sha256 (and calls discard_unpacked, then unpacks again, when a cached copy fails)."""
    where = Path(path)
    try:
        raw = open(where, "rb")  # noqa: SIM115  (closed below; the hash and the members come from one open file)
    except OSError as e:
        raise StoreError(f"cannot read tarball {where}: {e.strerror}") from e
    with raw:
        try:
            tf = tarfile.open(fileobj=raw, mode="r:*")
        except (OSError, tarfile.TarError) as e:
            raise StoreError(f"cannot read tarball {where}: {e}") from e
        with tf:
            plan = _TarPlan(where)
            try:
                for m in tf:
                    plan.check(m)
                    if plan.manifest is None and _member_name(m.name, where)[1] == MANIFEST and m.isreg():
                        plan.set_manifest(_read_member(tf, m, MAX_MANIFEST_BYTES, where))
            except (tarfile.TarError, EOFError, zlib.error, OSError) as e:
                raise StoreError(f"tarball {where} is damaged: {e}") from e
            if plan.manifest is None:
                raise StoreError(f"tarball {where} has no {MANIFEST}; is it a boardtalk artifact?")
            missing = sorted(set(plan.sizes) - set(plan.members))
            if missing:
                raise StoreError(f"tarball {where} lacks {', '.join(missing)} listed in its {MANIFEST}")
            try:
                digest = _sha256_of_open_file(raw)
            except OSError as e:
                raise StoreError(f"cannot read tarball {where}: {e.strerror}") from e
            root = unpacked_root()
            dest = root / digest[:32]
            root.mkdir(parents=True, exist_ok=True)
            lock = lock_path(dest)
            if os.path.lexists(lock) and (lock.is_symlink() or not lock.is_file()):
                raise StoreError(f"{lock} is not a regular file (a lock of the unpacked-tarball cache); "
                                 "delete it and try again")
            with build_lock(dest):
                if _unpacked_ok(dest, plan):
                    log.info("tarball %s: reusing %s", where, dest)
                    return dest
                with staging_dir(dest) as tmp:
                    (tmp / MANIFEST).write_bytes(plan.manifest)
                    try:
                        for name, m in plan.members.items():
                            _copy_member(tf, m, tmp / name)
                    except (tarfile.TarError, EOFError, zlib.error) as e:
                        raise StoreError(f"tarball {where} is damaged: {e}") from e
                    if os.path.lexists(dest) and (dest.is_symlink() or not is_artifact_dir(dest)):
                        log.info("replacing the damaged cache entry %s", dest)
                        _clear_entry(dest)  # our own cache entry: a symlink, a file, or damaged beyond recognition
                    install(tmp, dest)
                log.info("tarball %s unpacked to %s (%d files)", where, dest, len(plan.members))
                return dest


def discard_unpacked(path: str | os.PathLike) -> bool:
    """Remove an unpacked copy of a tarball (``cache_dir()/unpacked/<id>``), e.g. one whose files no
    longer match its manifest, so the next unpack_tarball writes it again. Anything not directly
    inside ``cache_dir()/unpacked`` (symlinks resolved for the parent only) is refused with a
    StoreError; an entry that is a symlink is unlinked, never followed. True when something was
    removed. Running models that map the old files keep them (unlinked files live on)."""
    p = Path(os.path.abspath(os.fspath(path)))
    root = unpacked_root()
    if not re.fullmatch(r"[0-9a-f]{32}", p.name) or os.path.realpath(p.parent) != os.path.realpath(root):
        raise StoreError(f"refusing to discard {p}: it is not an unpacked tarball in {root}")
    entry = Path(root) / p.name
    with build_lock(entry):
        if not os.path.lexists(entry):
            return False
        _clear_entry(entry)
    log.info("discarded the unpacked copy %s", entry)
    return True


def _unpacked_ok(dest: Path, plan: _TarPlan) -> bool:
    """An earlier unpack of this tarball is complete: a real directory holding the manifest and every
    member as regular files of the right sizes (the loader checks their sha256)."""
    import stat

    try:
        if dest.is_symlink() or not dest.is_dir():
            return False
        names = {MANIFEST: len(plan.manifest or b""), **{n: m.size for n, m in plan.members.items()}}
        for n, size in names.items():
            st = os.lstat(dest / n)
            if not stat.S_ISREG(st.st_mode) or st.st_size != size:
                return False
        if set(os.listdir(dest)) != set(names):
            return False
        return (dest / MANIFEST).read_bytes() == plan.manifest
    except OSError:
        return False
