"""Hand-scheduled CUDA kernels (TVMScript TIR) for the decode step, where launch count decides speed.

dlight schedules the TE versions of these ops as 5 kernels (RoPE, three for the int8 quantizer, the cache
write) and 5 kernels (scores, softmax, three for P @ V) per layer; these do each in one launch. Used only in
CUDA builds (a CPU build keeps the TE ops: thread bindings do not run there); the tiny and real-dimension
models are checked against the float64 reference on a GPU (tests/test_tvm.py, scripts/gpu_proof.py).
"""
from __future__ import annotations


def qkv_post(H: int, KVH: int, D: int):
    """(qkv (1, (H+2KVH)*D), cos, sin (P, D/2), pos (1,), kv (S, 2KVH, D) int8, sc (S, 2KVH)) -> q (1, H, D) rotated;
    K (rotated) and V of the token quantized (absmax/127 per head, round half to even) and written at row pos[0].
    One block per head (H + 2*KVH), one thread per element."""
    from tvm.script import tirx as T

    HALF = D // 2
    NH = H + 2 * KVH
    LOG_D = D.bit_length() - 1
    assert 1 << LOG_D == D

    @T.prim_func(private=True, s_tir=True)
    def qkv_post(var_qkv: T.handle, var_cos: T.handle, var_sin: T.handle, var_pos: T.handle, var_kv: T.handle,
                 var_sc: T.handle, var_q: T.handle):
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True})
        P, S = T.int64(), T.int64()
        qkv = T.match_buffer(var_qkv, (1, NH * D), "float32")
        cos = T.match_buffer(var_cos, (P, HALF), "float32")
        sin = T.match_buffer(var_sin, (P, HALF), "float32")
        pos = T.match_buffer(var_pos, (1,), "int32")
        kv = T.match_buffer(var_kv, (S, 2 * KVH, D), "int8")
        sc = T.match_buffer(var_sc, (S, 2 * KVH), "float32")
        q = T.match_buffer(var_q, (1, H, D), "float32")
        for hh in T.thread_binding(T.int64(NH), thread="blockIdx.x"):
            for i in T.thread_binding(T.int64(D), thread="threadIdx.x"):
                with T.sblock("post"):
                    T.reads()
                    T.writes()
                    red = T.sblock_alloc_buffer((D,), "float32", scope="shared")
                    val = T.sblock_alloc_buffer((1,), "float32", scope="local")
                    amax = T.sblock_alloc_buffer((1,), "float32", scope="local")
                    p: T.let[T.int64] = T.Cast("int64", pos[0])
                    j: T.let[T.int64] = i // 2
                    a: T.let[T.float32] = qkv[0, hh * D + 2 * j]
                    b: T.let[T.float32] = qkv[0, hh * D + 2 * j + 1]
                    if hh < H + KVH:
                        if i % 2 == 0:
                            val[0] = a * cos[p, j] - b * sin[p, j]
                        else:
                            val[0] = a * sin[p, j] + b * cos[p, j]
                    else:
                        val[0] = qkv[0, hh * D + i]
                    red[i] = T.abs(val[0])  # every head takes part, so no sync sits inside a branch
                    for k in T.unroll(T.int64(LOG_D)):  # butterfly max over the head's D values
                        T.tvm_storage_sync("shared")
                        amax[0] = T.max(red[i], red[T.bitwise_xor(i, T.shift_left(T.int64(1), k))])
                        T.tvm_storage_sync("shared")
                        red[i] = amax[0]
                    amax[0] = T.max(amax[0] * T.float32(1.0 / 127.0), T.float32(1e-30))
                    if hh < H:
                        q[0, hh, i] = val[0]
                    else:
                        kv[p, hh - H, i] = T.Cast("int8", T.nearbyint(val[0] / amax[0]))
                        if i == 0:
                            sc[p, hh - H] = amax[0]

    return qkv_post


