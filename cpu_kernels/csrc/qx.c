#include "cpu_kernels.h"
#include "simd.h"

// A float32 linear (or LM head) whose weight is a GGUF file's Q4_1, Q4_0 or Q8_0 blocks dequantized,
// multiplied from the blocks themselves, to the same bits: each weight is rebuilt as the loader computed it
// (Q4_1 (d * q) + m, Q4_0 d * (q - 8), Q8_0 q * d, rounded to float32: enginecore/gguf_dequant.c; d * q, 11
// significant bits times at most 8, is exact, so a compiler's fusing it with the sum changes nothing) and every
// output is the same single FMA chain over k in ascending order as panel_gemm's (with `argmax`, folded as its
// greedy head folds them). So a step's outputs do not depend on which of the two ran, and a decode step of
// few rows, which streams its weights from memory, reads 0.625 (Q4), 1.06 (Q8) or 2 (BF16, below) bytes a weight
// instead of 4.
#define QX_HALVES(kind) ((kind) == QX_BF16 || (kind) == QX_F16 || (kind) == QX_BDOT)  // 16-bit weights, no scales
#define QX_ROWS 4  // rows a tile: 2 accumulators a row, the group's d and m, the weights and one activation
#define QX_BF16_ROWS 6  // (no d and m: 12 accumulators)

// fn(KIND, ...) with `kind` (any but QX_BDOT) as a constant: each kind's own copy of an always-inline fn
#define QX_BY_KIND(kind, fn, ...)                        \
    switch (kind) {                                      \
        case QX_Q4_0: fn(QX_Q4_0, __VA_ARGS__); break;   \
        case QX_Q4_1: fn(QX_Q4_1, __VA_ARGS__); break;   \
        case QX_Q4_K: fn(QX_Q4_K, __VA_ARGS__); break;   \
        case QX_I8: fn(QX_I8, __VA_ARGS__); break;       \
        case QX_F16: fn(QX_F16, __VA_ARGS__); break;     \
        case QX_IQ4: fn(QX_IQ4, __VA_ARGS__); break;     \
        case QX_Q8_0: fn(QX_Q8_0, __VA_ARGS__); break;   \
        default: fn(QX_BF16, __VA_ARGS__); break;        \
    }

// IQ4_NL's 16 values, which QX_IQ4's nibbles index (a byte shuffle)
#define QX_IQ4_VALUES() _mm_setr_epi8(-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)

static inline int qx_group_bytes(int kind) {
    return QX_HALVES(kind) ? 32 * 32 : kind == QX_Q8_0 ? 32 + 32 * 16 : kind == QX_Q4_K ? 128 + 32 * 8
           : kind == QX_I8 ? 256 + 32 * 16 : 64 + 32 * 8;
}

// a group's 16 rows' d (and for Q4_1 / Q4_K m) in two vectors each, rows 0-7 and 8-15 (none for 16-bit kinds)
static inline __attribute__((always_inline)) void qx_scales(const int kind, const uint8_t *b, __m256 *d0, __m256 *d1,
                                                           __m256 *m0, __m256 *m1) {
    *d0 = *d1 = _mm256_setzero_ps();
    // float32 d, then m (QX_I8: k 0-15's, k 16-31's 128 bytes on; QX_IQ4: no m)
    if (kind == QX_Q4_K || kind == QX_I8 || kind == QX_IQ4) {
        *d0 = _mm256_loadu_ps((const float *)b), *d1 = _mm256_loadu_ps((const float *)b + 8);
        if (kind != QX_IQ4)
            *m0 = _mm256_loadu_ps((const float *)b + 16), *m1 = _mm256_loadu_ps((const float *)b + 24);
        return;
    }
    if (!QX_HALVES(kind)) {
        *d0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)b));
        *d1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(b + 16)));
    }
    *m0 = *d0, *m1 = *d1;
    if (kind == QX_Q4_1) {
        *m0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(b + 32)));
        *m1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(b + 48)));
    }
}

