"""Artifact tarballs: checked from their member headers, unpacked once into the cache.

A tarball is unpacked once per distinct tarball file (``<id>`` is from the sha256 of its bytes) into
``cache_dir()/unpacked/<id>``, only after every member header has been checked against the manifest
(names, types, sizes), so a decompression bomb is refused before any of its data is written, and a
corrupt tarball never shares a directory with a good one. ``discard_unpacked`` removes a copy that
failed verification, so it is unpacked again. The copy is written through the store's staging and
atomic install (runtime/store.py), under its build lock.

Board side: stdlib and pyyaml only.
"""
from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import tarfile
import zlib
from pathlib import Path

from .store import (MANIFEST, MAX_MANIFEST_BYTES, SIGNATURE, STORE_FILES, StoreError, _plain_name, build_lock,
                    install, is_artifact_dir, lock_path, staging_dir)

log = logging.getLogger(__name__)

MAX_SIGNATURE_BYTES = 64 << 10
PRE_MANIFEST_LIMIT = 64 << 20  # bytes of tarball members allowed before manifest.yaml is seen
# Quantized weights barely compress (~1.1x): a tarball whose manifest promises more than this many
# times its own size (and more than EXPANSION_FLOOR) is a decompression bomb, even if the sizes agree.
MAX_EXPANSION = 50
EXPANSION_FLOOR = 64 << 20



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
