/* boardtalk native backend: a Llama forward pass over GGUF Q4_1 / Q8_0 blocks (regrouped 8 rows
 * at a time by the artifact builder, never re-rounded), with the int8 KV cache written in place.
 *
 * Why it exists: through ONNX Runtime the decoder is ~1500 small graph nodes and a decode
 * step of SmolLM2-135M spends more time dispatching them than reading weights (see
 * docs/performance.md). Here one call runs the whole model: activations are quantized to
 * int8 blocks of 32 (d, d*sum) once per matrix, and each weight block is used as stored
 * (w = d*q + m), so no weight is ever re-rounded.
 *
 * Layouts:
 *   weights: Q4_1x8 / Q8_0x8 row groups, described at the matrix kernels below
 *   KV cache: kv (L, max_seq, 2*KVH, D) int8, scale (L, max_seq, 2*KVH) float32 (layer-major: a
 *             layer's positions are contiguous, so attention streams them; token-major also works),
 *             K heads first, scale = max(absmax/127, 1e-30), q = round-half-even(x/scale)
 *   rope cos/sin: (max_pos, D/2) float32, adjacent pairs (x[2i], x[2i+1]) rotated
 * Threads: OpenMP over 8-row groups of each matrix; attention over (token, KV head) pairs in prefill
 * and over (KV head, 32-position chunk) in decode. The thread count is fixed when the scratch is made
 * (bt_scratch_new) and passed with num_threads(...) to every parallel region, so OMP_NUM_THREADS or
 * another caller's omp_set_num_threads cannot change it, and omp_get_thread_num() < the scratch's
 * n_threads always (per-thread buffers are sized from it).
 * State: none global. Everything a call mutates lives in its scratch (buffers, profile timers), so
 * two threads may run bt_forward at once on different scratches.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#include <immintrin.h>
#define BT_AVX2 1
#elif defined(__ARM_NEON) && defined(__aarch64__)
#include <arm_neon.h>
#define BT_NEON 1
#endif

#define QK 32
#define KV_SCALE_FLOOR 1e-30f

typedef struct {
    int32_t n_layers, hidden, n_heads, n_kv_heads, head_dim, ffn, vocab, max_seq;
    float norm_eps;
    float q_scale;          /* 1/sqrt(head_dim) */
    int32_t kv_layer_major; /* cache layout: 1 = (L, max_seq, 2*KVH, D), 0 = (max_seq, L, 2*KVH, D) */
} bt_config;

typedef struct { /* pointers into the mmapped weights file, per layer arrays of L entries */
    const uint8_t *tok_embd;     /* Q8_0x8 (vocab, hidden): embedding and tied output layer */
    const float *output_norm;    /* (hidden) */
    const float *rope_cos, *rope_sin;
    const float **attn_norm, **ffn_norm;
    const uint8_t **wq, **wk, **wv, **wo, **wgate, **wup, **wdown; /* Q4_1x8 */
} bt_weights;

typedef struct { float d, s; int8_t qs[QK]; } block_q8; /* activations: s = d * sum(qs) */

/* Optional phase timers (bt_profile), per scratch: seconds spent in each part of bt_forward since the last reset. */
enum { P_QKV, P_ATTN, P_O, P_GATE_UP, P_DOWN, P_LM_HEAD, P_OTHER, P_N };
#ifdef _OPENMP
#define NOW() omp_get_wtime()
#else
#include <time.h>
static double NOW(void) { struct timespec ts; clock_gettime(CLOCK_MONOTONIC, &ts); return ts.tv_sec + 1e-9 * ts.tv_nsec; }
#endif

static inline float f16_to_f32(uint16_t h) {
#if defined(BT_AVX2)
    return _cvtsh_ss(h);
#elif defined(BT_NEON)
    __fp16 f;
    memcpy(&f, &h, 2);
    return (float)f;
#else
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0) {
        if (man == 0) { bits = sign; }
        else { exp = 127 - 15 + 1; while (!(man & 0x400)) { man <<= 1; exp--; } man &= 0x3ff; bits = sign | (exp << 23) | (man << 13); }
    } else if (exp == 31) { bits = sign | 0x7f800000 | (man << 13); }
    else { bits = sign | ((exp + 127 - 15) << 23) | (man << 13); }
    float f; memcpy(&f, &bits, 4); return f;
#endif
}

static inline uint16_t rd16(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return v; }

/* ---------------------------------------------------------------- activation quantization */
static void quantize_q8(const float *x, block_q8 *y, int K) {
#if defined(BT_AVX2)
    /* same arithmetic as the scalar loop below (cvtps rounds half to even, like lrintf) */
    const __m256 signbit = _mm256_set1_ps(-0.f);
    for (int b = 0; b < K / QK; b++) {
        const float *xb = x + b * QK;
        __m256 v[4], mx = _mm256_setzero_ps();
        for (int j = 0; j < 4; j++) {
            v[j] = _mm256_loadu_ps(xb + 8 * j);
            mx = _mm256_max_ps(mx, _mm256_andnot_ps(signbit, v[j]));
        }
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        const float amax = _mm_cvtss_f32(m4);
        const float d = amax / 127.f, id = d > 0.f ? 1.f / d : 0.f;
        const __m256 idv = _mm256_set1_ps(id);
        __m256i q[4], sum = _mm256_setzero_si256();
        for (int j = 0; j < 4; j++) {
            q[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], idv));
            sum = _mm256_add_epi32(sum, q[j]);
        }
        /* pack 32 x int32 -> 32 x int8 in order (packs work per 128-bit lane: fix with a permute) */
        __m256i p16a = _mm256_packs_epi32(q[0], q[1]), p16b = _mm256_packs_epi32(q[2], q[3]);
        __m256i p8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(p16a, p16b), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i *)y[b].qs, p8);
        __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
        s4 = _mm_hadd_epi32(s4, s4);
        s4 = _mm_hadd_epi32(s4, s4);
        y[b].d = d;
        y[b].s = d * (float)_mm_cvtsi128_si32(s4);
    }
    return;