// the weights of k kk of a group (its q bytes `qs`, scales from qx_scales) of the 16 rows, as the loader computed
// them: rows 0-7 in *w0, 8-15 in *w1
static inline __attribute__((always_inline)) void qx_weights(const int kind, const uint8_t *qs, int kk, __m256 d0,
                                                            __m256 d1, __m256 m0, __m256 m1, __m256 *w0, __m256 *w1) {
    // Each half of the 16 rows is converted or widened straight from memory (the instruction's own load), not
    // split from one wide load by a shuffle: the shuffles' ports were the limit (a decode step's Q8_0 head 1.17-1.2x
    // faster at 1-8 rows, bfloat16 halves 1.07-1.19x and float16 1.01-1.17x at 1-6, on a Zen 3)
    if (QX_HALVES(kind)) {
        const __m128i h0 = _mm_loadu_si128((const __m128i *)(qs + kk * 32));
        const __m128i h1 = _mm_loadu_si128((const __m128i *)(qs + kk * 32 + 16));
        if (kind == QX_F16) {
            *w0 = _mm256_cvtph_ps(h0), *w1 = _mm256_cvtph_ps(h1);
        } else {  // a bfloat16's bits are a float32's high half
            *w0 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h0), 16));
            *w1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h1), 16));
        }
        return;
    }
    __m256i q0, q1;
    if (kind == QX_IQ4) {  // the nibbles index IQ4_NL's values (pshufb), rows 0-7 the low ones
        const __m128i v = _mm_loadl_epi64((const __m128i *)(qs + kk * 8)), f = _mm_set1_epi8(15);
        const __m128i values = QX_IQ4_VALUES();
        q0 = _mm256_cvtepi8_epi32(_mm_shuffle_epi8(values, _mm_and_si128(v, f)));
        q1 = _mm256_cvtepi8_epi32(_mm_shuffle_epi8(values, _mm_and_si128(_mm_srli_epi16(v, 4), f)));
    } else if (kind == QX_Q8_0 || kind == QX_I8) {
        q0 = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(qs + kk * 16)));
        q1 = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(qs + kk * 16 + 8)));
    } else {
        const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(qs + kk * 8)));
        q0 = _mm256_and_si256(v, _mm256_set1_epi32(15)), q1 = _mm256_srli_epi32(v, 4);
        const __m256i eight = _mm256_set1_epi32(8);
        if (kind == QX_Q4_0) q0 = _mm256_sub_epi32(q0, eight), q1 = _mm256_sub_epi32(q1, eight);
    }
    // d * q is exact, so one FMA rounds once, as the loader's product then sum did (and frees the adds' uops)
    if (kind == QX_Q4_1 || kind == QX_Q4_K || kind == QX_I8) {
        *w0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q0), d0, m0), *w1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q1), d1, m1);
        return;
    }
    *w0 = _mm256_mul_ps(_mm256_cvtepi32_ps(q0), d0), *w1 = _mm256_mul_ps(_mm256_cvtepi32_ps(q1), d1);
}

// the q bytes of a group `b` of `kind`: past the scales
static inline const uint8_t *qx_qs(const int kind, const uint8_t *b) {
    return b + (QX_HALVES(kind) ? 0 : kind == QX_Q8_0 ? 32 : kind == QX_Q4_K ? 128 : kind == QX_I8 ? 256 : 64);
}

// R rows times P (1 or 2) adjacent panels (pb bytes apart) from `panel`, y and col0 the first panel's; pf: P panels
// to fetch into L2 meanwhile. A row of one panel has 2 FMA chains, which wait on the FMA's latency at every k; two
// panels give it 4 (with the fetch, a decode step's Q4_1 linears and Q8_0 head at 1 row: 1.23x on a Zen 3).
static inline __attribute__((always_inline)) void qx_tile(const int R, const int P, const int kind, const float *x,
                                                        int K, const uint8_t *panel, size_t pb, float *y, long ldy,
                                                        int col0, int N, head_best *best, const uint8_t *pf) {
    __m256 a[2 * QX_BF16_ROWS];  // (loops over `a` unrolled: an indexed one would keep it in memory)
#pragma GCC unroll 12
    for (int i = 0; i < 2 * R * P; i++) a[i] = _mm256_setzero_ps();
    const int gb = qx_group_bytes(kind);
    for (int g = 0; g < K / 32; g++) {
        if (pf != NULL)  // the same group of the panels to fetch
#pragma GCC unroll 2
            for (int j = 0; j < P; j++)
                for (int off = 0; off < gb; off += 64)
                    _mm_prefetch((const char *)pf + j * pb + (size_t)g * gb + off, _MM_HINT_T1);
        const uint8_t *b[2], *qs[2];
        __m256 d0[2], d1[2], m0[2], m1[2];
#pragma GCC unroll 2
        for (int j = 0; j < P; j++) {
            b[j] = panel + j * pb + (size_t)g * gb, qs[j] = qx_qs(kind, b[j]);
            qx_scales(kind, b[j], &d0[j], &d1[j], &m0[j], &m1[j]);
        }
        for (int kk = 0; kk < 32; kk++) {
            __m256 w0[2], w1[2];
            const int k = g * 32 + kk;
#pragma GCC unroll 2
            for (int j = 0; j < P; j++) {
                if (kind == QX_I8 && kk == 16) qx_scales(kind, b[j] + 128, &d0[j], &d1[j], &m0[j], &m1[j]);
                qx_weights(kind, qs[j], kk, d0[j], d1[j], m0[j], m1[j], &w0[j], &w1[j]);
            }
#pragma GCC unroll 6
            for (int r = 0; r < R; r++) {
                const __m256 xv = _mm256_broadcast_ss(x + (size_t)r * K + k);
#pragma GCC unroll 2
                for (int j = 0; j < P; j++) {
                    a[2 * (r * P + j)] = _mm256_fmadd_ps(xv, w0[j], a[2 * (r * P + j)]);
                    a[2 * (r * P + j) + 1] = _mm256_fmadd_ps(xv, w1[j], a[2 * (r * P + j) + 1]);
                }
            }
        }
    }
#pragma GCC unroll 6
    for (int r = 0; r < R; r++)
#pragma GCC unroll 2
        for (int j = 0; j < P; j++) {
            const int c = col0 + 16 * j;
            float *yr = y == NULL ? NULL : y + r * ldy + 16 * j;
            if (best != NULL) {
                head_fold(a[2 * (r * P + j)], c, N, best + r);
                head_fold(a[2 * (r * P + j) + 1], c + 8, N, best + r);
            } else if (c + 16 <= N) {
                _mm256_storeu_ps(yr, a[2 * (r * P + j)]);
                _mm256_storeu_ps(yr + 8, a[2 * (r * P + j) + 1]);
            } else {
                float t[16];
                _mm256_storeu_ps(t, a[2 * (r * P + j)]);
                _mm256_storeu_ps(t + 8, a[2 * (r * P + j) + 1]);
                for (int i = 0; i < N - c; i++) yr[i] = t[i];
            }
        }
}

