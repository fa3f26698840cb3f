"""Signed artifacts: a board that trusts keys loads only manifests signed by one of them."""
import hashlib
import os
import stat

import pytest
import yaml

pytest.importorskip("cryptography", reason="signing needs the 'sign' extra: pip install 'boardtalk[sign]'")

from runtime import signing  # noqa: E402
from runtime.signing import SignatureError  # noqa: E402


@pytest.fixture()
def art(tmp_path):
    d = tmp_path / "art"
    d.mkdir()
    (d / "weights.bin").write_bytes(b"w" * 64)
    files = {"weights.bin": {"size": 64, "sha256": hashlib.sha256(b"w" * 64).hexdigest()}}
    (d / "manifest.yaml").write_text(yaml.safe_dump({"format_version": 2, "files": files}))
    return d


@pytest.fixture()
def key(tmp_path):
    kid = signing.generate_key(tmp_path / "fleet.key", tmp_path / "fleet.pub")
    return kid, tmp_path / "fleet.key", tmp_path / "fleet.pub"


@pytest.fixture(autouse=True)
def no_configured_keys(monkeypatch, tmp_path):
    monkeypatch.delenv(signing.ENV_KEYS, raising=False)
    monkeypatch.setattr(signing, "DEFAULT_KEYS_DIR", tmp_path / "etc-none")


def test_generate_key_files(key):
    kid, priv, pub = key
    assert stat.S_IMODE(priv.stat().st_mode) == 0o600
    assert b"PRIVATE KEY" in priv.read_bytes()
    (k,) = signing.load_public_keys(pub)
    assert pub.read_text().startswith("boardtalk-ed25519 ") and len(k.raw) == 32
    assert k.key_id == kid == hashlib.sha256(k.raw).hexdigest()[:16]
    with pytest.raises(FileExistsError, match="refusing to overwrite"):
        signing.generate_key(priv, pub.with_name("other.pub"))
    assert not pub.with_name("other.pub").exists()


def test_sign_verify_round_trip(art, key):
    kid, priv, pub = key
    assert signing.sign_manifest(art, priv) == kid
    sig = (art / "manifest.sig").read_text().splitlines()
    assert sig[0] == "boardtalk-signature 1" and f"key-id: {kid}" in sig
    assert signing.verify_manifest(art, signing.load_public_keys(pub)) == kid


def test_tampered_manifest_is_refused(art, key):
    """Bug 7: nothing stopped a modified artifact from loading on a fleet board."""
    kid, priv, pub = key
    signing.sign_manifest(art, priv)
    m = art / "manifest.yaml"
    m.write_text(m.read_text().replace("format_version: 2", "format_version: 3"))
    with pytest.raises(SignatureError, match=f"manifest.yaml does not match its signature by key {kid}"):
        signing.verify_manifest(art, signing.load_public_keys(pub))


def test_bytes_the_caller_parsed_are_the_ones_checked(art, key):
    _, priv, pub = key
    signing.sign_manifest(art, priv)
    good = (art / "manifest.yaml").read_bytes()
    with pytest.raises(SignatureError, match="does not match its signature"):
        signing.verify_manifest(art, signing.load_public_keys(pub), manifest_bytes=good + b"\nx: 1\n")


def test_unsigned_refused_when_keys_are_trusted(art, key, monkeypatch):
    kid, _, pub = key
    monkeypatch.setenv(signing.ENV_KEYS, str(pub))
    with pytest.raises(SignatureError, match=rf"artifact \S+ is not signed, but this board trusts only signed "
                                             rf"artifacts \(keys: {kid}\)"):
        signing.check_artifact(art)


def test_other_key_refused(art, key, tmp_path, monkeypatch):
    kid, _, pub = key
    keys = tmp_path / "trusted"
    keys.mkdir()
    os.rename(pub, keys / "fleet.pub")
    other = signing.generate_key(tmp_path / "rogue.key", tmp_path / "rogue.pub")
    signing.sign_manifest(art, tmp_path / "rogue.key")
    monkeypatch.setenv(signing.ENV_KEYS, str(keys))  # a directory of *.pub
    with pytest.raises(SignatureError, match=f"signed by key {other}, which this board does not trust .keys: {kid}"):
        signing.check_artifact(art)
    signing.sign_manifest(art, tmp_path / "fleet.key")  # re-signed by the fleet key: accepted
    assert signing.check_artifact(art) == kid


def test_no_keys_configured_accepts_unsigned(art):
    assert signing.trusted_keys() == []
    assert signing.check_artifact(art) is None


def test_default_keys_dir(art, key, tmp_path, monkeypatch):
    kid, priv, pub = key
    d = tmp_path / "etc"
    d.mkdir()
    os.rename(pub, d / "fleet.pub")
    monkeypatch.setattr(signing, "DEFAULT_KEYS_DIR", d)
    signing.sign_manifest(art, priv)
    assert signing.check_artifact(art) == kid


def test_misconfigured_keys_never_mean_trust_everything(art, tmp_path, monkeypatch):
    monkeypatch.setenv(signing.ENV_KEYS, str(tmp_path / "missing.pub"))
    with pytest.raises(SignatureError, match="does not exist"):
        signing.check_artifact(art)
    bad = tmp_path / "bad.pub"
    bad.write_text("ssh-ed25519 AAAA user@host\n")
    monkeypatch.setenv(signing.ENV_KEYS, str(bad))
    with pytest.raises(SignatureError, match=r"bad.pub:1: expected 'boardtalk-ed25519 <base64 of 32 bytes>'"):
        signing.check_artifact(art)
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.setenv(signing.ENV_KEYS, str(empty))
    with pytest.raises(SignatureError, match="holds no 'boardtalk-ed25519' key"):
        signing.check_artifact(art)