#elif defined(BT_NEON)
    for (int b = 0; b < K / QK; b++) { /* same arithmetic as the scalar loop (vcvtnq rounds half to even) */
        const float *xb = x + b * QK;
        float32x4_t v[8], mx = vdupq_n_f32(0.f);
        for (int j = 0; j < 8; j++) {
            v[j] = vld1q_f32(xb + 4 * j);
            mx = vmaxq_f32(mx, vabsq_f32(v[j]));
        }
        const float amax = vmaxvq_f32(mx);
        const float d = amax / 127.f, id = d > 0.f ? 1.f / d : 0.f;
        int32x4_t sum = vdupq_n_s32(0);
        for (int j = 0; j < 8; j += 2) {
            const int32x4_t q0 = vcvtnq_s32_f32(vmulq_n_f32(v[j], id)), q1 = vcvtnq_s32_f32(vmulq_n_f32(v[j + 1], id));
            sum = vaddq_s32(sum, vaddq_s32(q0, q1));
            const int16x8_t q16 = vcombine_s16(vmovn_s32(q0), vmovn_s32(q1));
            vst1_s8(y[b].qs + 4 * j, vmovn_s16(q16));
        }
        y[b].d = d;
        y[b].s = d * (float)vaddvq_s32(sum);
    }
    return;
#endif
    for (int b = 0; b < K / QK; b++) {
        const float *xb = x + b * QK;
        float amax = 0.f;
        for (int i = 0; i < QK; i++) { float a = fabsf(xb[i]); if (a > amax) amax = a; }
        float d = amax / 127.f, id = d > 0.f ? 1.f / d : 0.f;
        int sum = 0;
        for (int i = 0; i < QK; i++) { int q = (int)lrintf(xb[i] * id); y[b].qs[i] = (int8_t)q; sum += q; }
        y[b].d = d;
        y[b].s = d * (float)sum;
    }
}

/* ---------------------------------------------------------------- matrix kernels
 * Weights are stored 8 rows interleaved per block of 32 columns, so one pass computes 8 outputs
 * with no horizontal sums, and each activation load serves 8 rows:
 *   Q4_1x8 (160 B): f16 d[8], f16 m[8], then 4 chunks of 32 B; byte 4r+i of chunk k holds
 *                   q[r][4k+i] in its low nibble and q[r][16+4k+i] in its high one (w = d*q + m)
 *   Q8_0x8 (272 B): f16 d[8], then 8 chunks of 32 B; byte 4r+i of chunk k is q[r][4k+i] (w = d*q)
 * A matrix is its row groups one after another, each group's blocks in column order; the
 * last group is padded with zero rows. Every token is computed with the same operations in the
 * same order whatever tile it falls in, so prefill and decode give bit-identical results. */
#define BT_INLINE static inline __attribute__((always_inline))
#define Q4X8 160
#define Q8X8 272
#define ACH 32 /* positions per attention chunk: each gets its own softmax partial, merged in order */
static inline int32_t ld32(const int8_t *p) { int32_t v; memcpy(&v, p, 4); return v; }

#if defined(BT_AVX2)
/* NT tokens (x[j * ldx + b]) against one row group: y[j * ldy + r] for r < 8 */
BT_INLINE void q4x8_tile(const uint8_t *w, int nb, const block_q8 *x, int ldx, float *y, int ldy, const int NT) {
    const __m256i m4 = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
    __m256 acc[4];
    for (int j = 0; j < NT; j++) acc[j] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++, w += Q4X8) {
        __m256i s[4]; /* int16 sums: 8 products of <= 15 * 127 per pair stay below 2^15 */
        for (int j = 0; j < NT; j++) s[j] = _mm256_setzero_si256();
        for (int k = 0; k < 4; k++) {
            const __m256i P = _mm256_loadu_si256((const __m256i *)(w + 32 + 32 * k));
            const __m256i lo = _mm256_and_si256(P, m4), hi = _mm256_and_si256(_mm256_srli_epi16(P, 4), m4);
            for (int j = 0; j < NT; j++) {
                const int8_t *q = x[(size_t)j * ldx + b].qs;
                s[j] = _mm256_add_epi16(s[j], _mm256_maddubs_epi16(lo, _mm256_set1_epi32(ld32(q + 4 * k))));
                s[j] = _mm256_add_epi16(s[j], _mm256_maddubs_epi16(hi, _mm256_set1_epi32(ld32(q + 16 + 4 * k))));
            }
        }
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)w));
        const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w + 16)));
        for (int j = 0; j < NT; j++) {
            const block_q8 *xb = x + (size_t)j * ldx + b;
            const __m256 p = _mm256_cvtepi32_ps(_mm256_madd_epi16(s[j], ones));
            acc[j] = _mm256_fmadd_ps(p, _mm256_mul_ps(d, _mm256_set1_ps(xb->d)), acc[j]);
            acc[j] = _mm256_fmadd_ps(m, _mm256_set1_ps(xb->s), acc[j]);
        }
    }
    for (int j = 0; j < NT; j++) _mm256_storeu_ps(y + (size_t)j * ldy, acc[j]);
}

BT_INLINE void q8x8_tile(const uint8_t *w, int nb, const block_q8 *x, int ldx, float *y, int ldy, const int NT) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[4];
    for (int j = 0; j < NT; j++) acc[j] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++, w += Q8X8) {
        __m256i s[4];
        for (int j = 0; j < NT; j++) s[j] = _mm256_setzero_si256();
        for (int k = 0; k < 8; k++) {
            const __m256i W = _mm256_loadu_si256((const __m256i *)(w + 16 + 32 * k));
            const __m256i aw = _mm256_abs_epi8(W); /* maddubs wants one unsigned operand: |w| * (x with w's sign) */
            for (int j = 0; j < NT; j++) {
                const __m256i xs = _mm256_sign_epi8(_mm256_set1_epi32(ld32(x[(size_t)j * ldx + b].qs + 4 * k)), W);
                s[j] = _mm256_add_epi32(s[j], _mm256_madd_epi16(_mm256_maddubs_epi16(aw, xs), ones));
            }
        }
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)w));
        for (int j = 0; j < NT; j++)
            acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[j]), _mm256_mul_ps(d, _mm256_set1_ps(x[(size_t)j * ldx + b].d)),
                                     acc[j]);
    }
    for (int j = 0; j < NT; j++) _mm256_storeu_ps(y + (size_t)j * ldy, acc[j]);
}
#elif defined(BT_NEON)
/* acc (4 rows) += w (4 rows x 4 int8) . lane l of x (4 int8) */
#if defined(__ARM_FEATURE_DOTPROD)
#define DOTL(acc, w, x, l) vdotq_laneq_s32(acc, w, x, l)
#else
#define DOTL(acc, w, x, l) dot_lane_(acc, w, vreinterpretq_s8_s32(vdupq_laneq_s32(vreinterpretq_s32_s8(x), l)))
static inline int32x4_t dot_lane_(int32x4_t acc, int8x16_t w, int8x16_t xl) {
    const int32x4_t a = vpaddlq_s16(vmull_s8(vget_low_s8(w), vget_low_s8(xl))); /* rows 0,1: 2 pair sums each */
    const int32x4_t b = vpaddlq_s16(vmull_high_s8(w, xl));                       /* rows 2,3 */
    return vaddq_s32(acc, vpaddq_s32(a, b));
}
#endif
static inline float32x4_t f16x4(const uint8_t *p) { return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16((const uint16_t *)p))); }