// panels [p0, p1) for all M rows, QX_ROWS (16-bit kinds: QX_BF16_ROWS) at a time (y, or the rows' running maxima
// `best`); the first tile of a panel prefetches the next one into L2, a group at a time (BF16 1.4-1.7x at 4-12
// rows, Q4 1.0-1.06x). One row: two panels a tile, each tile fetching the pair after the next.
static inline __attribute__((always_inline)) void qx_panels(const int kind, const float *x, int M, int K,
                                                           const uint8_t *w, int N, float *y, head_best *best, int p0,
                                                           int p1) {
    const size_t pb = (size_t)K / 32 * qx_group_bytes(kind);
    const int rows = QX_HALVES(kind) ? QX_BF16_ROWS : QX_ROWS;
    if (M == 1) {
        int p = p0;
        for (; p + 2 <= p1; p += 2)
            qx_tile(1, 2, kind, x, K, w + p * pb, pb, y == NULL ? NULL : y + p * 16, N, p * 16, N, best,
                    p + 6 <= p1 ? w + (p + 4) * pb : NULL);
        if (p < p1) qx_tile(1, 1, kind, x, K, w + p * pb, pb, y == NULL ? NULL : y + p * 16, N, p * 16, N, best, NULL);
        return;
    }
    for (int p = p0; p < p1; p++)
        for (int m = 0; m < M; m += rows) {
            const float *xm = x + (size_t)m * K;
            float *ym = y == NULL ? NULL : y + (size_t)m * N + p * 16;
            head_best *bm = best == NULL ? NULL : best + m;
            const uint8_t *pf = m == 0 && p + 1 < p1 ? w + (p + 1) * pb : NULL;
            switch (M - m < rows ? M - m : rows) {
                case 6:
                    if (QX_HALVES(kind)) qx_tile(6, 1, kind, xm, K, w + p * pb, pb, ym, N, p * 16, N, bm, pf);
                    break;
                case 5:
                    if (QX_HALVES(kind)) qx_tile(5, 1, kind, xm, K, w + p * pb, pb, ym, N, p * 16, N, bm, pf);
                    break;
                case 4: qx_tile(4, 1, kind, xm, K, w + p * pb, pb, ym, N, p * 16, N, bm, pf); break;
                case 3: qx_tile(3, 1, kind, xm, K, w + p * pb, pb, ym, N, p * 16, N, bm, pf); break;
                case 2: qx_tile(2, 1, kind, xm, K, w + p * pb, pb, ym, N, p * 16, N, bm, pf); break;
                default: qx_tile(1, 1, kind, xm, K, w + p * pb, pb, ym, N, p * 16, N, bm, pf); break;
            }
        }
}

// qx_panels of each kind its own function, `kind` a constant in it. Left to the compiler (GCC 12: one clone of a
// `static` qx_panels for one kind), the others tested `kind` and jumped through a table at every k of every tile:
// a decode step's Q4_1 linears and Q8_0 head (`bench_kernels_ab --what qx`, a 2-core Zen 3 without
// AVX-512) took 20 ms at 1 row against 8.7 now, 19 at 4 against 12.8. (qx512_panels was always inlined by kind.)
#define QX_PANELS_FN(KIND)                                                                                      \
    static __attribute__((noinline)) void qx_panels_##KIND(const float *x, int M, int K, const uint8_t *w, int N, \
                                                           float *y, head_best *best, int p0, int p1) {        \
        qx_panels(KIND, x, M, K, w, N, y, best, p0, p1);                                                        \
    }
QX_PANELS_FN(QX_Q4_0) QX_PANELS_FN(QX_Q4_1) QX_PANELS_FN(QX_Q4_K) QX_PANELS_FN(QX_I8) QX_PANELS_FN(QX_F16)
QX_PANELS_FN(QX_IQ4) QX_PANELS_FN(QX_Q8_0) QX_PANELS_FN(QX_BF16)
#define QX_PANELS_OF(KIND, ...) qx_panels_##KIND(__VA_ARGS__)

