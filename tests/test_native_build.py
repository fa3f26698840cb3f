"""The native kernels as the artifact ships them: compiled for the board's CPU by models/native_build.py,
refused by runtime/native when this CPU cannot run them, and safe whatever thread count the caller or
the environment asks for.

Tests that compile C are marked ``kernels`` (run them with ``pytest -m kernels``; CI runs them). The
Pi 5 build needs the aarch64 cross compiler (apt install gcc-aarch64-linux-gnu).
"""
import ctypes
import os
import platform
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

import boards
import runtime.native as native
from models.native_build import NativeBuildError, build_library, can_build, compiler_for, target_macros

ROOT = Path(__file__).resolve().parents[1]
X86 = platform.machine().lower() in ("x86_64", "amd64")
HERE = boards.detect().name
needs_cc = pytest.mark.skipif(not can_build(HERE), reason=f"needs a C compiler with OpenMP for {HERE} (apt install gcc)")
needs_cross = pytest.mark.skipif(not can_build("pi5"), reason="install gcc-aarch64-linux-gnu to build for the Pi 5")


@pytest.fixture(scope="module")
def here_lib(tmp_path_factory):
    """The library an artifact for this machine's board ships, and what the builder recorded of it."""
    out = tmp_path_factory.mktemp("kernels")
    info = build_library(HERE, out)
    return out / info["file"], info


@pytest.fixture(scope="module")
def pi5_lib(tmp_path_factory):
    out = tmp_path_factory.mktemp("kernels-pi5")
    info = build_library("pi5", out)
    return out / info["file"], info


# ---------------------------------------------------------------- building


@pytest.mark.kernels
@needs_cc
@pytest.mark.skipif(not X86, reason="the host profile is x86-64")
def test_host_library_loads_and_runs_avx2(here_lib):
    """The host tier follows this CPU: x86-64-v4 (AVX-512 registers for the AVX2 kernels) where it has
    AVX-512, else x86-64-v3; either way the manifest records exactly the features the build needs."""
    path, info = here_lib
    v4 = set(boards.AVX512) <= native.cpu_features()
    level = "x86-64-v4" if v4 else "x86-64-v3"
    assert info["file"] == f"bt_native-{level}.so" and info["cflags"] == [f"-march={level}"]
    assert info["cpu_features"] == sorted(boards.AVX512 if v4 else ("avx2", "fma", "f16c")) and info["simd"] == "avx2"
    assert info["compiler"] and "\n" not in info["compiler"]
    lib = native.load_library(path, info["cpu_features"])
    assert lib.bt_simd().decode() == "avx2"
    assert native.load_library(path) is lib  # one CDLL per path


@pytest.mark.kernels
@needs_cross
def test_pi5_library_is_an_aarch64_elf(pi5_lib):
    path, info = pi5_lib
    assert path.name == "bt_native-cortex-a76.so"
    assert native.library_arch(path) == "aarch64"
    assert info["simd"] == "neon+dotprod" and info["cflags"] == ["-mcpu=cortex-a76"]
    assert set(info["cpu_features"]) == set(boards.get("pi5").cpu_features)


@pytest.mark.kernels
@pytest.mark.parametrize("name", list(boards.PROFILES))
def test_each_profiles_flags_imply_exactly_its_cpu_features(name):
    """The runtime checks a profile's cpu_features; a build using more would die with SIGILL instead."""
    profile = boards.get(name)
    if not can_build(name):
        pytest.skip(f"no {compiler_for(profile)} here (install it to check {name}'s flags)")
    import shutil

    from models.native_build import FEATURE_MACROS

    macros = target_macros(shutil.which(compiler_for(profile)), profile.cflags)
    assert {f for m, f in FEATURE_MACROS.items() if m in macros} == set(profile.cpu_features)


@pytest.mark.kernels
@needs_cc
def test_a_second_build_reuses_the_cached_library(here_lib, tmp_path, monkeypatch):
    import models.native_build as nb

    def no_compile(*a):
        raise AssertionError("compiled again")

    monkeypatch.setattr(nb, "_compile", no_compile)
    info = build_library(HERE, tmp_path)
    assert (tmp_path / info["file"]).read_bytes() == here_lib[0].read_bytes()


def test_a_missing_compiler_says_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no compilers at all
    monkeypatch.delenv("CC", raising=False)
    cross = "pi5" if X86 else "host"
    with pytest.raises(NativeBuildError, match="apt install gcc-"):
        build_library(cross, tmp_path)
    assert not can_build(cross)
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    with pytest.raises(NativeBuildError, match="apt install gcc"):
        build_library(HERE, tmp_path)