BT_INLINE void q4x8_tile(const uint8_t *w, int nb, const block_q8 *x, int ldx, float *y, int ldy, const int NT) {
    const uint8x16_t m4 = vdupq_n_u8(0x0f);
    float32x4_t acc[4][2];
    for (int j = 0; j < NT; j++) acc[j][0] = acc[j][1] = vdupq_n_f32(0.f);
    for (int b = 0; b < nb; b++, w += Q4X8) {
        int32x4_t s[4][2];
        int8x16_t x0[4], x1[4];
        for (int j = 0; j < NT; j++) {
            s[j][0] = s[j][1] = vdupq_n_s32(0);
            x0[j] = vld1q_s8(x[(size_t)j * ldx + b].qs);
            x1[j] = vld1q_s8(x[(size_t)j * ldx + b].qs + 16);
        }
#define Q4STEP(k)                                                                                            \
        do {                                                                                                 \
            const uint8x16_t Pa = vld1q_u8(w + 32 + 32 * (k)), Pb = vld1q_u8(w + 48 + 32 * (k));             \
            const int8x16_t la = vreinterpretq_s8_u8(vandq_u8(Pa, m4)), ha = vreinterpretq_s8_u8(vshrq_n_u8(Pa, 4)); \
            const int8x16_t lb = vreinterpretq_s8_u8(vandq_u8(Pb, m4)), hb = vreinterpretq_s8_u8(vshrq_n_u8(Pb, 4)); \
            for (int j = 0; j < NT; j++) {                                                                   \
                s[j][0] = DOTL(DOTL(s[j][0], la, x0[j], k), ha, x1[j], k);                                   \
                s[j][1] = DOTL(DOTL(s[j][1], lb, x0[j], k), hb, x1[j], k);                                   \
            }                                                                                                \
        } while (0)
        Q4STEP(0); Q4STEP(1); Q4STEP(2); Q4STEP(3);
#undef Q4STEP
        const float32x4_t d0 = f16x4(w), d1 = f16x4(w + 8), m0 = f16x4(w + 16), m1 = f16x4(w + 24);
        for (int j = 0; j < NT; j++) {
            const block_q8 *xb = x + (size_t)j * ldx + b;
            acc[j][0] = vfmaq_f32(acc[j][0], vcvtq_f32_s32(s[j][0]), vmulq_n_f32(d0, xb->d));
            acc[j][1] = vfmaq_f32(acc[j][1], vcvtq_f32_s32(s[j][1]), vmulq_n_f32(d1, xb->d));
            acc[j][0] = vfmaq_n_f32(acc[j][0], m0, xb->s);
            acc[j][1] = vfmaq_n_f32(acc[j][1], m1, xb->s);
        }
    }
    for (int j = 0; j < NT; j++) {
        vst1q_f32(y + (size_t)j * ldy, acc[j][0]);
        vst1q_f32(y + (size_t)j * ldy + 4, acc[j][1]);
    }
}

BT_INLINE void q8x8_tile(const uint8_t *w, int nb, const block_q8 *x, int ldx, float *y, int ldy, const int NT) {
    float32x4_t acc[4][2];
    for (int j = 0; j < NT; j++) acc[j][0] = acc[j][1] = vdupq_n_f32(0.f);
    for (int b = 0; b < nb; b++, w += Q8X8) {
        int32x4_t s[4][2];
        int8x16_t x0[4], x1[4];
        for (int j = 0; j < NT; j++) {
            s[j][0] = s[j][1] = vdupq_n_s32(0);
            x0[j] = vld1q_s8(x[(size_t)j * ldx + b].qs);
            x1[j] = vld1q_s8(x[(size_t)j * ldx + b].qs + 16);
        }
#define Q8STEP(k, xv, l)                                                                                     \
        do {                                                                                                 \
            const int8x16_t Wa = vld1q_s8((const int8_t *)w + 16 + 32 * (k)), Wb = vld1q_s8((const int8_t *)w + 32 + 32 * (k)); \
            for (int j = 0; j < NT; j++) {                                                                   \
                s[j][0] = DOTL(s[j][0], Wa, xv[j], l);                                                       \
                s[j][1] = DOTL(s[j][1], Wb, xv[j], l);                                                       \
            }                                                                                                \
        } while (0)
        Q8STEP(0, x0, 0); Q8STEP(1, x0, 1); Q8STEP(2, x0, 2); Q8STEP(3, x0, 3);
        Q8STEP(4, x1, 0); Q8STEP(5, x1, 1); Q8STEP(6, x1, 2); Q8STEP(7, x1, 3);
#undef Q8STEP
        const float32x4_t d0 = f16x4(w), d1 = f16x4(w + 8);
        for (int j = 0; j < NT; j++) {
            const float xd = x[(size_t)j * ldx + b].d;
            acc[j][0] = vfmaq_f32(acc[j][0], vcvtq_f32_s32(s[j][0]), vmulq_n_f32(d0, xd));
            acc[j][1] = vfmaq_f32(acc[j][1], vcvtq_f32_s32(s[j][1]), vmulq_n_f32(d1, xd));
        }
    }
    for (int j = 0; j < NT; j++) {
        vst1q_f32(y + (size_t)j * ldy, acc[j][0]);
        vst1q_f32(y + (size_t)j * ldy + 4, acc[j][1]);
    }
}
#else
BT_INLINE void q4x8_tile(const uint8_t *w, int nb, const block_q8 *x, int ldx, float *y, int ldy, const int NT) {
    for (int j = 0; j < NT; j++) {
        float acc[8] = {0};
        const uint8_t *wb = w;
        for (int b = 0; b < nb; b++, wb += Q4X8) {
            const block_q8 *xb = x + (size_t)j * ldx + b;
            for (int r = 0; r < 8; r++) {
                int isum = 0;
                for (int k = 0; k < 4; k++)
                    for (int i = 0; i < 4; i++) {
                        const uint8_t v = wb[32 + 32 * k + 4 * r + i];
                        isum += (v & 15) * xb->qs[4 * k + i] + (v >> 4) * xb->qs[16 + 4 * k + i];
                    }
                acc[r] = fmaf((float)isum, f16_to_f32(rd16(wb + 2 * r)) * xb->d, acc[r]);
                acc[r] = fmaf(f16_to_f32(rd16(wb + 16 + 2 * r)), xb->s, acc[r]);
            }
        }
        memcpy(y + (size_t)j * ldy, acc, sizeof acc);
    }
}

