"""Signed artifacts for fleets: Ed25519 over the exact bytes of manifest.yaml.

The manifest lists every file's sha256, so signing it signs the whole artifact. A board that
trusts at least one key (``trusted_keys()``) loads only artifacts signed by one of them; a board
that trusts none loads unsigned artifacts as before.

Files (docs/artifact-store.md):

- private key: PKCS#8 PEM, unencrypted, mode 0600 (``generate_key``); ``check_private_key`` validates
  one without signing.
- Key and signature files must be regular files of at most 64 KiB (read with a bounded read), so
  a mistaken path such as /dev/zero or a FIFO is an error at once, never a hang.
- public key (``*.pub``): one line ``boardtalk-ed25519 <base64 of the raw 32-byte key> [comment]``;
  blank lines and ``#`` comments are ignored, so one file may hold several keys.
- ``manifest.sig`` beside manifest.yaml::

      boardtalk-signature 1
      algorithm: ed25519
      key-id: <first 16 hex of sha256(raw public key)>
      signature: <base64 of the 64-byte signature over manifest.yaml's bytes>

Uses the ``cryptography`` package (optional extra ``sign``), imported only when a key is used.
"""
from __future__ import annotations

import base64
import binascii
import hashlib
import logging
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

log = logging.getLogger(__name__)

MANIFEST = "manifest.yaml"
SIGNATURE = "manifest.sig"
KEY_TAG = "boardtalk-ed25519"
SIG_HEADER = "boardtalk-signature 1"
ENV_KEYS = "BOARDTALK_TRUSTED_KEYS"
DEFAULT_KEYS_DIR = Path("/etc/boardtalk/trusted_keys")
MAX_KEY_FILE_BYTES = 64 << 10  # a key file is a few hundred bytes; /dev/zero or a FIFO is not one
MAX_SIGNATURE_BYTES = 64 << 10


class SignatureError(ValueError):
    """Unsigned, signed by an untrusted key, or not matching its signature; one-line message."""


@dataclass(frozen=True)
class PublicKey:
    raw: bytes  # 32 bytes, Ed25519
    source: str  # where it was read from, for messages

    @property
    def key_id(self) -> str:
        return key_id(self.raw)


def key_id(raw_public_key: bytes) -> str:
    return hashlib.sha256(raw_public_key).hexdigest()[:16]


def _ed25519():
    try:
        from cryptography.hazmat.primitives.asymmetric import ed25519
    except ImportError as e:
        raise ImportError("signed artifacts need the 'cryptography' package: pip install 'boardtalk[sign]' "
                          "(or pip install cryptography)") from e
    return ed25519


def _raw_public(pub) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return pub.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def public_key_line(raw: bytes, comment: str = "") -> str:
    return f"{KEY_TAG} {base64.b64encode(raw).decode()}" + (f" {comment}" if comment else "")


