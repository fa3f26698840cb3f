/* Checks the SIMD dot products of bt_native.c (AVX2 / NEON / NEON dotprod, whichever this build
 * selects) against plain scalar arithmetic on random blocks. Prints "N passed, M failed".
 * Built and run by tests/test_native_kernels.py: natively, and for aarch64 under qemu when a cross
 * compiler is installed. */
#include "../../runtime/native/bt_native.c"
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

int main(void) {
    enum { NB = 18, ROWS = 64 };
    static uint8_t w4[ROWS][NB * 20], w8[ROWS][NB * 34];
    static block_q8 x[4 * NB];
    static float xf[4 * NB * QK];
    int passed = 0, failed = 0;
    srand(7);
    for (int i = 0; i < 4 * NB * QK; i++) xf[i] = (float)(rand() % 2001 - 1000) / 250.f;
    for (int i = 0; i < QK; i++) xf[i] = (float)(i - 16) * 0.5f; /* exact halves: round-half-even cases */
    for (int i = QK; i < 2 * QK; i++) xf[i] = 0.f;             /* an all-zero block */
    for (int t = 0; t < 4; t++) quantize_q8(xf + t * NB * QK, x + t * NB, NB * QK);
    for (int r = 0; r < ROWS; r++) {
        for (int b = 0; b < NB; b++) {
            uint16_t d = (uint16_t)(0x1c00 + rand() % 0x800), m = (uint16_t)(0x9c00 + rand() % 0x800);
            memcpy(&w4[r][b * 20], &d, 2);
            memcpy(&w4[r][b * 20 + 2], &m, 2);
            for (int j = 0; j < 16; j++) w4[r][b * 20 + 4 + j] = (uint8_t)rand();
            memcpy(&w8[r][b * 34], &d, 2);
            for (int j = 0; j < QK; j++) w8[r][b * 34 + 2 + j] = (uint8_t)(rand() % 255 + 129); /* int8 -127..127 */
        }
        for (int t = 0; t < 4; t++) {
            float a = dot_q4_1(w4[r], x + t * NB, NB), e = ref_q4_1(w4[r], x + t * NB, NB);
            float b = dot_q8_0(w8[r], x + t * NB, NB), f = ref_q8_0(w8[r], x + t * NB, NB);
            int ok4 = fabsf(a - e) <= 1e-4f * (1.f + fabsf(e)), ok8 = fabsf(b - f) <= 1e-4f * (1.f + fabsf(f));
            if (!ok4) fprintf(stderr, "q4_1 row %d token %d: %.7g vs %.7g\n", r, t, a, e);
            if (!ok8) fprintf(stderr, "q8_0 row %d token %d: %.7g vs %.7g\n", r, t, b, f);
            passed += ok4 + ok8;
            failed += !ok4 + !ok8;
        }
    }
    /* quantize_q8 (SIMD where built) against the plain definition, bit for bit */
    for (int t = 0; t < 4; t++) {
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
    /* quantize_head: round half to even, floor on the scale */
    float hv[64] = {0};
    int8_t hq[64];
    float hs;
    quantize_head(hv, hq, &hs, 64);
    int okz = hs == KV_SCALE_FLOOR && hq[0] == 0;
    passed += okz;
    failed += !okz;
    printf("%s: %d passed, %d failed\n", bt_simd(), passed, failed);
    return failed != 0;
}
