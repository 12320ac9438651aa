// Internal to the kernels' C sources: the includes, the vector helpers and the KV element types several topics share.
#ifndef XLASERVE_CPU_SIMD_H
#define XLASERVE_CPU_SIMD_H
#include <immintrin.h>
#ifdef XLASERVE_NO_OPENMP
// cpu_kernels/csrc/xla_ffi.cc links this file for its single-threaded entry points (panel_gemm_plan and
// panel_gemm_part, decode_heads_per_task, decode_attention_tasks and decode_split_phase) and splits the work
// between XLA's threads itself: no OpenMP runtime in the jax process. The pragmas are ignored and the
// multi-threaded entry points run on one thread.
static inline int omp_get_max_threads(void) { return 1; }
static inline int omp_get_thread_num(void) { return 0; }
static inline int omp_get_num_threads(void) { return 1; }
#else
#include <omp.h>
#endif
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

// x [M, K] float32 -> xq [M, K / 32, 32] int8 (Q16: int16), dx and xs [M, K / 32] (scale and exact sum of
// each block)

// to sleep, and waking one costs tens of microseconds on a VM (a tiny model's decode attention took 80 us
// in a step on two threads, 7 us in a tight loop).
#define PARALLEL_WORK (1L << 15)

// threads worth waking for M rows times an [N, K] weight: all of nthreads from PARALLEL_WORK multiply-adds,
// rows counted up to 8 (a few rows' product is the weight's streaming); at most `most`
static inline int gemm_threads(int M, int K, int N, int nthreads, int most) {
    const int n = (long)N * K * (M < 8 ? M : 8) >= PARALLEL_WORK ? (nthreads > 0 ? nthreads : 1) : 1;
    return n < most ? n : most;
}

// One 8-lane FMA chain over the floats in order, hsum8, then the scalar tail (dots_tile computes each
// attention score this way too, several at a time).
static inline float dot(const float *a, const float *b, int n) {
    __m256 acc = _mm256_setzero_ps();
    int j = 0;
    for (; j + 8 <= n; j += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + j), _mm256_loadu_ps(b + j), acc);
    float s = hsum8(acc);
    for (; j < n; j++) s += a[j] * b[j];
    return s;
}

// [hsum8(a), hsum8(b), hsum8(c), hsum8(d)]: the same additions of the same operands, four at a time
static inline __m128 hsum8x4(__m256 a, __m256 b, __m256 c, __m256 d) {
    const __m256 ab = _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
    const __m256 cd = _mm256_add_ps(_mm256_permute2f128_ps(c, d, 0x20), _mm256_permute2f128_ps(c, d, 0x31));
    // [a0 + a2, a1 + a3, c0 + c2, c1 + c3 | the same of b, d]
    const __m256 u = _mm256_add_ps(_mm256_shuffle_ps(ab, cd, 0x44), _mm256_shuffle_ps(ab, cd, 0xEE));
    // [a, c, a, c | b, d, b, d]
    const __m256 r = _mm256_add_ps(_mm256_shuffle_ps(u, u, 0x88), _mm256_shuffle_ps(u, u, 0xDD));
    return _mm_unpacklo_ps(_mm256_castps256_ps128(r), _mm256_extractf128_ps(r, 1));
}

// exp of 8 floats: x = k ln2 + r with |r| <= ln2 / 2, e^r by its degree-7 Taylor-like polynomial (Cephes'
// expf coefficients; ~1 ulp on [-87, 88]), times 2^k built in the exponent bits. Inputs are clamped to
// [-87.3, 88.376] (k <= 127: 2^k a finite float; above that the result stays 2.4e38, not inf); below, the
// result is 0 or a tiny normal number, not a denormal. NaN stays NaN, as in expf (a NaN attention score
// gives a NaN row whether it falls in the vector body or the scalar tail).
static inline __m256 exp8(__m256 x) {
    const __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
    const __m256 x0 = x;
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3762626647949f));
    const __m256 k = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(k, _mm256_set1_ps(0.693359375f), x);  // ln2 in two parts: exact k * hi
    r = _mm256_fnmadd_ps(k, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
    return _mm256_blendv_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(e)), x0, nan);
}

// the largest of n floats, NaN skipped (-inf if none): `x > m ? x : m` over them, 8 lanes at a time (a scalar
// chain of them waited 3 cycles an element: ~9% of prefill attention). A maximum does not round, so any order
// gives the same value, up to a zero's sign: exp_shift_sum then takes exp(-0) for exp(+0) or the reverse, both
// exactly 1 (exp8 and expf).
static inline float row_max(const float *x, int n) {
    __m256 v = _mm256_set1_ps(-INFINITY);
    int k = 0;
    for (; k + 8 <= n; k += 8) v = _mm256_max_ps(_mm256_loadu_ps(x + k), v);  // (x, v): NaN x keeps v
    float t[8], m = -INFINITY;
    _mm256_storeu_ps(t, v);
    for (int j = 0; j < 8; j++) m = t[j] > m ? t[j] : m;
    for (; k < n; k++) m = x[k] > m ? x[k] : m;
    return m;
}