BT_INLINE void q8x8_tile(const uint8_t *w, int nb, const block_q8 *x, int ldx, float *y, int ldy, const int NT) {
    for (int j = 0; j < NT; j++) {
        float acc[8] = {0};
        const uint8_t *wb = w;
        for (int b = 0; b < nb; b++, wb += Q8X8) {
            const block_q8 *xb = x + (size_t)j * ldx + b;
            for (int r = 0; r < 8; r++) {
                int isum = 0;
                for (int k = 0; k < 8; k++)
                    for (int i = 0; i < 4; i++) isum += ((const int8_t *)wb)[16 + 32 * k + 4 * r + i] * xb->qs[4 * k + i];
                acc[r] = fmaf((float)isum, f16_to_f32(rd16(wb + 2 * r)) * xb->d, acc[r]);
            }
        }
        memcpy(y + (size_t)j * ldy, acc, sizeof acc);
    }
}
#endif

/* All T tokens against one row group, four at a time (the group's weights stay in L1). */
static void group_matmul(const uint8_t *w, int nb, const block_q8 *x, int T, float *y, int ldy, int q8) {
    int t = 0;
    if (q8) {
        for (; t + 4 <= T; t += 4) q8x8_tile(w, nb, x + (size_t)t * nb, nb, y + (size_t)t * ldy, ldy, 4);
        switch (T - t) {
        case 3: q8x8_tile(w, nb, x + (size_t)t * nb, nb, y + (size_t)t * ldy, ldy, 3); break;
        case 2: q8x8_tile(w, nb, x + (size_t)t * nb, nb, y + (size_t)t * ldy, ldy, 2); break;
        case 1: q8x8_tile(w, nb, x + (size_t)t * nb, nb, y + (size_t)t * ldy, ldy, 1); break;
        }
    } else {
        for (; t + 4 <= T; t += 4) q4x8_tile(w, nb, x + (size_t)t * nb, nb, y + (size_t)t * ldy, ldy, 4);
        switch (T - t) {
        case 3: q4x8_tile(w, nb, x + (size_t)t * nb, nb, y + (size_t)t * ldy, ldy, 3); break;
        case 2: q4x8_tile(w, nb, x + (size_t)t * nb, nb, y + (size_t)t * ldy, ldy, 2); break;
        case 1: q4x8_tile(w, nb, x + (size_t)t * nb, nb, y + (size_t)t * ldy, ldy, 1); break;
        }
    }
}

/* y[t][n] = W[n] . x[t] for n < N, t < T, where the rows of W are those of up to three matrices
 * stacked (fused QKV, gate|up: one parallel region instead of three). N0 and N1 are multiples
 * of 8; the last matrix may end in a padded group, whose extra rows are computed and dropped. */
static void matmul3(float *y, int ldy, const uint8_t *W0, int N0, const uint8_t *W1, int N1, const uint8_t *W2, int N2,
                    const block_q8 *xq, int nb, int T, int q8, int nt) {
    const size_t gbytes = (size_t)nb * (q8 ? Q8X8 : Q4X8);
    const int N = N0 + N1 + N2, G0 = N0 / 8, G1 = N1 / 8, G = (N + 7) / 8;
    (void)nt; /* unused without OpenMP */
#pragma omp parallel for schedule(static) num_threads(nt)
    for (int g = 0; g < G; g++) {
        const int n = 8 * g;
        const uint8_t *wg = n < N0 ? W0 + g * gbytes : n < N0 + N1 ? W1 + (g - G0) * gbytes : W2 + (g - G0 - G1) * gbytes;
        if (n + 8 <= N) {
            group_matmul(wg, nb, xq, T, y + n, ldy, q8);
        } else { /* padded last group: compute into a buffer, keep the real rows */
            float tmp[8 * 4];
            for (int t = 0; t < T; t += 4) {
                const int nt = T - t < 4 ? T - t : 4;
                group_matmul(wg, nb, xq + (size_t)t * nb, nt, tmp, 8, q8);
                for (int j = 0; j < nt; j++) memcpy(y + (size_t)(t + j) * ldy + n, tmp + 8 * j, sizeof(float) * (N - n));
            }
        }
    }
}

static void matmul(float *y, int ldy, const uint8_t *W, int N, const block_q8 *xq, int nb, int T, int q8, int nt) {
    matmul3(y, ldy, W, N, NULL, 0, NULL, 0, xq, nb, T, q8, nt);
}

static void rmsnorm(float *o, const float *x, const float *w, int n, float eps) {
    double ss = 0.0;
    for (int i = 0; i < n; i++) ss += (double)x[i] * x[i];
    const float r = 1.f / sqrtf((float)(ss / n) + eps);
    for (int i = 0; i < n; i++) o[i] = x[i] * r * w[i];
}

static void rope(float *x, int n_heads, int D, const float *cs, const float *sn) {
    for (int h = 0; h < n_heads; h++) {
        float *v = x + h * D;
        for (int i = 0; i < D / 2; i++) {
            const float a = v[2 * i], b = v[2 * i + 1];
            v[2 * i] = a * cs[i] - b * sn[i];
            v[2 * i + 1] = a * sn[i] + b * cs[i];
        }
    }
}

static void quantize_head(const float *x, int8_t *q, float *scale, int D) {
    float amax = 0.f;
    for (int i = 0; i < D; i++) { float a = fabsf(x[i]); if (a > amax) amax = a; }
    float s = amax * (1.0f / 127.0f);
    if (s < KV_SCALE_FLOOR) s = KV_SCALE_FLOOR;
    for (int i = 0; i < D; i++) q[i] = (int8_t)lrintf(x[i] / s); /* lrintf: round half to even */
    *scale = s;
}