def generate_key(private_path: str | os.PathLike, public_path: str | os.PathLike) -> str:
    """Write a new key pair (refusing to overwrite either file); returns its key id."""
    ed25519 = _ed25519()
    from cryptography.hazmat.primitives import serialization

    private_path, public_path = Path(private_path), Path(public_path)
    for p in (private_path, public_path):
        if os.path.lexists(p):
            raise FileExistsError(f"refusing to overwrite {p}; move it away or choose another path")
    key = ed25519.Ed25519PrivateKey.generate()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    raw = _raw_public(key.public_key())
    fd = os.open(private_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(pem)
    with open(public_path, "x", encoding="ascii") as f:
        f.write(public_key_line(raw, private_path.stem) + "\n")
    log.info("generated signing key %s: private %s, public %s", key_id(raw), private_path, public_path)
    return key_id(raw)


_FILE_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
               (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def _kind(mode: int) -> str:
    return next((name for test, name in _FILE_KINDS if test(mode)), "not a regular file")


def read_small_file(path: str | os.PathLike, what: str, limit: int = MAX_KEY_FILE_BYTES) -> bytes:
    """The bytes of ``path``, which must be a regular file (symlinks to one are followed) of at most
    ``limit`` bytes, read with a bounded read: /dev/zero, a FIFO or a 1 GiB file is a SignatureError
    (one line) at once, never a hang or an out-of-memory. ``what`` names the file in messages."""
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):
            raise SignatureError(f"{what} {path} is {_kind(st.st_mode)}; expected a regular file")
        # O_NONBLOCK: if the path became a FIFO since the stat, opening it must not wait for a writer
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise SignatureError(f"cannot read {what} {path}: {e.strerror}") from e
    try:
        st = os.fstat(fd)  # what was opened, not what the path named a moment ago
        if not stat.S_ISREG(st.st_mode):
            raise SignatureError(f"{what} {path} is {_kind(st.st_mode)}; expected a regular file")
        if st.st_size > limit:
            raise SignatureError(f"{what} {path} is {st.st_size} bytes, more than {limit} for a key file; wrong file?")
        chunks, total = [], 0
        while total <= limit:
            chunk = os.read(fd, limit + 1 - total)
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
    except OSError as e:
        raise SignatureError(f"cannot read {what} {path}: {e.strerror}") from e
    finally:
        os.close(fd)
    if total > limit:
        raise SignatureError(f"{what} {path} is more than {limit} bytes (it grew while read); wrong file?")
    return b"".join(chunks)


def _load_private(path: Path):
    ed25519 = _ed25519()
    from cryptography.exceptions import UnsupportedAlgorithm
    from cryptography.hazmat.primitives import serialization

    data = read_small_file(path, "private key")
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError, UnsupportedAlgorithm) as e:
        msg = " ".join(str(e).split())[:200]
        raise SignatureError(f"{path}: not an unencrypted PEM private key ({msg})") from e
    if not isinstance(key, ed25519.Ed25519PrivateKey):
        raise SignatureError(f"{path}: a {type(key).__name__}, expected an Ed25519 private key")
    return key


def check_private_key(path: str | os.PathLike) -> str:
    """Load and validate a private signing key without signing anything; returns its key id.
    For ``build --sign-key``: a missing, unreadable or wrong key fails before a long build.
    Raises SignatureError (one line); ImportError without the 'cryptography' package."""
    key = _load_private(Path(path))
    return key_id(_raw_public(key.public_key()))


def sign_manifest(art_dir: str | os.PathLike, private_key_path: str | os.PathLike) -> str:
    """Write ``manifest.sig`` for the manifest in art_dir (a staging dir: never an artifact in use);
    returns the key id."""
    art_dir = Path(art_dir)
    key = _load_private(Path(private_key_path))
    data = (art_dir / MANIFEST).read_bytes()
    kid = key_id(_raw_public(key.public_key()))
    text = (f"{SIG_HEADER}\nalgorithm: ed25519\nkey-id: {kid}\n"
            f"signature: {base64.b64encode(key.sign(data)).decode()}\n")
    tmp = art_dir / f".{SIGNATURE}.tmp-{os.getpid()}"
    tmp.write_text(text, encoding="ascii")
    os.replace(tmp, art_dir / SIGNATURE)
    log.info("signed %s with key %s", art_dir / MANIFEST, kid)
    return kid


def parse_public_keys(text: str, source: str) -> list[PublicKey]:
    keys = []
    for i, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split()
        try:
            raw = base64.b64decode(parts[1], validate=True) if len(parts) >= 2 and parts[0] == KEY_TAG else b""
        except binascii.Error:
            raw = b""
        if len(raw) != 32:
            raise SignatureError(f"{source}:{i}: expected '{KEY_TAG} <base64 of 32 bytes>', found {line[:60]!r}")
        keys.append(PublicKey(raw, f"{source}:{i}"))
    return keys


def load_public_keys(path: str | os.PathLike) -> list[PublicKey]:
    """Keys in one .pub file, or in every *.pub of a directory (sorted by name). Each must be a
    regular file of at most 64 KiB (read_small_file); anything else is a SignatureError."""
    p = Path(path)
    files = sorted(p.glob("*.pub")) if p.is_dir() else [p]
    keys = []
    for f in files:
        data = read_small_file(f, "trusted key file")
        try:
            text = data.decode("ascii")
        except UnicodeDecodeError as e:
            raise SignatureError(f"trusted key file {f} is not ASCII text (byte {e.start}); "
                                 f"expected '{KEY_TAG} <base64>' lines") from e
        keys += parse_public_keys(text, str(f))
    return keys


