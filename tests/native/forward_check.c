/* Runs the whole native forward pass (bt_forward) from a spec written by tests/test_native_kernels.py,
 * so the ARM builds can be checked end to end under qemu-user against the x86 result:
 *
 *   forward_check SPEC WEIGHTS OUT
 *
 * SPEC (little-endian): bt_config; int64 offsets of token_embd and output_norm; per layer int64
 * offsets of attn_norm, ffn_norm, q, k, v, o, gate, up, down; rope cos then sin (max_seq x D/2 f32);
 * int32 T; int64 ids[T + 1]. It prefills ids[0..T) in one call, then decodes ids[T] alone, and
 * writes every position's logits ((T + 1) x vocab f32) to OUT. */
#include "../../runtime/native/bt_native.c"
#include <stdio.h>

static void *slurp(const char *path, size_t *n) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    *n = (size_t)ftell(f);
    fseek(f, 0, SEEK_SET);
    void *p = malloc(*n ? *n : 1);
    if (p && fread(p, 1, *n, f) != *n) { free(p); p = NULL; }
    fclose(f);
    return p;
}

int main(int argc, char **argv) {
    if (argc != 4) { fprintf(stderr, "usage: forward_check SPEC WEIGHTS OUT\n"); return 2; }
    size_t ns, nw;
    uint8_t *spec = (uint8_t *)slurp(argv[1], &ns), *wts = (uint8_t *)slurp(argv[2], &nw);
    if (!spec || !wts) { fprintf(stderr, "cannot read inputs\n"); return 2; }
    bt_config c;
    memcpy(&c, spec, sizeof c);
    const int L = c.n_layers, D = c.head_dim;
    const uint8_t *p = spec + sizeof c;
    int64_t off[2];
    memcpy(off, p, sizeof off);
    p += sizeof off;
    const float **an = malloc(sizeof(void *) * L), **fn = malloc(sizeof(void *) * L);
    const uint8_t **m[7];
    for (int i = 0; i < 7; i++) m[i] = malloc(sizeof(void *) * L);
    for (int l = 0; l < L; l++) {
        int64_t o[9];
        memcpy(o, p, sizeof o);
        p += sizeof o;
        an[l] = (const float *)(wts + o[0]);
        fn[l] = (const float *)(wts + o[1]);
        for (int i = 0; i < 7; i++) m[i][l] = wts + o[2 + i];
    }
    const size_t rope = (size_t)c.max_seq * (D / 2);
    float *cs = malloc(sizeof(float) * rope), *sn = malloc(sizeof(float) * rope);
    memcpy(cs, p, sizeof(float) * rope);
    p += sizeof(float) * rope;
    memcpy(sn, p, sizeof(float) * rope);
    p += sizeof(float) * rope;
    int32_t T;
    memcpy(&T, p, 4);
    p += 4;
    int64_t *ids = malloc(sizeof(int64_t) * (T + 1));
    memcpy(ids, p, sizeof(int64_t) * (T + 1));
    bt_weights w = {wts + off[0], (const float *)(wts + off[1]), cs, sn, an, fn, m[0], m[1], m[2], m[3], m[4], m[5], m[6]};
    const size_t kvn = (size_t)L * c.max_seq * 2 * c.n_kv_heads;
    int8_t *kv = calloc(kvn * D, 1);
    float *ks = calloc(kvn, sizeof(float)), *logits = malloc(sizeof(float) * (size_t)(T + 1) * c.vocab);
    void *s = bt_scratch_new(&c, T, 2);
    if (!s) { fprintf(stderr, "bt_scratch_new failed\n"); return 1; }
    int rc = bt_forward(&c, &w, s, ids, T, 0, kv, ks, logits, 0);
    if (!rc) rc = bt_forward(&c, &w, s, ids + T, 1, T, kv, ks, logits + (size_t)T * c.vocab, 0);
    if (rc) { fprintf(stderr, "bt_forward failed: %d\n", rc); return 1; }
    FILE *f = fopen(argv[3], "wb");
    fwrite(logits, sizeof(float), (size_t)(T + 1) * c.vocab, f);
    fclose(f);
    bt_scratch_free(s);
    printf("%s: ok\n", bt_simd());
    return 0;
}