// bytes of one panel of qx_gemm's of `kind` over K (K / 32 groups), -1 for a bad kind or K
long qx_panel_bytes(int kind, int K) {
    return kind < QX_Q4_0 || kind > QX_BDOT || K <= 0 || K % 32 ? -1 : (long)K / 32 * qx_group_bytes(kind);
}

// How many weights of the first N rows qx_gemm's panels `w` (of `kind`, over K) rebuild to other bits than the
// float32 panels `f` (panel_gemm's [ceil(N / 16), K, 16]) hold, each rebuilt as qx_gemm rebuilds it: 0 when a step
// may multiply either (the same outputs). The loaders check a GGUF file's blocks against the weights they loaded
// with it (cpu_kernels.layout.rebuilds). -1 for bad arguments.
long qx_mismatches(const void *w, int kind, int K, int N, const float *f) {
    const long pb = qx_panel_bytes(kind, K);
    if (N <= 0 || pb < 0 || kind == QX_BDOT) return -1;
    const int gb = qx_group_bytes(kind);
    long bad = 0;
    for (int p = 0; p < (N + 15) / 16; p++) {
        const int valid = N - p * 16 >= 16 ? 0xFFFF : (1 << (N - p * 16)) - 1;  // the padding rows' are not weights
        for (int g = 0; g < K / 32; g++) {
            const uint8_t *b = (const uint8_t *)w + p * pb + (size_t)g * gb, *qs = qx_qs(kind, b);
            __m256 d0, d1, m0, m1, w0, w1;
            qx_scales(kind, b, &d0, &d1, &m0, &m1);
            for (int kk = 0; kk < 32; kk++) {
                if (kind == QX_I8 && kk == 16) qx_scales(kind, b + 128, &d0, &d1, &m0, &m1);
                qx_weights(kind, qs, kk, d0, d1, m0, m1, &w0, &w1);
                const float *fk = f + ((size_t)p * K + g * 32 + kk) * 16;
                const __m256i e0 = _mm256_cmpeq_epi32(_mm256_castps_si256(w0), _mm256_loadu_si256((const __m256i *)fk)),
                              e1 = _mm256_cmpeq_epi32(_mm256_castps_si256(w1),
                                                      _mm256_loadu_si256((const __m256i *)(fk + 8)));
                const int same = _mm256_movemask_ps(_mm256_castsi256_ps(e0)) |
                                 _mm256_movemask_ps(_mm256_castsi256_ps(e1)) << 8;
                bad += __builtin_popcount(~same & valid);
            }
        }
    }
    return bad;
}

// QX_BDOT's kernel. The activations are rounded to bfloat16 once a call (VCVTNE2PS2BF16: to nearest even,
// denormals to zero) into pairs as the weights are paired; each output is one VDPBF16PS chain over the pairs of k
// in ascending order from zero (each instruction adds a pair's two exact products into its float32 sum, to
// nearest even, denormals to zero), so, as everywhere here, a row's outputs do not depend on the rows beside it,
// the tiles or the threads. 32 registers: tiles of up to BDOT_ROWS rows times two panels (24 sums).
// From BDOT_PF_ROWS rows on, the first two tiles of a pair of panels prefetch the next pair into L2, a line or two
// a pair of k (the hardware's streams alone left memory idle while a pair's later tiles ran from cache:
// the embedded model's decode linears, 16 rows 12.0-12.2 -> 9.8-9.9 ms, 1.16-1.19x at 12 rows, 1.04-1.10x
// from 24 to 256; at 1-4 rows, memory-bound, no better, and left alone).
#if defined(__clang__) ? __clang_major__ >= 9 : __GNUC__ >= 10
#define XLASERVE_BDOT 1  // (a compiler that builds AVX-512 code by target attributes: qx512_panels below too)
#define BDOT_TARGET __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16")))
#define BDOT_ROWS 12
#define BDOT_PF_ROWS 6

// this thread's buffer of n uint32s for a call's activations, kept between calls; NULL if out of memory
static uint32_t *bdot_scratch(size_t n) {
    static __thread uint32_t *buf;
    static __thread size_t cap;
    if (n > cap) {
        free(buf);
        buf = (uint32_t *)aligned_alloc(64, (n * sizeof(uint32_t) + 63) / 64 * 64);
        cap = buf == NULL ? 0 : n;
    }
    return buf;
}