// x[i] = exp(x[i] - m) for n floats; returns their sum
static inline float exp_shift_sum(float *x, int n, float m) {
    const __m256 vm = _mm256_set1_ps(m);
    __m256 acc = _mm256_setzero_ps();
    int j = 0;
    for (; j + 8 <= n; j += 8) {
        const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(x + j), vm));
        _mm256_storeu_ps(x + j, e);
        acc = _mm256_add_ps(acc, e);
    }
    float sum = hsum8(acc);
    for (; j < n; j++) sum += (x[j] = expf(x[j] - m));
    return sum;
}
// The KV cache's element type (kv_write, decode_attention, prefill_attention, decode_layers): float32, or
// float16 / bfloat16 (`--kv-cache-dtype`), half the bytes that decode attention streams from memory.
// Stored rounded to nearest even (as torch's .to() rounds; a NaN stays a NaN), read back exactly into
// float32, so attention over a 16-bit cache is the float32 kernels' arithmetic on those values, bit for bit.
#define KV_BYTES(T) ((T) == KV_F32 ? 4 : 2)

static inline __attribute__((always_inline)) __m256 kv_load8(const int T, const char *p) {
    if (T == KV_F16) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
    if (T == KV_BF16)
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
    return _mm256_loadu_ps((const float *)p);
}

static inline __attribute__((always_inline)) float kv_load1(const int T, const char *p) {
    if (T == KV_F16) return _cvtsh_ss(*(const uint16_t *)p);
    if (T == KV_BF16) {
        const uint32_t u = (uint32_t)(*(const uint16_t *)p) << 16;
        float f;
        memcpy(&f, &u, 4);
        return f;
    }
    return *(const float *)p;
}

// float32 -> bfloat16 bits, round to nearest even; NaN -> 0x7FC0 (c10::BFloat16's conversion)
static inline uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if (f != f) return 0x7FC0;
    return (uint16_t)((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

// n floats of src into a cache row of type T
static inline void kv_store(const int T, char *dst, const float *src, int n) {
    if (T == KV_F32) {
        memcpy(dst, src, sizeof(float) * n);
        return;
    }
    uint16_t *d = (uint16_t *)dst;
    int j = 0;
    if (T == KV_F16) {
        for (; j + 8 <= n; j += 8)
            _mm_storeu_si128((__m128i *)(d + j), _mm256_cvtps_ph(_mm256_loadu_ps(src + j), _MM_FROUND_TO_NEAREST_INT));
        for (; j < n; j++) d[j] = _cvtss_sh(src[j], _MM_FROUND_TO_NEAREST_INT);
    } else {
        for (; j < n; j++) d[j] = to_bf16(src[j]);
    }
}


// Folds 8 outputs (columns col0 ..) into a row's running maxima: lane j keeps the largest value of its columns and,
// among equal ones, the lowest column. So a set's result does not depend on the order its panels come in, and
// claims (shares_claim) may hand a thread panels out of order: from the back of another's share.
static inline __attribute__((always_inline)) void head_fold(__m256 a, int col0, int V, head_best *b) {
    const __m256 nanm = _mm256_cmp_ps(a, a, _CMP_UNORD_Q);
    if (__builtin_expect(col0 + 8 > V || _mm256_movemask_ps(nanm), 0)) {  // the padded tail, or a NaN
        float t[8];
        _mm256_storeu_ps(t, a);
        for (int j = 0; j < 8 && col0 + j < V; j++) {
            if (t[j] != t[j]) {
                if (col0 + j < b->nan) b->nan = col0 + j;
            } else if (t[j] > b->v[j] || (t[j] == b->v[j] && col0 + j < b->i[j])) {
                b->v[j] = t[j];
                b->i[j] = col0 + j;
            }
        }
        return;
    }
    const __m256 bv = _mm256_loadu_ps(b->v);
    const __m256i idx = _mm256_add_epi32(_mm256_set1_epi32(col0), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    const __m256i bi = _mm256_loadu_si256((const __m256i *)b->i);
    const __m256 take = _mm256_or_ps(_mm256_cmp_ps(a, bv, _CMP_GT_OQ),
                                     _mm256_and_ps(_mm256_cmp_ps(a, bv, _CMP_EQ_OQ),
                                                   _mm256_castsi256_ps(_mm256_cmpgt_epi32(bi, idx))));
    _mm256_storeu_ps(b->v, _mm256_blendv_ps(bv, a, take));
    _mm256_storeu_si256((__m256i *)b->i, _mm256_castps_si256(_mm256_blendv_ps(
        _mm256_castsi256_ps(bi), _mm256_castsi256_ps(idx), take)));
}

// M rows' running maxima for each of nt threads (thread t's at best + M t), initialised; NULL if out of memory
static inline head_best *maxima_new(int M, int nt) {
    head_best *best = (head_best *)malloc(sizeof(head_best) * (size_t)M * nt);
    if (best != NULL) head_best_init(best, (size_t)M * nt);
    return best;
}

// each row's token from the nt threads' maxima (maxima_new's), which are then freed
static inline void maxima_merge(head_best *best, int M, int nt, int64_t *argmax) {
    for (int m = 0; m < M; m++) argmax[m] = head_best_argmax(best + m, nt, sizeof(head_best) * (size_t)M);
    free(best);
}

#endif
