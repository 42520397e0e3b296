/* MXFP4 expert product on the CPU: y[n, j, :] = x[n, j or 0, :] . W[idx[n, j]]^T, W packed as the checkpoint keeps it.

   blocks [E, out, G, 16] uint8: two E2M1 codes a byte, the low nibble the earlier value; scales [E, out, G] uint8
   (E8M0: 2^(s - 127); 0xFF is NaN, as the OCP MX spec has it); x float32 [N, kx, G * 32] with kx 1 (every pick
   reads row n) or k; idx int64 [N, k], each in [0, E) (the caller checks: this file trusts it); y float32
   [N, k, out].

   A code is decoded by a 16-entry table held in a register (a byte shuffle: one instruction for 16 codes), the
   table holding twice each E2M1 value so that it fits int8 (0, 1, 2, 3, 4, 6, 8, 12 and their negatives); the
   group's scale (with the 1/2) multiplies the group's 32-value partial sum. Built by
   neffbuild/runtime/native_build.py with the host's -march: AVX-512 (16 lanes) or AVX2 + FMA (8); elsewhere the
   plain loop (same sums, slower). */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

static const int8_t TWICE_E2M1[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

/* The group's scale with the table's 1/2; byte 255 is NaN (OCP MX E8M0), as in runtime/native.py's e8m0. */
static float half_scale(uint8_t s) { return s == 255 ? NAN : ldexpf(0.5f, (int)s - 127); }

#if (defined(__AVX512F__) && defined(__AVX512BW__)) || (defined(__AVX2__) && defined(__FMA__))
/* One group's 16 bytes -> its 32 values as int8 (twice E2M1), in order: [0..15] and [16..31]. */
static inline void decode_group(const uint8_t *bytes, __m128i *first, __m128i *second) {
    const __m128i table = _mm_loadu_si128((const __m128i *)TWICE_E2M1);
    const __m128i low4 = _mm_set1_epi8(0x0F);
    const __m128i b = _mm_loadu_si128((const __m128i *)bytes);
    const __m128i lo = _mm_shuffle_epi8(table, _mm_and_si128(b, low4));  /* the low nibble: the earlier value */
    const __m128i hi = _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(b, 4), low4));
    *first = _mm_unpacklo_epi8(lo, hi);
    *second = _mm_unpackhi_epi8(lo, hi);
}
#endif

#define MX_CHUNK 4 /* picks of one expert sharing each decoded group (their accumulators stay in registers) */

/* One weight row against ``cnt`` (1..MX_CHUNK) x rows, each group decoded once for all of them; every x row's sum is
   formed exactly as a row alone would form it (same operations, same order), so sharing changes no bit. */
#if defined(__AVX512F__) && defined(__AVX512BW__)
/* 16 lanes: a group's 32 values are two vectors, each one widen of 16 decoded int8 and one FMA. */
static inline __attribute__((always_inline)) void rows_dot(const float *const *x, const int cnt, const uint8_t *row,
                                                             const uint8_t *scales, int64_t groups,
                                                             const float *scale_of, float *out) {
    __m512 acc[MX_CHUNK];
#pragma GCC unroll 4
    for (int t = 0; t < MX_CHUNK; t++) acc[t] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        __m128i c0, c1;
        decode_group(row + g * 16, &c0, &c1);
        const __m512 v0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(c0));  /* values 0..15 */
        const __m512 v1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(c1));  /* 16..31 */
        const __m512 sg = _mm512_set1_ps(scale_of[scales[g]]);
#pragma GCC unroll 4
        for (int t = 0; t < cnt; t++) {
            __m512 part = _mm512_mul_ps(v0, _mm512_loadu_ps(x[t] + g * 32));
            part = _mm512_fmadd_ps(v1, _mm512_loadu_ps(x[t] + g * 32 + 16), part);
            acc[t] = _mm512_fmadd_ps(part, sg, acc[t]);
        }
    }
#pragma GCC unroll 4
    for (int t = 0; t < cnt; t++) out[t] = _mm512_reduce_add_ps(acc[t]);
}
#elif defined(__AVX2__) && defined(__FMA__)
static inline __m256 widen(__m128i bytes8) {  /* the low 8 int8 of a register -> 8 float32 */
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes8));
}

static inline float hsum256(__m256 acc) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline __attribute__((always_inline)) void rows_dot(const float *const *x, const int cnt, const uint8_t *row,
                                                             const uint8_t *scales, int64_t groups,
                                                             const float *scale_of, float *out) {
    __m256 acc[MX_CHUNK];
#pragma GCC unroll 4
    for (int t = 0; t < MX_CHUNK; t++) acc[t] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        __m128i v0, v1;
        decode_group(row + g * 16, &v0, &v1);  /* values 0..15 and 16..31 of the group */
        const __m256 w0 = widen(v0), w1 = widen(_mm_srli_si128(v0, 8)), w2 = widen(v1), w3 = widen(_mm_srli_si128(v1, 8));
        const __m256 sg = _mm256_set1_ps(scale_of[scales[g]]);
#pragma GCC unroll 4
        for (int t = 0; t < cnt; t++) {
            const float *xg = x[t] + g * 32;
            __m256 part = _mm256_mul_ps(w0, _mm256_loadu_ps(xg));
            part = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xg + 8), part);
            part = _mm256_fmadd_ps(w2, _mm256_loadu_ps(xg + 16), part);
            part = _mm256_fmadd_ps(w3, _mm256_loadu_ps(xg + 24), part);
            acc[t] = _mm256_fmadd_ps(part, sg, acc[t]);
        }
    }
#pragma GCC unroll 4
    for (int t = 0; t < cnt; t++) out[t] = hsum256(acc[t]);
}
#else
static void rows_dot(const float *const *x, const int cnt, const uint8_t *row, const uint8_t *scales, int64_t groups,
                     const float *scale_of, float *out) {
    for (int t = 0; t < cnt; t++) {
        float acc = 0.0f;
        for (int64_t g = 0; g < groups; g++) {
            float part = 0.0f;
            for (int i = 0; i < 16; i++) {
                const uint8_t b = row[g * 16 + i];
                part += TWICE_E2M1[b & 0x0F] * x[t][g * 32 + 2 * i] + TWICE_E2M1[b >> 4] * x[t][g * 32 + 2 * i + 1];
            }
            acc += part * scale_of[scales[g]];
        }
        out[t] = acc;
    }
}
#endif

/* The picks (n * k of them) as runs of one expert, each cut at ``chunk`` picks: pairs[2p] the expert and pairs[2p+1]
   the pick, sorted; run r is picks starts[r] .. starts[r + 1] - 1 of that order. The number of runs. */
static int by_expert(const void *a, const void *b) {  /* (expert, pick) pairs, ascending */
    const int64_t *x = a, *y = b;
    return x[0] != y[0] ? (x[0] < y[0] ? -1 : 1) : (x[1] < y[1] ? -1 : x[1] > y[1]);
}

static int64_t expert_runs(const int64_t *idx, int64_t picks, int chunk, int64_t *pairs, int64_t *starts) {
    for (int64_t p = 0; p < picks; p++) { pairs[2 * p] = idx[p]; pairs[2 * p + 1] = p; }
    qsort(pairs, (size_t)picks, 2 * sizeof(int64_t), by_expert);
    int64_t runs = 0;
    for (int64_t p = 0; p < picks; p++)
        if (p == 0 || pairs[2 * p] != pairs[2 * p - 2] || p - starts[runs - 1] == chunk) starts[runs++] = p;
    starts[runs] = picks;
    return runs;
}

/* The x row a pick reads: row n (kx 1) or its own (kx k). */
static inline int64_t x_row(int64_t pick, int64_t k, int64_t kx) { return (pick / k) * kx + (kx == 1 ? 0 : pick % k); }

/* 2: the AVX-512 path, 1: AVX2, 0: the plain loop (the caller reports it). */
int neffbuild_mxfp4_vectorised(void) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
    return 2;
#elif defined(__AVX2__) && defined(__FMA__)
    return 1;
#else
    return 0;
#endif
}

#define MAX_CHUNK 8 /* the largest chunk of any loop below (the int8 form's) */
_Static_assert(MX_CHUNK <= MAX_CHUNK, "mx_drive's unit arrays hold MAX_CHUNK picks");

/* One unit of work: one weight row against the x rows ``xr[0..cnt)`` (row indices into the loop's own activations,
   ``ctx``: float32, bf16, or quantized), each group decoded once for all of them. */
typedef void (*rows_fn)(const void *ctx, const int64_t *xr, int cnt, const uint8_t *row, const uint8_t *sc,
                        int64_t groups, const float *scale_of, float *out);

/* Four weight rows (``nr`` <= 4 of them) against one x row in step: out[j] for row j (a form's optional unit). */
typedef void (*rows4_fn)(const void *ctx, int64_t xr, const uint8_t *const *rows, const uint8_t *const *scs, int nr,
                         int64_t groups, const float *scale_of, float *out);

/* The expert products' driver, every form's: the picks as runs of one expert in chunks of ``chunk``, and work units
   (run, four output rows), each decoding a row's groups once for every pick of the run (``fn``). A run of one pick
   (batch 1, and most runs at small batches) with ``fn4`` reads its four rows in step from the four quarters of the
   expert (o = u, u + Q, u + 2Q, u + 3Q; Q = ceil(out / 4)): four read streams far apart, which one core reads faster
   than one (``neffbuild_q8_head16``); other runs take rows 4u .. 4u + 3 one after another. 0, or 1 when the scratch
   could not be allocated (nothing written). */
static int mx_drive(const void *ctx, int chunk, int64_t kx, const uint8_t *blocks, const uint8_t *scales,
                    const int64_t *idx, int64_t n, int64_t k, int64_t out, int64_t groups, float *y, int threads,
                    rows_fn fn, rows4_fn fn4) {
    const int64_t picks = n * k;
    int64_t *pairs = malloc((size_t)(2 * picks + 1) * sizeof(int64_t));
    int64_t *starts = malloc((size_t)(picks + 2) * sizeof(int64_t));
    if (!pairs || !starts) { free(pairs); free(starts); return 1; }
    float scale_of[256];
    for (int s = 0; s < 256; s++) scale_of[s] = half_scale((uint8_t)s);
    const int64_t runs = expert_runs(idx, picks, chunk, pairs, starts);
    const int64_t quarter = (out + 3) / 4;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t u = 0; u < runs * quarter; u++) {
        const int64_t r = u / quarter, v = u % quarter, e = pairs[2 * starts[r]];
        const int cnt = (int)(starts[r + 1] - starts[r]);
        int64_t xr[MAX_CHUNK];
        for (int t = 0; t < cnt; t++) xr[t] = x_row(pairs[2 * (starts[r] + t) + 1], k, kx);
        if (cnt == 1 && fn4 != NULL) {
            const uint8_t *rows[4], *scs[4];
            float res[4];
            int nr = 0;
            for (; nr < 4 && nr * quarter + v < out; nr++) {
                const int64_t o = nr * quarter + v;
                rows[nr] = blocks + (e * out + o) * groups * 16;
                scs[nr] = scales + (e * out + o) * groups;
            }
            fn4(ctx, xr[0], rows, scs, nr, groups, scale_of, res);
            for (int j = 0; j < nr; j++) y[pairs[2 * starts[r] + 1] * out + j * quarter + v] = res[j];
            continue;
        }
        for (int64_t o = 4 * v; o < 4 * v + 4 && o < out; o++) {
            float res[MAX_CHUNK];
            fn(ctx, xr, cnt, blocks + (e * out + o) * groups * 16, scales + (e * out + o) * groups, groups, scale_of,
               res);
            for (int t = 0; t < cnt; t++) y[pairs[2 * (starts[r] + t) + 1] * out + o] = res[t];
        }
    }
    free(pairs); free(starts);
    return 0;
}