// x [M, K] (K % 32 == 0) -> xb [M, K / 2]: each pair of k as bfloat16s, k even in the low half
BDOT_TARGET static void bdot_activations(const float *x, int M, int K, uint32_t *xb) {
    for (size_t i = 0; i < (size_t)M * K; i += 32) {
        const __m512 lo = _mm512_loadu_ps(x + i), hi = _mm512_loadu_ps(x + i + 16);
        _mm512_storeu_si512((void *)(xb + i / 2), (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
}

// 16 outputs (columns col0 ..) into a row's running maxima. Not inlined: head_fold inlined into the AVX-512
// tiles left GCC (12) 8 vector registers for them, and the 24 sums went to the stack.
static __attribute__((noinline)) void bdot_fold(const float *t, int col0, int N, head_best *b) {
    head_fold(_mm256_loadu_ps(t), col0, N, b);
    head_fold(_mm256_loadu_ps(t + 8), col0 + 8, N, b);
}

BDOT_TARGET static inline __attribute__((always_inline)) void bdot_tile(const int R, const int P, const uint32_t *xb,
                                                                        int K2, const uint32_t *w, size_t pw, int col,
                                                                        int N, float *y, head_best *best,
                                                                        const char *pf, int pf_rate, int pf_k) {
    // (pf: lines to prefetch into L2, pf_rate (1 or 2) a pair of k for the first pf_k pairs)
    __m512 a[2 * BDOT_ROWS];
#pragma GCC unroll 24
    for (int i = 0; i < R * P; i++) a[i] = _mm512_setzero_ps();
    for (int k = 0; k < K2; k++) {
        const __m512bh b0 = (__m512bh)_mm512_loadu_si512((const void *)(w + (size_t)k * 16));
        const __m512bh b1 = P > 1 ? (__m512bh)_mm512_loadu_si512((const void *)(w + pw + (size_t)k * 16)) : b0;
        if (k < pf_k) {
            _mm_prefetch(pf + (size_t)k * pf_rate * 64, _MM_HINT_T1);
            if (pf_rate > 1) _mm_prefetch(pf + ((size_t)k * pf_rate + 1) * 64, _MM_HINT_T1);
        }
#pragma GCC unroll 12
        for (int r = 0; r < R; r++) {
            const __m512bh xv = (__m512bh)_mm512_set1_epi32((int)xb[(size_t)r * K2 + k]);
            a[r * P] = _mm512_dpbf16_ps(a[r * P], xv, b0);
            if (P > 1) a[r * P + 1] = _mm512_dpbf16_ps(a[r * P + 1], xv, b1);
        }
    }
#pragma GCC unroll 12
    for (int r = 0; r < R; r++)
#pragma GCC unroll 2
        for (int j = 0; j < P; j++) {
            const int c0 = col + 16 * j;
            const __m512 v = a[r * P + j];
            if (best != NULL) {
                float t[16];
                _mm512_storeu_ps(t, v);
                bdot_fold(t, c0, N, best + r);
            } else if (c0 + 16 <= N) {
                _mm512_storeu_ps(y + (size_t)r * N + c0, v);
            } else {
                float t[16];
                _mm512_storeu_ps(t, v);
                for (int c = 0; c < N - c0; c++) y[(size_t)r * N + c0 + c] = t[c];
            }
        }
}

#define BDOT_TILE(R)                                                                                     \
    case R:                                                                                              \
        if (two)                                                                                         \
            bdot_tile(R, 2, xm, K2, wp, pw, p * 16, N, ym, bm, pfi, rate, pk);                           \
        else                                                                                             \
            bdot_tile(R, 1, xm, K2, wp, pw, p * 16, N, ym, bm, pfi, rate, pk);                           \
        break;

// panels [p0, p1), two at a time, for all M rows in tiles of up to BDOT_ROWS as even as they go (xb:
// bdot_activations'; y, or the rows' running maxima `best`)
BDOT_TARGET static void bdot_panels(const uint32_t *xb, int M, int K, const uint8_t *w, int N, float *y,
                                    head_best *best, int p0, int p1) {
    const int K2 = K / 2, tiles = (M + BDOT_ROWS - 1) / BDOT_ROWS;
    const size_t pw = (size_t)K2 * 16;  // uint32s a panel
    for (int p = p0; p < p1; p += 2) {
        const int two = p + 1 < p1;
        const uint32_t *wp = (const uint32_t *)w + (size_t)p * pw;
        // the next pair's lines (K2 a panel, none past p1), split between the first pf_tiles tiles
        const int next = M < BDOT_PF_ROWS || p + 2 >= p1 ? 0 : p + 3 < p1 ? 2 : 1;
        const int pf_tiles = tiles < 2 ? tiles : 2, lines = next * K2, rate = pf_tiles == 1 && next == 2 ? 2 : 1;
        const char *pf = (const char *)(wp + 2 * pw);
        for (int i = 0, m = 0; i < tiles; i++) {
            const int m1 = (int)((long)M * (i + 1) / tiles);
            const int l0 = i < pf_tiles ? lines * i / pf_tiles : 0;
            const int pk = i < pf_tiles ? (lines * (i + 1) / pf_tiles - l0) / rate : 0;
            const char *pfi = pf + (size_t)l0 * 64;
            const uint32_t *xm = xb + (size_t)m * K2;
            float *ym = y == NULL ? NULL : y + (size_t)m * N;
            head_best *bm = best == NULL ? NULL : best + m;
            switch (m1 - m) {
                BDOT_TILE(1) BDOT_TILE(2) BDOT_TILE(3) BDOT_TILE(4) BDOT_TILE(5) BDOT_TILE(6)
                BDOT_TILE(7) BDOT_TILE(8) BDOT_TILE(9) BDOT_TILE(10) BDOT_TILE(11) BDOT_TILE(12)
            }
            m = m1;
        }
    }
}

// QX kinds other than QX_BDOT on a CPU with AVX-512 (qx512_use): a tile's rows, up to QX512_ROWS, times one panel's
// 16 columns, one 512-bit sum a row. A k's 16 weights are rebuilt once for all the tile's rows (qx_tile's 256-bit
// tiles of QX_ROWS rows rebuild them for every 4: at 8-16 rows most of its time), with the same operations lane
// by lane (q converted, times d, plus m), and each output is the same FMA chain over k in ascending order, so the
// bits are qx_tile's and panel_gemm's. A decode step's linears and greedy head (`bench_kernels_ab --what qx`,
// 2-core Zen 4): Q4_1 6.7 -> 5.7 ms at 1 row, 9.9 -> 7.9 at 4, 19.2 -> 12.5 at 8, 28.0 -> 18.3 at 12,
// 37.2 -> 22.4 at 16 (~188 GFLOP/s, the FMA peak), so cpu_kernels.layout.QX512_MAX_ROWS keeps them to 20 rows.
#define QX512_TARGET __attribute__((target("avx512f,avx512bw,avx512vl")))
#define QX512_ROWS 16

static int qx512_state = -1;  // -1: not yet asked

static int qx512_cpu(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl");
}

static inline int qx512_on(void) {
    if (qx512_state < 0) qx512_state = qx512_cpu();
    return qx512_state;
}

QX512_TARGET static inline __attribute__((always_inline)) void qx512_scales(const int kind, const uint8_t *b,
                                                                          __m512 *d, __m512 *m) {
    if (kind == QX_Q4_K || kind == QX_I8 || kind == QX_IQ4) {  // float32 d, then m
        *d = _mm512_loadu_ps((const float *)b);
        *m = kind == QX_IQ4 ? *d : _mm512_loadu_ps((const float *)b + 16);
        return;
    }
    *d = QX_HALVES(kind) ? _mm512_setzero_ps() : _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)b));
    *m = kind == QX_Q4_1 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(b + 32))) : *d;
}