def trusted_keys() -> list[PublicKey]:
    """The keys this board trusts: $BOARDTALK_TRUSTED_KEYS (a .pub file or a directory of them), else
    /etc/boardtalk/trusted_keys/*.pub; [] when neither is configured. A configured path that does not
    exist or holds no key is an error, never a silent "trust everything"."""
    env = os.environ.get(ENV_KEYS)
    if env:
        p = Path(env)
        if not p.exists():
            raise SignatureError(f"${ENV_KEYS} is {env}, which does not exist; fix it or unset it")
        keys = load_public_keys(p)
        if not keys:
            raise SignatureError(f"${ENV_KEYS} is {env}, which holds no '{KEY_TAG}' key")
        return keys
    if DEFAULT_KEYS_DIR.is_dir():
        return load_public_keys(DEFAULT_KEYS_DIR)
    return []


def _read_signature(path: Path) -> tuple[str, bytes]:
    try:
        lines = read_small_file(path, "signature file", MAX_SIGNATURE_BYTES).decode("ascii").splitlines()
    except UnicodeDecodeError as e:
        raise SignatureError(f"{path}: unreadable (not ASCII text)") from e
    fields = dict(line.split(": ", 1) for line in lines[1:] if ": " in line)
    try:
        if not lines or lines[0] != SIG_HEADER or fields.get("algorithm") != "ed25519":
            raise ValueError
        sig = base64.b64decode(fields["signature"], validate=True)
        kid = fields["key-id"]
    except (ValueError, KeyError, binascii.Error):
        raise SignatureError(f"{path}: not a '{SIG_HEADER}' ed25519 signature file") from None
    return kid, sig


def verify_manifest(art_dir: str | os.PathLike, trusted: Sequence[PublicKey],
                    manifest_bytes: bytes | None = None) -> str:
    """Check manifest.sig against the trusted keys; returns the signing key's id.

    manifest_bytes: the manifest exactly as the caller read (and will parse) it, so a manifest swapped
    after the check cannot slip through; default: read it now."""
    art_dir = Path(art_dir)
    if not trusted:
        raise SignatureError("no trusted keys given to check the signature against")
    ids = ", ".join(k.key_id for k in trusted)
    sig_path = art_dir / SIGNATURE
    if not sig_path.is_file():
        raise SignatureError(f"artifact {art_dir} is not signed, but this board trusts only signed artifacts "
                             f"(keys: {ids})")
    kid, sig = _read_signature(sig_path)
    key = next((k for k in trusted if k.key_id == kid), None)
    if key is None:
        raise SignatureError(f"artifact {art_dir} is signed by key {kid}, which this board does not trust "
                             f"(keys: {ids})")
    data = manifest_bytes if manifest_bytes is not None else (art_dir / MANIFEST).read_bytes()
    ed25519 = _ed25519()
    from cryptography.exceptions import InvalidSignature

    try:
        ed25519.Ed25519PublicKey.from_public_bytes(key.raw).verify(sig, data)
    except InvalidSignature:
        raise SignatureError(f"artifact {art_dir}: {MANIFEST} does not match its signature by key {kid} "
                             "(modified after signing?)") from None
    log.info("artifact %s: manifest signed by trusted key %s (%s)", art_dir, kid, key.source)
    return kid


def check_artifact(art_dir: str | os.PathLike, manifest_bytes: bytes | None = None,
                   trusted: Sequence[PublicKey] | None = None) -> str | None:
    """The board's policy, for the loader: with trusted keys configured the artifact must be signed by
    one of them (returns its key id); with none, anything loads (returns None)."""
    keys = trusted_keys() if trusted is None else list(trusted)
    if not keys:
        return None
    return verify_manifest(art_dir, keys, manifest_bytes)
