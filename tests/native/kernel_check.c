/* Checks the SIMD matrix kernels of bt_native.c (AVX2 / NEON / NEON dotprod, whichever this build
 * selects) against plain scalar arithmetic on random blocks, and bt_scratch_new's argument checks and
 * clean-up. Prints "N passed, M failed".
 * Built and run by tests/test_native_kernels.py: natively, and for aarch64 under qemu when a cross
 * compiler is installed. */
#include <stdlib.h>

/* bt_native.c's allocations go through these: live counts what is not yet freed, and fail_in > 0 makes
 * the fail_in-th allocation from now return NULL (to check that bt_scratch_new frees what it had). */
static long live, fail_in;
static void *ck_take(void *p) { live += p != NULL; return p; }
static int ck_fail(void) { return fail_in > 0 && --fail_in == 0; }
static void *ck_malloc(size_t n) { return ck_fail() ? NULL : ck_take(malloc(n)); }
static void *ck_calloc(size_t n, size_t m) { return ck_fail() ? NULL : ck_take(calloc(n, m)); }
static void ck_free(void *p) { live -= p != NULL; free(p); }
#define malloc ck_malloc
#define calloc ck_calloc
#define free ck_free
#include "../../runtime/native/bt_native.c"
#undef malloc
#undef calloc
#undef free
#include <stdio.h>

static float ref_q4_1(const uint8_t *w, const block_q8 *x, int nb) {
    double sum = 0.0;
    for (int b = 0; b < nb; b++, w += 20) {
        const double d = f16_to_f32(rd16(w)), m = f16_to_f32(rd16(w + 2));
        for (int j = 0; j < 16; j++) {
            sum += (d * (w[4 + j] & 15) + m) * x[b].d * x[b].qs[j];
            sum += (d * (w[4 + j] >> 4) + m) * x[b].d * x[b].qs[j + 16];
        }
    }
    return (float)sum;
}

static float ref_q8_0(const uint8_t *w, const block_q8 *x, int nb) {
    double sum = 0.0;
    for (int b = 0; b < nb; b++, w += 34) {
        const double d = f16_to_f32(rd16(w));
        for (int j = 0; j < QK; j++) sum += d * ((const int8_t *)w)[2 + j] * x[b].d * x[b].qs[j];
    }
    return (float)sum;
}

/* The builder's regrouping (models/quant.py interleave_*), written out independently from the layout comment */
static void interleave_q4_1(const uint8_t *rows, int N, int nb, uint8_t *out) {
    memset(out, 0, (size_t)(N + 7) / 8 * nb * Q4X8);
    for (int n = 0; n < N; n++)
        for (int b = 0; b < nb; b++) {
            const uint8_t *src = rows + ((size_t)n * nb + b) * 20;
            uint8_t *g = out + ((size_t)(n / 8) * nb + b) * Q4X8;
            const int r = n % 8;
            memcpy(g + 2 * r, src, 2);
            memcpy(g + 16 + 2 * r, src + 2, 2);
            for (int k = 0; k < 4; k++)
                for (int i = 0; i < 4; i++) {
                    /* q[j] = low nibble of byte j (j < 16), high nibble of byte j - 16 */
                    const int j0 = 4 * k + i, j1 = 16 + 4 * k + i;
                    const int q0 = src[4 + j0] & 15, q1 = src[4 + j1 - 16] >> 4;
                    g[32 + 32 * k + 4 * r + i] = (uint8_t)(q0 | q1 << 4);
                }
        }
}

static void interleave_q8_0(const uint8_t *rows, int N, int nb, uint8_t *out) {
    memset(out, 0, (size_t)(N + 7) / 8 * nb * Q8X8);
    for (int n = 0; n < N; n++)
        for (int b = 0; b < nb; b++) {
            const uint8_t *src = rows + ((size_t)n * nb + b) * 34;
            uint8_t *g = out + ((size_t)(n / 8) * nb + b) * Q8X8;
            const int r = n % 8;
            memcpy(g + 2 * r, src, 2);
            for (int k = 0; k < 8; k++)
                for (int i = 0; i < 4; i++) g[16 + 32 * k + 4 * r + i] = src[2 + 4 * k + i];
        }
}