QX512_TARGET static inline __attribute__((always_inline)) __m512 qx512_weights(const int kind, const uint8_t *qs,
                                                                             int kk, __m512 d, __m512 m) {
    if (kind == QX_F16) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(qs + kk * 32)));
    if (kind == QX_BF16)
        return _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(qs + kk * 32))), 16));
    __m512i q;
    if (kind == QX_Q8_0 || kind == QX_I8) {
        q = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(qs + kk * 16)));
    } else {  // rows 0-7 the low nibbles, 8-15 the high ones
        const __m128i v = _mm_loadl_epi64((const __m128i *)(qs + kk * 8));
        const __m128i n = _mm_and_si128(_mm_unpacklo_epi64(v, _mm_srli_epi16(v, 4)), _mm_set1_epi8(15));
        if (kind == QX_IQ4) {
            q = _mm512_cvtepi8_epi32(_mm_shuffle_epi8(QX_IQ4_VALUES(), n));
        } else {
            q = _mm512_cvtepu8_epi32(n);
            if (kind == QX_Q4_0) q = _mm512_sub_epi32(q, _mm512_set1_epi32(8));
        }
    }
    const __m512 w = _mm512_mul_ps(_mm512_cvtepi32_ps(q), d);
    return kind == QX_Q4_1 || kind == QX_Q4_K || kind == QX_I8 ? _mm512_add_ps(w, m) : w;
}

QX512_TARGET static inline __attribute__((always_inline)) void qx512_tile(const int R, const int kind, const float *x,
                                                                        int K, const uint8_t *panel, float *y, int col0,
                                                                        int N, head_best *best, const uint8_t *pf) {
    __m512 a[QX512_ROWS];
#pragma GCC unroll 16
    for (int r = 0; r < R; r++) a[r] = _mm512_setzero_ps();
    const int gb = qx_group_bytes(kind);
    for (int g = 0; g < K / 32; g++) {
        const uint8_t *b = panel + (size_t)g * gb, *qs = qx_qs(kind, b);
        if (pf != NULL)  // the same group of the next panel
            for (int off = 0; off < gb; off += 64) _mm_prefetch((const char *)pf + (size_t)g * gb + off, _MM_HINT_T1);
        __m512 d, m;
        qx512_scales(kind, b, &d, &m);
        for (int kk = 0; kk < 32; kk++) {
            if (kind == QX_I8 && kk == 16) qx512_scales(kind, b + 128, &d, &m);
            const __m512 w = qx512_weights(kind, qs, kk, d, m);
            const float *xk = x + g * 32 + kk;
#pragma GCC unroll 16
            for (int r = 0; r < R; r++) a[r] = _mm512_fmadd_ps(_mm512_set1_ps(xk[(size_t)r * K]), w, a[r]);
        }
    }
#pragma GCC unroll 16
    for (int r = 0; r < R; r++) {
        if (best != NULL) {
            float t[16];
            _mm512_storeu_ps(t, a[r]);
            bdot_fold(t, col0, N, best + r);
        } else {
            _mm512_mask_storeu_ps(y + (size_t)r * N + col0, col0 + 16 <= N ? 0xFFFF : (1u << (N - col0)) - 1, a[r]);
        }
    }
}