/* ``rows_dot`` with the count a constant where it is inlined: the accumulators stay in registers. */
static void rows_f32(const void *ctx, const int64_t *xr, int cnt, const uint8_t *row, const uint8_t *sc,
                     int64_t groups, const float *scale_of, float *out) {
    const float *xf[MX_CHUNK];
    for (int t = 0; t < cnt; t++) xf[t] = (const float *)ctx + xr[t] * groups * 32;
    switch (cnt) {
        case 1: rows_dot(xf, 1, row, sc, groups, scale_of, out); break;
        case 2: rows_dot(xf, 2, row, sc, groups, scale_of, out); break;
        case 3: rows_dot(xf, 3, row, sc, groups, scale_of, out); break;
        default: rows_dot(xf, 4, row, sc, groups, scale_of, out); break;
    }
}

int neffbuild_mxfp4_dot(const float *x, int64_t kx, const uint8_t *blocks, const uint8_t *scales,
                        const int64_t *idx, int64_t n, int64_t k, int64_t out, int64_t groups, float *y,
                        int threads) {
    return mx_drive(x, MX_CHUNK, kx, blocks, scales, idx, n, k, out, groups, y, threads, rows_f32, NULL);
}

/* bf16 linear without bias, y[m, o] = sum_k x[m, k] w[o, k] (the LM head over the vocabulary): bf16 inputs, float32
   sums (x times w is exact in float32), rounded to bf16 by the caller as a bf16 matmul's output is. Each weight row
   is read once for every row of x (up to 4 at a time). AVX-512 BF16: one dot-product instruction per 32 weights;
   AVX2 + FMA: 8 weights widened to float32 by a 16-bit shift (bf16 is float32's upper half) and one FMA a row, x
   widened once up front; elsewhere the plain loop. */
static inline float bf16_to_float(uint16_t h) {
    union { uint32_t u; float f; } v = {.u = (uint32_t)h << 16};
    return v.f;
}

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define BF16_PATH 2
typedef uint16_t x_t;  /* x as the caller's bf16 */
/* m (1..4) rows of x against one weight row; m is a constant where it is called (below), so the accumulators stay
   in registers. */
static inline __attribute__((always_inline)) void rows_dot_m(const uint16_t *x, const int m, const uint16_t *w,
                                                               int64_t in, float *y, int64_t ystride) {
    /* Two accumulators a row (even and odd 32-weight chunks): the dot product's latency, not its throughput, bounds
       one chain. */
    __m512 acc[4], acc2[4];
#pragma GCC unroll 4
    for (int i = 0; i < 4; i++) acc[i] = acc2[i] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 64 <= in; k += 64) {
        const __m512bh wv = (__m512bh)_mm512_loadu_si512((const void *)(w + k));
        const __m512bh wv2 = (__m512bh)_mm512_loadu_si512((const void *)(w + k + 32));
#pragma GCC unroll 4
        for (int i = 0; i < m; i++) {
            acc[i] = _mm512_dpbf16_ps(acc[i], (__m512bh)_mm512_loadu_si512((const void *)(x + i * in + k)), wv);
            acc2[i] = _mm512_dpbf16_ps(acc2[i], (__m512bh)_mm512_loadu_si512((const void *)(x + i * in + k + 32)),
                                       wv2);
        }
    }
    for (; k + 32 <= in; k += 32) {
        const __m512bh wv = (__m512bh)_mm512_loadu_si512((const void *)(w + k));
#pragma GCC unroll 4
        for (int i = 0; i < m; i++)
            acc[i] = _mm512_dpbf16_ps(acc[i], (__m512bh)_mm512_loadu_si512((const void *)(x + i * in + k)), wv);
    }
#pragma GCC unroll 4
    for (int i = 0; i < m; i++) {
        float s = _mm512_reduce_add_ps(_mm512_add_ps(acc[i], acc2[i]));
        for (int64_t t = k; t < in; t++) s += bf16_to_float(x[i * in + t]) * bf16_to_float(w[t]);
        y[i * ystride] = s;
    }
}
#elif defined(__AVX2__) && defined(__FMA__)
#define BF16_PATH 1
typedef float x_t;  /* x widened to float32 once */
static inline __m256 widen_bf16(const uint16_t *p) {  /* 8 bf16 -> 8 float32 */
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

/* Two weight rows' sums from their accumulators, the columns past the last 8 (or 16) added one by one. */
static inline void finish_pair(__m256 acc0, __m256 acc1, const float *x, const uint16_t *w, int64_t in, int64_t k,
                               float *y) {
    for (int r = 0; r < 2; r++) {
        const __m256 v = r ? acc1 : acc0;
        __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        h = _mm_add_ps(h, _mm_movehl_ps(h, h));
        h = _mm_add_ss(h, _mm_movehdup_ps(h));
        float s = _mm_cvtss_f32(h);
        for (int64_t t = k; t < in; t++) s += x[t] * bf16_to_float(w[r * in + t]);
        y[r] = s;
    }
}

/* m (1..4) rows of x against two weight rows (w and w + in), y[i][0] and y[i][1]: each load of x serves two rows of
   weights, which halves the reads of x (four float32 rows of GPT-OSS's 2,880 are 46 KB, past a 32 KB L1: reading
   them from L2 once for every weight row bound the loop), and 2m chains of FMAs stay in flight. */
static inline __attribute__((always_inline)) void rows_dot_m(const float *x, const int m, const uint16_t *w,
                                                               int64_t in, float *y, int64_t ystride) {
    __m256 acc[4], acc2[4];
#pragma GCC unroll 4
    for (int i = 0; i < 4; i++) acc[i] = acc2[i] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 <= in; k += 8) {
        const __m256 w0 = widen_bf16(w + k), w1 = widen_bf16(w + in + k);
#pragma GCC unroll 4
        for (int i = 0; i < m; i++) {
            const __m256 xv = _mm256_loadu_ps(x + i * in + k);
            acc[i] = _mm256_fmadd_ps(xv, w0, acc[i]);
            acc2[i] = _mm256_fmadd_ps(xv, w1, acc2[i]);
        }
    }
#pragma GCC unroll 4
    for (int i = 0; i < m; i++) finish_pair(acc[i], acc2[i], x + i * in, w, in, k, y + i * ystride);
}
#else
#define BF16_PATH 0
typedef float x_t;
#endif

#if BF16_PATH == 2
static void rows_dot_bf16(const x_t *x, int64_t m, const uint16_t *w, int64_t in, float *y, int64_t ystride) {
    switch (m) {
        case 1: rows_dot_m(x, 1, w, in, y, ystride); break;
        case 2: rows_dot_m(x, 2, w, in, y, ystride); break;
        case 3: rows_dot_m(x, 3, w, in, y, ystride); break;
        default: rows_dot_m(x, 4, w, in, y, ystride); break;
    }
}
#elif BF16_PATH == 1
/* One row of x against two weight rows, two chains each (one chain a row would leave the FMA's latency exposed). */
static void row_dot_1(const float *x, const uint16_t *w, int64_t in, float *y) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, b0 = a0, b1 = a0;
    int64_t k = 0;
    for (; k + 16 <= in; k += 16) {
        const __m256 x0 = _mm256_loadu_ps(x + k), x1 = _mm256_loadu_ps(x + k + 8);
        a0 = _mm256_fmadd_ps(x0, widen_bf16(w + k), a0);
        a1 = _mm256_fmadd_ps(x1, widen_bf16(w + k + 8), a1);
        b0 = _mm256_fmadd_ps(x0, widen_bf16(w + in + k), b0);
        b1 = _mm256_fmadd_ps(x1, widen_bf16(w + in + k + 8), b1);
    }
    finish_pair(_mm256_add_ps(a0, a1), _mm256_add_ps(b0, b1), x, w, in, k, y);
}

/* Rows of w in pairs (``rows_dot_m``, ``row_dot_1``); an odd last row through a zero-padded copy. */
static void rows_dot_bf16(const x_t *x, int64_t m, const uint16_t *w, int64_t in, float *y, int64_t ystride) {
    switch (m) {
        case 1: row_dot_1(x, w, in, y); break;
        case 2: rows_dot_m(x, 2, w, in, y, ystride); break;
        case 3: rows_dot_m(x, 3, w, in, y, ystride); break;
        default: rows_dot_m(x, 4, w, in, y, ystride); break;
    }
}
#else
static void rows_dot_bf16(const float *x, int64_t m, const uint16_t *w, int64_t in, float *y, int64_t ystride) {
    for (int64_t i = 0; i < m; i++) {
        float s = 0.0f;
        for (int64_t t = 0; t < in; t++) s += x[i * in + t] * bf16_to_float(w[t]);
        y[i * ystride] = s;
    }
}
#endif

/* 2: AVX-512 BF16 dot products, 1: AVX2 + FMA, 0: the plain loop (the Python side uses the matmul there). */
int neffbuild_bf16_native(void) { return BF16_PATH; }

/* 0, or 1 when its scratch (the widened copy of x, an odd last row) could not be allocated (nothing written then). */
int neffbuild_bf16_linear(const uint16_t *x, int64_t m, const uint16_t *w, int64_t out, int64_t in, float *y,
                          int threads) {
#if BF16_PATH == 2
    const x_t *xs = x;
#else
    float *xs = malloc((size_t)(m * in) * sizeof(float));
    if (xs == NULL) return 1;
    for (int64_t t = 0; t < m * in; t++) xs[t] = bf16_to_float(x[t]);
#endif
#if BF16_PATH == 1
    /* Weight rows in pairs; an odd count's last row is one of a pair with a zero row (its second sum discarded), its
       scratch allocated before anything is written. */
    uint16_t *last = NULL;
    float *two = NULL;
    if (out % 2) {
        last = calloc((size_t)(2 * in), sizeof(uint16_t));
        two = malloc((size_t)(2 * m) * sizeof(float));
        if (last == NULL || two == NULL) { free(last); free(two); free(xs); return 1; }
        memcpy(last, w + (out - 1) * in, (size_t)in * sizeof(uint16_t));
    }
    int64_t pairs = out / 2;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t p = 0; p < pairs; p++)
        for (int64_t i0 = 0; i0 < m; i0 += 4)
            rows_dot_bf16(xs + i0 * in, m - i0 < 4 ? m - i0 : 4, w + 2 * p * in, in, y + i0 * out + 2 * p, out);
    if (out % 2) {
        for (int64_t i0 = 0; i0 < m; i0 += 4)
            rows_dot_bf16(xs + i0 * in, m - i0 < 4 ? m - i0 : 4, last, in, two + i0 * 2, 2);
        for (int64_t i = 0; i < m; i++) y[i * out + out - 1] = two[i * 2];
        free(last);
        free(two);
    }
    free(xs);