def test_compiler_for_cross_builds_for_another_architecture(monkeypatch):
    monkeypatch.delenv("CC", raising=False)
    here, other = ("host", "pi5") if X86 else ("pi5", "host")
    assert compiler_for(boards.get(here)) == "cc"
    assert compiler_for(boards.get(other)) == f"{boards.get(other).triple}-gcc"
    monkeypatch.setenv("CC", "clang")
    assert compiler_for(boards.get(here)) == "clang"


# ---------------------------------------------------------------- refusing what this CPU cannot run


@pytest.mark.skipif(not X86, reason="x86 only: the check of the AVX2 host build")
def test_cpu_features_of_this_x86_machine_include_avx2():
    assert {"avx2", "fma", "f16c"} <= native.cpu_features()


def test_check_cpu_names_the_missing_features():
    """A library built for features the CPU lacks is refused with one clear line, not a SIGILL."""
    native.check_cpu(sorted(native.cpu_features()), "bt_native-x.so")  # what we have passes
    with pytest.raises(native.NativeError) as e:
        native.check_cpu([*native.cpu_features(), "fake-feature"], "bt_native-x.so")
    msg = str(e.value)
    assert "bt_native-x.so needs CPU features fake-feature, which this CPU lacks" in msg
    assert "--board" in msg and "--backend onnxruntime" in msg and "\n" not in msg


@pytest.mark.kernels
@needs_cc
def test_load_library_refuses_missing_features_before_dlopen(here_lib):
    path, info = here_lib
    with pytest.raises(native.NativeError, match="needs CPU features fake-feature"):
        native.load_library(path, [*info["cpu_features"], "fake-feature"])


@pytest.mark.kernels
@needs_cross
@pytest.mark.skipif(not X86, reason="checks an aarch64 library on x86")
def test_an_aarch64_library_is_refused_on_x86(pi5_lib):
    with pytest.raises(native.NativeError, match=r"bt_native-cortex-a76.so is built for aarch64, but this machine is "
                                                 r"x86_64; rebuild the artifact with --board host"):
        native.load_library(pi5_lib[0], pi5_lib[1]["cpu_features"])


def test_a_file_that_is_not_a_library_is_refused(tmp_path):
    bad = tmp_path / "bt_native-x.so"
    bad.write_bytes(b"not an ELF file at all")
    with pytest.raises(native.NativeError, match="not an ELF shared library"):
        native.load_library(bad)


# ---------------------------------------------------------------- threads


@pytest.mark.parametrize("bad", [-1, 0, 257, True, 2.0, "4", None])
def test_validate_threads_refuses(bad):
    """`--threads -1` was accepted and skipped the thread cap (then crashed the native backend)."""
    with pytest.raises(ValueError, match=rf"threads must be an integer from 1 to 256, got {bad!r}"):
        boards.validate_threads(bad)


def test_validate_threads_and_resolved_threads():
    assert boards.validate_threads(1) == 1 and boards.validate_threads(256) == 256
    assert 1 <= boards.get("host").resolved_threads() <= boards.MAX_THREADS
    assert boards.get("pi5").resolved_threads() == 4
    with pytest.raises(ValueError, match="got -1"):
        boards.overlay(boards.get("host"), threads=-1).resolved_threads()


class _Weights(ctypes.Structure):  # bt_weights
    _fields_ = [(n, ctypes.c_void_p) for n in ("tok_embd", "output_norm", "rope_cos", "rope_sin")] + [
        (n, ctypes.POINTER(ctypes.c_void_p)) for n in ("attn_norm", "ffn_norm", "wq", "wk", "wv", "wo", "wgate", "wup",
                                                       "wdown")]


