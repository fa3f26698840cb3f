"""``boardtalk verify``: is this artifact good on this board? And the ``deploy`` command's options.

    result = verify("~/boardtalk/artifacts/smollm2-135m-instruct-native-pi5")
    result.backend, result.threads, result.ttft_ms, result.decode_tokens_per_s

verify() loads the artifact the way every run does (manifest fields, every file's size and sha256, the
target board, a signature when the board trusts keys, the kernel library's architecture and the CPU
features it needs), then runs a greedy smoke test: SMOKE_TOKENS tokens from a fixed prompt, twice, and
checks that both runs give the same ids, every id is in the vocabulary and no logit is NaN or infinite.
Board side: nothing from models/. ``deploy`` (laptop side, models/deploy.py) runs it on the board with
``--json`` and reads the result.
"""
from __future__ import annotations

import hashlib
import json
import logging
import platform
import sys
import time
from dataclasses import asdict, dataclass, field

log = logging.getLogger(__name__)

SMOKE_TOKENS = 16  # greedy tokens of the smoke test
# boardtalk extras deploy --with may install on a board (models/deploy.py): the service, the voice loop, signatures
DEPLOY_EXTRAS = ("serve", "voice", "sign", "onnxruntime")
SMOKE_PROMPT = "The three primary colors are"  # raw text (no chat template: every model has a tokenizer)


class VerifyError(RuntimeError):
    """The artifact loaded but does not run correctly here (the message says what was seen)."""


@dataclass
class VerifyResult:
    artifact: str  # the directory that was verified (a tarball's unpacked copy)
    model: str
    board: str  # the profile it ran as
    backend: str
    threads: int
    kernels: str | None  # native: "bt_native-cortex-a76.so (neon+dotprod)"; else None
    files: int  # files checked against the manifest (size and sha256)
    bytes: int  # their total size
    manifest_sha256: str
    signed: bool  # a manifest.sig was present (checked when the board trusts keys)
    load_s: float  # seconds: verify + load
    prompt_ids: list[int]
    token_ids: list[int]  # the smoke test's greedy ids
    text: str
    ttft_ms: float  # first run of the smoke test
    decode_tokens_per_s: float
    machine: str  # platform.machine()
    python: str
    cpu_features: list[str] = field(default_factory=list)  # what runtime.native sees on this CPU
    version: str = ""  # boardtalk's

    def to_json(self) -> str:
        return json.dumps(asdict(self), ensure_ascii=False)

    def summary(self) -> str:
        kern = f", kernels {self.kernels}" if self.kernels else ""
        return (f"ok: {self.model} on {self.board} ({self.machine}): backend {self.backend}{kern}, {self.threads} "
                f"threads; {self.files} files ({self.bytes / 2**20:.1f} MiB) match the manifest; loaded in "
                f"{self.load_s:.2f} s; {len(self.token_ids)}-token greedy smoke test: TTFT {self.ttft_ms:.0f} ms, "
                f"{self.decode_tokens_per_s:.1f} tok/s")