#else
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t o = 0; o < out; o++)
        for (int64_t i0 = 0; i0 < m; i0 += 4)
            rows_dot_bf16(xs + i0 * in, m - i0 < 4 ? m - i0 : 4, w + o * in, in, y + i0 * out + o, out);
#if BF16_PATH == 0
    free(xs);
#endif
#endif
    return 0;
}

/* ---------------------------------------------------------------------------------------------------------------
   Integer forms (opt-in recipe options, runtime/native.py: ``mxfp4_q8_dot`` and ``q8_head``): they change the
   numbers, so the float forms above stay the default.

   Activations quantized per 32-value block to int8 with one float scale (d = max|x| / 127, q = x / d rounded to
   nearest even); within a block q is stored as its 16 even-position values then its 16 odd ones, the order in which
   one 16-byte MXFP4 group decodes with no unpack (low nibbles = even positions, high nibbles = odd). A block's dot
   product is an exact int32 sum of q times twice the E2M1 value (|sum| <= 32 * 127 * 12), then one float FMA with
   d * 2^(s - 127) / 2. A block with a non-finite value has d NaN and q 0: its output is NaN, as in the float form. */

static void q8_quantize_block(const float *x, int8_t *q, float *d) {
    float amax = 0.0f;
    int finite = 1;
    for (int i = 0; i < 32; i++) {
        const float a = fabsf(x[i]);
        finite &= isfinite(a) != 0;
        amax = a > amax ? a : amax;
    }
    if (!finite) {
        memset(q, 0, 32);
        *d = NAN;
        return;
    }
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    *d = amax / 127.0f;
    for (int i = 0; i < 32; i++) q[(i & 1) * 16 + (i >> 1)] = (int8_t)nearbyintf(x[i] * inv);
}

/* x float32 [rows, groups * 32] -> q int8 [rows, groups * 32] (each block even values, then odd), d [rows, groups]. */
void neffbuild_q8_quantize(const float *x, int64_t rows, int64_t groups, int8_t *q, float *d) {
    for (int64_t b = 0; b < rows * groups; b++) q8_quantize_block(x + b * 32, q + b * 32, d + b);
}

#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
#define Q8_PATH 2
#elif defined(__AVX2__)
#define Q8_PATH 1
#else
#define Q8_PATH 0
#endif

/* 2: AVX512-VNNI (or AVX-VNNI) dpbusd, 1: AVX2 maddubs + madd, 0: the plain loop. */
int neffbuild_q8_path(void) { return Q8_PATH; }

#define Q8_CHUNK 8 /* picks of one expert sharing each decoded block */
_Static_assert(Q8_CHUNK <= MAX_CHUNK, "mx_drive's unit arrays hold MAX_CHUNK picks");

#if Q8_PATH >= 1
/* One group's 16 bytes -> its 32 codes as twice-E2M1 int8: the 16 low nibbles (even positions), then the 16 high
   ones. The bytes are broadcast to both 128-bit lanes, the upper lane shifted by 4 (a 32-bit shift: the bits from
   the next byte are masked off), and one in-lane shuffle looks all 32 up. */
static inline __m256i q8_decode(const uint8_t *bytes, __m256i table, __m256i shifts, __m256i low4) {
    const __m256i b = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)bytes));
    return _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srlv_epi32(b, shifts), low4));
}

/* sum over 32 of |c| * (q signed by c), as 8 int32 partial sums (the unsigned x signed product has |c| unsigned). */
static inline __m256i q8_dot(__m256i absc, __m256i c, __m256i q) {
    const __m256i sq = _mm256_sign_epi8(q, c);
#if Q8_PATH == 2 && defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), absc, sq);
#elif Q8_PATH == 2
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), absc, sq);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(absc, sq), _mm256_set1_epi16(1));
#endif
}

static inline float q8_hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* One weight row (its groups' bytes and scales) against ``cnt`` (<= Q8_CHUNK) quantized x rows: each group decoded
   once for all of them (inlined with ``cnt`` a constant, rows_q8: the accumulators stay in registers). */
static inline __attribute__((always_inline)) void q8_row(const uint8_t *w, const uint8_t *sc, int64_t groups,
                                                           const float *scale_of, const int8_t *const *q,
                                                           const float *const *d, const int cnt, float *out) {
    const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)TWICE_E2M1));
    const __m256i shifts = _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4), low4 = _mm256_set1_epi8(0x0F);
    __m256 acc[Q8_CHUNK];
    for (int t = 0; t < cnt; t++) acc[t] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        const __m256i c = q8_decode(w + g * 16, table, shifts, low4), absc = _mm256_abs_epi8(c);
        const float hs = scale_of[sc[g]];
        for (int t = 0; t < cnt; t++) {
            const __m256i dot = q8_dot(absc, c, _mm256_loadu_si256((const __m256i *)(q[t] + g * 32)));
            acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(hs * d[t][g]), acc[t]);
        }
    }
    for (int t = 0; t < cnt; t++) out[t] = q8_hsum(acc[t]);
}
#else
static void q8_row(const uint8_t *w, const uint8_t *sc, int64_t groups, const float *scale_of, const int8_t *const *q,
                   const float *const *d, int cnt, float *out) {
    float acc[Q8_CHUNK] = {0};
    for (int64_t g = 0; g < groups; g++) {
        int8_t c[32];
        for (int i = 0; i < 16; i++) {
            c[i] = TWICE_E2M1[w[g * 16 + i] & 0x0F];
            c[16 + i] = TWICE_E2M1[w[g * 16 + i] >> 4];
        }
        const float hs = scale_of[sc[g]];
        for (int t = 0; t < cnt; t++) {
            int32_t s = 0;
            for (int i = 0; i < 32; i++) s += (int32_t)c[i] * q[t][g * 32 + i];
            acc[t] += (float)s * (hs * d[t][g]);
        }
    }
    for (int t = 0; t < cnt; t++) out[t] = acc[t];
}
#endif

#if Q8_PATH >= 1
/* The codes as twice-E2M1 + 12 (0..24: unsigned, the operand dpbusd and maddubs take unsigned); each x block's lanes
   then start from minus 12 times their q values (``nc``), so each lane's sum is the signed form's exact integer. */
static const int8_t TWICE_E2M1_12[16] = {12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0};

/* An odd last group of one weight row against ``cnt`` x rows: the 256-bit loop's one step, into tail[t]. */
static inline __attribute__((always_inline)) void q8_odd_group(const uint8_t *w, const uint8_t *sc, int64_t g,
                                                                 const float *scale_of, const int8_t *const *q,
                                                                 const float *const *d, const int cnt, float *tail) {
    const __m256i table8 = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)TWICE_E2M1));
    const __m256i c8 = q8_decode(w + g * 16, table8, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4),
                                 _mm256_set1_epi8(0x0F));
    const __m256i absc = _mm256_abs_epi8(c8);
    const float hs = scale_of[sc[g]];
    for (int t = 0; t < cnt; t++) {
        const __m256i dot = q8_dot(absc, c8, _mm256_loadu_si256((const __m256i *)(q[t] + g * 32)));
        tail[t] = q8_hsum(_mm256_mul_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(hs * d[t][g])));
    }
}

#endif

#if Q8_PATH == 1
#define Q8_PAIRS 1
/* AVX2, two groups a step. Each x row re-laid per pair of groups (``q8_pair_extras``): group g's 16 even-position q,
   group g + 1's, then g's 16 odd ones, g + 1's. One 32-byte load of the pair's weight bytes then gives both groups'
   even codes (low nibbles) in one register and their odd codes (high nibbles, one 16-bit shift) in another, looked
   up as twice-E2M1 + 12; maddubs against the matching x halves, the two 16-bit sums added (|sum| <= 4 * 24 * 127:
   no saturation) and widened by one madd to 8 int32 lanes, lanes 0-3 group g and 4-7 group g + 1, each started at
   ``nc`` (-12 times its 8 q values): the exact signed sums. Scaled by x's block scales (``dv``: d in the lanes of its
   group) and the groups' half scales (powers of two: exact), one chain a row. Groups g and g + 1 of one weight row
   against ``cnt`` x rows, into ``acc``. */
static inline __attribute__((always_inline)) void q8_pair2(const uint8_t *w, const uint8_t *sc, int64_t g,
                                                             const float *scale_of, const int8_t *const *qp,
                                                             const int32_t *const *nc, const float *const *dv,
                                                             const int cnt, __m256 *acc) {
    const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)TWICE_E2M1_12));
    const __m256i low4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    const __m256i b = _mm256_loadu_si256((const __m256i *)(w + g * 16));
    const __m256i clo = _mm256_shuffle_epi8(table, _mm256_and_si256(b, low4));
    const __m256i chi = _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16(b, 4), low4));
    const __m256 hs = _mm256_set_m128(_mm_set1_ps(scale_of[sc[g + 1]]), _mm_set1_ps(scale_of[sc[g]]));
#pragma GCC unroll 8
    for (int t = 0; t < cnt; t++) {
        const int8_t *p = qp[t] + g * 32;  /* pair g / 2: 64 bytes */
        const __m256i s16 = _mm256_add_epi16(_mm256_maddubs_epi16(clo, _mm256_loadu_si256((const __m256i *)p)),
                                             _mm256_maddubs_epi16(chi, _mm256_loadu_si256((const __m256i *)(p + 32))));
        const __m256i isum = _mm256_add_epi32(_mm256_madd_epi16(s16, ones),
                                              _mm256_loadu_si256((const __m256i *)(nc[t] + g * 4)));
        const __m256 v = _mm256_mul_ps(_mm256_cvtepi32_ps(isum), _mm256_loadu_ps(dv[t] + g * 4));
        acc[t] = _mm256_fmadd_ps(v, hs, acc[t]);
    }
}

/* One weight row against ``cnt`` x rows, pair by pair (an odd last group: the one-group step). */
static inline __attribute__((always_inline)) void q8_rows_pairs(const uint8_t *w, const uint8_t *sc, int64_t groups,
                                                                  const float *scale_of, const int8_t *const *qp,
                                                                  const int32_t *const *nc, const float *const *dv,
                                                                  const int8_t *const *q, const float *const *d,
                                                                  const int cnt, float *out) {
    __m256 acc[Q8_CHUNK];
#pragma GCC unroll 8
    for (int t = 0; t < Q8_CHUNK; t++) acc[t] = _mm256_setzero_ps();
    int64_t g = 0;
    for (; g + 2 <= groups; g += 2) q8_pair2(w, sc, g, scale_of, qp, nc, dv, cnt, acc);
    float tail[Q8_CHUNK] = {0};
    if (g < groups) q8_odd_group(w, sc, g, scale_of, q, d, cnt, tail);
#pragma GCC unroll 8
    for (int t = 0; t < cnt; t++) out[t] = q8_hsum(acc[t]) + tail[t];
}