class TinyModel:
    """Random weights in the native layouts for a 2-layer model (64 wide, 4 query heads on 2 KV heads):
    valid f16 scales, random quants. Enough to run every kernel of bt_forward."""

    L, C, H, KVH, D, F, V, MAX_SEQ = 2, 64, 4, 2, 16, 96, 40, 128

    def __init__(self, seed: int = 0):
        rng = np.random.default_rng(seed)
        self.cfg = native.BtConfig(self.L, self.C, self.H, self.KVH, self.D, self.F, self.V, self.MAX_SEQ, 1e-5,
                                   1.0 / np.sqrt(self.D), 1)
        self.keep = []

        def x8(rows: int, cols: int, block: int, nscales: int) -> np.ndarray:
            a = rng.integers(0, 256, ((rows + 7) // 8 * (cols // 32), block), dtype=np.uint8)
            scales = rng.uniform(0.005, 0.05, (a.shape[0], nscales)).astype(np.float16)
            scales[:, 8:] *= -1  # Q4_1 minimums
            a[:, :2 * nscales] = scales.view(np.uint8)
            self.keep.append(a)
            return a

        def ptrs(arrays) -> ctypes.POINTER(ctypes.c_void_p):
            arr = (ctypes.c_void_p * self.L)(*[a.ctypes.data for a in arrays])
            self.keep.append(arr)
            return ctypes.cast(arr, ctypes.POINTER(ctypes.c_void_p))

        def norm() -> np.ndarray:
            n = (1 + 0.1 * rng.standard_normal(self.C)).astype(np.float32)
            self.keep.append(n)
            return n

        q4 = lambda r, c: x8(r, c, 160, 16)  # noqa: E731  Q4_1x8: d[8], m[8], nibbles
        C, F, HD, KD = self.C, self.F, self.H * self.D, self.KVH * self.D
        emb = x8(self.V, C, 272, 8)  # Q8_0x8
        inv = 1.0 / 10000 ** (np.arange(0, self.D, 2) / self.D)
        ang = np.outer(np.arange(self.MAX_SEQ), inv)
        self.cos, self.sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
        self.w = _Weights(emb.ctypes.data, norm().ctypes.data, self.cos.ctypes.data, self.sin.ctypes.data,
                          ptrs([norm() for _ in range(self.L)]), ptrs([norm() for _ in range(self.L)]),
                          *[ptrs([q4(r, c) for _ in range(self.L)]) for r, c in
                            ((HD, C), (KD, C), (KD, C), (C, HD), (F, C), (F, C), (C, F))])

    def kv(self):
        """An empty layer-major cache: (L, max_seq, 2*KVH, D) int8 and (L, max_seq, 2*KVH) float32."""
        return (np.zeros((self.L, self.MAX_SEQ, 2 * self.KVH, self.D), np.int8),
                np.zeros((self.L, self.MAX_SEQ, 2 * self.KVH), np.float32))

    def forward(self, lib, scratch, ids, start, kv, logits_from=0) -> np.ndarray:
        ids = np.asarray(ids, np.int64)
        logits = np.zeros((len(ids) - logits_from, self.V), np.float32)
        rc = lib.bt_forward(ctypes.byref(self.cfg), ctypes.byref(self.w), scratch, ids.ctypes.data, len(ids), start,
                            kv[0].ctypes.data, kv[1].ctypes.data, logits.ctypes.data, logits_from)
        assert rc == 0, f"bt_forward returned {rc}"
        return logits

    def prefill_then_decode(self, lib, threads: int, ids) -> np.ndarray:
        """Every position's logits: ids[:-1] in one call, then the last id alone."""
        s = lib.bt_scratch_new(ctypes.byref(self.cfg), len(ids), threads)
        assert s, f"bt_scratch_new failed for {threads} threads"
        try:
            kv = self.kv()
            pre = self.forward(lib, s, ids[:-1], 0, kv)
            return np.concatenate([pre, self.forward(lib, s, ids[-1:], len(ids) - 1, kv)])
        finally:
            lib.bt_scratch_free(s)


IDS = [int(i) for i in np.random.default_rng(1).integers(0, TinyModel.V, 121)]  # 120 prefilled x 2 KV heads: 240 items


@pytest.mark.kernels
@needs_cc
def test_scratch_refuses_thread_counts_below_one_and_takes_200(here_lib):
    """More than 64 threads crashed: attention scratch was sized for 64 threads; now from the real count."""
    lib = native.load_library(here_lib[0])
    m = TinyModel()
    for bad in (0, -1):
        assert not lib.bt_scratch_new(ctypes.byref(m.cfg), 8, bad)
    assert not lib.bt_scratch_new(ctypes.byref(m.cfg), 0, 2)
    s = lib.bt_scratch_new(ctypes.byref(m.cfg), 8, 200)
    assert s
    lib.bt_scratch_free(s)


@pytest.mark.kernels
@needs_cc
def test_thread_count_does_not_change_a_bit_and_prefill_matches_decode(here_lib):
    lib = native.load_library(here_lib[0])
    m = TinyModel()
    one = m.prefill_then_decode(lib, 1, IDS)
    assert np.isfinite(one).all() and one.std() > 0
    assert np.array_equal(one, m.prefill_then_decode(lib, 3, IDS))
    s = lib.bt_scratch_new(ctypes.byref(m.cfg), len(IDS), 2)
    try:  # the whole sequence in one call gives the same last row as prefill + decode
        assert np.array_equal(m.forward(lib, s, IDS, 0, m.kv())[-1], one[-1])
    finally:
        lib.bt_scratch_free(s)


def _omp_child(lib_path: str, out: str) -> None:
    """Run in a subprocess with OMP_NUM_THREADS=200: forwards on 2- and 200-thread scratches."""
    lib = native.load_library(Path(lib_path))
    m = TinyModel()
    np.save(out, np.stack([m.prefill_then_decode(lib, 2, IDS), m.prefill_then_decode(lib, 200, IDS)]))


@pytest.mark.kernels
@needs_cc
def test_omp_num_threads_200_does_not_crash_a_forward(here_lib, tmp_path):
    """OMP_NUM_THREADS=200 segfaulted the native backend (prefill attention indexed 64 per-thread slots by
    omp_get_thread_num()); every parallel region now runs the scratch's own thread count."""
    lib = native.load_library(here_lib[0])
    want = TinyModel().prefill_then_decode(lib, 1, IDS)
    env = {**os.environ, "OMP_NUM_THREADS": "200", "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    code = f"import test_native_build as t; t._omp_child({str(here_lib[0])!r}, {str(tmp_path / 'out.npy')!r})"
    res = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, f"exit {res.returncode}: {res.stderr[-2000:]}"
    got = np.load(tmp_path / "out.npy")
    assert np.array_equal(got[0], want) and np.array_equal(got[1], want)


@pytest.mark.kernels
@needs_cc
def test_two_threads_forward_concurrently_on_their_own_scratches(here_lib):
    """Run state was global (profile timers process-wide, omp_set_num_threads per call): two models
    forwarding at once must not see each other."""
    lib = native.load_library(here_lib[0])
    m = TinyModel()
    want = m.prefill_then_decode(lib, 1, IDS)
    got, errors = {}, []

    def work(i: int) -> None:
        try:
            got[i] = [m.prefill_then_decode(lib, 1 + i, IDS) for _ in range(3)]
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert all(np.array_equal(r, want) for rs in got.values() for r in rs)


@pytest.mark.kernels
@needs_cc
def test_profile_timers_belong_to_their_scratch(here_lib):
    """The profile timers were process-wide: enabling them for one model timed (and reset) every model's."""
    lib = native.load_library(here_lib[0])
    m = TinyModel()
    a, b = (lib.bt_scratch_new(ctypes.byref(m.cfg), 16, 2) for _ in range(2))
    try:
        lib.bt_profile(a, 1, None)
        for s in (a, b):
            m.forward(lib, s, IDS[:16], 0, m.kv())
        ta, tb = np.zeros(len(native.PHASES)), np.zeros(len(native.PHASES))
        lib.bt_profile(b, 0, tb.ctypes.data)
        lib.bt_profile(a, 0, ta.ctypes.data)
        assert (tb == 0).all() and ta.sum() > 0 and (ta >= 0).all()
        lib.bt_profile(a, 0, ta.ctypes.data)  # read resets
        assert (ta == 0).all()
    finally:
        lib.bt_scratch_free(a)
        lib.bt_scratch_free(b)


@pytest.mark.kernels
@needs_cc
def test_read_bandwidth_runs_with_an_explicit_thread_count(here_lib):
    assert native.read_bandwidth(here_lib[0], 2, nbytes=8 << 20, passes=1) > 0


@pytest.mark.kernels
@needs_cc
def test_the_board_side_loads_kernels_without_models(here_lib):
    """Nothing from models/ on the board: runtime.native loads and checks a library without importing it."""
    code = ("import sys; from pathlib import Path; import runtime.native as n; "
            f"lib = n.load_library(Path({str(here_lib[0])!r}), n.cpu_features()); lib.bt_simd(); "
            "bad = sorted(m for m in sys.modules if m == 'models' or m.startswith('models.')); "
            "assert not bad, bad")
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]


def test_check_cpu_on_the_artifacts_own_board_does_not_say_rebuild_for_it(monkeypatch):
    """Deploy review: a pi5 artifact on a Cortex-A53 (no dotprod, detected as pi5) was told to rebuild with
    --board pi5, which is what it already was."""
    monkeypatch.setattr(native, "_this_board", lambda: "pi5")
    with pytest.raises(native.NativeError) as e:
        native.check_cpu([*native.cpu_features(), "dotprod-x"], "bt_native-pi5.so", board="pi5")
    msg = str(e.value)
    assert "not the one the pi5 profile describes" in msg and "--board pi5" not in msg and "\n" not in msg