def verify(artifact, board: str | None = None, threads: int | None = None, trusted_keys=None,
           max_new_tokens: int = SMOKE_TOKENS, prompt: str = SMOKE_PROMPT) -> VerifyResult:
    """Load and check the artifact, run the greedy smoke test; VerifyError when it runs but misbehaves.

    Loading errors are runtime's own (ArtifactError, BoardMismatch, NativeError for a library this CPU
    cannot run, ImportError for a missing backend package)."""
    import numpy as np

    import runtime
    from runtime.artifact import MANIFEST, open_artifact
    from runtime.native import cpu_features

    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 2:
        raise ValueError(f"max_new_tokens must be an integer >= 2, got {max_new_tokens!r}")
    t0 = time.monotonic()
    model = runtime.load(artifact, threads=threads, board=board, trusted_keys=trusted_keys)
    load_s = time.monotonic() - t0
    try:
        m = model.manifest
        art = open_artifact(artifact)  # a tarball: its unpacked copy (unpacked once, by load)
        ids = model.tokenizer.encode(prompt)
        room = model.max_context - max_new_tokens
        if room < 1:
            raise VerifyError(f"the context ({model.max_context}) is too small for a {max_new_tokens}-token smoke test")
        ids = ids[:room]
        cfg = runtime.GenerationConfig(max_new_tokens=max_new_tokens, temperature=0.0, stop_ids=())
        runs = []
        for _ in range(2):  # the second from a reset cache: the same ids, or the kernels are not deterministic
            model.reset()
            got = list(model.generate(ids, cfg))
            runs.append((got, model.last_stats))
        (first, st), (second, _) = runs
        if len(first) != max_new_tokens:
            raise VerifyError(f"the smoke test made {len(first)} tokens, expected {max_new_tokens}")
        if first != second:
            raise VerifyError(f"two greedy runs of the smoke test differ: {first} vs {second}")
        bad = [t for t in first if not 0 <= t < model.vocab]
        if bad:
            raise VerifyError(f"the smoke test made ids outside the vocabulary of {model.vocab}: {bad}")
        model.reset()
        logits = model.session.logits(ids + first[:-1])  # (positions, vocab) float32
        if not np.isfinite(logits).all():
            raise VerifyError("the model's logits have NaN or infinite values")
        kern = None
        if m.kernels is not None:
            lib = getattr(model.backend, "lib", None)
            simd = lib.bt_simd().decode() if lib is not None else m.kernels.simd
            kern = f"{m.kernels.file} ({simd})"
        manifest_bytes = (art / MANIFEST).read_bytes()
        return VerifyResult(
            artifact=str(art), model=m.model_name, board=model.profile.name if model.profile else "?",
            backend=m.backend, threads=int(getattr(model.backend, "threads", 0) or 0), kernels=kern,
            files=len(m.files), bytes=sum(int(f["size"]) for f in m.files.values()),
            manifest_sha256=hashlib.sha256(manifest_bytes).hexdigest(), signed=(art / "manifest.sig").exists(),
            load_s=round(load_s, 3), prompt_ids=list(ids), token_ids=first,
            text=model.tokenizer.decode(first), ttft_ms=round(st.ttft_s * 1e3, 2),
            decode_tokens_per_s=round(st.decode_tokens_per_s, 2), machine=platform.machine(),
            python=platform.python_version(), cpu_features=sorted(cpu_features()), version=runtime.__version__)
    finally:
        model.close()


# ---------------------------------------------------------------------------------------------
# CLI: verify (board side) and deploy (laptop side: its handler imports models/ only when run)

def cmd_verify(args) -> int:
    from runtime.cli import CliError, _trusted_keys

    try:
        res = verify(args.artifact, board=args.board, threads=args.threads, trusted_keys=_trusted_keys(args),
                     max_new_tokens=args.tokens)
    except VerifyError as e:
        raise CliError(f"verify {args.artifact}: {e}") from e
    print(res.to_json() if args.json else res.summary(), flush=True)
    if not args.json:
        print(f"  ids {res.token_ids}\n  text {res.text!r}")
    return 0


def cmd_deploy(args) -> int:
    from runtime.cli import BUILD_EXTRA, CliError

    try:
        from models import deploy
    except ImportError as e:
        log.debug("models/ is not importable", exc_info=True)
        raise CliError(f"deploy runs on the build machine: {BUILD_EXTRA}") from e
    from models.native_build import NativeBuildError

    try:
        return deploy.main(args)
    except (deploy.DeployError, NativeBuildError) as e:
        raise CliError(str(e)) from e