/* ---------------------------------------------------------------- attention and activations */
#if defined(BT_AVX2)
/* e^x for 8 floats: 2^n * p(r), r = x - n ln2, |r| <= ln2/2; a degree-6 polynomial, ~2 ulp */
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.7f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145752f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860677e-6f), r);
    __m256 p = _mm256_set1_ps(1.f / 720.f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120.f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24.f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6.f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
/* the 8 horizontal sums of v[0..7], in order */
static inline __m256 hsum8x8(const __m256 *v) {
    const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}
static inline __m256 i8x8_to_f32(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
#elif defined(BT_NEON)
/* the same e^x as exp8, 4 lanes */
static inline float32x4_t exp4(float32x4_t x) {
    x = vminq_f32(vmaxq_f32(x, vdupq_n_f32(-87.3f)), vdupq_n_f32(88.7f));
    const float32x4_t n = vrndnq_f32(vmulq_n_f32(x, 1.44269504f));
    float32x4_t r = vfmsq_n_f32(x, n, 0.693145752f);
    r = vfmsq_n_f32(r, n, 1.42860677e-6f);
    float32x4_t p = vdupq_n_f32(1.f / 720.f);
    p = vfmaq_f32(vdupq_n_f32(1.f / 120.f), p, r);
    p = vfmaq_f32(vdupq_n_f32(1.f / 24.f), p, r);
    p = vfmaq_f32(vdupq_n_f32(1.f / 6.f), p, r);
    p = vfmaq_f32(vdupq_n_f32(0.5f), p, r);
    p = vfmaq_f32(vdupq_n_f32(1.f), p, r);
    p = vfmaq_f32(vdupq_n_f32(1.f), p, r);
    const int32x4_t e = vshlq_n_s32(vaddq_s32(vcvtnq_s32_f32(n), vdupq_n_s32(127)), 23);
    return vmulq_f32(p, vreinterpretq_f32_s32(e));
}
static inline float32x4_t i8x4_to_f32(const int8_t *p) {
    int8x8_t b = vreinterpret_s8_u32(vld1_dup_u32((const uint32_t *)(const void *)p)); /* 4 bytes, twice */
    return vcvtq_f32_s32(vmovl_s16(vget_low_s16(vmovl_s8(b))));
}
#endif

/* x[i] <- e^(x[i] - mx); returns the sum */
static float exp_shift_sum(float *x, int n, float mx) {
    int i = 0;
    float sum = 0.f;
#if defined(BT_AVX2)
    __m256 s8 = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) {
        const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i), _mm256_set1_ps(mx)));
        _mm256_storeu_ps(x + i, e);
        s8 = _mm256_add_ps(s8, e);
    }
    float t[8];
    _mm256_storeu_ps(t, s8);
    for (int j = 0; j < 8; j++) sum += t[j];
#elif defined(BT_NEON)
    float32x4_t s4 = vdupq_n_f32(0.f);
    for (; i + 4 <= n; i += 4) {
        const float32x4_t e = exp4(vsubq_f32(vld1q_f32(x + i), vdupq_n_f32(mx)));
        vst1q_f32(x + i, e);
        s4 = vaddq_f32(s4, e);
    }
    sum = vaddvq_f32(s4);
#endif
    for (; i < n; i++) { x[i] = expf(x[i] - mx); sum += x[i]; }
    return sum;
}

/* a[i] <- silu(g[i]) * u[i] */
static void swiglu(float *a, const float *g, const float *u, int n) {
    int i = 0;
#if defined(BT_AVX2)
    const __m256 one = _mm256_set1_ps(1.f);
    for (; i + 8 <= n; i += 8) {
        const __m256 gv = _mm256_loadu_ps(g + i);
        const __m256 den = _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv)));
        _mm256_storeu_ps(a + i, _mm256_mul_ps(_mm256_div_ps(gv, den), _mm256_loadu_ps(u + i)));
    }
#elif defined(BT_NEON)
    for (; i + 4 <= n; i += 4) {
        const float32x4_t gv = vld1q_f32(g + i);
        const float32x4_t den = vaddq_f32(vdupq_n_f32(1.f), exp4(vnegq_f32(gv)));
        vst1q_f32(a + i, vmulq_f32(vdivq_f32(gv, den), vld1q_f32(u + i)));
    }
#endif
    for (; i < n; i++) a[i] = g[i] / (1.f + expf(-g[i])) * u[i];
}

#define GMAX 16   /* query heads per KV head */

/* Attention of the G query heads q (G x D) sharing one KV head, over positions [p0, p1) (p1 - p0 <= ACH).
 * k/v: that head's rows at position 0, kst/vst: their scales; positions are pst rows apart.
 * part (G x (D + 2)): per head the unnormalized sum of e^(s - m) v, then m, then the sum of e^(s - m).
 * Inlined with G a constant (attn_chunk below), so the per-head accumulators stay in registers. */
BT_INLINE void attn_chunk_g(const float *q, int D, float q_scale, const int8_t *k, const float *ks, const int8_t *v,
                            const float *vs, size_t pst, int p0, int p1, float *part, const int G) {
    const int n = p1 - p0;
    float sc[GMAX][ACH];
#if defined(BT_AVX2)
    if (D % 16 == 0) {
        __m256 dots[GMAX][8];
        for (int p = 0; p < n; p++) { /* each K row is widened once for all G heads */
            const int8_t *kp = k + (size_t)(p0 + p) * pst * D;
            __m256 a[GMAX];
            for (int g = 0; g < G; g++) a[g] = _mm256_setzero_ps();
            for (int i = 0; i < D; i += 8) {
                const __m256 kf = i8x8_to_f32(kp + i);
                for (int g = 0; g < G; g++) a[g] = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * D + i), kf, a[g]);
            }
            for (int g = 0; g < G; g++) dots[g][p % 8] = a[g];
            if (p % 8 == 7 || p == n - 1) { /* 8 positions' sums at once */
                const int b = p - p % 8;
                for (int g = 0; g < G; g++) {
                    for (int j = p % 8 + 1; j < 8; j++) dots[g][j] = _mm256_setzero_ps();
                    float t8[8];
                    _mm256_storeu_ps(t8, hsum8x8(dots[g]));
                    for (int j = 0; j <= p % 8; j++) sc[g][b + j] = t8[j];
                }
            }
        }
    } else
#elif defined(BT_NEON)
    if (D % 16 == 0) {
        for (int p = 0; p < n; p++) { /* each K row is widened once for all G heads */
            const int8_t *kp = k + (size_t)(p0 + p) * pst * D;
            float32x4_t a[GMAX];
            for (int g = 0; g < G; g++) a[g] = vdupq_n_f32(0.f);
            for (int i = 0; i < D; i += 4) {
                const float32x4_t kf = i8x4_to_f32(kp + i);
                for (int g = 0; g < G; g++) a[g] = vfmaq_f32(a[g], vld1q_f32(q + g * D + i), kf);
            }
            for (int g = 0; g < G; g++) sc[g][p] = vaddvq_f32(a[g]);
        }
    } else