/* ``q8_rows_pairs`` for four weight rows (nr <= 4) against one x row, in step (``mx_drive``'s quartered units): the
   same steps in the same order a row, so each output equals the one-row loop's. */
static inline __attribute__((always_inline)) void q8_rows4_pairs(const uint8_t *const *w, const uint8_t *const *sc,
                                                                   const int nr, int64_t groups, const float *scale_of,
                                                                   const int8_t *qp, const int32_t *nc, const float *dv,
                                                                   const int8_t *q, const float *d, float *out) {
    const int8_t *const qps[1] = {qp}, *const qs[1] = {q};
    const int32_t *const ncs[1] = {nc};
    const float *const dvs[1] = {dv}, *const ds[1] = {d};
    __m256 acc[4];
#pragma GCC unroll 4
    for (int j = 0; j < 4; j++) acc[j] = _mm256_setzero_ps();
    int64_t g = 0;
    for (; g + 2 <= groups; g += 2) {
#pragma GCC unroll 4
        for (int j = 0; j < nr; j++) q8_pair2(w[j], sc[j], g, scale_of, qps, ncs, dvs, 1, &acc[j]);
    }
    for (int j = 0; j < nr; j++) {
        float tail = 0.0f;
        if (g < groups) q8_odd_group(w[j], sc[j], g, scale_of, qs, ds, 1, &tail);
        out[j] = q8_hsum(acc[j]) + tail;
    }
}
#endif

#if Q8_PATH == 2 && defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
#define Q8_WIDE 1
/* The 512-bit form: two groups a register, one dpbusd a pair of groups and x row. The codes are looked up as
   twice-E2M1 + 12 (0..24, unsigned: dpbusd's unsigned operand, no abs/sign pair), and each x block's 8 lanes start
   from minus 12 times their 4 q values (``nc``, once per x row), so each lane's sum is the same exact integer as
   the signed form's. The lanes are scaled by the x block's d (``dv``: d in 8 lanes a block) and the weight group's
   half scale (a power of two: its product exact), two chains a row over pairs of pairs. */

/* Groups g and g + 1 of one weight row against ``cnt`` x rows, into ``acc``. */
static inline __attribute__((always_inline)) void q8_pair(const uint8_t *w, const uint8_t *sc, int64_t g,
                                                            const float *scale_of, const int8_t *const *q,
                                                            const int32_t *const *nc, const float *const *dv,
                                                            const int cnt, __m512i table, __m512 *acc) {
    const __m512i shifts = _mm512_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4, 0, 0, 0, 0, 4, 4, 4, 4);
    const __m512i b = _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(w + g * 16)));
    const __m512i c = _mm512_shuffle_epi8(table, _mm512_and_si512(
        _mm512_srlv_epi32(_mm512_shuffle_i64x2(b, b, _MM_SHUFFLE(1, 1, 0, 0)), shifts), _mm512_set1_epi8(0x0F)));
    const __m512 hs = _mm512_insertf32x8(_mm512_set1_ps(scale_of[sc[g]]), _mm256_set1_ps(scale_of[sc[g + 1]]), 1);
#pragma GCC unroll 8
    for (int t = 0; t < cnt; t++) {
        const __m512i isum = _mm512_dpbusd_epi32(_mm512_loadu_si512((const void *)(nc[t] + g * 8)), c,
                                                 _mm512_loadu_si512((const void *)(q[t] + g * 32)));
        const __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(isum), _mm512_loadu_ps(dv[t] + g * 8));
        acc[t] = _mm512_fmadd_ps(v, hs, acc[t]);
    }
}

static inline __attribute__((always_inline)) void q8_rows_wide(const uint8_t *w, const uint8_t *sc, int64_t groups,
                                                                 const float *scale_of, const int8_t *const *q,
                                                                 const int32_t *const *nc, const float *const *dv,
                                                                 const float *const *d, const int cnt, float *out) {
    const __m512i table = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)TWICE_E2M1_12));
    __m512 acc[Q8_CHUNK], acc2[Q8_CHUNK];
#pragma GCC unroll 8
    for (int t = 0; t < Q8_CHUNK; t++) acc[t] = acc2[t] = _mm512_setzero_ps();
    int64_t g = 0;
    for (; g + 4 <= groups; g += 4) {  /* two pairs, two chains */
        q8_pair(w, sc, g, scale_of, q, nc, dv, cnt, table, acc);
        q8_pair(w, sc, g + 2, scale_of, q, nc, dv, cnt, table, acc2);
    }
    if (g + 2 <= groups) {
        q8_pair(w, sc, g, scale_of, q, nc, dv, cnt, table, acc);
        g += 2;
    }
    float tail[Q8_CHUNK] = {0};
    if (g < groups) q8_odd_group(w, sc, g, scale_of, q, d, cnt, tail);
#pragma GCC unroll 8
    for (int t = 0; t < cnt; t++) out[t] = _mm512_reduce_add_ps(_mm512_add_ps(acc[t], acc2[t])) + tail[t];
}

/* ``q8_rows_wide`` for four weight rows (nr <= 4) against one x row, in step (``mx_drive``'s quartered units): the
   same pairs of groups, the same sums in the same order a row, so each output equals the one-row loop's. */
static inline __attribute__((always_inline)) void q8_rows4_wide(const uint8_t *const *w, const uint8_t *const *sc,
                                                                  const int nr, int64_t groups, const float *scale_of,
                                                                  const int8_t *q, const int32_t *nc, const float *dv,
                                                                  const float *d, float *out) {
    const __m512i table = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)TWICE_E2M1_12));
    const int8_t *const qs[1] = {q};
    const int32_t *const ncs[1] = {nc};
    const float *const dvs[1] = {dv}, *const ds[1] = {d};
    __m512 acc[4], acc2[4];
#pragma GCC unroll 4
    for (int j = 0; j < 4; j++) acc[j] = acc2[j] = _mm512_setzero_ps();
    int64_t g = 0;
    for (; g + 4 <= groups; g += 4) {
#pragma GCC unroll 4
        for (int j = 0; j < nr; j++) {
            q8_pair(w[j], sc[j], g, scale_of, qs, ncs, dvs, 1, table, &acc[j]);
            q8_pair(w[j], sc[j], g + 2, scale_of, qs, ncs, dvs, 1, table, &acc2[j]);
        }
    }
    const int64_t g4 = g;
    for (int j = 0; j < nr; j++) {  /* the one-row loop's tail, row by row */
        g = g4;
        if (g + 2 <= groups) {
            q8_pair(w[j], sc[j], g, scale_of, qs, ncs, dvs, 1, table, &acc[j]);
            g += 2;
        }
        float tail = 0.0f;
        if (g < groups) q8_odd_group(w[j], sc[j], g, scale_of, qs, ds, 1, &tail);
        out[j] = _mm512_reduce_add_ps(_mm512_add_ps(acc[j], acc2[j])) + tail;
    }
}
#endif

struct q8_x {  /* x quantized: int8 rows and their block scales; the wide and pair paths' extras (q8_extras) */
    const int8_t *q;
    const float *d;
    const int32_t *nc;
    const float *dv;
    const int8_t *qp;  /* the pair path's re-laid q */
};

static void rows_q8(const void *ctx, const int64_t *xr, int cnt, const uint8_t *row, const uint8_t *sc,
                    int64_t groups, const float *scale_of, float *out) {
    const struct q8_x *x = ctx;
    const int8_t *qs[Q8_CHUNK];
    const float *ds[Q8_CHUNK];
    for (int t = 0; t < cnt; t++) {
        qs[t] = x->q + xr[t] * groups * 32;
        ds[t] = x->d + xr[t] * groups;
    }
#ifdef Q8_WIDE
    const int32_t *ncs[Q8_CHUNK];
    const float *dvs[Q8_CHUNK];
    for (int t = 0; t < cnt; t++) {
        ncs[t] = x->nc + xr[t] * groups * 8;
        dvs[t] = x->dv + xr[t] * groups * 8;
    }
    switch (cnt) {  /* the count a constant where inlined: the accumulators stay in registers */
        case 1: q8_rows_wide(row, sc, groups, scale_of, qs, ncs, dvs, ds, 1, out); break;
        case 2: q8_rows_wide(row, sc, groups, scale_of, qs, ncs, dvs, ds, 2, out); break;
        case 3: q8_rows_wide(row, sc, groups, scale_of, qs, ncs, dvs, ds, 3, out); break;
        case 4: q8_rows_wide(row, sc, groups, scale_of, qs, ncs, dvs, ds, 4, out); break;
        default: q8_rows_wide(row, sc, groups, scale_of, qs, ncs, dvs, ds, cnt, out); break;
    }
#elif defined(Q8_PAIRS)
    const int8_t *qps[Q8_CHUNK];
    const int32_t *ncs[Q8_CHUNK];
    const float *dvs[Q8_CHUNK];
    for (int t = 0; t < cnt; t++) {
        qps[t] = x->qp + xr[t] * groups * 32;
        ncs[t] = x->nc + xr[t] * groups * 4;
        dvs[t] = x->dv + xr[t] * groups * 4;
    }
    switch (cnt) {  /* the count a constant where inlined: the accumulators stay in registers */
        case 1: q8_rows_pairs(row, sc, groups, scale_of, qps, ncs, dvs, qs, ds, 1, out); break;
        case 2: q8_rows_pairs(row, sc, groups, scale_of, qps, ncs, dvs, qs, ds, 2, out); break;
        case 3: q8_rows_pairs(row, sc, groups, scale_of, qps, ncs, dvs, qs, ds, 3, out); break;
        case 4: q8_rows_pairs(row, sc, groups, scale_of, qps, ncs, dvs, qs, ds, 4, out); break;
        default: q8_rows_pairs(row, sc, groups, scale_of, qps, ncs, dvs, qs, ds, cnt, out); break;
    }
#else
    switch (cnt) {
        case 1: q8_row(row, sc, groups, scale_of, qs, ds, 1, out); break;
        case 2: q8_row(row, sc, groups, scale_of, qs, ds, 2, out); break;
        case 3: q8_row(row, sc, groups, scale_of, qs, ds, 3, out); break;
        case 4: q8_row(row, sc, groups, scale_of, qs, ds, 4, out); break;
        default: q8_row(row, sc, groups, scale_of, qs, ds, cnt, out); break;
    }
#endif
}