def attn_decode(H: int, KVH: int, D: int, W: int, NT: int = 256):
    """(q (1, H, D), kv (S, 2KVH, D) int8, sc (S, 2KVH), pos (1,)) -> (1, H*D): softmax(q k^T / sqrt(D)) v over cache
    rows 0..pos[0] (rows beyond are skipped), scanning at most W rows. One block per query head, NT threads:
    scores one row per thread, block max and sum by butterfly all-reduce in shared memory, then P @ V with NT/D
    threads per output column."""
    from tvm.script import tirx as T

    G = H // KVH
    PARTS = NT // D
    ITER = (W + NT - 1) // NT
    PV_ITER = (W + PARTS - 1) // PARTS
    PV_U = 8 if PV_ITER % 8 == 0 else 1
    LOG_NT = NT.bit_length() - 1
    assert 1 << LOG_NT == NT
    qscale = 1.0 / float(D) ** 0.5
    assert NT % D == 0 and NT >= D

    @T.prim_func(private=True, s_tir=True)
    def attn_decode(var_q: T.handle, var_kv: T.handle, var_sc: T.handle, var_pos: T.handle, var_out: T.handle):
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True})
        S = T.int64()
        q = T.match_buffer(var_q, (1, H, D), "float32")
        kv = T.match_buffer(var_kv, (S, 2 * KVH, D), "int8")
        sc = T.match_buffer(var_sc, (S, 2 * KVH), "float32")
        pos = T.match_buffer(var_pos, (1,), "int32")
        out = T.match_buffer(var_out, (1, H * D), "float32")
        for h in T.thread_binding(T.int64(H), thread="blockIdx.x"):
            for tx in T.thread_binding(T.int64(NT), thread="threadIdx.x"):
                with T.sblock("attn"):
                    T.reads()
                    T.writes()
                    s_sh = T.sblock_alloc_buffer((W,), "float32", scope="shared")
                    q_sh = T.sblock_alloc_buffer((D,), "float32", scope="shared")
                    red = T.sblock_alloc_buffer((NT,), "float32", scope="shared")
                    acc = T.sblock_alloc_buffer((1,), "float32", scope="local")
                    mx = T.sblock_alloc_buffer((1,), "float32", scope="local")
                    den = T.sblock_alloc_buffer((1,), "float32", scope="local")
                    sv = T.sblock_alloc_buffer((ITER,), "float32", scope="local")
                    n: T.let[T.int64] = T.min(T.Cast("int64", pos[0]) + 1, T.int64(W))
                    kh: T.let[T.int64] = h // G
                    if tx < D:
                        q_sh[tx] = q[0, h, tx]
                    T.tvm_storage_sync("shared")
                    mx[0] = T.float32(-3.0e38)
                    for it in T.serial(T.int64(ITER)):
                        if it * NT + tx < n:
                            acc[0] = T.float32(0)
                            for d in T.unroll(T.int64(D)):  # unrolled: the row's loads issue back to back
                                acc[0] = acc[0] + q_sh[d] * T.Cast("float32", kv[it * NT + tx, kh, d])
                            sv[it] = acc[0] * sc[it * NT + tx, kh] * T.float32(qscale)
                            mx[0] = T.max(mx[0], sv[it])
                    red[tx] = mx[0]
                    for k in T.unroll(T.int64(LOG_NT)):  # butterfly: after log2(NT) steps every thread holds the max
                        T.tvm_storage_sync("shared")
                        mx[0] = T.max(red[tx], red[T.bitwise_xor(tx, T.shift_left(T.int64(1), k))])
                        T.tvm_storage_sync("shared")
                        red[tx] = mx[0]
                    T.tvm_storage_sync("shared")
                    acc[0] = T.float32(0)
                    for it in T.serial(T.int64(ITER)):
                        if it * NT + tx < n:
                            s_sh[it * NT + tx] = T.exp(sv[it] - mx[0])
                            acc[0] = acc[0] + T.exp(sv[it] - mx[0])
                    red[tx] = acc[0]
                    for k in T.unroll(T.int64(LOG_NT)):  # butterfly sum
                        T.tvm_storage_sync("shared")
                        den[0] = red[tx] + red[T.bitwise_xor(tx, T.shift_left(T.int64(1), k))]
                        T.tvm_storage_sync("shared")
                        red[tx] = den[0]
                    acc[0] = T.float32(0)
                    for io in T.serial(T.int64(PV_ITER // PV_U)):
                        for iu in T.unroll(T.int64(PV_U)):  # unrolled: PV_U positions' loads in flight at once
                            if (io * PV_U + iu) * PARTS + tx // D < n:
                                acc[0] = acc[0] + s_sh[(io * PV_U + iu) * PARTS + tx // D] * (
                                    T.Cast("float32", kv[(io * PV_U + iu) * PARTS + tx // D, KVH + kh, tx % D])
                                    * sc[(io * PV_U + iu) * PARTS + tx // D, KVH + kh])
                    T.tvm_storage_sync("shared")
                    red[tx] = acc[0]
                    T.tvm_storage_sync("shared")
                    if tx < D:
                        acc[0] = red[tx]
                        for k in T.serial(T.int64(PARTS - 1)):
                            acc[0] = acc[0] + red[(k + 1) * D + tx]
                        out[0, h * D + tx] = acc[0] / den[0]

    return attn_decode


def qkv_post_rows(H: int, KVH: int, D: int):
    """qkv_post for T rows at positions start.. (prefill): (qkv (T, ...), cos, sin, kv, sc, start) -> q (T, H, D).
    One block per (row, head)."""
    from tvm.script import tirx as T

    HALF = D // 2
    NH = H + 2 * KVH
    LOG_D = D.bit_length() - 1
    assert 1 << LOG_D == D

    @T.prim_func(private=True, s_tir=True)
    def qkv_post_rows(var_qkv: T.handle, var_cos: T.handle, var_sin: T.handle, var_kv: T.handle, var_sc: T.handle,
                      start: T.int64, var_q: T.handle):
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True})
        P, S, Tn = T.int64(), T.int64(), T.int64()
        qkv = T.match_buffer(var_qkv, (Tn, NH * D), "float32")
        cos = T.match_buffer(var_cos, (P, HALF), "float32")
        sin = T.match_buffer(var_sin, (P, HALF), "float32")
        kv = T.match_buffer(var_kv, (S, 2 * KVH, D), "int8")
        sc = T.match_buffer(var_sc, (S, 2 * KVH), "float32")
        q = T.match_buffer(var_q, (Tn, H, D), "float32")
        for b in T.thread_binding(Tn * NH, thread="blockIdx.x"):
            for i in T.thread_binding(T.int64(D), thread="threadIdx.x"):
                with T.sblock("post"):
                    T.reads()
                    T.writes()
                    red = T.sblock_alloc_buffer((D,), "float32", scope="shared")
                    val = T.sblock_alloc_buffer((1,), "float32", scope="local")
                    amax = T.sblock_alloc_buffer((1,), "float32", scope="local")
                    t: T.let[T.int64] = b // NH
                    hh: T.let[T.int64] = b % NH
                    p: T.let[T.int64] = start + t
                    j: T.let[T.int64] = i // 2
                    a: T.let[T.float32] = qkv[t, hh * D + 2 * j]
                    b: T.let[T.float32] = qkv[t, hh * D + 2 * j + 1]
                    if hh < H + KVH:
                        if i % 2 == 0:
                            val[0] = a * cos[p, j] - b * sin[p, j]
                        else:
                            val[0] = a * sin[p, j] + b * cos[p, j]
                    else:
                        val[0] = qkv[t, hh * D + i]
                    red[i] = T.abs(val[0])  # every head takes part, so no sync sits inside a branch
                    for k in T.unroll(T.int64(LOG_D)):  # butterfly max over the head's D values
                        T.tvm_storage_sync("shared")
                        amax[0] = T.max(red[i], red[T.bitwise_xor(i, T.shift_left(T.int64(1), k))])
                        T.tvm_storage_sync("shared")
                        red[i] = amax[0]
                    amax[0] = T.max(amax[0] * T.float32(1.0 / 127.0), T.float32(1e-30))
                    if hh < H:
                        q[t, hh, i] = val[0]
                    else:
                        kv[p, hh - H, i] = T.Cast("int8", T.nearbyint(val[0] / amax[0]))
                        if i == 0:
                            sc[p, hh - H] = amax[0]

    return qkv_post_rows


def attn_rows(H: int, KVH: int, D: int, W: int, NT: int = 256):
    """attn_decode for T query rows at positions start.. (prefill, causal): one block per (row, head)."""
    from tvm.script import tirx as T

    G = H // KVH
    PARTS = NT // D
    ITER = (W + NT - 1) // NT
    PV_ITER = (W + PARTS - 1) // PARTS
    PV_U = 8 if PV_ITER % 8 == 0 else 1
    LOG_NT = NT.bit_length() - 1
    assert 1 << LOG_NT == NT
    qscale = 1.0 / float(D) ** 0.5
    assert NT % D == 0 and NT >= D

    @T.prim_func(private=True, s_tir=True)
    def attn_rows(var_q: T.handle, var_kv: T.handle, var_sc: T.handle, start: T.int64, var_out: T.handle):
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True})
        S, Tn = T.int64(), T.int64()
        q = T.match_buffer(var_q, (Tn, H, D), "float32")
        kv = T.match_buffer(var_kv, (S, 2 * KVH, D), "int8")
        sc = T.match_buffer(var_sc, (S, 2 * KVH), "float32")
        out = T.match_buffer(var_out, (Tn, H * D), "float32")
        for b in T.thread_binding(Tn * H, thread="blockIdx.x"):
            for tx in T.thread_binding(T.int64(NT), thread="threadIdx.x"):
                with T.sblock("attn"):
                    T.reads()
                    T.writes()
                    s_sh = T.sblock_alloc_buffer((W,), "float32", scope="shared")
                    q_sh = T.sblock_alloc_buffer((D,), "float32", scope="shared")
                    red = T.sblock_alloc_buffer((NT,), "float32", scope="shared")
                    acc = T.sblock_alloc_buffer((1,), "float32", scope="local")
                    mx = T.sblock_alloc_buffer((1,), "float32", scope="local")
                    den = T.sblock_alloc_buffer((1,), "float32", scope="local")
                    sv = T.sblock_alloc_buffer((ITER,), "float32", scope="local")
                    t: T.let[T.int64] = b // H
                    h: T.let[T.int64] = b % H
                    n: T.let[T.int64] = T.min(start + t + 1, T.int64(W))
                    kh: T.let[T.int64] = h // G
                    if tx < D:
                        q_sh[tx] = q[t, h, tx]
                    T.tvm_storage_sync("shared")
                    mx[0] = T.float32(-3.0e38)
                    for it in T.serial(T.int64(ITER)):
                        if it * NT + tx < n:
                            acc[0] = T.float32(0)
                            for d in T.unroll(T.int64(D)):  # unrolled: the row's loads issue back to back
                                acc[0] = acc[0] + q_sh[d] * T.Cast("float32", kv[it * NT + tx, kh, d])
                            sv[it] = acc[0] * sc[it * NT + tx, kh] * T.float32(qscale)
                            mx[0] = T.max(mx[0], sv[it])
                    red[tx] = mx[0]
                    for k in T.unroll(T.int64(LOG_NT)):  # butterfly: after log2(NT) steps every thread holds the max
                        T.tvm_storage_sync("shared")
                        mx[0] = T.max(red[tx], red[T.bitwise_xor(tx, T.shift_left(T.int64(1), k))])
                        T.tvm_storage_sync("shared")
                        red[tx] = mx[0]
                    T.tvm_storage_sync("shared")
                    acc[0] = T.float32(0)
                    for it in T.serial(T.int64(ITER)):
                        if it * NT + tx < n:
                            s_sh[it * NT + tx] = T.exp(sv[it] - mx[0])
                            acc[0] = acc[0] + T.exp(sv[it] - mx[0])
                    red[tx] = acc[0]
                    for k in T.unroll(T.int64(LOG_NT)):  # butterfly sum
                        T.tvm_storage_sync("shared")
                        den[0] = red[tx] + red[T.bitwise_xor(tx, T.shift_left(T.int64(1), k))]
                        T.tvm_storage_sync("shared")
                        red[tx] = den[0]
                    acc[0] = T.float32(0)
                    for io in T.serial(T.int64(PV_ITER // PV_U)):
                        for iu in T.unroll(T.int64(PV_U)):  # unrolled: PV_U positions' loads in flight at once
                            if (io * PV_U + iu) * PARTS + tx // D < n:
                                acc[0] = acc[0] + s_sh[(io * PV_U + iu) * PARTS + tx // D] * (
                                    T.Cast("float32", kv[(io * PV_U + iu) * PARTS + tx // D, KVH + kh, tx % D])
                                    * sc[(io * PV_U + iu) * PARTS + tx // D, KVH + kh])
                    T.tvm_storage_sync("shared")
                    red[tx] = acc[0]
                    T.tvm_storage_sync("shared")
                    if tx < D:
                        acc[0] = red[tx]
                        for k in T.serial(T.int64(PARTS - 1)):
                            acc[0] = acc[0] + red[(k + 1) * D + tx]
                        out[t, h * D + tx] = acc[0] / den[0]

    return attn_rows


# Q4_1 GEMV kernels for the decode step: one warp per output row (8 rows per 256-thread block), each lane
# dequantizing whole 32-bit words (8 nibbles) of its row; the input vector is staged once per block in shared
# memory with its prologue applied (RMSNorm, or SiLU(gate) * up) and the residual is added in the epilogue.

def rms_gemv(N: int, K: int, eps: float, NT: int = 256):
    """(x (1, K), norm weight (K,), qs (N, K/8) uint32, d, m (N, K/32) f16) -> (1, N) = W @ rmsnorm(x): the norm
    and the GEMV in one launch."""
    from tvm.script import tirx as T

    RPB, NW = NT // 32, K // 8
    WI, KI = (NW + 31) // 32, (K + NT - 1) // NT
    LOG_NT = NT.bit_length() - 1
    assert N % RPB == 0 and K % 32 == 0 and 1 << LOG_NT == NT

    @T.prim_func(private=True, s_tir=True)
    def rms_gemv(var_x: T.handle, var_nw: T.handle, var_qs: T.handle, var_d: T.handle, var_m: T.handle,
                 var_out: T.handle):
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True})
        x = T.match_buffer(var_x, (1, K), "float32")
        nw = T.match_buffer(var_nw, (K,), "float32")
        qs = T.match_buffer(var_qs, (N, NW), "uint32")
        d = T.match_buffer(var_d, (N, K // 32), "float16")
        m = T.match_buffer(var_m, (N, K // 32), "float16")
        out = T.match_buffer(var_out, (1, N), "float32")
        for b in T.thread_binding(T.int64(N // RPB), thread="blockIdx.x"):
            for tx in T.thread_binding(T.int64(NT), thread="threadIdx.x"):
                with T.sblock("gemv"):
                    T.reads()
                    T.writes()
                    xs = T.sblock_alloc_buffer((K,), "float32", scope="shared")
                    red = T.sblock_alloc_buffer((NT,), "float32", scope="shared")
                    acc = T.sblock_alloc_buffer((1,), "float32", scope="local")
                    ss = T.sblock_alloc_buffer((1,), "float32", scope="local")
                    ss[0] = T.float32(0)
                    for i in T.serial(T.int64(KI)):
                        if i * NT + tx < K:
                            ss[0] = ss[0] + x[0, i * NT + tx] * x[0, i * NT + tx]
                    red[tx] = ss[0]
                    for k in T.unroll(T.int64(LOG_NT)):
                        T.tvm_storage_sync("shared")
                        ss[0] = red[tx] + red[T.bitwise_xor(tx, T.shift_left(T.int64(1), k))]
                        T.tvm_storage_sync("shared")
                        red[tx] = ss[0]
                    for i in T.serial(T.int64(KI)):
                        if i * NT + tx < K:
                            xs[i * NT + tx] = x[0, i * NT + tx] / T.sqrt(ss[0] / T.float32(K) + T.float32(eps)) \
                                * nw[i * NT + tx]
                    T.tvm_storage_sync("shared")
                    n: T.let[T.int64] = b * RPB + tx // 32
                    lane: T.let[T.int64] = tx % 32
                    acc[0] = T.float32(0)
                    for it in T.serial(T.int64(WI)):
                        if it * 32 + lane < NW:
                            for e in T.unroll(T.int64(8)):
                                acc[0] = acc[0] + xs[(it * 32 + lane) * 8 + e] * (
                                    T.Cast("float32", d[n, (it * 32 + lane) // 4]) * T.Cast(
                                        "float32", T.bitwise_and(T.shift_right(qs[n, it * 32 + lane], T.Cast(
                                            "uint32", e * 4)), T.uint32(15)))
                                    + T.Cast("float32", m[n, (it * 32 + lane) // 4]))
                    T.tvm_storage_sync("shared")
                    red[tx] = acc[0]
                    for k in T.unroll(T.int64(5)):  # butterfly inside each warp's 32 lanes
                        T.tvm_storage_sync("shared")
                        acc[0] = red[tx] + red[T.bitwise_xor(tx, T.shift_left(T.int64(1), k))]
                        T.tvm_storage_sync("shared")
                        red[tx] = acc[0]
                    if lane == 0:
                        out[0, n] = acc[0]

    return rms_gemv


def gemv_add(N: int, K: int, swiglu: bool, NT: int = 256):
    """(x (1, K) or, with swiglu, gate|up (1, 2K); residual (1, N); qs, d, m) -> (1, N) = residual + W @ x'
    where x' = x, or silu(gate) * up: the activation, the GEMV and the residual add in one launch."""
    from tvm.script import tirx as T

    RPB, NW = NT // 32, K // 8
    WI, KI = (NW + 31) // 32, (K + NT - 1) // NT
    XK = 2 * K if swiglu else K
    assert N % RPB == 0 and K % 32 == 0

    @T.prim_func(private=True, s_tir=True)
    def gemv_add(var_x: T.handle, var_res: T.handle, var_qs: T.handle, var_d: T.handle, var_m: T.handle,
                 var_out: T.handle):
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True})
        x = T.match_buffer(var_x, (1, XK), "float32")
        res = T.match_buffer(var_res, (1, N), "float32")
        qs = T.match_buffer(var_qs, (N, NW), "uint32")
        d = T.match_buffer(var_d, (N, K // 32), "float16")
        m = T.match_buffer(var_m, (N, K // 32), "float16")
        out = T.match_buffer(var_out, (1, N), "float32")
        for b in T.thread_binding(T.int64(N // RPB), thread="blockIdx.x"):
            for tx in T.thread_binding(T.int64(NT), thread="threadIdx.x"):
                with T.sblock("gemv"):
                    T.reads()
                    T.writes()
                    xs = T.sblock_alloc_buffer((K,), "float32", scope="shared")
                    red = T.sblock_alloc_buffer((NT,), "float32", scope="shared")
                    acc = T.sblock_alloc_buffer((1,), "float32", scope="local")
                    for i in T.serial(T.int64(KI)):
                        if i * NT + tx < K:
                            if swiglu:
                                xs[i * NT + tx] = x[0, i * NT + tx] / (T.float32(1) + T.exp(-x[0, i * NT + tx])) \
                                    * x[0, K + i * NT + tx]
                            else:
                                xs[i * NT + tx] = x[0, i * NT + tx]
                    T.tvm_storage_sync("shared")
                    n: T.let[T.int64] = b * RPB + tx // 32
                    lane: T.let[T.int64] = tx % 32
                    acc[0] = T.float32(0)
                    for it in T.serial(T.int64(WI)):
                        if it * 32 + lane < NW:
                            for e in T.unroll(T.int64(8)):
                                acc[0] = acc[0] + xs[(it * 32 + lane) * 8 + e] * (
                                    T.Cast("float32", d[n, (it * 32 + lane) // 4]) * T.Cast(
                                        "float32", T.bitwise_and(T.shift_right(qs[n, it * 32 + lane], T.Cast(
                                            "uint32", e * 4)), T.uint32(15)))
                                    + T.Cast("float32", m[n, (it * 32 + lane) // 4]))
                    T.tvm_storage_sync("shared")
                    red[tx] = acc[0]
                    for k in T.unroll(T.int64(5)):
                        T.tvm_storage_sync("shared")
                        acc[0] = red[tx] + red[T.bitwise_xor(tx, T.shift_left(T.int64(1), k))]
                        T.tvm_storage_sync("shared")
                        red[tx] = acc[0]
                    if lane == 0:
                        out[0, n] = res[0, n] + acc[0]

    return gemv_add