#define QX512_TILE(R) \
    case R: qx512_tile(R, kind, xm, K, w + p * pb, ym, p * 16, N, bm, pf); break;

// qx_panels on AVX-512: panels [p0, p1) for all M rows in tiles of up to QX512_ROWS as even as they go; the first
// tile of a panel prefetches the next one into L2, a group at a time
QX512_TARGET static inline __attribute__((always_inline)) void qx512_panels(const int kind, const float *x, int M,
                                                                          int K, const uint8_t *w, int N, float *y,
                                                                          head_best *best, int p0, int p1) {
    const size_t pb = (size_t)K / 32 * qx_group_bytes(kind);
    const int tiles = (M + QX512_ROWS - 1) / QX512_ROWS;
    for (int p = p0; p < p1; p++)
        for (int i = 0, m = 0; i < tiles; i++) {
            const int m1 = (int)((long)M * (i + 1) / tiles);
            const float *xm = x + (size_t)m * K;
            float *ym = y == NULL ? NULL : y + (size_t)m * N;
            head_best *bm = best == NULL ? NULL : best + m;
            const uint8_t *pf = M >= 2 && i == 0 && p + 1 < p1 ? w + (p + 1) * pb : NULL;
            switch (m1 - m) {
                QX512_TILE(1) QX512_TILE(2) QX512_TILE(3) QX512_TILE(4) QX512_TILE(5) QX512_TILE(6)
                QX512_TILE(7) QX512_TILE(8) QX512_TILE(9) QX512_TILE(10) QX512_TILE(11) QX512_TILE(12)
                QX512_TILE(13) QX512_TILE(14) QX512_TILE(15) QX512_TILE(16)
            }
            m = m1;
        }
}

QX512_TARGET static void qx512_gemm_part(const float *x, int M, int K, const uint8_t *w, int N, float *y,
                                         head_best *b, int kind, int p0, int p1) {
    QX_BY_KIND(kind, qx512_panels, x, M, K, w, N, y, b, p0, p1);
}
#endif

// float32 panels [npanels, K, 16] (pack_panels_f32's) -> QX_BDOT's [npanels, K / 2, 16, 2] bfloat16s: each weight
// rounded as the KV cache's bfloat16 writes round (to_bf16: c10::BFloat16's), per pair of k the 16 rows' two
// values, k even first. Portable (no AVX-512 needed to pack). -1 for bad arguments.
int pack_bdot_panels(const float *panels, long npanels, int K, uint16_t *out) {
    if (npanels < 0 || K <= 0 || K % 32) return -1;
#pragma omp parallel for schedule(static)
    for (long p = 0; p < npanels; p++) {
        const float *src = panels + (size_t)p * K * 16;
        uint16_t *dst = out + (size_t)p * K * 16;
        for (int j = 0; j < K / 2; j++)
            for (int c = 0; c < 16; c++) {
                dst[((size_t)j * 16 + c) * 2] = to_bf16(src[(size_t)(2 * j) * 16 + c]);
                dst[((size_t)j * 16 + c) * 2 + 1] = to_bf16(src[(size_t)(2 * j + 1) * 16 + c]);
            }
    }
    return 0;
}

// Whether QX_BDOT runs here: built with it, on a CPU with AVX512-BF16 (and the AVX-512 parts it needs)
int bdot_supported(void) {
#ifdef XLASERVE_BDOT
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
           __builtin_cpu_supports("avx512bf16");
#else
    return 0;
#endif
}

// QX_BDOT's operands for callers that split the panels themselves (jaxengine's custom calls): x [M, K] rounded
// once a call into xb (M * K / 2 uint32s, bdot_activations'), then bdot_gemm_part over each part of the panels.
// -1 where QX_BDOT cannot run here, or for bad arguments.
int bdot_round(const float *x, int M, int K, uint32_t *xb) {
#ifdef XLASERVE_BDOT
    if (!bdot_supported() || M < 0 || K <= 0 || K % 32) return -1;
    bdot_activations(x, M, K, xb);
    return 0;
#else
    (void)x, (void)M, (void)K, (void)xb;
    return -1;
#endif
}

int bdot_gemm_part(const uint32_t *xb, int M, int K, const void *w, int N, float *y, void *best, int p0, int p1) {
    if (M < 1 || N <= 0 || K <= 0 || K % 32 || (y == NULL) == (best == NULL) || p0 < 0 || p1 > (N + 15) / 16 ||
        !bdot_supported())
        return -1;
#ifdef XLASERVE_BDOT
    bdot_panels(xb, M, K, (const uint8_t *)w, N, y, (head_best *)best, p0, p1);
    return 0;
#else
    (void)xb, (void)w;
    return -1;
#endif
}