def test_signed_build_is_installed_with_its_signature(tiny_gguf, tmp_path, key):
    """build_artifact(sign_key=...) signs the staged manifest, so the switched-in artifact is signed."""
    from models.build import build_artifact

    kid, priv, pub = key
    out = tmp_path / "signed"
    build_artifact(str(tiny_gguf), out, board="host", backend="onnxruntime", max_context=128, sign_key=priv)
    assert signing.verify_manifest(out, signing.load_public_keys(pub)) == kid
    from runtime import store

    assert store.is_artifact_dir(out)  # manifest.sig is part of an artifact


@pytest.fixture()
def alarm():
    """Fails a call that would block (a FIFO opened for reading waits for a writer) instead of hanging."""
    import signal

    def timeout(*_):
        raise TimeoutError("blocked reading a key file")

    old = signal.signal(signal.SIGALRM, timeout)
    signal.alarm(20)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


def _sparse(path, size=1 << 30):
    """A file of `size` bytes that costs no disk (what /dev/zero looked like to the old reader)."""
    with open(path, "wb") as f:
        f.truncate(size)
    return path


def test_trusted_keys_that_are_not_small_regular_files_are_refused(art, tmp_path, monkeypatch, alarm):
    """CRASH (OOM): BOARDTALK_TRUSTED_KEYS=/dev/zero was read forever. Key files must be regular files of
    at most 64 KiB, read with a bounded read; anything else is one line, at once."""
    fifo = tmp_path / "fifo.pub"
    os.mkfifo(fifo)
    big = _sparse(tmp_path / "big.pub")
    cases = {fifo: r"trusted key file \S*fifo.pub is a FIFO; expected a regular file",
             big: r"trusted key file \S*big.pub is 1073741824 bytes, more than 65536 for a key file"}
    if os.path.exists("/dev/null"):  # a character device, like /dev/zero (which is never read here)
        cases["/dev/null"] = r"trusted key file /dev/null is a character device; expected a regular file"
    for path, msg in cases.items():
        monkeypatch.setenv(signing.ENV_KEYS, str(path))
        with pytest.raises(SignatureError, match=msg) as e:
            signing.check_artifact(art)
        assert "\n" not in str(e.value)
    d = tmp_path / "keys"  # a directory holding such a *.pub
    d.mkdir()
    os.rename(big, d / "big.pub")
    monkeypatch.setenv(signing.ENV_KEYS, str(d))
    with pytest.raises(SignatureError, match=r"big.pub is 1073741824 bytes"):
        signing.trusted_keys()
    (d / "big.pub").unlink()
    os.mkfifo(d / "z.pub")
    with pytest.raises(SignatureError, match=r"z.pub is a FIFO"):
        signing.trusted_keys()
    (d / "z.pub").unlink()
    (d / "sub.pub").mkdir()
    with pytest.raises(SignatureError, match=r"sub.pub is a directory"):
        signing.trusted_keys()


def test_private_keys_that_are_not_small_regular_files_are_refused(art, key, tmp_path, alarm):
    """CRASH: `boardtalk sign --key /dev/zero` hung. A private key is read the same bounded way."""
    fifo = tmp_path / "fifo.key"
    os.mkfifo(fifo)
    big = _sparse(tmp_path / "big.key")
    for path, msg in {fifo: "private key .*fifo.key is a FIFO", big: "private key .*big.key is 1073741824 bytes",
                      tmp_path: "is a directory", tmp_path / "missing.key": "cannot read private key .*missing.key: "
                                                                            "No such file"}.items():
        with pytest.raises(SignatureError, match=msg):
            signing.sign_manifest(art, path)
        with pytest.raises(SignatureError, match=msg):
            signing.check_private_key(path)
    assert not (art / "manifest.sig").exists()


def test_check_private_key(key, tmp_path):
    """build --sign-key must fail before a long build: check_private_key loads and validates a key
    without signing anything, and returns its key id."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec, ed25519

    kid, priv, pub = key
    assert signing.check_private_key(priv) == kid
    assert signing.check_private_key(str(priv)) == kid
    with pytest.raises(SignatureError, match=r"fleet.pub: not an unencrypted PEM private key"):
        signing.check_private_key(pub)
    enc = tmp_path / "enc.key"
    enc.write_bytes(ed25519.Ed25519PrivateKey.generate().private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.BestAvailableEncryption(b"pw")))
    with pytest.raises(SignatureError, match=r"enc.key: not an unencrypted PEM private key"):
        signing.check_private_key(enc)
    other = tmp_path / "ec.key"
    other.write_bytes(ec.generate_private_key(ec.SECP256R1()).private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    with pytest.raises(SignatureError, match=r"ec.key: a \w+, expected an Ed25519 private key"):
        signing.check_private_key(other)
    for bad in (pub, enc, other):
        with pytest.raises(SignatureError) as e:
            signing.check_private_key(bad)
        assert "\n" not in str(e.value)


def test_a_huge_signature_file_is_refused_without_reading_it(art, key, tmp_path):
    """CRASH (OOM), as for key files: manifest.sig is read with the same bounded read."""
    _, priv, pub = key
    _sparse(art / "manifest.sig")
    with pytest.raises(SignatureError, match=r"signature file \S*manifest.sig is 1073741824 bytes"):
        signing.verify_manifest(art, signing.load_public_keys(pub))