#endif
    for (int p = 0; p < n; p++) {
        const int8_t *kp = k + (size_t)(p0 + p) * pst * D;
        for (int g = 0; g < G; g++) {
            float dot = 0.f;
            for (int i = 0; i < D; i++) dot += q[g * D + i] * (float)kp[i];
            sc[g][p] = dot;
        }
    }
    for (int g = 0; g < G; g++) {
        float mx = -INFINITY, *s = sc[g], *o = part + (size_t)g * (D + 2);
        for (int p = 0; p < n; p++) {
            s[p] *= ks[(size_t)(p0 + p) * pst] * q_scale;
            mx = s[p] > mx ? s[p] : mx;
        }
        o[D] = mx;
        o[D + 1] = exp_shift_sum(s, n, mx);
        for (int p = 0; p < n; p++) s[p] *= vs[(size_t)(p0 + p) * pst];
    }
#if defined(BT_AVX2)
    if (D % 16 == 0) {
        for (int i = 0; i < D; i += 16) { /* each V slice is widened once for all G heads; 2G chains in flight */
            __m256 acc[GMAX][2];
            for (int g = 0; g < G; g++) acc[g][0] = acc[g][1] = _mm256_setzero_ps();
            for (int p = 0; p < n; p++) {
                const int8_t *vp = v + (size_t)(p0 + p) * pst * D + i;
                const __m256 v0 = i8x8_to_f32(vp), v1 = i8x8_to_f32(vp + 8);
                for (int g = 0; g < G; g++) {
                    const __m256 w = _mm256_broadcast_ss(&sc[g][p]);
                    acc[g][0] = _mm256_fmadd_ps(w, v0, acc[g][0]);
                    acc[g][1] = _mm256_fmadd_ps(w, v1, acc[g][1]);
                }
            }
            for (int g = 0; g < G; g++) {
                _mm256_storeu_ps(part + (size_t)g * (D + 2) + i, acc[g][0]);
                _mm256_storeu_ps(part + (size_t)g * (D + 2) + i + 8, acc[g][1]);
            }
        }
        return;
    }
#elif defined(BT_NEON)
    if (D % 16 == 0) {
        for (int i = 0; i < D; i += 8) { /* each V slice is widened once for all G heads; 2G chains in flight */
            float32x4_t acc[GMAX][2];
            for (int g = 0; g < G; g++) acc[g][0] = acc[g][1] = vdupq_n_f32(0.f);
            for (int p = 0; p < n; p++) {
                const int8x8_t v8 = vld1_s8(v + (size_t)(p0 + p) * pst * D + i);
                const int16x8_t v16 = vmovl_s8(v8);
                const float32x4_t v0 = vcvtq_f32_s32(vmovl_s16(vget_low_s16(v16)));
                const float32x4_t v1 = vcvtq_f32_s32(vmovl_s16(vget_high_s16(v16)));
                for (int g = 0; g < G; g++) {
                    acc[g][0] = vfmaq_n_f32(acc[g][0], v0, sc[g][p]);
                    acc[g][1] = vfmaq_n_f32(acc[g][1], v1, sc[g][p]);
                }
            }
            for (int g = 0; g < G; g++) {
                vst1q_f32(part + (size_t)g * (D + 2) + i, acc[g][0]);
                vst1q_f32(part + (size_t)g * (D + 2) + i + 4, acc[g][1]);
            }
        }
        return;
    }
#endif
    for (int g = 0; g < G; g++) {
        float *o = part + (size_t)g * (D + 2);
        for (int i = 0; i < D; i++) o[i] = 0.f;
        for (int p = 0; p < n; p++) {
            const int8_t *vp = v + (size_t)(p0 + p) * pst * D;
            for (int i = 0; i < D; i++) o[i] += sc[g][p] * (float)vp[i];
        }
    }
}

static void attn_chunk(const float *q, int G, int D, float q_scale, const int8_t *k, const float *ks, const int8_t *v,
                       const float *vs, size_t pst, int p0, int p1, float *part) {
#define CASE(g) case g: attn_chunk_g(q, D, q_scale, k, ks, v, vs, pst, p0, p1, part, g); break
    switch (G) {
        CASE(1); CASE(2); CASE(3); CASE(4); CASE(5); CASE(6); CASE(7); CASE(8);
        default: attn_chunk_g(q, D, q_scale, k, ks, v, vs, pst, p0, p1, part, G);
    }
#undef CASE
}

/* out (G x D, head stride D) = the chunks' partials (nch x G x (D + 2)) combined, in chunk order */
static void attn_merge(const float *parts, int nch, int G, int D, float *out) {
    for (int g = 0; g < G; g++) {
        float mx = -INFINITY, l = 0.f, *o = out + (size_t)g * D;
        for (int c = 0; c < nch; c++) {
            const float m = parts[((size_t)c * G + g) * (D + 2) + D];
            mx = m > mx ? m : mx;
        }
        for (int i = 0; i < D; i++) o[i] = 0.f;
        for (int c = 0; c < nch; c++) {
            const float *pc = parts + ((size_t)c * G + g) * (D + 2), f = expf(pc[D] - mx);
            l += f * pc[D + 1];
            for (int i = 0; i < D; i++) o[i] += f * pc[i];
        }
        const float inv = 1.f / l;
        for (int i = 0; i < D; i++) o[i] *= inv;
    }
}

/* Everything one model instance mutates during bt_forward: buffers for up to max_t tokens per call,
 * the thread count every parallel region uses, and the profile timers. */
typedef struct {
    bt_config cfg; /* the shapes the buffers were sized for: bt_forward refuses a different config */
    int max_t, n_threads;
    float *h, *xn, *qkv, *att, *gu;
    block_q8 *xq;
    float *parts; /* attention partials: per thread (prefill) or per KV head (decode), max(n_threads, KVH)
                   * slots of max_seq/ACH chunks of G x (D+2) */
    double prof_s[P_N]; /* seconds per phase since the last bt_profile */
    int prof_on;
} bt_scratch;

void bt_scratch_free(void *p) {
    bt_scratch *s = (bt_scratch *)p;
    if (!s) return;
    free(s->h); free(s->xn); free(s->qkv); free(s->att); free(s->gu); free(s->xq); free(s->parts);
    free(s);
}

/* Scratch for up to max_t tokens per call run by n_threads threads (>= 1). NULL on bad arguments or
 * a failed allocation, with whatever was allocated freed. */