#ifdef Q8_WIDE
static void rows4_q8(const void *ctx, int64_t xr, const uint8_t *const *rows, const uint8_t *const *scs, int nr,
                     int64_t groups, const float *scale_of, float *out) {
    const struct q8_x *x = ctx;
    const int8_t *q = x->q + xr * groups * 32;
    const int32_t *nc = x->nc + xr * groups * 8;
    const float *dv = x->dv + xr * groups * 8, *d = x->d + xr * groups;
    switch (nr) {  /* the row count a constant where inlined */
        case 4: q8_rows4_wide(rows, scs, 4, groups, scale_of, q, nc, dv, d, out); break;
        case 3: q8_rows4_wide(rows, scs, 3, groups, scale_of, q, nc, dv, d, out); break;
        case 2: q8_rows4_wide(rows, scs, 2, groups, scale_of, q, nc, dv, d, out); break;
        default: q8_rows4_wide(rows, scs, 1, groups, scale_of, q, nc, dv, d, out); break;
    }
}
#define ROWS4_Q8 rows4_q8
#elif defined(Q8_PAIRS)
static void rows4_q8(const void *ctx, int64_t xr, const uint8_t *const *rows, const uint8_t *const *scs, int nr,
                     int64_t groups, const float *scale_of, float *out) {
    const struct q8_x *x = ctx;
    const int8_t *q = x->q + xr * groups * 32, *qp = x->qp + xr * groups * 32;
    const int32_t *nc = x->nc + xr * groups * 4;
    const float *dv = x->dv + xr * groups * 4, *d = x->d + xr * groups;
    switch (nr) {  /* the row count a constant where inlined */
        case 4: q8_rows4_pairs(rows, scs, 4, groups, scale_of, qp, nc, dv, q, d, out); break;
        case 3: q8_rows4_pairs(rows, scs, 3, groups, scale_of, qp, nc, dv, q, d, out); break;
        case 2: q8_rows4_pairs(rows, scs, 2, groups, scale_of, qp, nc, dv, q, d, out); break;
        default: q8_rows4_pairs(rows, scs, 1, groups, scale_of, qp, nc, dv, q, d, out); break;
    }
}
#define ROWS4_Q8 rows4_q8
#else
#define ROWS4_Q8 NULL
#endif

/* The per-block extras of quantized x (``rows`` rows of ``groups`` blocks). The wide path (``q8_rows_wide``):
   nc[b, j] = -12 * (the 4 q values of lane j), dv[b, j] = d[b], for j < 8. The pair path (``q8_pair2``), per pair of
   blocks g, g + 1 of a row: qp = g's 16 even-position q, g + 1's, g's 16 odd, g + 1's; its 8 lanes j (g's 0-3, g + 1's
   4-7) nc = -12 * (the 4 even and the 4 odd q that lane sums), dv = the block's d (an odd last block has none). */
static void q8_extras(const int8_t *q, const float *d, int64_t rows, int64_t groups, int32_t *nc, float *dv,
                      int8_t *qp) {
#ifdef Q8_PAIRS
    for (int64_t r = 0; r < rows; r++)
        for (int64_t g = 0; g + 2 <= groups; g += 2) {
            const int8_t *a = q + (r * groups + g) * 32;  /* blocks g and g + 1: 64 bytes */
            int8_t *p = qp + (r * groups + g) * 32;
            memcpy(p, a, 16); memcpy(p + 16, a + 32, 16); memcpy(p + 32, a + 16, 16); memcpy(p + 48, a + 48, 16);
            for (int j = 0; j < 8; j++) {
                const int8_t *e = p + 4 * j, *o = p + 32 + 4 * j;
                nc[(r * groups + g) * 4 + j] = -12 * ((int32_t)e[0] + e[1] + e[2] + e[3] + o[0] + o[1] + o[2] + o[3]);
                dv[(r * groups + g) * 4 + j] = d[r * groups + g + j / 4];
            }
        }
#else
    (void)qp;
    for (int64_t b = 0; b < rows * groups; b++)
        for (int j = 0; j < 8; j++) {
            const int8_t *l = q + b * 32 + 4 * j;
            nc[b * 8 + j] = -12 * ((int32_t)l[0] + l[1] + l[2] + l[3]);
            dv[b * 8 + j] = d[b];
        }
#endif
}

/* The integer form of neffbuild_mxfp4_dot (same arguments and layout): x quantized once, then the experts' driver
   (mx_drive) with chunks of Q8_CHUNK picks. 0, or 1 when the scratch could not be allocated (nothing written then). */
int neffbuild_mxfp4_q8_dot(const float *x, int64_t kx, const uint8_t *blocks, const uint8_t *scales,
                           const int64_t *idx, int64_t n, int64_t k, int64_t out, int64_t groups, float *y,
                           int threads) {
    const int64_t xrows = n * kx;
    int8_t *q = malloc((size_t)(xrows * groups * 32) + 1);
    float *d = malloc((size_t)(xrows * groups + 1) * sizeof(float));
    int32_t *nc = malloc((size_t)(xrows * groups * 8 + 1) * sizeof(int32_t));
    float *dv = malloc((size_t)(xrows * groups * 8 + 1) * sizeof(float));
    int8_t *qp = malloc((size_t)(xrows * groups * 32) + 1);
    int status = 1;
    if (q && d && nc && dv && qp) {
        neffbuild_q8_quantize(x, xrows, groups, q, d);
        q8_extras(q, d, xrows, groups, nc, dv, qp);
        const struct q8_x qx = {q, d, nc, dv, qp};
        status = mx_drive(&qx, Q8_CHUNK, kx, blocks, scales, idx, n, k, out, groups, y, threads, rows_q8, ROWS4_Q8);
    }
    free(q); free(d); free(nc); free(dv); free(qp);
    return status;
}

/* ---- The int8 LM head: per-row scales (s = max|w| / 127, q = w / s rounded to nearest even), x as float. ---- */

/* w bf16 [rows, in] -> q int8 [rows, in], s [rows]; a row with a non-finite weight gets s NaN (the caller then runs
   the exact head). */
void neffbuild_q8_rows(const uint16_t *w, int64_t rows, int64_t in, int8_t *q, float *s, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *wr = w + r * in;
        float amax = 0.0f;
        int finite = 1;
        for (int64_t t = 0; t < in; t++) {
            const float a = fabsf(bf16_to_float(wr[t]));
            finite &= isfinite(a) != 0;
            amax = a > amax ? a : amax;
        }
        const float inv = finite && amax > 0.0f ? 127.0f / amax : 0.0f;
        s[r] = finite ? amax / 127.0f : NAN;
        for (int64_t t = 0; t < in; t++) q[r * in + t] = (int8_t)nearbyintf(bf16_to_float(wr[t]) * inv);
    }
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define Q8_HEAD_PATH 2
#elif defined(__AVX2__) && defined(__FMA__)
#define Q8_HEAD_PATH 1
#else
#define Q8_HEAD_PATH 0
#endif

int neffbuild_q8_head_path(void) { return Q8_HEAD_PATH; }

/* m (1..4) float rows of x against one int8 weight row (AVX2 and plain paths; AVX-512: ``q8_tile_bf16`` with
   AVX-512 BF16, else ``q8_head_tile``): y[i * ystride] = sum_t q[t] x[i, t] (every product exact in float32: 7 by 8
   significant bits). Each x row keeps 4 / m chains of FMAs (m = 1: four 8-weight chunks an iteration, each its own
   accumulator): one chain a row left the FMA's latency exposed. */
static inline __attribute__((always_inline)) void q8_head_rows(const float *x, const int m, const int8_t *q,
                                                                 int64_t in, float *y, int64_t ystride) {
    const int u = m == 1 ? 4 : (m == 2 ? 2 : 1);  /* chains a row: m * u <= 4 accumulators */
    int64_t t = 0;
    float sums[4] = {0, 0, 0, 0};
#if Q8_HEAD_PATH == 1
    __m256 acc[4];
#pragma GCC unroll 4
    for (int i = 0; i < 4; i++) acc[i] = _mm256_setzero_ps();
    for (; t + 8 * u <= in; t += 8 * u) {
#pragma GCC unroll 4
        for (int j = 0; j < u; j++) {
            const __m128i b = _mm_loadl_epi64((const __m128i *)(q + t + 8 * j));
            const __m256 wv = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
#pragma GCC unroll 4
            for (int i = 0; i < m; i++)
                acc[i * u + j] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + i * in + t + 8 * j), acc[i * u + j]);
        }
    }
    for (; t + 8 <= in; t += 8) {
        const __m256 wv = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + t))));
#pragma GCC unroll 4
        for (int i = 0; i < m; i++) acc[i * u] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + i * in + t), acc[i * u]);
    }
#pragma GCC unroll 4
    for (int i = 0; i < m; i++) {
        __m256 v = acc[i * u];
#pragma GCC unroll 4
        for (int j = 1; j < u; j++) v = _mm256_add_ps(v, acc[i * u + j]);
        sums[i] = q8_hsum(v);
    }
#else
    (void)u;
#endif
    for (int i = 0; i < m; i++) {
        float s = sums[i];
        for (int64_t r = t; r < in; r++) s += (float)q[r] * x[i * in + r];
        y[i * ystride] = s;
    }
}

/* y[i, o] = s[o] * sum_t q[o, t] x[i, t]: x bf16 [m, in] (widened once), q int8 [out, in]. 0, or 1 when the widened
   copy of x could not be allocated. */
#if Q8_HEAD_PATH == 2
/* r (1..4) int8 weight rows against m (1..4) float rows of x: y[i * ystride + j] = sum_t q[j, t] x[i, t]. Each 16
   values of x are loaded once for the r weight rows and each 16 weights widened once for the m x rows: four float32
   rows of GPT-OSS's 2,880 (46 KB) are past a 32 KB L1, and reading them from L2 for every weight row bound the batch-4
   head; r * m chains of FMAs stay in flight (r = 4 at batch 1 hides the FMA's latency). */
static inline __attribute__((always_inline)) void q8_head_tile(const float *x, const int m, const int8_t *q,
                                                                 const int r, int64_t in, float *y, int64_t ystride) {
    __m512 acc[4][4];
#pragma GCC unroll 4
    for (int j = 0; j < 4; j++)
#pragma GCC unroll 4
        for (int i = 0; i < 4; i++) acc[j][i] = _mm512_setzero_ps();
    int64_t t = 0;
    for (; t + 16 <= in; t += 16) {
        __m512 xv[4];
#pragma GCC unroll 4
        for (int i = 0; i < m; i++) xv[i] = _mm512_loadu_ps(x + i * in + t);
#pragma GCC unroll 4
        for (int j = 0; j < r; j++) {
            const __m128i b = _mm_loadu_si128((const __m128i *)(q + j * in + t));
            const __m512 wv = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
#pragma GCC unroll 4
            for (int i = 0; i < m; i++) acc[j][i] = _mm512_fmadd_ps(wv, xv[i], acc[j][i]);
        }
    }
    for (int j = 0; j < r; j++)
        for (int i = 0; i < m; i++) {
            float v = _mm512_reduce_add_ps(acc[j][i]);
            for (int64_t u = t; u < in; u++) v += (float)q[j * in + u] * x[i * in + u];
            y[i * ystride + j] = v;
        }
}