// this thread's scratch for x [M, K] rounded (bdot_round), what qx_gemm and qx_gemm_part multiply QX_BDOT's
// panels by (their callers have checked M and K: qx_panel_bytes); NULL where QX_BDOT cannot run here, or out of
// memory
static uint32_t *bdot_buffer(int M, int K) {
#ifdef XLASERVE_BDOT
    return bdot_supported() ? bdot_scratch((size_t)M * K / 2) : NULL;
#else
    (void)M, (void)K;
    return NULL;
#endif
}

// Whether qx_gemm runs its AVX-512 tiles (qx512_panels): where built with them, on a CPU with AVX-512. `set` 0
// turns them off, 1 back on where the CPU has them (the tests multiply with both tiles), -1 only asks. Returns
// the state before. Not for steps in flight: the kernels read it without a lock.
int qx512_use(int set) {
#ifdef XLASERVE_BDOT
    const int before = qx512_on();
    if (set >= 0) qx512_state = set && qx512_cpu();
    return before;
#else
    (void)set;
    return 0;
#endif
}

// qx_gemm's panels [p0, p1) on the calling thread: y, or with `best` (y NULL) the M rows' running maxima (M
// head_best, head_best_init'ed). jaxengine's custom calls share the panels between XLA's threads with it.
// Returns 0, -1 for bad arguments.
int qx_gemm_part(const float *x, int M, int K, const void *w, int N, float *y, void *best, int kind, int p0,
                 int p1) {
    if (M < 1 || N <= 0 || qx_panel_bytes(kind, K) < 0 || (y == NULL) == (best == NULL) || p0 < 0 ||
        p1 > (N + 15) / 16)
        return -1;
    const uint8_t *wb = (const uint8_t *)w;
    head_best *b = (head_best *)best;
    if (kind == QX_BDOT) {
        uint32_t *xb = bdot_buffer(M, K);
        return xb == NULL || bdot_round(x, M, K, xb) != 0 ? -1 : bdot_gemm_part(xb, M, K, w, N, y, best, p0, p1);
    }
#ifdef XLASERVE_BDOT
    if (qx512_on()) {
        qx512_gemm_part(x, M, K, wb, N, y, b, kind, p0, p1);
        return 0;
    }
#endif
    QX_BY_KIND(kind, QX_PANELS_OF, x, M, K, wb, N, y, b, p0, p1);
    return 0;
}

// y [M, N] = x [M, K] . W^T from pack_q4x's / pack_q8x's / pack_bf16x's panels of `kind` (QX_*); or, with
// `argmax` (y NULL), each row's argmax as panel_gemm's greedy head gives it. Returns 0, -1 for bad arguments,
// -2 if the maxima cannot be allocated.
int qx_gemm(const float *x, int M, int K, const void *w, int N, float *y, int64_t *argmax, int kind, int nthreads) {
    if (M < 1 || N <= 0 || qx_panel_bytes(kind, K) < 0 || (y == NULL) == (argmax == NULL)) return -1;
    if (nthreads <= 0) nthreads = omp_get_max_threads();
    const int NP = (N + 15) / 16, nt = gemm_threads(M, K, N, nthreads, NP);
    // QX_BDOT: the activations rounded once for every thread's panels; from 65536 values on, each thread rounds
    // its share of the rows (a prefill's on the calling thread alone: 1-2% of its step, the other thread waiting)
    uint32_t *xb = kind == QX_BDOT ? bdot_buffer(M, K) : NULL;
    if (kind == QX_BDOT && xb == NULL) return -1;
    const int shared_round = (long)M * K >= 65536;
    if (xb != NULL && !shared_round) bdot_round(x, M, K, xb);
    head_best *best = argmax == NULL ? NULL : maxima_new(M, nt);
    if (argmax != NULL && best == NULL) return -2;
#pragma omp parallel num_threads(nt)
    {
        const int t = omp_get_thread_num(), T = omp_get_num_threads();
        const int p0 = (int)((long)NP * t / T), p1 = (int)((long)NP * (t + 1) / T);
        head_best *own = best == NULL ? NULL : best + (size_t)M * t;
        if (xb != NULL) {
            if (shared_round) {
                const int r0 = (int)((long)M * t / T), r1 = (int)((long)M * (t + 1) / T);
                bdot_round(x + (size_t)r0 * K, r1 - r0, K, xb + (size_t)r0 * K / 2);
#pragma omp barrier
            }
            bdot_gemm_part(xb, M, K, w, N, y, own, p0, p1);
        } else
            qx_gemm_part(x, M, K, w, N, y, own, kind, p0, p1);
    }
    if (argmax != NULL) maxima_merge(best, M, nt, argmax);
    return 0;
}
