"""boardtalk runtime: load a verified model artifact and stream tokens from it.

    import runtime
    model = runtime.load(artifact_dir)
    for delta in model.chat([{"role": "user", "content": "hi"}], runtime.GenerationConfig(max_new_tokens=64)):
        print(delta, end="")

Importing this package is cheap: onnxruntime, regex and yaml load on ``load()``.
"""
from __future__ import annotations

import logging
import os
import time
from pathlib import Path

# boardtalk runs its own compute threads and never calls BLAS. NumPy's OpenBLAS pool would only
# compete for the cores: its threads spin at start-up, during load (seen in perf on 2 cores).
# Set before NumPy is first imported (by the modules below); a user's own setting wins.
for _v in ("OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_v, "1")
# The native kernels pass their thread count to every parallel region, so OMP_NUM_THREADS never applies;
# an invalid one would only make libgomp print a complaint on every run.
if not os.environ.get("OMP_NUM_THREADS", "1").strip().isdigit() or os.environ.get("OMP_NUM_THREADS") == "0":
    os.environ.pop("OMP_NUM_THREADS", None)

from .artifact import ArtifactError, Manifest  # noqa: E402
from .backends import BACKENDS, DEFAULT_BACKEND, default_backend  # noqa: E402
from .config import ConfigError, ModelConfig  # noqa: E402
from .kv_cache import ContextOverflow, KVCache  # noqa: E402
from .model import Model  # noqa: E402
from .sampling import GenerationConfig, Sampler  # noqa: E402
from .session import CancelToken, Generation, GenerationStats, Session, SessionBusy  # noqa: E402

__all__ = ["load", "default_artifact", "default_backend", "Model", "Session", "Generation", "GenerationConfig",
           "GenerationStats", "CancelToken", "SessionBusy", "Sampler", "KVCache", "ArtifactError", "ConfigError",
           "ContextOverflow", "Manifest", "ModelConfig", "BoardMismatch", "UntrustedArtifact", "BACKENDS", "DEFAULT_BACKEND",
           "DEFAULT_MODEL", "__version__"]
__version__ = "0.1.0"
DEFAULT_MODEL = "smollm2-135m-instruct"  # the name of the default artifact the CLI builds (models/sources.py)
log = logging.getLogger(__name__)


class BoardMismatch(ArtifactError):
    """The artifact was built for another board."""


class UntrustedArtifact(ArtifactError):
    """This board trusts signing keys and the artifact is unsigned, signed by another key, or altered."""


def load(artifact_dir, threads: int | None = None, board: str | None = None, max_context: int | None = None,
         trusted_keys=None) -> Model:
    """Verify and load an artifact.

    threads: compute threads, 1-256 (None = the board profile's default).
    board: board profile name to run as (None = detect this machine); must match the artifact's target.
    max_context: KV cache positions of each session (None = the board profile's, capped by the artifact's).
    trusted_keys: public key files; when any are given (or configured: $BOARDTALK_TRUSTED_KEYS,
        /etc/boardtalk/trusted_keys/), the manifest must be signed by one of them.
    """
    import boards

    from .artifact import load_manifest, open_artifact, read_manifest_bytes
    from .backends import open_backend

    t0 = time.monotonic()
    if threads is not None:
        boards.validate_threads(threads)
    if max_context is not None and (not isinstance(max_context, int) or isinstance(max_context, bool)
                                    or max_context < 2):
        raise ValueError(f"max_context must be an integer >= 2, got {max_context!r}")
    art = open_artifact(artifact_dir)
    data = read_manifest_bytes(art)
    _check_signature(art, data, trusted_keys)
    m = load_manifest(art, verify_files=False, data=data)
    profile = boards.get(board) if board else boards.detect()
    if m.target.board != profile.name:
        raise BoardMismatch(f"artifact {art} was built for board '{m.target.board}' ({m.target.triple}), "
                            f"but this is '{profile.name}' ({profile.triple}); rebuild with --board {profile.name}")
    profile = boards.overlay(profile, threads=threads)
    ctx = min(max_context or profile.max_context, m.max_context)
    if max_context and max_context > m.max_context:
        log.warning("max_context %d exceeds the artifact's %d; using %d", max_context, m.max_context, ctx)
    try:
        tok = _verify(art, m)
    except ArtifactError:
        if art == Path(artifact_dir):
            raise
        # an unpacked copy of a tarball that no longer matches (edited in the cache): unpack it once more
        from .tarball import discard_unpacked

        log.warning("unpacked copy %s of %s is damaged; unpacking it again", art, artifact_dir)
        discard_unpacked(art)
        art = open_artifact(artifact_dir)
        tok = _verify(art, m)
    if tok.vocab_size != m.architecture.vocab:
        raise ArtifactError(f"{m.tokenizer_file} has {tok.vocab_size} tokens, the manifest's vocab is "
                            f"{m.architecture.vocab}")
    _release_freed_memory()  # give back the heap freed while loading (split lines of the tokenizer file)
    backend = open_backend(m, art, threads=profile.resolved_threads(), provider=profile.provider)
    model = Model(m, backend, tok, ctx, profile)
    log.info("loaded %s (%s, %s) for %s in %.2f s; KV cache %d positions x %d B", m.model_name, m.backend,
             m.quantization.scheme, profile.name, time.monotonic() - t0, ctx, model.cache.bytes_per_position)
    return model


def _verify(art: Path, m: Manifest):
    """Every listed file's size and sha256, in background threads, before anything runs; returns the
    tokenizer (read as soon as its own file is verified)."""
    from .artifact import FileVerifier
    from .tokenizer import Tokenizer

    verifier = FileVerifier(art, m)
    try:
        return Tokenizer(verifier.wait(m.tokenizer_file).read_text(encoding="utf-8"))
    except ValueError as e:
        if isinstance(e, ArtifactError):
            raise
        raise ArtifactError(f"{m.tokenizer_file}: {e}") from None
    finally:
        verifier.wait_all()


def _check_signature(art: Path, data: bytes, trusted_keys) -> None:
    """With trusted keys configured, only a manifest signed by one of them loads (fleets: runtime/signing.py).
    trusted_keys: runtime.signing.PublicKey objects or key file paths; None = the board's configuration."""
    from . import signing

    try:
        keys = None
        if trusted_keys is not None:
            keys = [k for t in trusted_keys
                    for k in ([t] if isinstance(t, signing.PublicKey) else signing.load_public_keys(t))]
        signing.check_artifact(art, data, keys)
    except signing.SignatureError as e:
        raise UntrustedArtifact(str(e)) from None


def _release_freed_memory() -> None:
    """Give freed heap pages back to the OS (glibc's malloc_trim); a no-op elsewhere."""
    import ctypes

    try:  # not ctypes.util.find_library: it spawns a subprocess
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def default_artifact(model_name: str | None = None, board: str | None = None, backend: str | None = None) -> Path:
    """Where the CLI keeps the artifact it builds on first use."""
    import boards

    from .artifact import cache_dir

    b = board or boards.detect().name
    return cache_dir() / "artifacts" / f"{model_name or DEFAULT_MODEL}-{backend or default_backend()}-{b}"