#if BF16_PATH == 2
/* 32 int8 weights -> their bf16 values, exactly (|q| <= 127 needs 7 significant bits, bf16 holds 8). */
static inline __m512bh q8_bf16(const int8_t *q) {
    const __m256i b = _mm256_loadu_si256((const __m256i *)q);
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(b)));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(b, 1)));
    return _mm512_cvtne2ps_pbh(hi, lo);  /* the low 16 words from lo: the weights in order */
}

/* ``q8_head_tile`` on AVX-512 BF16, x as the caller's bf16: each 32 weights converted to bf16 once (exact) for the
   m rows of x, one dot-product instruction a row of x (two exact products accumulated by two FMAs, each rounded
   to nearest even; subnormal inputs read as zero and subnormal results flushed: ``q8_head``'s bound counts it),
   where the float tile takes two conversions and two FMAs a row for the same 32 weights. */
static inline __attribute__((always_inline)) void q8_tile_bf16(const uint16_t *x, const int m, const int8_t *q,
                                                                 const int r, int64_t in, float *y, int64_t ystride) {
    __m512 acc[4][4];
#pragma GCC unroll 4
    for (int j = 0; j < 4; j++)
#pragma GCC unroll 4
        for (int i = 0; i < 4; i++) acc[j][i] = _mm512_setzero_ps();
    int64_t t = 0;
    for (; t + 32 <= in; t += 32) {
        __m512bh xv[4];
#pragma GCC unroll 4
        for (int i = 0; i < m; i++) xv[i] = (__m512bh)_mm512_loadu_si512((const void *)(x + i * in + t));
#pragma GCC unroll 4
        for (int j = 0; j < r; j++) {
            const __m512bh wv = q8_bf16(q + j * in + t);
#pragma GCC unroll 4
            for (int i = 0; i < m; i++) acc[j][i] = _mm512_dpbf16_ps(acc[j][i], xv[i], wv);
        }
    }
    for (int j = 0; j < r; j++)
        for (int i = 0; i < m; i++) {
            float v = _mm512_reduce_add_ps(acc[j][i]);
            for (int64_t u = t; u < in; u++) v += (float)q[j * in + u] * bf16_to_float(x[i * in + u]);
            y[i * ystride + j] = v;
        }
}
#define Q8_TILE(mc, rc) q8_tile_bf16(x + i0 * in, mc, q + o * in, rc, in, y + i0 * out + o, out)
#else
#define Q8_TILE(mc, rc) q8_head_tile(xs + i0 * in, mc, q + o * in, rc, in, y + i0 * out + o, out)
#endif

/* One float row of x against one int8 weight row (batch 1): one chain of FMAs, 16 weights a step. Memory bound at
   GPT-OSS's vocabulary; four chains (or the 4-row tile) ran slower here (36 against 44 and 49 ms a 201,088-row head,
   interleaved, one thread), so the plain chain stays. */
static float q8_head_row1(const float *x, const int8_t *q, int64_t in) {
    __m512 acc = _mm512_setzero_ps();
    int64_t t = 0;
    for (; t + 16 <= in; t += 16) {
        const __m128i b = _mm_loadu_si128((const __m128i *)(q + t));
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)), _mm512_loadu_ps(x + t), acc);
    }
    float v = _mm512_reduce_add_ps(acc);
    for (; t < in; t++) v += (float)q[t] * x[t];
    return v;
}
#endif

/* y[i, o] = s[o] * sum_t q[o, t] x[i, t]: x bf16 [m, in] (widened once), q int8 [out, in]. 0, or 1 when the widened
   copy of x could not be allocated. */
int neffbuild_q8_linear(const uint16_t *x, int64_t m, const int8_t *q, const float *s, int64_t out, int64_t in,
                        float *y, int threads) {
    float *xs = malloc((size_t)(m * in + 1) * sizeof(float));
    if (xs == NULL) return 1;
    for (int64_t t = 0; t < m * in; t++) xs[t] = bf16_to_float(x[t]);
#if Q8_HEAD_PATH == 2
    if (m == 1) {
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
        for (int64_t o = 0; o < out; o++) y[o] = s[o] * q8_head_row1(xs, q + o * in, in);
        free(xs);
        return 0;
    }
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t o = 0; o < out; o += 4)  /* tiles of 4 weight rows (the last may hold fewer) */
        for (int64_t i0 = 0; i0 < m; i0 += 4) {
            const int mc = m - i0 < 4 ? (int)(m - i0) : 4, rc = out - o < 4 ? (int)(out - o) : 4;
            if (rc == 4) {
                switch (mc) {
                    case 1: Q8_TILE(1, 4); break;
                    case 2: Q8_TILE(2, 4); break;
                    case 3: Q8_TILE(3, 4); break;
                    default: Q8_TILE(4, 4); break;
                }
            } else {
                switch (rc) {
                    case 1: Q8_TILE(mc, 1); break;
                    case 2: Q8_TILE(mc, 2); break;
                    default: Q8_TILE(mc, 3); break;
                }
            }
            for (int64_t i = 0; i < mc; i++)
                for (int j = 0; j < rc; j++) y[(i0 + i) * out + o + j] *= s[o + j];
        }
#else
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t o = 0; o < out; o++)
        for (int64_t i0 = 0; i0 < m; i0 += 4) {
            float *yo = y + i0 * out + o;
            switch (m - i0 < 4 ? m - i0 : 4) {
                case 1: q8_head_rows(xs + i0 * in, 1, q + o * in, in, yo, out); break;
                case 2: q8_head_rows(xs + i0 * in, 2, q + o * in, in, yo, out); break;
                case 3: q8_head_rows(xs + i0 * in, 3, q + o * in, in, yo, out); break;
                default: q8_head_rows(xs + i0 * in, 4, q + o * in, in, yo, out); break;
            }
            for (int64_t i = 0; i < (m - i0 < 4 ? m - i0 : 4); i++) yo[i * out] *= s[o];
        }
#endif
    free(xs);
    return 0;
}

/* The int8 rows in integers (``q8_head`` and ``q8_linear``, runtime/native_q8.py ``head16``): each x row quantized
   to int16 with one scale (d = max|x| / qmax, qx = x / d rounded to nearest even; qmax 32,767, or less where K is
   so long that a lane's int32 sum could overflow), the int8 weights widened to int16 once for the m rows of x and
   one multiply-add of pairs a row of x (AVX512-VNNI ``vpdpwssd``, 32 weights; AVX2 ``vpmaddwd`` + ``vpaddd``, 16):
   exact int32 lane sums, then an exact int64 total S, and y = (float)((s * d) * S) in double. The float forms
   convert each 8-32 weights in two to five instructions before their dot products; here in one. x's rounding is
   at most d / 2 a value: ex[i] = sum_t |x_t - d qx_t| (double) goes into the bound (``native_q8.bound_terms``).
   Writes qx [m, in], d [m], ex [m]. 0; 1 when scratch could not be allocated; 2 where this form does not run
   (neither AVX512-VNNI nor AVX2, a non-finite x). Q8_HEAD16: 2 VNNI, 1 AVX2, 0 none. */
#if Q8_HEAD_PATH == 2 && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define Q8_HEAD16 2
#define Q8_LANE_WEIGHTS 32 /* weights a step; each int32 lane adds two products a step */
#define Q8_TILE_M 4        /* x rows a tile (registers: 16 accumulators of 32) */
#elif defined(__AVX2__)
#define Q8_HEAD16 1
#define Q8_LANE_WEIGHTS 16
#define Q8_TILE_M 2        /* 8 accumulators of AVX2's 16 registers */
#else
#define Q8_HEAD16 0
#define Q8_LANE_WEIGHTS 32
#define Q8_TILE_M 1
#endif

int neffbuild_q8_head16_path(void) { return Q8_HEAD16; }

/* The largest |qx| for rows of ``in`` values: a lane adds 2 * ceil(in / Q8_LANE_WEIGHTS) products of |q| <= 127. */
int neffbuild_q8_head16_qmax(int64_t in) {
    const int64_t per_lane = 2 * ((in + Q8_LANE_WEIGHTS - 1) / Q8_LANE_WEIGHTS) * 127;
    const int64_t most = per_lane > 0 ? INT32_MAX / per_lane : 32767;
    return (int)(most < 32767 ? most : 32767);
}

#if Q8_HEAD16
static int q8_head16_x(const uint16_t *x, int64_t m, int64_t in, int16_t *qx, float *d, double *ex) {
    const float qmax = (float)neffbuild_q8_head16_qmax(in);
    for (int64_t i = 0; i < m; i++) {
        const uint16_t *xi = x + i * in;
        float amax = 0.0f;
        for (int64_t t = 0; t < in; t++) {
            const float v = bf16_to_float(xi[t]);
            if (!isfinite(v)) return 2;
            amax = fabsf(v) > amax ? fabsf(v) : amax;
        }
        const float inv = amax > 0.0f ? qmax / amax : 0.0f;
        d[i] = amax / qmax;
        double err = 0.0;
        for (int64_t t = 0; t < in; t++) {
            const float v = bf16_to_float(xi[t]);
            const int k = (int)nearbyintf(v * inv);
            qx[i * in + t] = (int16_t)k;
            err += fabs((double)v - (double)d[i] * k);
        }
        ex[i] = err;
    }
    return 0;
}

/* The products the vector steps left (values t .. in - 1 of a row), exactly. */
static inline int64_t q8_rest16(const int8_t *w, const int16_t *x, int64_t t, int64_t in) {
    int64_t v = 0;
    for (; t < in; t++) v += (int64_t)w[t] * x[t];
    return v;
}

#if Q8_HEAD16 == 2
static inline int64_t q8_lanes64(__m512i acc) {  /* the 16 int32 lanes summed without overflow */
    return _mm512_reduce_add_epi64(_mm512_cvtepi32_epi64(_mm512_castsi512_si256(acc))) +
           _mm512_reduce_add_epi64(_mm512_cvtepi32_epi64(_mm512_extracti64x4_epi64(acc, 1)));
}

/* r (1..4) int8 weight rows, ``rs`` values apart, against mc (1..4) int16 x rows:
   sums[i * 4 + j] = sum_t q[j * rs + t] qx[i, t], exactly. */