void *bt_scratch_new(const bt_config *c, int max_t, int n_threads) {
    if (!c || max_t < 1 || n_threads < 1 || c->hidden < QK || c->hidden % QK || c->ffn < QK || c->ffn % QK ||
        c->n_heads < 1 || c->n_kv_heads < 1 || c->n_heads % c->n_kv_heads || c->head_dim < 2 || c->max_seq < 1)
        return NULL;
    bt_scratch *s = (bt_scratch *)calloc(1, sizeof(bt_scratch));
    if (!s) return NULL;
    const int C = c->hidden, QKV = (c->n_heads + 2 * c->n_kv_heads) * c->head_dim, F = c->ffn;
    const int widest = F > C ? F : C;
    s->cfg = *c;
    s->max_t = max_t;
    s->n_threads = n_threads;
    s->h = (float *)malloc(sizeof(float) * (size_t)max_t * C);
    s->xn = (float *)malloc(sizeof(float) * (size_t)max_t * widest);
    s->qkv = (float *)malloc(sizeof(float) * (size_t)max_t * QKV);
    s->att = (float *)malloc(sizeof(float) * (size_t)max_t * C);
    s->gu = (float *)malloc(sizeof(float) * (size_t)max_t * 2 * F);
    s->xq = (block_q8 *)malloc(sizeof(block_q8) * (size_t)max_t * (widest / QK));
    const int nch = (c->max_seq + ACH - 1) / ACH, slots = n_threads > c->n_kv_heads ? n_threads : c->n_kv_heads;
    s->parts = (float *)malloc(sizeof(float) * (size_t)slots * nch * (c->n_heads / c->n_kv_heads) * (c->head_dim + 2));
    if (!s->h || !s->xn || !s->qkv || !s->att || !s->gu || !s->xq || !s->parts) {
        bt_scratch_free(s);
        return NULL;
    }
    return s;
}

/* on: 1 enables the scratch's timers, 0 disables; out (P_N doubles, may be NULL) receives the totals,
 * which are then reset. Phases: qkv, attention, o_proj, gate_up, down, lm_head, other. */
void bt_profile(void *scratch, int on, double *out) {
    bt_scratch *s = (bt_scratch *)scratch;
    if (!s) return;
    if (out) memcpy(out, s->prof_s, sizeof s->prof_s);
    memset(s->prof_s, 0, sizeof s->prof_s);
    s->prof_on = on;
}

#define TICK(phase) do { if (s->prof_on) { double t_ = NOW(); s->prof_s[phase] += t_ - prof_t; prof_t = t_; } } while (0)

/* Run T tokens at positions start..start+T-1 with the scratch's n_threads threads. Writes their K/V into
 * the cache rows and the logits of tokens logits_from..T-1 into logits ((T - logits_from) x vocab);
 * logits_from = -1 skips the output layer. Returns 0 or an error code: 1 bad T (or no scratch),
 * 2 positions past max_seq, 3 bad logits_from, 4 token id out of range, 5 unsupported head grouping,
 * 6 a config with other shapes than the scratch was made for. */
