"""Export a Llama-family model to one ONNX graph for ONNX Runtime (CPU), INT4 weights, int8 KV cache.

One graph serves prefill (T tokens) and decode (T = 1).

Inputs
  input_ids     (T,)                  int64
  position_ids  (1, T)                int64   absolute positions P..P+T-1
  past_kv       (P, L, 2*KVH, D)      int8    the cache's live prefix: K heads then V heads per layer
  past_scale    (P, L, 2*KVH, 1)      float32 one scale per (token, layer, head)
  logits_from   (1,)                  int64   first position whose logits are returned (T-1: last only)
Outputs
  logits        (T - logits_from, V)  float32
  present_kv    (T, L, 2*KVH, D)      int8    new tokens' K/V, already quantized
  present_scale (T, L, 2*KVH, 1)      float32

KV quantization (in graph, per token and head): scale = max(absmax/127, 1e-30),
q = round_half_even(x/scale) as int8. The current tokens attend to their own K/V
*after* the int8 round trip, so a token's attention is the same whether its K/V
came from this call or from the cache (prefix reuse gives identical results).

The layout is token-major over everything (position, layer, head, dim) so the live
prefix cache[:P] is one contiguous view: the runtime passes it without a copy and
writes present_kv into cache[P:P+T] in place.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from runtime.backends.onnxruntime import ARCH_METADATA
from runtime.kv_cache import KV_SCALE_FLOOR

from . import quant
from .arch import GGUFModel, LlamaConfig, layer_tensor, rope_tables

log = logging.getLogger(__name__)

OPSET = 21


@dataclass
class ExportOptions:
    scheme: str = "q4_1-exact"  # linear layers: a key of quant.SCHEMES
    embedding: str = "q8_0"  # tied embedding / lm_head: q8_0 (exact from GGUF) or rtn-int4 (lm_head only)
    accuracy_level: int = 4  # MatMulNBits: 4 = int8 activations (fast path), 0 = fp32
    max_context: int = 2048  # RoPE table length; the KV cache is sized by the runtime
    # The KV cache's int8 quantizer: "quantizelinear" (one blocked QuantizeLinear, opset 21) or "round" (Div,
    # Round, Clip, Cast: the same arithmetic, bit-identical on the CPU EP, 3 more nodes a layer). ONNX Runtime's
    # CUDA EP places the int8 QuantizeLinear on the GPU but implements its blocked form for int4 only: the first
    # forward fails ("Unsupported quantization type", measured on an H200, docs/gpu.md), so CUDA boards get "round".
    kv_quantizer: str = "quantizelinear"


@dataclass
class ExportReport:
    worst_tensor: str = ""
    worst_max_abs: float = 0.0
    errors: dict = field(default_factory=dict)  # tensor -> quant.QuantError
    weight_bytes: int = 0
    n_nodes: int = 0
    exact: bool = False  # True: weights copied as stored (native), nothing re-rounded, no graph

    def summary(self) -> str:
        if self.exact:
            return f"{self.weight_bytes / 2**20:.1f} MiB of weights copied as stored (no re-rounding, no graph)"
        lm = self.errors.get("lm_head")
        return (f"{self.n_nodes} graph nodes; worst weight error {self.worst_max_abs:.3g} ({self.worst_tensor or '-'})"
                + (f", lm_head error {lm.max_abs:.3g}" if lm else ""))


class _Graph:
    """A tiny builder over onnx.helper: unique names, constants, nodes."""

    def __init__(self):
        from onnx import helper

        self.h = helper
        self.nodes = []
        self.inits = []
        self._n = 0
        self._consts: dict = {}

    def name(self, base: str) -> str:
        self._n += 1
        return f"{base}_{self._n}"

    def init(self, name: str, arr: np.ndarray) -> str:
        from onnx import numpy_helper

        arr = np.asarray(arr)
        self.inits.append(numpy_helper.from_array(arr if arr.flags.c_contiguous else arr.copy(), name))  # keeps 0-d
        return name

    def const(self, values, dtype=np.int64) -> str:
        arr = np.asarray(values, dtype)
        key = (arr.dtype.str, arr.shape, arr.tobytes())
        if key not in self._consts:
            self._consts[key] = self.init(self.name("c"), arr)
        return self._consts[key]

    def op(self, op_type: str, inputs, n_out: int = 1, domain: str = "", **attrs):
        outs = [self.name(op_type.lower()) for _ in range(n_out)]
        self.nodes.append(self.h.make_node(op_type, list(inputs), outs, name=self.name("n_" + op_type), domain=domain, **attrs))
        return outs[0] if n_out == 1 else outs


class _Linears:
    """Adds MatMulNBits layers (plus the exact Q4_1 block-min term) to a graph."""

    def __init__(self, g: _Graph, opts: ExportOptions, report: ExportReport):
        self.g, self.opts, self.report = g, opts, report

    def add(self, x: str, p: quant.PackedLinear, name: str) -> str:
        g = self.g
        ins = [x, g.init(name + ".qweight", p.qweight), g.init(name + ".scales", p.scales)]
        if p.zero_points is not None:
            ins.append(g.init(name + ".zero_points", p.zero_points))
        y = g.op("MatMulNBits", ins, domain="com.microsoft", K=p.K, N=p.N, bits=p.bits, block_size=p.block_size,
                 accuracy_level=self.opts.accuracy_level)
        if p.block_offset is not None:
            # W = d*(q-8) + c per block  =>  x @ W.T = x @ (d*(q-8)).T + blocksum(x) @ c.T   (exact in real arithmetic)
            xb = g.op("Reshape", [x, g.const([-1, p.n_blocks, p.block_size])])
            s = g.op("ReduceSum", [xb, g.const([-1])], keepdims=0)  # (T, K/32); MatMul + Add become one Gemm
            ct = g.init(name + ".block_offset_t", np.ascontiguousarray(p.block_offset.T))  # (K/32, N)
            y = g.op("Add", [y, g.op("MatMul", [s, ct])])
        self.report.weight_bytes += p.nbytes()
        return y


def _pack(model: GGUFModel, names: list[str], K: int, scheme: str, report: ExportReport) -> quant.PackedLinear:
    parts = []
    for n in names:
        t, raw = model.raw(n)
        p = quant.pack_tensor(t, raw, K, scheme, lambda n=n: model.dequantized(n))
        err = quant.error(p, model.dequantized(n))
        report.errors[n] = err
        if err.max_abs >= report.worst_max_abs:
            report.worst_tensor, report.worst_max_abs = n, err.max_abs
        parts.append(p)
    return parts[0] if len(parts) == 1 else quant.concat(parts)


def build_graph(model: GGUFModel, opts: ExportOptions, progress=None):
    """Return (onnx.ModelProto, ExportReport). progress(i, n, what) is called per layer."""
    import onnx
    from onnx import TensorProto as TP

    cfg = model.config
    if opts.scheme not in quant.SCHEMES:
        raise ValueError(f"unknown scheme {opts.scheme!r}; known: {', '.join(quant.SCHEMES)}")
    if opts.kv_quantizer not in ("quantizelinear", "round"):
        raise ValueError(f"unknown kv_quantizer {opts.kv_quantizer!r}; known: quantizelinear, round")
    if opts.embedding not in quant.EMBEDDING_SCHEMES:
        raise ValueError(f"unknown embedding scheme {opts.embedding!r}; known: {', '.join(quant.EMBEDDING_SCHEMES)}")
    if not cfg.tie_embeddings:
        raise NotImplementedError("untied output layers are not supported yet (SmolLM2 ties them)")
    report = ExportReport()
    g = _Graph()
    lin = _Linears(g, opts, report)
    H, KVH, D, L, C = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.n_layers, cfg.hidden
    G = cfg.group
    f32 = lambda name: np.asarray(model.dequantized(name), np.float32).reshape(-1)  # noqa: E731

    # --- token embedding: the Q8_0 table, shared with the tied lm_head when that stays 8-bit
    et, eraw = model.raw("token_embd.weight")
    if et != "Q8_0":  # a float source: quantize the table to Q8_0 blocks (lossy; the error is reported)
        import gguf

        eraw = gguf.quants.quantize(model.dequantized("token_embd.weight"), gguf.GGMLQuantizationType.Q8_0)
    emb = quant.from_q8_0(eraw, C)
    table = g.init("token_embd.qweight", emb.qweight)  # (V, C/32, 32) uint8 = q + 128
    escale = g.init("token_embd.scales_3d", emb.scales.reshape(cfg.vocab, -1, 1))
    rows = g.op("Gather", [table, "input_ids"], axis=0)  # (T, C/32, 32)
    rs = g.op("Gather", [escale, "input_ids"], axis=0)  # (T, C/32, 1)
    e = g.op("Mul", [g.op("Sub", [g.op("Cast", [rows], to=TP.FLOAT), g.const(128.0, np.float32)]), rs])
    h = g.op("Reshape", [e, g.const([-1, C])])  # (T, C) residual stream

    # --- once per call: the past in attention (head-major) layout, and the sequence lengths GQA wants
    past_t = g.op("Transpose", ["past_kv"], perm=[1, 2, 0, 3])  # (L, 2KVH, P, D) int8: one int8 pass
    scale_t = g.op("Transpose", ["past_scale"], perm=[1, 2, 0, 3])  # (L, 2KVH, P, 1)
    total = g.op("ReduceSum", [g.op("Concat", [g.op("Shape", ["past_kv"], start=0, end=1),
                                               g.op("Shape", ["input_ids"], start=0, end=1)], axis=0)], keepdims=1)
    total = g.op("Cast", [total], to=TP.INT32)  # (1,) P + T
    seqlens_k = g.op("Sub", [total, g.const([1], np.int32)])  # (1,) index of the last key
    total_len = g.op("Squeeze", [total])  # () P + T
    cos, sin = rope_tables(cfg, opts.max_context)
    cos_c, sin_c = g.init("rope.cos", cos), g.init("rope.sin", sin)
    q_scale = 1.0 / np.sqrt(D)
    fold_q_scale = float(np.log2(q_scale)).is_integer()
    presents, pscales = [], []
    x = g.op("SimplifiedLayerNormalization", [h, g.init("blk.0.attn_norm", f32(layer_tensor(0, "attn_norm")))],
             axis=-1, epsilon=cfg.norm_eps, stash_type=1)
    for i in range(L):
        if progress:
            progress(i, L, f"layer {i}")
        # attention
        qkv_p = _pack(model, [layer_tensor(i, n) for n in ("attn_q", "attn_k", "attn_v")], C, opts.scheme, report)
        if fold_q_scale:  # 1/sqrt(D) is a power of two: scaling d and the offset is exact
            qkv_p.scales[: H * D * (C // qkv_p.block_size)] *= np.float32(q_scale)
            if qkv_p.block_offset is not None:
                qkv_p.block_offset[: H * D] *= np.float32(q_scale)
        qkv = lin.add(x, qkv_p, f"blk.{i}.attn_qkv")  # (T, (H + 2KVH) D)
        qkv = g.op("Reshape", [qkv, g.const([1, -1, (H + 2 * KVH) * D])])  # (1, T, .): RoPE and GQA want a batch
        q, k, v = g.op("Split", [qkv, g.const([H * D, KVH * D, KVH * D])], n_out=3, axis=-1)
        q = g.op("RotaryEmbedding", [q, "position_ids", cos_c, sin_c], domain="com.microsoft", interleaved=1)
        k = g.op("RotaryEmbedding", [k, "position_ids", cos_c, sin_c], domain="com.microsoft", interleaved=1)
        kv = g.op("Reshape", [g.op("Concat", [k, v], axis=-1), g.const([-1, 1, 2 * KVH, D])])  # (T, 1, 2KVH, D)
        # int8 per (token, head): scale = max(absmax/127, floor); q = round_half_even(x / scale)
        amax = g.op("ReduceMax", [g.op("Abs", [kv]), g.const([-1])], keepdims=1)  # (T, 1, 2KVH, 1)
        scale = g.op("Max", [g.op("Mul", [amax, g.const(1.0 / 127.0, np.float32)]), g.const(KV_SCALE_FLOOR, np.float32)])
        if opts.kv_quantizer == "round":
            kv_q = g.op("Cast", [g.op("Clip", [g.op("Round", [g.op("Div", [kv, scale])]), g.const(-128.0, np.float32),
                                              g.const(127.0, np.float32)])], to=TP.INT8)
        else:
            kv_q = g.op("QuantizeLinear", [kv, scale], axis=3, block_size=D, output_dtype=TP.INT8)
        presents.append(kv_q)
        pscales.append(scale)
        # this call's tokens attend to their K/V after the int8 round trip, exactly as later tokens will see them
        kv_dq = g.op("Reshape", [g.op("Mul", [g.op("Cast", [kv_q], to=TP.FLOAT), scale]), g.const([1, -1, 2 * KVH * D])])
        k, v = g.op("Split", [kv_dq, g.const([KVH * D, KVH * D])], n_out=2, axis=-1)
        past = []
        for lo, hi in ((0, KVH), (KVH, 2 * KVH)):  # K heads, V heads of layer i: (1, KVH, P, D) float
            st, en, ax = g.const([i, lo]), g.const([i + 1, hi]), g.const([0, 1])
            # Cast + Mul: ORT's blocked DequantizeLinear is several times slower here (measured)
            past.append(g.op("Mul", [g.op("Cast", [g.op("Slice", [past_t, st, en, ax])], to=TP.FLOAT),
                                     g.op("Slice", [scale_t, st, en, ax])]))
        if not fold_q_scale:
            q = g.op("Mul", [q, g.const(q_scale, np.float32)])
        ctx = g.op("GroupQueryAttention", [q, k, v, past[0], past[1], seqlens_k, total_len], n_out=3,
                   domain="com.microsoft", num_heads=H, kv_num_heads=KVH, scale=1.0)[0]  # (1, T, H*D), causal
        ctx = g.op("Reshape", [ctx, g.const([-1, H * D])])
        o = lin.add(ctx, _pack(model, [layer_tensor(i, "attn_output")], H * D, opts.scheme, report), f"blk.{i}.attn_output")
        x, _, _, h = g.op("SkipSimplifiedLayerNormalization", [o, h, g.init(f"blk.{i}.ffn_norm", f32(layer_tensor(i, "ffn_norm")))],
                          n_out=4, domain="com.microsoft", epsilon=cfg.norm_eps)
        # feed-forward (SwiGLU)
        gu = lin.add(x, _pack(model, [layer_tensor(i, "ffn_gate"), layer_tensor(i, "ffn_up")], C, opts.scheme, report),
                     f"blk.{i}.ffn_gate_up")
        gate, up = g.op("Split", [gu, g.const([cfg.ffn, cfg.ffn])], n_out=2, axis=-1)
        act = g.op("Mul", [g.op("Mul", [gate, g.op("Sigmoid", [gate])]), up])
        f = lin.add(act, _pack(model, [layer_tensor(i, "ffn_down")], cfg.ffn, opts.scheme, report), f"blk.{i}.ffn_down")
        nxt = f"blk.{i + 1}.attn_norm" if i + 1 < L else "output_norm"
        nxt_w = f32(layer_tensor(i + 1, "attn_norm")) if i + 1 < L else f32("output_norm.weight")
        x, _, _, h = g.op("SkipSimplifiedLayerNormalization", [f, h, g.init(nxt, nxt_w)], n_out=4, domain="com.microsoft",
                          epsilon=cfg.norm_eps)
    # --- head: logits only from logits_from on (T-1: the last position)
    last = g.op("Slice", [x, "logits_from", g.const([np.iinfo(np.int64).max]), g.const([0])])
    if opts.embedding == "q8_0":
        head = emb
        ins = [last, table, g.init("lm_head.scales", emb.scales)]
    else:
        head = quant.rtn_int4(model.dequantized("token_embd.weight"))
        ins = [last, g.init("lm_head.qweight", head.qweight), g.init("lm_head.scales", head.scales),
               g.init("lm_head.zero_points", head.zero_points)]
    report.errors["lm_head"] = quant.error(head, model.dequantized("token_embd.weight"))
    g.nodes.append(g.h.make_node("MatMulNBits", ins, ["logits"], name="lm_head", domain="com.microsoft", K=C, N=cfg.vocab,
                                 bits=head.bits, block_size=head.block_size, accuracy_level=opts.accuracy_level))
    report.weight_bytes += head.nbytes()
    g.nodes.append(g.h.make_node("Concat", presents, ["present_kv"], axis=1, name="present_kv"))
    g.nodes.append(g.h.make_node("Concat", pscales, ["present_scale"], axis=1, name="present_scale"))

    vi = g.h.make_tensor_value_info
    inputs = [
        vi("input_ids", TP.INT64, ["T"]),
        vi("position_ids", TP.INT64, [1, "T"]),
        vi("past_kv", TP.INT8, ["P", L, 2 * KVH, D]),
        vi("past_scale", TP.FLOAT, ["P", L, 2 * KVH, 1]),
        vi("logits_from", TP.INT64, [1]),
    ]
    outputs = [
        vi("logits", TP.FLOAT, ["N", cfg.vocab]),
        vi("present_kv", TP.INT8, ["T", L, 2 * KVH, D]),
        vi("present_scale", TP.FLOAT, ["T", L, 2 * KVH, 1]),
    ]
    graph = g.h.make_graph(g.nodes, "boardtalk_llama", inputs, outputs, g.inits)
    m = g.h.make_model(graph, opset_imports=[g.h.make_opsetid("", OPSET), g.h.make_opsetid("com.microsoft", 1)],
                       producer_name="boardtalk")
    m.ir_version = 10
    # The architecture the graph was built for, inside the hashed graph: the loader requires the
    # manifest's to equal it, so an edited manifest cannot describe a different model than it runs.
    g.h.set_model_props(m, {ARCH_METADATA: json.dumps(cfg.to_dict(), sort_keys=True)})
    report.n_nodes = len(g.nodes)
    if progress:
        progress(L, L, "graph built")
    log.info("graph: %d nodes, %.1f MiB of weights; worst quantization error %.3g in %s", len(g.nodes),
             report.weight_bytes / 2**20, report.worst_max_abs, report.worst_tensor)
    return m, report


def save(model_proto, out_dir: Path, name: str = "model.onnx") -> list[str]:
    """Save graph + one external data file; returns the file names written."""
    import onnx

    out_dir.mkdir(parents=True, exist_ok=True)
    data = name + ".data"
    for p in (out_dir / name, out_dir / data):
        if p.exists():
            p.unlink()
    onnx.save_model(model_proto, str(out_dir / name), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=data, size_threshold=1024)
    return [name, data]
