"""SmolLM2 (Llama) in ``tvm.relax.frontend.nn`` for the tvm backend: GGUF blocks in, fused kernels out.

Weights are the GGUF's own blocks, split into arrays without re-rounding (models/tvm_build.py):
  Q4_1 linear (N, K):  qs (N, K/8) uint32, element k in bits 4*(k%8).. of word k//8 (the GGUF block keeps
                       element j in byte j's low nibble and j + 16 in its high one: nibbles moved, values not),
                       d, m (N, K/32) float16 (the blocks' own f16 bits)   w = d * q + m
  Q8_0 embedding (V, C): qs (V, C) int8, d (V, C/32) float16   w = d * q
Q, K and V rows are stacked into one matrix, gate and up into another (rows moved, bytes unchanged), so a
decoder block is two GEMVs fewer. Every linear layer is one TE function with a dequantize stage and a
reduction; dlight's GEMV/Matmul schedules inline the dequantize into the reduction (one kernel, the
weights read once as 4-bit).

The int8 KV cache (one scale per (position, head), K heads then V heads) lives on the GPU, one tensor per
layer: kv[i] (S, 2*KVH, D) int8 and sc[i] (S, 2*KVH) float32, written in place at rows [start, start + T)
(``call_tir_inplace``) and read by attention, which dequantizes on the fly.

Exported functions (all take the parameters after these inputs, see ``export``):
  prefill(ids (T,) int32, rows (R,) int32, cos, sin (P, D/2) float32, kv..., sc..., start)
        -> logits (R, vocab) float32 of hidden rows ``rows`` (0 <= rows < T)
  decode(ids (1,) int32, ...)   the same with T = 1 and R = 1 (static shapes: the GEMV schedules)
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

QK = 32  # GGUF block size (Q4_1, Q8_0)
NEG_INF = -3.0e38


@dataclass(frozen=True)
class Dims:
    n_layers: int
    hidden: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    norm_eps: float

    @classmethod
    def of(cls, cfg) -> "Dims":
        return cls(cfg.n_layers, cfg.hidden, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.ffn, cfg.vocab,
                   float(cfg.norm_eps))


def param_names(d: Dims) -> list[str]:
    """The parameters in the order the exported functions take them (after the inputs)."""
    names = ["embd.qs", "embd.d"]
    for i in range(d.n_layers):
        for w in ("qkv", "o", "gate_up", "down"):
            names += [f"l{i}.{w}.qs", f"l{i}.{w}.d", f"l{i}.{w}.m"]
        names += [f"l{i}.attn_norm", f"l{i}.ffn_norm"]
    return names + ["out_norm"]


def build_ir(d: Dims, max_ctx: int, windows: list[int], cuda: bool = False):
    """(IRModule, [(name, nn.Parameter)]) of the model; import-time heavy (tvm)."""
    from tvm import te, tirx as tir
    from tvm.relax.frontend import nn
    from tvm.relax.frontend.nn import op
    from tvm.script import tirx as T

    f32, f16 = "float32", "float16"
    C, H, KVH, D, F, V = d.hidden, d.n_heads, d.n_kv_heads, d.head_dim, d.ffn, d.vocab
    G = H // KVH
    HALF = D // 2
    eps = d.norm_eps
    qscale = 1.0 / float(D) ** 0.5

    # ---- TE kernels ---------------------------------------------------------------------------------
    def q4_linear(x, qs, sd, sm):  # x (T, K) f32 -> (T, N) f32
        T_, K = x.shape
        N = qs.shape[0]

        def w(n, k):
            q = (qs[n, k // 8] >> (tir.const(4, "uint32") * (k % 8).astype("uint32"))) & tir.const(15, "uint32")
            return sd[n, k // QK].astype(f32) * q.astype(f32) + sm[n, k // QK].astype(f32)

        W = te.compute((N, K), w, name="dequant")
        r = te.reduce_axis((0, K), name="k")
        return te.compute((T_, N), lambda t, n: te.sum(x[t, r] * W[n, r], axis=r), name="matmul")

    def q4_linear_swiglu(gu, qs, sd, sm):  # the down projection of silu(gate) * up: (T, 2F) -> (T, N), one kernel
        x = swiglu(gu)
        return q4_linear(x, qs, sd, sm)

    def gather_rows(x, rows):  # (T, C), (R,) -> (R, C)
        return te.compute((rows.shape[0], C), lambda t, c: x[rows[t], c], name="gather")

    def q8_logits(x, qs, sd):  # (R, C) -> (R, V) f32; the tied Q8_0 output layer
        R = x.shape[0]
        W = te.compute((V, C), lambda v, c: sd[v, c // QK].astype(f32) * qs[v, c].astype(f32), name="dequant")
        r = te.reduce_axis((0, C), name="k")
        return te.compute((R, V), lambda t, v: te.sum(x[t, r] * W[v, r], axis=r), name="matmul")

    def embed(ids, qs, sd):  # (T,) -> (T, C) f32
        return te.compute((ids.shape[0], C), lambda t, c: sd[ids[t], c // QK].astype(f32) * qs[ids[t], c].astype(f32),
                          name="embed")

    def rms_norm(x, w):  # x (T, C) f32, w (C,) f32
        r = te.reduce_axis((0, C), name="c")
        ss = te.compute((x.shape[0],), lambda t: te.sum(x[t, r] * x[t, r], axis=r), name="ss")
        return te.compute(x.shape, lambda t, c: x[t, c] / te.sqrt(ss[t] / tir.const(C, f32) + tir.const(eps, f32))
                          * w[c], name="rms")

    def at(start, t):  # the position of row t: start + t, start a symbolic int or a (1,) int32 tensor
        return start[0].astype("int64") + t if isinstance(start, te.Tensor) else start + t

    def rope_q(qkv, cos, sin, start):  # q (T, H, D) f32 rotated, adjacent pairs
        def f(t, h, i):
            j = i // 2
            a, b = qkv[t, h * D + 2 * j], qkv[t, h * D + 2 * j + 1]
            c, s = cos[at(start, t), j], sin[at(start, t), j]
            return tir.if_then_else(i % 2 == 0, a * c - b * s, a * s + b * c)

        return te.compute((qkv.shape[0], H, D), f, name="rope_q")

    def kv_quant(qkv, cos, sin, start):  # -> codes (T, 2KVH, D) int8, scales (T, 2KVH) f32 (K rotated)
        T_ = qkv.shape[0]

        def val(t, h, i):
            j = i // 2
            base = C + h * D  # K heads then V heads follow Q in the stacked rows
            a, b = qkv[t, base + 2 * j], qkv[t, base + 2 * j + 1]
            c, s = cos[at(start, t), j], sin[at(start, t), j]
            rot = tir.if_then_else(i % 2 == 0, a * c - b * s, a * s + b * c)
            return tir.if_then_else(h < KVH, rot, qkv[t, base + i])

        x = te.compute((T_, 2 * KVH, D), val, name="kv_val")
        r = te.reduce_axis((0, D), name="d")
        amax = te.compute((T_, 2 * KVH), lambda t, h: te.max(te.abs(x[t, h, r]), axis=r), name="amax")
        scale = te.compute((T_, 2 * KVH), lambda t, h: te.max(amax[t, h] * tir.const(1.0 / 127.0, f32),
                                                              tir.const(1e-30, f32)), name="scale")
        codes = te.compute((T_, 2 * KVH, D), lambda t, h, i: tir.nearbyint(x[t, h, i] / scale[t, h]).astype("int8"),
                           name="codes")
        return codes, scale

    def attention(q, kv, sc, start):  # q (T, H, D); kv (S, 2KVH, D) int8 -> (T, H*D) f32
        T_ = q.shape[0]
        n = start + T_
        p = te.reduce_axis((0, D), name="d")
        # scores: scale applied after the dot (the codes share one scale per position and head)
        dot = te.compute((H, T_, n), lambda h, t, j: te.sum(q[t, h, p] * kv[j, h // G, p].astype(f32), axis=p),
                         name="qk")
        sco = te.compute((H, T_, n), lambda h, t, j: tir.if_then_else(
            j <= start + t, dot[h, t, j] * sc[j, h // G] * tir.const(qscale, f32), tir.const(NEG_INF, f32)),
                         name="score")
        k1 = te.reduce_axis((0, n), name="j")
        mx = te.compute((H, T_), lambda h, t: te.max(sco[h, t, k1], axis=k1), name="smax")
        e = te.compute((H, T_, n), lambda h, t, j: te.exp(sco[h, t, j] - mx[h, t]), name="sexp")
        k2 = te.reduce_axis((0, n), name="j")
        den = te.compute((H, T_), lambda h, t: te.sum(e[h, t, k2], axis=k2), name="ssum")
        k3 = te.reduce_axis((0, n), name="j")
        o = te.compute((T_, H, D), lambda t, h, i: te.sum(
            e[h, t, k3] * (kv[k3, KVH + h // G, i].astype(f32) * sc[k3, KVH + h // G]), axis=k3), name="pv")
        return te.compute((T_, H * D), lambda t, c: o[t, c // D, c % D] / den[c // D, t], name="ctx")

    def dec_scores(q, kv, sc, pos, W):  # q (1, H, D); W = cache rows scanned (static) -> scores (H, W), masked
        p = te.reduce_axis((0, D), name="d")
        dot = te.compute((H, W), lambda h, j: te.sum(q[0, h, p] * kv[j, h // G, p].astype(f32), axis=p), name="qk")
        return te.compute((H, W), lambda h, j: tir.if_then_else(
            j <= pos[0].astype("int64"), dot[h, j] * sc[j, h // G] * tir.const(qscale, f32), tir.const(NEG_INF, f32)),
                          name="score")

    def softmax(sco):  # (H, W) -> (H, W)
        W = sco.shape[1]
        k1 = te.reduce_axis((0, W), name="j")
        mx = te.compute((H,), lambda h: te.max(sco[h, k1], axis=k1), name="smax")
        e = te.compute((H, W), lambda h, j: te.exp(sco[h, j] - mx[h]), name="sexp")
        k2 = te.reduce_axis((0, W), name="j")
        den = te.compute((H,), lambda h: te.sum(e[h, k2], axis=k2), name="ssum")
        return te.compute((H, W), lambda h, j: e[h, j] / den[h], name="prob")

    PV_CHUNK = 32

    def dec_pv(pr, kv, sc):  # (H, W) probabilities -> (1, H*D) over the first W cache rows
        W = pr.shape[1]
        nc = (W + PV_CHUNK - 1) // PV_CHUNK
        k = te.reduce_axis((0, PV_CHUNK), name="j")

        def part(h, c, i):  # rows [c*32, c*32 + 32) of one chunk: many threads, short loops
            j = c * PV_CHUNK + k
            jj = tir.min(j, W - 1)
            return te.sum(tir.if_then_else(j < W, pr[h, jj] * (kv[jj, KVH + h // G, i].astype(f32) *
                                                               sc[jj, KVH + h // G]), tir.const(0, f32)), axis=k)

        partial = te.compute((H, nc, D), part, name="pv_part")
        c = te.reduce_axis((0, nc), name="c")
        o = te.compute((H, D), lambda h, i: te.sum(partial[h, c, i], axis=c), name="pv")
        return te.compute((1, H * D), lambda t, x: o[x // D, x % D], name="ctx")

    def swiglu(gu):  # (T, 2F) -> (T, F)
        return te.compute((gu.shape[0], F), lambda t, i: gu[t, i] / (tir.const(1, f32) + te.exp(-gu[t, i])) * gu[t, F + i],
                          name="swiglu")

    def add(a, b):
        return te.compute(a.shape, lambda *i: a(*i) + b(*i), name="add")

    @T.prim_func(private=True, s_tir=True)
    def kv_write(var_kv: T.handle, var_sc: T.handle, var_codes: T.handle, var_scales: T.handle, start: T.int64):
        T.func_attr({"tir.noalias": True})
        S, Tn = T.int64(), T.int64()
        kv = T.match_buffer(var_kv, (S, 2 * KVH, D), "int8")
        sc = T.match_buffer(var_sc, (S, 2 * KVH), f32)
        codes = T.match_buffer(var_codes, (Tn, 2 * KVH, D), "int8")
        scales = T.match_buffer(var_scales, (Tn, 2 * KVH), f32)
        for t, h, i in T.grid(Tn, 2 * KVH, D):
            with T.sblock("write"):
                vt, vh, vi = T.axis.remap("SSS", [t, h, i])
                kv[start + vt, vh, vi] = codes[vt, vh, vi]
                if vi == 0:
                    sc[start + vt, vh] = scales[vt, vh]

    @T.prim_func(private=True, s_tir=True)
    def kv_write_at(var_kv: T.handle, var_sc: T.handle, var_codes: T.handle, var_scales: T.handle, var_pos: T.handle):
        T.func_attr({"tir.noalias": True})
        S = T.int64()
        kv = T.match_buffer(var_kv, (S, 2 * KVH, D), "int8")
        sc = T.match_buffer(var_sc, (S, 2 * KVH), f32)
        codes = T.match_buffer(var_codes, (1, 2 * KVH, D), "int8")
        scales = T.match_buffer(var_scales, (1, 2 * KVH), f32)
        pos = T.match_buffer(var_pos, (1,), "int32")
        for h, i in T.grid(2 * KVH, D):
            with T.sblock("write"):
                vh, vi = T.axis.remap("SS", [h, i])
                kv[T.Cast("int64", pos[0]), vh, vi] = codes[0, vh, vi]
                if vi == 0:
                    sc[T.Cast("int64", pos[0]), vh] = scales[0, vh]

    if cuda:
        from .tvm_kernels import attn_decode, attn_rows, qkv_post, qkv_post_rows

        post_kernel, post_rows_kernel = qkv_post(H, KVH, D), qkv_post_rows(H, KVH, D)
        attn_kernels = {w: attn_decode(H, KVH, D, w) for w in windows}
        attn_rows_kernel = attn_rows(H, KVH, D, max_ctx)
        from .tvm_kernels import gemv_add, rms_gemv

        gemv_kernels = {"qkv": rms_gemv((H + 2 * KVH) * D, C, eps), "o": gemv_add(C, H * D, False),
                        "gate_up": rms_gemv(2 * F, C, eps), "down": gemv_add(C, F, True)}

    # ---- the module -----------------------------------------------------------------------------------
    class Q4Linear(nn.Module):
        def __init__(self, n: int, k: int):
            self.qs = nn.Parameter((n, k // 8), "uint32")
            self.d = nn.Parameter((n, k // QK), f16)
            self.m = nn.Parameter((n, k // QK), f16)

        def forward(self, x):
            return op.tensor_expr_op(q4_linear, "q4_linear", [x, self.qs, self.d, self.m])

        def swiglu_forward(self, gu):
            return op.tensor_expr_op(q4_linear_swiglu, "q4_linear_swiglu", [gu, self.qs, self.d, self.m])

    class Layer(nn.Module):
        def __init__(self):
            self.qkv = Q4Linear((H + 2 * KVH) * D, C)
            self.o = Q4Linear(C, H * D)
            self.gate_up = Q4Linear(2 * F, C)
            self.down = Q4Linear(C, F)
            self.attn_norm = nn.Parameter((C,), f32)
            self.ffn_norm = nn.Parameter((C,), f32)

        def forward(self, h, cos, sin, kv, sc, start):
            x = op.tensor_expr_op(rms_norm, "rms_norm", [h, self.attn_norm])
            qkv = self.qkv(x)
            if cuda:  # the hand kernels, one block per (row, head): models/tvm_kernels.py
                T_ = h.shape[0]
                q, kv, sc = op.tensor_ir_inplace_op(
                    post_rows_kernel, "qkv_post_rows", [qkv, cos, sin, kv, sc, start], [-1, 3, 4],
                    [nn.Tensor.placeholder((T_, H, D), f32), nn.Tensor.placeholder(kv.shape, "int8"),
                     nn.Tensor.placeholder(sc.shape, f32)])
                ctx = op.tensor_ir_op(attn_rows_kernel, "attn_rows", [q, kv, sc, start],
                                      nn.Tensor.placeholder((T_, H * D), f32))
            else:
                q = op.tensor_expr_op(rope_q, "rope_q", [qkv, cos, sin, start])
                codes, scales = op.tensor_expr_op(kv_quant, "kv_quant", [qkv, cos, sin, start])
                kv, sc = op.tensor_ir_inplace_op(kv_write, "kv_write", [kv, sc, codes, scales, start], [0, 1],
                                                 [nn.Tensor.placeholder(kv.shape, "int8"),
                                                  nn.Tensor.placeholder(sc.shape, f32)])
                ctx = op.tensor_expr_op(attention, "attention", [q, kv, sc, start])
            h = op.tensor_expr_op(add, "add", [h, self.o(ctx)])
            x = op.tensor_expr_op(rms_norm, "rms_norm", [h, self.ffn_norm])
            gu = op.tensor_expr_op(swiglu, "swiglu", [self.gate_up(x)])  # (prefill: fused into the GEMM it was slower)
            return op.tensor_expr_op(add, "add", [h, self.down(gu)]), kv, sc

        def step(self, h, cos, sin, kv, sc, pos, window: int):
            """One token at position pos[0] (a device tensor: every shape static, so the whole step can be
            captured in one CUDA graph); attention scans the first `window` cache rows, masked beyond pos."""
            if cuda:  # hand-scheduled kernels (models/tvm_kernels.py): 6 launches per layer
                qkv = op.tensor_ir_op(gemv_kernels["qkv"], "rms_gemv_qkv",
                                      [h, self.attn_norm, self.qkv.qs, self.qkv.d, self.qkv.m],
                                      nn.Tensor.placeholder((1, (H + 2 * KVH) * D), f32))
                q, kv, sc = op.tensor_ir_inplace_op(
                    post_kernel, "qkv_post", [qkv, cos, sin, pos, kv, sc], [-1, 4, 5],
                    [nn.Tensor.placeholder((1, H, D), f32), nn.Tensor.placeholder(kv.shape, "int8"),
                     nn.Tensor.placeholder(sc.shape, f32)])
                ctx = op.tensor_ir_op(attn_kernels[window], f"attn_decode{window}", [q, kv, sc, pos],
                                      nn.Tensor.placeholder((1, H * D), f32))
                h = op.tensor_ir_op(gemv_kernels["o"], "gemv_add_o", [ctx, h, self.o.qs, self.o.d, self.o.m],
                                    nn.Tensor.placeholder((1, C), f32))
                gu = op.tensor_ir_op(gemv_kernels["gate_up"], "rms_gemv_gate_up",
                                     [h, self.ffn_norm, self.gate_up.qs, self.gate_up.d, self.gate_up.m],
                                     nn.Tensor.placeholder((1, 2 * F), f32))
                h = op.tensor_ir_op(gemv_kernels["down"], "gemv_add_down",
                                    [gu, h, self.down.qs, self.down.d, self.down.m], nn.Tensor.placeholder((1, C), f32))
                return h, kv, sc
            x = op.tensor_expr_op(rms_norm, "rms_norm", [h, self.attn_norm])
            qkv = self.qkv(x)
            q = op.tensor_expr_op(rope_q, "rope_q", [qkv, cos, sin, pos])
            codes, scales = op.tensor_expr_op(kv_quant, "kv_quant", [qkv, cos, sin, pos])
            kv, sc = op.tensor_ir_inplace_op(kv_write_at, "kv_write_at", [kv, sc, codes, scales, pos], [0, 1],
                                             [nn.Tensor.placeholder(kv.shape, "int8"),
                                              nn.Tensor.placeholder(sc.shape, f32)])
            sco = op.tensor_expr_op(functools.partial(dec_scores, W=window), f"dec_scores{window}",
                                    [q, kv, sc, pos])
            pr = op.tensor_expr_op(softmax, "softmax", [sco])
            ctx = op.tensor_expr_op(dec_pv, "dec_pv", [pr, kv, sc])
            h = op.tensor_expr_op(add, "add", [h, self.o(ctx)])
            x = op.tensor_expr_op(rms_norm, "rms_norm", [h, self.ffn_norm])
            return op.tensor_expr_op(add, "add", [h, self.down.swiglu_forward(self.gate_up(x))]), kv, sc

    class Model(nn.Module):
        def __init__(self):
            self.embd_qs = nn.Parameter((V, C), "int8")
            self.embd_d = nn.Parameter((V, C // QK), f16)
            self.layers = nn.ModuleList([Layer() for _ in range(d.n_layers)])
            self.out_norm = nn.Parameter((C,), f32)

        def _run(self, ids, rows, cos, sin, kvs, scs, start):
            h = op.tensor_expr_op(embed, "embed", [ids, self.embd_qs, self.embd_d])
            outs = []
            for layer, kv, sc in zip(self.layers, kvs, scs):
                h, kv, sc = layer(h, cos, sin, kv, sc, start)
                outs += [kv, sc]
            x = op.tensor_expr_op(rms_norm, "rms_norm", [h, self.out_norm])
            x = op.tensor_expr_op(gather_rows, "gather_rows", [x, rows])
            logits = op.tensor_expr_op(q8_logits, "logits", [x, self.embd_qs, self.embd_d])
            return logits, outs

        def prefill(self, ids, rows, cos, sin, kvs, scs, start):
            return self._run(ids, rows, cos, sin, kvs, scs, start)

        def _step(self, ids, pos, cos, sin, kvs, scs, window):
            h = op.tensor_expr_op(embed, "embed", [ids, self.embd_qs, self.embd_d])
            outs = []
            for layer, kv, sc in zip(self.layers, kvs, scs):
                h, kv, sc = layer.step(h, cos, sin, kv, sc, pos, window)
                outs += [kv, sc]
            x = op.tensor_expr_op(rms_norm, "rms_norm", [h, self.out_norm])
            return op.tensor_expr_op(q8_logits, "logits", [x, self.embd_qs, self.embd_d]), outs

    from tvm.relax.frontend.nn import spec

    L = d.n_layers
    def decode_fn(w):
        def decode(self, ids, pos, cos, sin, kvs, scs):
            return self._step(ids, pos, cos, sin, kvs, scs, w)

        return decode

    for w in windows:  # one decode function per attention window (static shapes: one CUDA graph each)
        setattr(Model, f"decode{w}", decode_fn(w))

    def cache_spec():
        return {"cos": spec.Tensor([max_ctx, HALF], f32), "sin": spec.Tensor([max_ctx, HALF], f32),
                "kvs": [spec.Tensor([max_ctx, 2 * KVH, D], "int8") for _ in range(L)],
                "scs": [spec.Tensor([max_ctx, 2 * KVH], f32) for _ in range(L)]}

    specs = {"prefill": {"ids": spec.Tensor(["T"], "int32"), "rows": spec.Tensor(["R"], "int32"), **cache_spec(),
                         "start": spec.Int()}}
    for w in windows:
        specs[f"decode{w}"] = {"ids": spec.Tensor([1], "int32"), "pos": spec.Tensor([1], "int32"), **cache_spec()}
    model = Model()
    mod, params = model.export_tvm(spec=specs)
    return mod, params


def windows_for(max_ctx: int) -> list[int]:
    """Decode attention windows: powers of two from 128 up to max_ctx (a step scans at most twice the rows it needs)."""
    out, w = [], 128
    while w < max_ctx:
        out.append(w)
        w *= 2
    return out + [max_ctx]