int main(void) {
    enum { NB = 18, ROWS = 61, TOK = 7 }; /* 61 rows: a padded last group; 7 tokens: tiles of 4, 3, 2, 1 */
    static uint8_t w4[ROWS][NB * 20], w8[ROWS][NB * 34], g4[(ROWS + 7) / 8 * NB * Q4X8], g8[(ROWS + 7) / 8 * NB * Q8X8];
    static block_q8 x[TOK * NB];
    static float xf[TOK * NB * QK], y4[TOK][ROWS], y8[TOK][ROWS], y1[ROWS];
    int passed = 0, failed = 0;
    srand(7);
    for (int i = 0; i < TOK * NB * QK; i++) xf[i] = (float)(rand() % 2001 - 1000) / 250.f;
    for (int i = 0; i < QK; i++) xf[i] = (float)(i - 16) * 0.5f; /* exact halves: round-half-even cases */
    for (int i = QK; i < 2 * QK; i++) xf[i] = 0.f;             /* an all-zero block */
    for (int i = 0; i < QK; i++) xf[2 * NB * QK + 5 * QK + i] = (i % 2 ? -1.f : 1.f) * 3.f; /* extreme +-127 values */
    for (int t = 0; t < TOK; t++) quantize_q8(xf + t * NB * QK, x + t * NB, NB * QK);
    for (int r = 0; r < ROWS; r++) {
        for (int b = 0; b < NB; b++) {
            uint16_t d = (uint16_t)(0x1c00 + rand() % 0x800), m = (uint16_t)(0x9c00 + rand() % 0x800);
            memcpy(&w4[r][b * 20], &d, 2);
            memcpy(&w4[r][b * 20 + 2], &m, 2);
            for (int j = 0; j < 16; j++) w4[r][b * 20 + 4 + j] = (uint8_t)(r == 3 ? 0xff : rand()); /* row 3: all 15s */
            memcpy(&w8[r][b * 34], &d, 2);
            for (int j = 0; j < QK; j++) w8[r][b * 34 + 2 + j] = (uint8_t)(rand() % 256); /* int8 -128..127 */
        }
    }
    interleave_q4_1(&w4[0][0], ROWS, NB, g4);
    interleave_q8_0(&w8[0][0], ROWS, NB, g8);
    matmul(&y4[0][0], ROWS, g4, ROWS, x, NB, TOK, 0, 4);
    matmul(&y8[0][0], ROWS, g8, ROWS, x, NB, TOK, 1, 4);
    for (int t = 0; t < TOK; t++) {
        /* one token alone (decode) must give the same bits as inside a tile (prefill) */
        matmul(y1, ROWS, g4, ROWS, x + t * NB, NB, 1, 0, 4);
        int same = !memcmp(y1, y4[t], sizeof y1);
        matmul(y1, ROWS, g8, ROWS, x + t * NB, NB, 1, 1, 3);
        same &= !memcmp(y1, y8[t], sizeof y1);
        if (!same) fprintf(stderr, "token %d: alone differs from in a tile\n", t);
        passed += same;
        failed += !same;
        for (int r = 0; r < ROWS; r++) {
            float a = y4[t][r], e = ref_q4_1(w4[r], x + t * NB, NB);
            float b = y8[t][r], f = ref_q8_0(w8[r], x + t * NB, NB);
            int ok4 = fabsf(a - e) <= 1e-4f * (1.f + fabsf(e)), ok8 = fabsf(b - f) <= 1e-4f * (1.f + fabsf(f));
            if (!ok4) fprintf(stderr, "q4_1 row %d token %d: %.7g vs %.7g\n", r, t, a, e);
            if (!ok8) fprintf(stderr, "q8_0 row %d token %d: %.7g vs %.7g\n", r, t, b, f);
            passed += ok4 + ok8;
            failed += !ok4 + !ok8;
        }
    }
    /* quantize_q8 (SIMD where built) against the plain definition, bit for bit */
    for (int t = 0; t < TOK; t++) {
        for (int b = 0; b < NB; b++) {
            const float *xb = xf + (size_t)(t * NB + b) * QK;
            float amax = 0.f;
            int sum = 0, same = 1;
            for (int i = 0; i < QK; i++) amax = fabsf(xb[i]) > amax ? fabsf(xb[i]) : amax;
            const float d = amax / 127.f, id = d > 0.f ? 1.f / d : 0.f;
            for (int i = 0; i < QK; i++) {
                int q = (int)lrintf(xb[i] * id);
                sum += q;
                same &= x[t * NB + b].qs[i] == q;
            }
            same &= x[t * NB + b].d == d && x[t * NB + b].s == d * (float)sum;
            if (!same) fprintf(stderr, "quantize_q8 token %d block %d differs\n", t, b);
            passed += same;
            failed += !same;
        }
    }
    /* attention: chunks of ACH positions merged, against softmax in double, for SIMD and scalar head sizes */
    {
        enum { NPOS = 77, KVH = 2, GQ = 3, DMAX = 64 };
        static int8_t kvc[NPOS * 2 * KVH * DMAX];
        static float kvs[NPOS * 2 * KVH], qh[GQ * DMAX], parts[3 * GQ * (DMAX + 2)], out[GQ * DMAX];
        for (int D = 16; D <= DMAX; D = D == 16 ? 24 : D == 24 ? 64 : DMAX + 1) { /* 24: the scalar path */
            for (int i = 0; i < NPOS * 2 * KVH * D; i++) kvc[i] = (int8_t)(rand() % 255 - 127);
            for (int i = 0; i < NPOS * 2 * KVH; i++) kvs[i] = (float)(rand() % 1000 + 1) / 20000.f;
            for (int i = 0; i < GQ * D; i++) qh[i] = (float)(rand() % 2001 - 1000) / 100.f;
            const int kvh = 1, pst = 2 * KVH, nch = (NPOS + ACH - 1) / ACH;
            for (int ch = 0; ch < nch; ch++) {
                const int p0 = ch * ACH, p1 = p0 + ACH < NPOS ? p0 + ACH : NPOS;
                attn_chunk(qh, GQ, D, 0.125f, kvc + kvh * D, kvs + kvh, kvc + (KVH + kvh) * D, kvs + KVH + kvh, pst, p0, p1,
                           parts + ch * GQ * (D + 2));
            }
            attn_merge(parts, nch, GQ, D, out);
            for (int g = 0; g < GQ; g++) {
                double sc[NPOS], mx = -1e300, sum = 0.0;
                for (int p = 0; p < NPOS; p++) {
                    double dot = 0.0;
                    for (int i = 0; i < D; i++) dot += (double)qh[g * D + i] * kvc[(p * pst + kvh) * D + i];
                    sc[p] = dot * kvs[p * pst + kvh] * 0.125;
                    mx = sc[p] > mx ? sc[p] : mx;
                }
                for (int p = 0; p < NPOS; p++) { sc[p] = exp(sc[p] - mx); sum += sc[p]; }
                int ok = 1;
                for (int i = 0; i < D; i++) {
                    double o = 0.0;
                    for (int p = 0; p < NPOS; p++) o += sc[p] / sum * kvs[p * pst + KVH + kvh] * kvc[(p * pst + KVH + kvh) * D + i];
                    ok &= fabs(out[g * D + i] - o) <= 1e-4 * (1.0 + fabs(o));
                }
                if (!ok) fprintf(stderr, "attention D=%d head %d differs\n", D, g);
                passed += ok;
                failed += !ok;
            }
        }
    }
    /* the vector exp (inside softmax and SiLU) against exp in double, over a dense grid */
    {
        enum { NX = 4096 };
        static float xs[NX], ys[NX], gs[64], us[64], as[64];
        double worst = 0.0, ref = 0.0;
        for (int i = 0; i < NX; i++) xs[i] = ys[i] = -80.f + 164.f * i / NX; /* -80 .. 84 */
        const float sum = exp_shift_sum(ys, NX, 0.f);
        for (int i = 0; i < NX; i++) {
            const double e = exp((double)xs[i]), rel = fabs(ys[i] - e) / e;
            worst = rel > worst ? rel : worst;
            ref += e;
        }
        int ok = worst <= 2.5e-7 && fabs(sum - ref) <= 1e-6 * ref;
        for (int i = 0; i < 64; i++) { gs[i] = (float)(i - 32) * 0.37f; us[i] = 1.f + 0.01f * i; }
        swiglu(as, gs, us, 64);
        for (int i = 0; i < 64; i++) ok &= fabsf(as[i] - gs[i] / (1.f + expf(-gs[i])) * us[i]) <= 1e-6f * (1.f + fabsf(as[i]));
        if (!ok) fprintf(stderr, "exp / swiglu: worst relative error %.3g\n", worst);
        passed += ok;
        failed += !ok;
    }
    /* quantize_head: round half to even, floor on the scale */
    float hv[64] = {0};
    int8_t hq[64];
    float hs;
    quantize_head(hv, hq, &hs, 64);
    int okz = hs == KV_SCALE_FLOOR && hq[0] == 0;
    passed += okz;
    failed += !okz;
    /* bt_scratch_new: thread counts below 1 and bad shapes are refused; 200 threads get 200 attention slots */
    {
        const bt_config c = {2, 64, 4, 2, 16, 96, 40, 70, 1e-5f, 0.25f, 1};
        bt_config bad = c;
        bad.n_kv_heads = 3; /* 4 query heads cannot share 3 KV heads */
        int ok = !bt_scratch_new(&c, 4, 0) && !bt_scratch_new(&c, 4, -1) && !bt_scratch_new(&c, 0, 2) &&
                 !bt_scratch_new(&bad, 4, 2) && !bt_scratch_new(NULL, 4, 2) && live == 0;
        bt_scratch *s = (bt_scratch *)bt_scratch_new(&c, 4, 200);
        ok &= s && s->n_threads == 200;
        if (s) { /* the last slot of the last chunk is writable: (200 slots x 3 chunks - 1) x G x (D + 2) onward */
            const size_t last = ((size_t)200 * ((70 + ACH - 1) / ACH) - 1) * 2 * (16 + 2);
            for (size_t i = 0; i < 2 * (16 + 2); i++) s->parts[last + i] = 1.f;
        }
        bt_scratch_free(s);
        if (!ok) fprintf(stderr, "bt_scratch_new: argument checks failed\n");
        passed += ok;
        failed += !ok;
        /* a failed allocation, at each of its 8 allocations in turn, returns NULL and leaks nothing */
        for (int k = 1; k <= 8; k++) {
            fail_in = k;
            void *f = bt_scratch_new(&c, 4, 3);
            fail_in = 0;
            const int clean = !f && live == 0;
            if (!clean) fprintf(stderr, "bt_scratch_new with allocation %d failing: %s, %ld blocks left\n", k,
                                f ? "not NULL" : "NULL", live);
            bt_scratch_free(f);
            passed += clean;
            failed += !clean;
        }
        void *f = bt_scratch_new(&c, 4, 3); /* and nothing is left once a good one is freed */
        bt_scratch_free(f);
        const int clean = f && live == 0;
        passed += clean;
        failed += !clean;
    }
    printf("%s: %d passed, %d failed\n", bt_simd(), passed, failed);
    return failed != 0;
}