static inline __attribute__((always_inline)) void q8_tile16(const int16_t *qx, const int mc, const int8_t *q,
                                                              const int r, int64_t rs, int64_t in, int64_t *sums) {
    __m512i acc[4][4];
#pragma GCC unroll 4
    for (int j = 0; j < 4; j++)
#pragma GCC unroll 4
        for (int i = 0; i < 4; i++) acc[j][i] = _mm512_setzero_si512();
    int64_t t = 0;
    for (; t + 32 <= in; t += 32) {
        __m512i xv[4];
#pragma GCC unroll 4
        for (int i = 0; i < mc; i++) xv[i] = _mm512_loadu_si512((const void *)(qx + i * in + t));
#pragma GCC unroll 4
        for (int j = 0; j < r; j++) {
            const __m512i wv = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(q + j * rs + t)));
#pragma GCC unroll 4
            for (int i = 0; i < mc; i++) acc[j][i] = _mm512_dpwssd_epi32(acc[j][i], wv, xv[i]);
        }
    }
    for (int j = 0; j < r; j++)
        for (int i = 0; i < mc; i++)
            sums[i * 4 + j] = q8_lanes64(acc[j][i]) + q8_rest16(q + j * rs, qx + i * in, t, in);
}
#else
static inline int64_t q8_lanes64(__m256i acc) {  /* the 8 int32 lanes summed without overflow */
    const __m256i w = _mm256_add_epi64(_mm256_cvtepi32_epi64(_mm256_castsi256_si128(acc)),
                                       _mm256_cvtepi32_epi64(_mm256_extracti128_si256(acc, 1)));
    const __m128i h = _mm_add_epi64(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1));
    return _mm_cvtsi128_si64(h) + _mm_extract_epi64(h, 1);
}

/* The AVX2 tile: r (1..4) weight rows against mc (1..2) x rows, 16 weights a step (``vpmaddwd``: pairs of exact
   products into 8 int32 lanes). */
static inline __attribute__((always_inline)) void q8_tile16(const int16_t *qx, const int mc, const int8_t *q,
                                                              const int r, int64_t rs, int64_t in, int64_t *sums) {
    __m256i acc[4][2];
#pragma GCC unroll 4
    for (int j = 0; j < 4; j++) acc[j][0] = acc[j][1] = _mm256_setzero_si256();
    int64_t t = 0;
    for (; t + 16 <= in; t += 16) {
        __m256i xv[2];
#pragma GCC unroll 2
        for (int i = 0; i < mc; i++) xv[i] = _mm256_loadu_si256((const __m256i *)(qx + i * in + t));
#pragma GCC unroll 4
        for (int j = 0; j < r; j++) {
            const __m256i wv = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(q + j * rs + t)));
#pragma GCC unroll 2
            for (int i = 0; i < mc; i++) acc[j][i] = _mm256_add_epi32(acc[j][i], _mm256_madd_epi16(wv, xv[i]));
        }
    }
    for (int j = 0; j < r; j++)
        for (int i = 0; i < mc; i++)
            sums[i * 4 + j] = q8_lanes64(acc[j][i]) + q8_rest16(q + j * rs, qx + i * in, t, in);
}

/* ``q8_tile16`` for the full tile (four weight rows, two x rows), its accumulators named: gcc kept the array form's
   eight in registers only by copying them round every step (and one to the stack). The same exact sums. */
static inline void q8_tile16_full(const int16_t *qx, const int8_t *q, int64_t rs, int64_t in, int64_t *sums) {
    const int16_t *x0 = qx, *x1 = qx + in;
    const int8_t *w0 = q, *w1 = q + rs, *w2 = q + 2 * rs, *w3 = q + 3 * rs;
    __m256i a00 = _mm256_setzero_si256(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00, a30 = a00, a31 = a00;
    int64_t t = 0;
    for (; t + 16 <= in; t += 16) {
        const __m256i xa = _mm256_loadu_si256((const __m256i *)(x0 + t));
        const __m256i xb = _mm256_loadu_si256((const __m256i *)(x1 + t));
        const __m256i v0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w0 + t)));
        const __m256i v1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w1 + t)));
        const __m256i v2 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w2 + t)));
        const __m256i v3 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w3 + t)));
        a00 = _mm256_add_epi32(a00, _mm256_madd_epi16(v0, xa));
        a01 = _mm256_add_epi32(a01, _mm256_madd_epi16(v0, xb));
        a10 = _mm256_add_epi32(a10, _mm256_madd_epi16(v1, xa));
        a11 = _mm256_add_epi32(a11, _mm256_madd_epi16(v1, xb));
        a20 = _mm256_add_epi32(a20, _mm256_madd_epi16(v2, xa));
        a21 = _mm256_add_epi32(a21, _mm256_madd_epi16(v2, xb));
        a30 = _mm256_add_epi32(a30, _mm256_madd_epi16(v3, xa));
        a31 = _mm256_add_epi32(a31, _mm256_madd_epi16(v3, xb));
    }
    const __m256i acc[4][2] = {{a00, a01}, {a10, a11}, {a20, a21}, {a30, a31}};
    for (int j = 0; j < 4; j++)
        for (int i = 0; i < 2; i++)
            sums[i * 4 + j] = q8_lanes64(acc[j][i]) + q8_rest16(q + j * rs, qx + i * in, t, in);
}
#endif
#endif

/* The tile's four weight rows come from the four quarters of the weight (k, k + Q, k + 2Q, k + 3Q; Q = ceil(out /
   4)): four read streams far apart. One core reads a 579 MB head so at 24 GB/s where it reads one stream (row after
   row) at 17-19 and four adjacent rows at 13 (docs/benchmarks.md, "Real width"), and the four rows are four
   independent chains at batch 1. */
int neffbuild_q8_head16(const uint16_t *x, int64_t m, const int8_t *q, const float *s, int64_t out, int64_t in,
                        float *y, int16_t *qx, float *d, double *ex, int threads) {
#if Q8_HEAD16
    const int status = q8_head16_x(x, m, in, qx, d, ex);
    if (status) return status;
    const int64_t quarter = (out + 3) / 4;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t k = 0; k < quarter; k++)
        for (int64_t i0 = 0; i0 < m; i0 += Q8_TILE_M) {
            int rc = 0;
            while (rc < 4 && rc * quarter + k < out) rc++;  /* the last quarter may be shorter */
            const int mc = m - i0 < Q8_TILE_M ? (int)(m - i0) : Q8_TILE_M;
            int64_t sums[16];
            const int16_t *xq = qx + i0 * in;
            const int8_t *w = q + k * in;
            const int64_t rs = quarter * in;
            if (rc == 4) {
                switch (mc) {  /* the counts constants where inlined: the accumulators stay in registers */
                    case 1: q8_tile16(xq, 1, w, 4, rs, in, sums); break;
#if Q8_TILE_M == 4
                    case 2: q8_tile16(xq, 2, w, 4, rs, in, sums); break;
                    case 3: q8_tile16(xq, 3, w, 4, rs, in, sums); break;
                    default: q8_tile16(xq, 4, w, 4, rs, in, sums); break;
#else
                    default: q8_tile16_full(xq, w, rs, in, sums); break;
#endif
                }
            } else {
                q8_tile16(xq, mc, w, rc, rs, in, sums);
            }
            for (int i = 0; i < mc; i++)
                for (int j = 0; j < rc; j++) {
                    const int64_t o = j * quarter + k;
                    y[(i0 + i) * out + o] = (float)(((double)s[o] * (double)d[i0 + i]) * (double)sums[i * 4 + j]);
                }
        }
    return 0;
#else
    (void)x; (void)m; (void)q; (void)s; (void)out; (void)in; (void)y; (void)qx; (void)d; (void)ex; (void)threads;
    return 2;
#endif
}

/* The int8 head's candidates (runtime/native_q8.py ``q8_head``): for each x row i, with the bound
   e[i, o] = (s[o] * x1c[i] + tiny) * (1 + 2^-30) (double, as ``head_bound`` computes it: the same operations, no
   contraction under -std=c11) and M = max_o (a - e), every o with R(a + e) >= R(M), R = rounding to float32, then to
   bf16 to nearest even (as torch rounds). Writes (i, o) pairs in row-major order while they fit ``cap``; returns how
   many there are (more than ``cap``: the caller asks again with room). AVX-512: 8 values a step, one pass for M
   and one for the picks (a few in a vocabulary: the lanes are looked at only when one passes). */
static inline float bf16_round(float f) {  /* R for a finite float32 */
    union { float f; uint32_t u; } b = {.f = f};
    b.u = (b.u + 0x7FFFu + ((b.u >> 16) & 1u)) & 0xFFFF0000u;
    return b.f;
}

static inline double head_e(float s, double x1c, double tiny) { return ((double)s * x1c + tiny) * (1.0 + 0x1p-30); }

int64_t neffbuild_q8_pick(const float *a, int64_t m, int64_t out, const float *s, const double *x1c, double tiny,
                          int64_t *rows, int64_t *cols, int64_t cap) {
    int64_t n = 0;
    for (int64_t i = 0; i < m; i++) {
        const float *ai = a + i * out;
        double top = -INFINITY;
        int64_t o = 0;
#if defined(__AVX512F__)
        const __m512d c = _mm512_set1_pd(x1c[i]), t8 = _mm512_set1_pd(tiny), wide = _mm512_set1_pd(1.0 + 0x1p-30);
        __m512d top8 = _mm512_set1_pd(-INFINITY);
        for (; o + 8 <= out; o += 8) {
            const __m512d e = _mm512_mul_pd(_mm512_add_pd(_mm512_mul_pd(_mm512_cvtps_pd(_mm256_loadu_ps(s + o)), c),
                                                          t8), wide);
            top8 = _mm512_max_pd(top8, _mm512_sub_pd(_mm512_cvtps_pd(_mm256_loadu_ps(ai + o)), e));
        }
        top = _mm512_reduce_max_pd(top8);
#endif
        for (; o < out; o++) {
            const double lo = (double)ai[o] - head_e(s[o], x1c[i], tiny);
            top = lo > top ? lo : top;
        }
        const float floor_v = bf16_round((float)top);
        o = 0;
#if defined(__AVX512F__)
        const __m256 floor8 = _mm256_set1_ps(floor_v);
        const __m256i bias = _mm256_set1_epi32(0x7FFF), one = _mm256_set1_epi32(1);
        const __m256i hi16 = _mm256_set1_epi32((int)0xFFFF0000u);
        for (; o + 8 <= out; o += 8) {
            const __m512d e = _mm512_mul_pd(_mm512_add_pd(_mm512_mul_pd(_mm512_cvtps_pd(_mm256_loadu_ps(s + o)), c),
                                                          t8), wide);
            const __m256i u = _mm256_castps_si256(_mm512_cvtpd_ps(_mm512_add_pd(_mm512_cvtps_pd(
                _mm256_loadu_ps(ai + o)), e)));
            const __m256i r = _mm256_and_si256(_mm256_add_epi32(_mm256_add_epi32(u, bias),
                                                                _mm256_and_si256(_mm256_srli_epi32(u, 16), one)), hi16);
            unsigned hit = (unsigned)_mm256_movemask_ps(_mm256_cmp_ps(_mm256_castsi256_ps(r), floor8, _CMP_GE_OQ));
            for (; hit; hit &= hit - 1) {
                if (n < cap) { rows[n] = i; cols[n] = o + __builtin_ctz(hit); }
                n++;
            }
        }
#endif
        for (; o < out; o++)
            if (bf16_round((float)((double)ai[o] + head_e(s[o], x1c[i], tiny))) >= floor_v) {
                if (n < cap) { rows[n] = i; cols[n] = o; }
                n++;
            }
    }
    return n;
}