def add_commands(sub) -> None:
    import boards
    import runtime
    from runtime.cli import _int_in, _path

    board_names = list(boards.PROFILES)
    v = sub.add_parser("verify", help="check an artifact on this board: checksums, a greedy smoke test, speed",
                       description="Load the artifact as every run does (manifest, every file's sha256, target "
                                   "board, kernel library against this CPU, signature if this board trusts keys), "
                                   f"then generate {SMOKE_TOKENS} greedy tokens twice from a fixed prompt and check "
                                   "they agree. Prints backend, threads, TTFT and tok/s. Exit 0 ok, 2 refused.")
    v.add_argument("--artifact", required=True, metavar="PATH", type=_path,
                   help="artifact directory or tarball (required)")
    v.add_argument("--board", choices=board_names,
                   help="run as this board profile (default: $BOARDTALK_BOARD or detected)")
    v.add_argument("--threads", type=_int_in(1, boards.MAX_THREADS), metavar="N",
                   help="compute threads (default: the board's)")
    v.add_argument("--trusted-keys", metavar="PATH", type=_path,
                   help="load only artifacts signed by one of these keys (default: $BOARDTALK_TRUSTED_KEYS, else "
                        "/etc/boardtalk/trusted_keys/ if it exists, else no signature check)")
    v.add_argument("--tokens", type=_int_in(2, 4096), default=SMOKE_TOKENS, metavar="N",
                   help="greedy tokens of the smoke test (default: %(default)s)")
    v.add_argument("--json", action="store_true", help="print one JSON object (default: a summary line)")
    v.set_defaults(func=cmd_verify)

    d = sub.add_parser("deploy", help="build an artifact for a board, copy it there, install the runtime, verify",
                       description="On the build machine (x86 laptop): build the artifact for --board (native "
                                   "kernels cross-compiled for its CPU), then with --to copy it over ssh, install "
                                   "the runtime there from wheels made here (the board needs Python >= 3.10 and "
                                   "no internet, compiler or pip), run 'boardtalk verify' there, switch the new "
                                   "artifact in and restart the service if it is enabled. Without --to it only "
                                   "builds. Needs the build extra. Details: docs/deploy.md.")
    d.add_argument("--board", required=True, choices=board_names, help="target board profile (required)")
    d.add_argument("--to", metavar="USER@HOST[:DIR]",
                   help="the board over ssh, and the directory there (default DIR: boardtalk, under the login's "
                        "home) (default: build only)")
    d.add_argument("--port", type=_int_in(1, 65535), metavar="N", help="ssh port (default: ssh's: 22 or ~/.ssh/config)")
    d.add_argument("--identity", metavar="FILE", type=_path, help="ssh private key (default: ssh's)")
    d.add_argument("--ssh-option", action="append", default=[], metavar="OPT",
                   help="extra 'ssh -o' option, e.g. StrictHostKeyChecking=accept-new; repeatable (default: "
                        "BatchMode=yes, ConnectTimeout=10 and ~/.ssh/config)")
    d.add_argument("--model", default=runtime.DEFAULT_MODEL,
                   help=f"registry name or .gguf path (default: {runtime.DEFAULT_MODEL})")
    d.add_argument("--backend", default=runtime.DEFAULT_BACKEND, choices=list(runtime.BACKENDS),
                   help="artifact backend (default: %(default)s)")
    d.add_argument("--max-context", type=_int_in(2), metavar="N",
                   help="positions the artifact supports (default: the board's, capped by the model's)")
    d.add_argument("--sign-key", metavar="KEY", type=_path, help="sign the manifest with this key (default: unsigned)")
    d.add_argument("--artifact", metavar="DIR", type=_path,
                   help="deploy this already built artifact instead of building (default: build)")
    d.add_argument("--out", metavar="PATH", type=_path,
                   help="where to build: a directory, or a .tar/.tar.gz/.tgz to pack (default: the cache's artifact "
                        "path for model, backend and board)")
    d.add_argument("--wheels", metavar="DIR", type=_path,
                   help="ship the wheels in DIR (one boardtalk wheel, pip's wheel and the runtime's dependencies for "
                        "the "
                        "board, e.g. an earlier deploy's, kept in the cache's deploy-wheels/) instead of making them "
                        "here: for a build machine without PyPI (default: make them)")
    d.add_argument("--remote-python", default="python3", metavar="CMD",
                   help="the board's Python >= 3.10 (default: %(default)s)")
    d.add_argument("--transfer", choices=("auto", "rsync", "tar"), default="auto",
                   help="copy with rsync over ssh, or a tar stream over ssh; auto: rsync when both sides have it "
                        "(default: %(default)s)")
    d.add_argument("--service", default="boardtalk", metavar="NAME",
                   help="systemd unit restarted after the switch if it is enabled on the board (default: %(default)s)")
    d.add_argument("--with", dest="with_extras", action="append", metavar="EXTRA",
                   choices=DEPLOY_EXTRAS,
                   help="also install this extra of boardtalk on the board: serve (boardtalk serve: API, Wyoming, "
                        "voice loop; the board also needs libportaudio2 for audio), voice, sign, onnxruntime; "
                        "repeatable (default: the runtime and the backend's needs only)")
    d.add_argument("--dry-run", action="store_true", help="print every step and run none (default: run them)")
    d.set_defaults(func=cmd_deploy)


if __name__ == "__main__":  # pragma: no cover
    from runtime.cli import main

    sys.exit(main(["verify", *sys.argv[1:]]))