int bt_forward(const bt_config *c, const bt_weights *w, void *scratch, const int64_t *ids, int T, int start,
               int8_t *kv, float *kv_scale, float *logits, int logits_from) {
    bt_scratch *s = (bt_scratch *)scratch;
    if (!s || T < 1 || T > s->max_t) return 1;
    if (start < 0 || start + T > c->max_seq) return 2;
    if (logits_from < -1 || logits_from >= T) return 3; /* -1: no logits wanted (an early prefill chunk) */
    if (c->n_heads % c->n_kv_heads || c->n_heads / c->n_kv_heads > GMAX) return 5;
    if (c->hidden != s->cfg.hidden || c->n_heads != s->cfg.n_heads || c->n_kv_heads != s->cfg.n_kv_heads ||
        c->head_dim != s->cfg.head_dim || c->ffn != s->cfg.ffn || c->max_seq > s->cfg.max_seq)
        return 6;
    const int nt = s->n_threads; /* every parallel region below: num_threads(nt) */
    (void)nt;
    const int C = c->hidden, H = c->n_heads, KVH = c->n_kv_heads, D = c->head_dim, F = c->ffn, L = c->n_layers;
    const int G = H / KVH, QKV = (H + 2 * KVH) * D, nbC = C / QK, nbF = F / QK;
    /* head row of (layer l, position p, head j) = lbase(l) + p * pstride + j */
    const size_t pstride = c->kv_layer_major ? (size_t)2 * KVH : (size_t)L * 2 * KVH;
#define LBASE(l) (c->kv_layer_major ? (size_t)(l) * c->max_seq * 2 * KVH : (size_t)(l) * 2 * KVH)
    for (int t = 0; t < T; t++) { /* embedding: row r of a Q8_0x8 group */
        if (ids[t] < 0 || ids[t] >= c->vocab) return 4;
        const int r = (int)(ids[t] % 8);
        const uint8_t *e = w->tok_embd + (size_t)(ids[t] / 8) * nbC * Q8X8;
        for (int b = 0; b < nbC; b++, e += Q8X8) {
            const float d = f16_to_f32(rd16(e + 2 * r));
            for (int j = 0; j < QK; j++) s->h[t * C + b * QK + j] = d * (float)((const int8_t *)e)[16 + 32 * (j / 4) + 4 * r + j % 4];
        }
    }
    double prof_t = s->prof_on ? NOW() : 0.0;
    for (int l = 0; l < L; l++) {
#pragma omp parallel for if (T > 1) num_threads(nt)
        for (int t = 0; t < T; t++) {
            rmsnorm(s->xn + t * C, s->h + t * C, w->attn_norm[l], C, c->norm_eps);
            quantize_q8(s->xn + t * C, s->xq + t * nbC, C);
        }
        TICK(P_OTHER);
        matmul3(s->qkv, QKV, w->wq[l], H * D, w->wk[l], KVH * D, w->wv[l], KVH * D, s->xq, nbC, T, 0, nt);
        TICK(P_QKV);
#pragma omp parallel for if (T > 1) num_threads(nt)
        for (int t = 0; t < T; t++) { /* RoPE, then K/V into the int8 cache */
            const int pos = start + t;
            float *q = s->qkv + t * QKV;
            rope(q, H + KVH, D, w->rope_cos + (size_t)pos * (D / 2), w->rope_sin + (size_t)pos * (D / 2));
            for (int j = 0; j < 2 * KVH; j++) {
                const size_t r = LBASE(l) + (size_t)pos * pstride + j;
                quantize_head(q + H * D + j * D, kv + r * D, kv_scale + r, D);
            }
        }
        TICK(P_OTHER);
        /* attention: token t's G query heads of KV head kvh over positions 0..start+t, in chunks of ACH
         * positions; each chunk's partial is computed and merged the same way whichever thread runs it,
         * so a token's result does not depend on T (prefill and decode agree bit for bit) */
        const size_t kv0 = LBASE(l);
        const int8_t *kl = kv + kv0 * D;
        const float *sl = kv_scale + kv0;
        const size_t PG = (size_t)G * (D + 2);
        if (T == 1) { /* decode: chunks of all KV heads spread over the threads */
            const int n = start + 1, nch = (n + ACH - 1) / ACH;
#pragma omp parallel for schedule(dynamic, 1) num_threads(nt)
            for (int it = 0; it < KVH * nch; it++) {
                const int kvh = it / nch, ch = it % nch, p0 = ch * ACH, p1 = p0 + ACH < n ? p0 + ACH : n;
                attn_chunk(s->qkv + kvh * G * D, G, D, c->q_scale, kl + (size_t)kvh * D, sl + kvh, kl + (size_t)(KVH + kvh) * D,
                           sl + KVH + kvh, pstride, p0, p1, s->parts + ((size_t)kvh * nch + ch) * PG);
            }
            for (int kvh = 0; kvh < KVH; kvh++) attn_merge(s->parts + (size_t)kvh * nch * PG, nch, G, D, s->att + kvh * G * D);
        } else {
#pragma omp parallel for schedule(dynamic, 1) num_threads(nt)
            for (int it = 0; it < T * KVH; it++) {
                const int t = it / KVH, kvh = it % KVH, n = start + t + 1, nch = (n + ACH - 1) / ACH;
#ifdef _OPENMP
                float *parts = s->parts + (size_t)omp_get_thread_num() * ((s->cfg.max_seq + ACH - 1) / ACH) * PG;
#else
                float *parts = s->parts;
#endif
                for (int ch = 0; ch < nch; ch++) {
                    const int p0 = ch * ACH, p1 = p0 + ACH < n ? p0 + ACH : n;
                    attn_chunk(s->qkv + (size_t)t * QKV + kvh * G * D, G, D, c->q_scale, kl + (size_t)kvh * D, sl + kvh,
                               kl + (size_t)(KVH + kvh) * D, sl + KVH + kvh, pstride, p0, p1, parts + (size_t)ch * PG);
                }
                attn_merge(parts, nch, G, D, s->att + (size_t)t * C + kvh * G * D);
            }
        }
        TICK(P_ATTN);
#pragma omp parallel for if (T > 1) num_threads(nt)
        for (int t = 0; t < T; t++) quantize_q8(s->att + t * C, s->xq + t * nbC, C);
        TICK(P_OTHER);
        matmul(s->xn, C, w->wo[l], C, s->xq, nbC, T, 0, nt);
        TICK(P_O);
#pragma omp parallel for if (T > 1) num_threads(nt)
        for (int t = 0; t < T; t++) {
            for (int i = 0; i < C; i++) s->h[t * C + i] += s->xn[t * C + i];
            rmsnorm(s->xn + t * C, s->h + t * C, w->ffn_norm[l], C, c->norm_eps);
            quantize_q8(s->xn + t * C, s->xq + t * nbC, C);
        }
        TICK(P_OTHER);
        matmul3(s->gu, 2 * F, w->wgate[l], F, w->wup[l], F, NULL, 0, s->xq, nbC, T, 0, nt);
        TICK(P_GATE_UP);
#pragma omp parallel for if (T > 1) num_threads(nt)
        for (int t = 0; t < T; t++) {
            float *g = s->gu + (size_t)t * 2 * F, *a = s->xn + (size_t)t * F;
            swiglu(a, g, g + F, F);
            quantize_q8(a, s->xq + t * nbF, F);
        }
        TICK(P_OTHER);
        matmul(s->att, C, w->wdown[l], C, s->xq, nbF, T, 0, nt);
        TICK(P_DOWN);
#pragma omp parallel for if (T > 1) num_threads(nt)
        for (int t = 0; t < T; t++)
            for (int i = 0; i < C; i++) s->h[t * C + i] += s->att[t * C + i];
    }
    if (logits_from < 0) return 0;
    const int NT = T - logits_from;
    for (int t = 0; t < NT; t++) {
        rmsnorm(s->xn + t * C, s->h + (size_t)(logits_from + t) * C, w->output_norm, C, c->norm_eps);
        quantize_q8(s->xn + t * C, s->xq + t * nbC, C);
    }
    TICK(P_OTHER);
    matmul(logits, c->vocab, w->tok_embd, c->vocab, s->xq, nbC, NT, 1, nt); /* tied output layer */
    TICK(P_LM_HEAD);
    return 0;
}

/* Streaming read bandwidth in GB/s, best of `passes` over a fresh `bytes` buffer read by n_threads
 * threads the way the matmuls read weights (sequential 32-byte loads): the decode floor's denominator. */
double bt_read_bandwidth(size_t bytes, int n_threads, int passes) {
    bytes &= ~(size_t)63;
    uint8_t *buf = (uint8_t *)malloc(bytes);
    if (!buf || bytes == 0) { free(buf); return 0.0; }
    memset(buf, 1, bytes);
#ifdef _OPENMP
    const int nt = n_threads > 0 ? n_threads : omp_get_max_threads(); /* <= 0: the OpenMP default */
#endif
    double best = 0.0;
    volatile uint64_t sink = 0;
    for (int pass = 0; pass < passes; pass++) {
        const double t0 = NOW();
        uint64_t total = 0;
#pragma omp parallel for schedule(static) reduction(+ : total) num_threads(nt)
        for (size_t i = 0; i < bytes / 64; i++) {
            uint64_t a, b;
            memcpy(&a, buf + 64 * i, 8);
            memcpy(&b, buf + 64 * i + 32, 8);
            total += a ^ b; /* one word per 32 B touches every line; the prefetcher streams the rest */
        }
        const double dt = NOW() - t0;
        sink += total;
        if (dt > 0 && bytes / dt > best) best = bytes / dt;
    }
    free(buf);
    return best / 1e9;
}

const char *bt_simd(void) {
#if defined(BT_AVX2)
    return "avx2";
#elif defined(BT_NEON) && defined(__ARM_FEATURE_DOTPROD)
    return "neon+dotprod";
#elif defined(BT_NEON)
    return "neon";
#else
    return "scalar";
#endif
}