/* The values neffbuild_bf16_linear gives at (row[p], col[p]) of its [m, out] output, for p < picks: the same call of
   the same loop (x's chunk of up to 4 rows, the weight row's pair on the AVX2 path, the zero-padded copy for an odd
   last row), so the values are bit for bit the full linear's. 0, or 1 when the scratch could not be allocated. */
int neffbuild_bf16_linear_at(const uint16_t *x, int64_t m, const uint16_t *w, int64_t out, int64_t in,
                             const int64_t *row, const int64_t *col, int64_t picks, float *y) {
#if BF16_PATH == 0
    (void)x; (void)m; (void)w; (void)out; (void)in; (void)row; (void)col; (void)picks; (void)y;
    return 1;  /* the plain path's exact head is the matmul (runtime/native.py): not reproduced here */
#else
#if BF16_PATH == 2
    const x_t *xs = x;
    (void)out;
#else
    float *xs = malloc((size_t)(m * in + 1) * sizeof(float));
    if (xs == NULL) return 1;
    for (int64_t t = 0; t < m * in; t++) xs[t] = bf16_to_float(x[t]);
#endif
    float tmp[8];
    int status = 0;
    for (int64_t p = 0; p < picks && !status; p++) {
        const int64_t i0 = row[p] / 4 * 4, mc = m - i0 < 4 ? m - i0 : 4, o = col[p];
#if BF16_PATH == 2
        rows_dot_bf16(xs + i0 * in, mc, w + o * in, in, tmp, 1);
        y[p] = tmp[row[p] - i0];
#else
        const uint16_t *pair = w + (o / 2) * 2 * in;
        uint16_t *last = NULL;
        if (out % 2 && o == out - 1) {
            last = calloc((size_t)(2 * in), sizeof(uint16_t));
            if (last == NULL) { status = 1; break; }
            memcpy(last, w + o * in, (size_t)in * sizeof(uint16_t));
            pair = last;
        }
        rows_dot_bf16(xs + i0 * in, mc, pair, in, tmp, 2);
        y[p] = tmp[(row[p] - i0) * 2 + (last ? 0 : o % 2)];
        free(last);
#endif
    }
#if BF16_PATH == 1
    free(xs);
#endif
    return status;
#endif
}

/* ---- The MXFP4 product with x in bfloat16 (a bf16 bundle's activations), on AVX-512 BF16: each group's 32 codes
   decoded once into bf16 words (twice E2M1: exact in bf16), and one dot-product instruction a group and x row (the
   products are exact in float32; the pair sums round as the instruction rounds, and bf16 subnormals in x count as
   zero), then the group's scale as in the float form. The same products as neffbuild_mxfp4_dot on x widened, summed
   in another order. */
#if BF16_PATH == 2
static const uint16_t TWICE_E2M1_BF16[32] = {0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40C0, 0x4100, 0x4140,
                                             0x8000, 0xBF80, 0xC000, 0xC040, 0xC080, 0xC0C0, 0xC100, 0xC140};

/* 16 bytes -> 32 bf16 words in value order: byte i zero-extended to a dword whose low word holds its low nibble
   (value 2i) and whose high word its high nibble (value 2i + 1), then one word permute looks all 32 up. */
static inline __m512i decode_bf16(const uint8_t *bytes, __m512i table) {
    const __m512i d = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)bytes));
    const __m512i nib = _mm512_or_si512(_mm512_and_si512(d, _mm512_set1_epi32(0x0F)),
                                        _mm512_and_si512(_mm512_slli_epi32(d, 12), _mm512_set1_epi32(0xF0000)));
    return _mm512_permutexvar_epi16(nib, table);
}

static inline __attribute__((always_inline)) void rows_dot_bx(const uint16_t *const *x, const int cnt,
                                                                const uint8_t *row, const uint8_t *scales,
                                                                int64_t groups, const float *scale_of, float *out) {
    const __m512i table = _mm512_loadu_si512((const void *)TWICE_E2M1_BF16);
    __m512 acc[MX_CHUNK], acc2[MX_CHUNK];  /* even and odd groups: two chains a row hide the FMA's latency */
#pragma GCC unroll 4
    for (int t = 0; t < MX_CHUNK; t++) acc[t] = acc2[t] = _mm512_setzero_ps();
    int64_t g = 0;
    for (; g + 2 <= groups; g += 2) {
        const __m512bh w0 = (__m512bh)decode_bf16(row + g * 16, table);
        const __m512bh w1 = (__m512bh)decode_bf16(row + g * 16 + 16, table);
        const __m512 s0 = _mm512_set1_ps(scale_of[scales[g]]), s1 = _mm512_set1_ps(scale_of[scales[g + 1]]);
#pragma GCC unroll 4
        for (int t = 0; t < cnt; t++) {
            const __m512 p0 = _mm512_dpbf16_ps(_mm512_setzero_ps(), w0,
                                               (__m512bh)_mm512_loadu_si512((const void *)(x[t] + g * 32)));
            const __m512 p1 = _mm512_dpbf16_ps(_mm512_setzero_ps(), w1,
                                               (__m512bh)_mm512_loadu_si512((const void *)(x[t] + g * 32 + 32)));
            acc[t] = _mm512_fmadd_ps(p0, s0, acc[t]);
            acc2[t] = _mm512_fmadd_ps(p1, s1, acc2[t]);
        }
    }
    if (g < groups) {
        const __m512bh w0 = (__m512bh)decode_bf16(row + g * 16, table);
        const __m512 s0 = _mm512_set1_ps(scale_of[scales[g]]);
#pragma GCC unroll 4
        for (int t = 0; t < cnt; t++) {
            const __m512 p0 = _mm512_dpbf16_ps(_mm512_setzero_ps(), w0,
                                               (__m512bh)_mm512_loadu_si512((const void *)(x[t] + g * 32)));
            acc[t] = _mm512_fmadd_ps(p0, s0, acc[t]);
        }
    }
#pragma GCC unroll 4
    for (int t = 0; t < cnt; t++) out[t] = _mm512_reduce_add_ps(_mm512_add_ps(acc[t], acc2[t]));
}
#endif

#if BF16_PATH == 2
static void rows_bf16x(const void *ctx, const int64_t *xr, int cnt, const uint8_t *row, const uint8_t *sc,
                       int64_t groups, const float *scale_of, float *out) {
    const uint16_t *xb[MX_CHUNK];
    for (int t = 0; t < cnt; t++) xb[t] = (const uint16_t *)ctx + xr[t] * groups * 32;
    switch (cnt) {
        case 1: rows_dot_bx(xb, 1, row, sc, groups, scale_of, out); break;
        case 2: rows_dot_bx(xb, 2, row, sc, groups, scale_of, out); break;
        case 3: rows_dot_bx(xb, 3, row, sc, groups, scale_of, out); break;
        default: rows_dot_bx(xb, 4, row, sc, groups, scale_of, out); break;
    }
}
#endif

/* neffbuild_mxfp4_dot's arguments with x bf16 [N, kx, G * 32]. 0; 1 when the scratch could not be allocated; 2 when
   this build has no AVX-512 BF16 (the caller widens x and runs neffbuild_mxfp4_dot). Nothing written unless 0. */
int neffbuild_mxfp4_dot_bf16(const uint16_t *x, int64_t kx, const uint8_t *blocks, const uint8_t *scales,
                             const int64_t *idx, int64_t n, int64_t k, int64_t out, int64_t groups, float *y,
                             int threads) {
#if BF16_PATH != 2
    (void)x; (void)kx; (void)blocks; (void)scales; (void)idx; (void)n; (void)k; (void)out; (void)groups; (void)y;
    (void)threads;
    return 2;
#else
    return mx_drive(x, MX_CHUNK, kx, blocks, scales, idx, n, k, out, groups, y, threads, rows_bf16x, NULL);
#endif
}

/* ---- An expert's MXFP4 rows decoded to bfloat16 (eager prefill: one expert at a time, then a bf16 matmul): each
   value E2M1 x 2^(s - 127) formed in float32 (exact) and rounded to bf16 to nearest even, NaN for scale byte 255;
   the values runtime/native.py's torch decode gives. blocks [rows, G, 16], scales [rows, G] -> out [rows, G * 32]. */
static const float E2M1_F32[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                                   -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

static inline uint16_t float_to_bf16(float f) {
    union { float f; uint32_t u; } v = {.f = f};
    if (isnan(f)) return (uint16_t)((v.u >> 16) | 0x40);
    return (uint16_t)((v.u + 0x7FFFu + ((v.u >> 16) & 1u)) >> 16);
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
static inline __m512i bf16_bits(__m512 v) {  /* 16 float32 -> their bf16 in the low words of 16 dwords (RNE) */
    const __m512i u = _mm512_castps_si512(v);
    const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)),
                                                         _mm512_and_si512(_mm512_srli_epi32(u, 16),
                                                                          _mm512_set1_epi32(1))), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    return _mm512_mask_blend_epi32(nan, r, _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40)));
}

static void decode_row_bf16(const uint8_t *row, const uint8_t *sc, int64_t groups, const float *scale_of,
                            uint16_t *out) {
    const __m512 table = _mm512_loadu_ps(E2M1_F32);
    for (int64_t g = 0; g < groups; g++) {
        const __m512i d = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(row + g * 16)));
        const __m512 s = _mm512_set1_ps(scale_of[sc[g]]);
        const __m512 lo = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_and_si512(d, _mm512_set1_epi32(15)), table), s);
        const __m512 hi = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(d, 4), table), s);
        /* dword i = (value 2i + 1) << 16 | value 2i: the 32 words in value order */
        const __m512i words = _mm512_or_si512(bf16_bits(lo), _mm512_slli_epi32(bf16_bits(hi), 16));
        _mm512_storeu_si512((void *)(out + g * 32), words);
    }
}
#else
static void decode_row_bf16(const uint8_t *row, const uint8_t *sc, int64_t groups, const float *scale_of,
                            uint16_t *out) {
    for (int64_t g = 0; g < groups; g++) {
        const float s = scale_of[sc[g]];
        for (int i = 0; i < 16; i++) {
            const uint8_t b = row[g * 16 + i];
            out[g * 32 + 2 * i] = float_to_bf16(E2M1_F32[b & 0x0F] * s);
            out[g * 32 + 2 * i + 1] = float_to_bf16(E2M1_F32[b >> 4] * s);
        }
    }
}
#endif

void neffbuild_mxfp4_decode_bf16(const uint8_t *blocks, const uint8_t *scales, int64_t rows, int64_t groups,
                                 uint16_t *out, int threads) {
    float scale_of[256];
    for (int s = 0; s < 256; s++) scale_of[s] = s == 255 ? NAN : ldexpf(1.0f, s - 127);
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t r = 0; r < rows; r++)
        decode_row_bf16(blocks + r * groups * 16, scales + r * groups, groups, scale_of, out + r * groups * 32);
}
