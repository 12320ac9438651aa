// The torch backend's CPU kernels, x86 with AVX2: 4- and 8-bit GGUF linears, y[M, N] = x[M, K] . w[N, K]^T
// with w in Q4_1 or Q8_0 blocks, and (at the end) the float32 glue of a decode step.
//
// Built and loaded by torchengine/cpu_kernels.py (gcc -O3 -mavx2 -mfma -mf16c -fopenmp); the OpenMP runtime is
// the one torch already loaded (same soname), so the threads are torch's.
//
// A block is 32 weights of one output row: w[j] = q[j] * d + m with q in 0..15, stored as llama.cpp's
// Q4_1 is: {f16 d, f16 m, 16 bytes}, byte j holding q[j] (low nibble) and q[j + 16] (high nibble).
// An 8-bit block is Q8_0's: {f16 d, 32 int8}, w[j] = q[j] * d (the LM head of most GGUF files). Its
// activations are quantized to 16 bits instead (dx = max|x| / 32767): the LM head's logits decide the
// tokens, and 8-bit activations there move them by ~0.1-0.3, enough to flip a near-tie of greedy sampling.
// Blocks are row-major: row n's K / 32 blocks are contiguous.
//
// The activations are quantized like llama.cpp's Q8 activations: per row and block of 32,
// xq[j] = rint(x[j] / dx) in -127..127 with dx = max|x| / 127. A block's dot product is then one integer
// multiply-add chain (vpmaddubsw + vpmaddwd: 32 weights in a few instructions), scaled once:
//     sum_j w[j] x[j] ~= d * dx * sum_j q[j] xq[j]  +  m * sum_j x[j]
// (the sum of x is exact, in float32). That is 3-4x fewer instructions than converting every weight to
// float, which is what bounds torch's own int4 CPU kernel at one or a few rows.

#include <immintrin.h>
#ifdef XLASERVE_NO_OPENMP
// jaxengine/cpu_kernels.cc links this file for its single-threaded entry points (panel_gemm_plan and
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

#define QK 32
#define MAX_ROWS 32

typedef struct {
    uint16_t d;  // float16
    uint16_t m;  // float16
    uint8_t qs[QK / 2];
} block_q4;

typedef struct {
    uint16_t d;  // float16
    int8_t qs[QK];
} block_q8;

_Static_assert(sizeof(block_q4) == 20 && sizeof(block_q8) == 34, "block layouts");

int q4_block_bytes(void) { return (int)sizeof(block_q4); }
int q8_block_bytes(void) { return (int)sizeof(block_q8); }
int max_rows(void) { return MAX_ROWS; }

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

// x [M, K] float32 -> xq [M, K / 32, 32] int8 (Q16: int16), dx and xs [M, K / 32] (scale and exact sum of
// each block)
static void quantize_rows(const int Q16, const float *x, int M, int K, void *xq, float *dx, float *xs) {
    const float qmax = Q16 ? 32767.f : 127.f;
    const int G = K / QK;
    for (int i = 0; i < M * G; i++) {
        const float *p = x + (size_t)i * QK;  // rows are contiguous, K a multiple of 32: block i of all rows
        float amax = 0.f, sum = 0.f;
        for (int j = 0; j < QK; j++) {
            float a = fabsf(p[j]);
            amax = a > amax ? a : amax;
            sum += p[j];
        }
        const float d = amax / qmax;
        const float id = d > 0.f ? 1.f / d : 0.f;
        for (int j = 0; j < QK; j++) {
            if (Q16) ((int16_t *)xq)[(size_t)i * QK + j] = (int16_t)nearbyintf(p[j] * id);
            else ((int8_t *)xq)[(size_t)i * QK + j] = (int8_t)nearbyintf(p[j] * id);
        }
        dx[i] = d;
        xs[i] = sum;
    }
}

// 32 unsigned 4-bit weights of a block, in the order of the activations (low nibbles 0..15, high 16..31)
static inline __m256i unpack(const block_q4 *b) {
    const __m128i packed = _mm_loadu_si128((const __m128i *)b->qs);
    const __m128i low4 = _mm_set1_epi8(0x0F);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(packed, 4), low4), _mm_and_si128(packed, low4));
}

// sum_j q[j] * a[j] of block i as 8 float lanes. Q4 (Q8 == 0): unsigned q (<= 15) times signed 8-bit a,
// so the pair sums of vpmaddubsw fit int16 (<= 3810). Q8: int8 q widened to int16 times 16-bit a
// (vpmaddwd; |pair sums| <= 2 * 128 * 32767).
static inline __attribute__((always_inline)) __m256 dot_block(const int Q8, __m256i q, const void *xq, size_t i) {
    if (Q8) {
        const int16_t *a = (const int16_t *)xq + i * QK;
        const __m256i lo = _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm256_castsi256_si128(q)),
                                             _mm256_loadu_si256((const __m256i *)a));
        const __m256i hi = _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm256_extracti128_si256(q, 1)),
                                             _mm256_loadu_si256((const __m256i *)(a + 16)));
        return _mm256_cvtepi32_ps(_mm256_add_epi32(lo, hi));
    }
    const __m256i x = _mm256_loadu_si256((const __m256i *)((const int8_t *)xq + i * QK));
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(q, x), _mm256_set1_epi16(1)));
}

// Block g of row n: its weights (ready for dot_block), scale and offset (0 for Q8).
#define BLOCK_BYTES(Q8) ((Q8) ? sizeof(block_q8) : sizeof(block_q4))
static inline __attribute__((always_inline)) __m256i load_block(const int Q8, const uint8_t *p, float *d, float *m) {
    if (Q8) {
        const block_q8 *b = (const block_q8 *)p;
        *d = _cvtsh_ss(b->d), *m = 0.f;
        return _mm256_loadu_si256((const __m256i *)b->qs);
    }
    const block_q4 *b = (const block_q4 *)p;
    *d = _cvtsh_ss(b->d), *m = _cvtsh_ss(b->m);
    return unpack(b);
}

// Output rows [n0, n1) for R activation rows starting at r0. Q8 and R are compile-time constants at every
// call, so the accumulators stay in registers. Every row is summed in the same order whatever R is (even
// blocks on one chain, odd blocks on another: an FMA's latency, not its throughput, bounds a single chain),
// so a row's result does not depend on how many rows share its step: batch-invariant outputs.
static inline __attribute__((always_inline)) void rows_pass(
    const int Q8, const int R, int r0, int G, int N, const uint8_t *w, const void *xq, const float *dx,
    const float *xs, float *y, int n0, int n1) {
    const size_t bb = BLOCK_BYTES(Q8);
    for (int n = n0; n < n1; n++) {
        const uint8_t *b = w + (size_t)n * G * bb;
        __m256 acc[4], acc2[4];
        float off[4], off2[4];
        for (int r = 0; r < R; r++) acc[r] = acc2[r] = _mm256_setzero_ps(), off[r] = off2[r] = 0.f;
        int g = 0;
        for (; g + 1 < G; g += 2) {
            float d0, m0, d2, m2;
            const __m256i q0 = load_block(Q8, b + g * bb, &d0, &m0);
            const __m256i q2 = load_block(Q8, b + (g + 1) * bb, &d2, &m2);
            for (int r = 0; r < R; r++) {
                const size_t i = (size_t)(r0 + r) * G + g;
                acc[r] = _mm256_fmadd_ps(dot_block(Q8, q0, xq, i), _mm256_set1_ps(d0 * dx[i]), acc[r]);
                acc2[r] = _mm256_fmadd_ps(dot_block(Q8, q2, xq, i + 1), _mm256_set1_ps(d2 * dx[i + 1]), acc2[r]);
                if (!Q8) off[r] += m0 * xs[i], off2[r] += m2 * xs[i + 1];
            }
        }
        if (g < G) {
            float d, m;
            const __m256i q = load_block(Q8, b + g * bb, &d, &m);
            for (int r = 0; r < R; r++) {
                const size_t i = (size_t)(r0 + r) * G + g;
                acc[r] = _mm256_fmadd_ps(dot_block(Q8, q, xq, i), _mm256_set1_ps(d * dx[i]), acc[r]);
                if (!Q8) off[r] += m * xs[i];
            }
        }
        for (int r = 0; r < R; r++) y[(size_t)(r0 + r) * N + n] = hsum8(_mm256_add_ps(acc[r], acc2[r])) + (off[r] + off2[r]);
    }
}

// All M activation rows over output rows [n0, n1): for each output row, passes of 4 activation rows, then the
// remainder (constant R each); a weight row comes from memory once and from L1 for the other passes.
static inline __attribute__((always_inline)) void all_rows(
    const int Q8, int M, int G, int N, const uint8_t *w, const void *xq, const float *dx, const float *xs,
    float *y, int n0, int n1) {
    for (int n = n0; n < n1; n++) {
        int r = 0;
        for (; r + 4 <= M; r += 4) rows_pass(Q8, 4, r, G, N, w, xq, dx, xs, y, n, n + 1);
        if (M - r == 3) rows_pass(Q8, 3, r, G, N, w, xq, dx, xs, y, n, n + 1);
        else if (M - r == 2) rows_pass(Q8, 2, r, G, N, w, xq, dx, xs, y, n, n + 1);
        else if (M - r == 1) rows_pass(Q8, 1, r, G, N, w, xq, dx, xs, y, n, n + 1);
    }
}

static int gemm(const int Q8, const float *x, int M, int K, const uint8_t *w, int N, float *y, int nthreads) {
    if (M < 1 || M > MAX_ROWS || K % QK != 0 || K <= 0 || N <= 0) return -1;
    const int G = K / QK;
    void *xq = aligned_alloc(32, ((size_t)M * K * (Q8 ? 2 : 1) + 31) / 32 * 32);
    float *dx = (float *)malloc(sizeof(float) * (size_t)M * G);
    float *xs = (float *)malloc(sizeof(float) * (size_t)M * G);
    if (!xq || !dx || !xs) {
        free(xq), free(dx), free(xs);
        return -2;
    }
    quantize_rows(Q8, x, M, K, xq, dx, xs);
    if (nthreads <= 0) nthreads = omp_get_max_threads();
    // each thread a contiguous share of the output rows (in whole 16-row chunks), all activation rows
    const int chunks = (N + 15) / 16;
    const int nt = N >= 64 ? (nthreads < chunks ? nthreads : chunks) : 1;
#pragma omp parallel num_threads(nt)
    {
        const int t = omp_get_thread_num(), T = omp_get_num_threads();
        const int n0 = (int)((long)chunks * t / T) * 16, n1e = (int)((long)chunks * (t + 1) / T) * 16;
        const int n1 = n1e < N ? n1e : N;
        if (Q8) all_rows(1, M, G, N, w, xq, dx, xs, y, n0, n1);
        else all_rows(0, M, G, N, w, xq, dx, xs, y, n0, n1);
    }
    free(xq), free(dx), free(xs);
    return 0;
}

// y [M, N] = x [M, K] . W^T; w: N * K / 32 blocks (Q4_1 layout / Q8_0 layout); M <= MAX_ROWS;
// nthreads <= 0: OpenMP's default. Returns 0, or < 0 for bad arguments.
int q4_gemm(const float *x, int M, int K, const void *w, int N, float *y, int nthreads) {
    return gemm(0, x, M, K, (const uint8_t *)w, N, y, nthreads);
}

int q8_gemm(const float *x, int M, int K, const void *w, int N, float *y, int nthreads) {
    return gemm(1, x, M, K, (const uint8_t *)w, N, y, nthreads);
}

// Below this many multiply-adds a call runs on the calling thread: between two steps OpenMP's threads go
// to sleep, and waking one costs tens of microseconds on a VM (a tiny model's decode attention took 80 us
// in a step on two threads, 7 us in a tight loop).
#define PARALLEL_WORK (1L << 15)

// threads worth waking for M rows times an [N, K] weight: all of nthreads from PARALLEL_WORK multiply-adds,
// rows counted up to 8 (a few rows' product is the weight's streaming); at most `most`
static inline int gemm_threads(int M, int K, int N, int nthreads, int most) {
    const int n = (long)N * K * (M < 8 ? M : 8) >= PARALLEL_WORK ? (nthreads > 0 ? nthreads : 1) : 1;
    return n < most ? n : most;
}

// ---------------------------------------------------------------------------------------------------------
// The float32 glue of a decode step. In torch each of these is several ops of a few microseconds to tens of
// microseconds of dispatch for a few hundred floats of work; a decode step of a 30-layer model runs them
// 30-60 times. Row strides are in floats, so views into a fused qkv output need no copy.

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

// out[M, K] = h * rsqrt(mean(h^2) + eps) * w with h = x (rows `x_stride` floats apart), or, given a
// residual [M, K] (contiguous), residual += x first and h = residual (the residual stream's add fused in)
int rms_norm(const float *x, int M, int K, long x_stride, float *residual, const float *w, float eps,
             float *out) {
    if (M < 0 || K <= 0) return -1;
#pragma omp parallel for if ((long)M * K >= 65536) schedule(static)
    for (int i = 0; i < M; i++) {
        const float *r = x + i * x_stride;
        if (residual) {
            float *res = residual + (size_t)i * K;
            for (int j = 0; j < K; j++) res[j] += r[j];
            r = res;
        }
        float *o = out + (size_t)i * K;
        const float inv = 1.f / sqrtf(dot(r, r, K) / (float)K + eps);
        const __m256 vi = _mm256_set1_ps(inv);
        int j = 0;
        for (; j + 8 <= K; j += 8)
            _mm256_storeu_ps(o + j, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(r + j), vi), _mm256_loadu_ps(w + j)));
        for (; j < K; j++) o[j] = r[j] * inv * w[j];
    }
    return 0;
}

// In place on x [T, H, D] (token rows `x_stride` floats apart, heads contiguous): rotate-half RoPE with the
// model's tables in swap-halves form, cos [T, D] = (cos, cos) and sin [T, D] = (-sin, sin) of each token's
// position: x = x * cos + swap_halves(x) * sin.
int rope(float *x, int T, int H, int D, long x_stride, const float *cos, const float *sin) {
    if (T < 0 || H <= 0 || D <= 0 || D % 2 || D > 1024) return -1;
    const int half = D / 2;
    for (int t = 0; t < T; t++) {
        const float *c = cos + (size_t)t * D, *s = sin + (size_t)t * D;
        for (int h = 0; h < H; h++) {
            float *p = x + t * x_stride + (size_t)h * D, tmp[1024];
            memcpy(tmp, p, sizeof(float) * D);
            for (int j = 0; j < half; j++) {
                p[j] = tmp[j] * c[j] + tmp[j + half] * s[j];
                p[j + half] = tmp[j + half] * c[j + half] + tmp[j] * s[j + half];
            }
        }
    }
    return 0;
}

// The KV cache's element type (kv_write, decode_attention, prefill_attention, decode_layers): float32, or
// float16 / bfloat16 (`--kv-cache-dtype`), half the bytes that decode attention streams from memory.
// Stored rounded to nearest even (as torch's .to() rounds; a NaN stays a NaN), read back exactly into
// float32, so attention over a 16-bit cache is the float32 kernels' arithmetic on those values, bit for bit.
enum { KV_F32 = 0, KV_F16 = 1, KV_BF16 = 2 };
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

// The cache writes of a step: token t's K and V rows (W floats each, k_stride / v_stride floats apart) to
// slot slots[t] of the caches [slots, W] of type kv_type; slots < 0 (padding) are skipped.
int kv_write(const float *k, const float *v, long k_stride, long v_stride, int T, const int64_t *slots,
             void *kcache, void *vcache, int W, int kv_type) {
    if (kv_type < KV_F32 || kv_type > KV_BF16) return -1;
    const int es = KV_BYTES(kv_type);
    for (int t = 0; t < T; t++) {
        if (slots[t] < 0) continue;
        kv_store(kv_type, (char *)kcache + (size_t)slots[t] * W * es, k + t * k_stride, W);
        kv_store(kv_type, (char *)vcache + (size_t)slots[t] * W * es, v + t * v_stride, W);
    }
    return 0;
}

// out[i] += p * x[i], x: n elements of type T (one FMA a float, in order)
static inline __attribute__((always_inline)) void axpy(const int T, float *out, float p, const char *x, int n) {
    const __m256 vp = _mm256_set1_ps(p);
    int j = 0;
    for (; j + 8 <= n; j += 8)
        _mm256_storeu_ps(out + j, _mm256_fmadd_ps(vp, kv_load8(T, x + (size_t)j * KV_BYTES(T)), _mm256_loadu_ps(out + j)));
    for (; j < n; j++) out[j] += p * kv_load1(T, x + (size_t)j * KV_BYTES(T));
}

// y[r][c] = dot(a[r], b[c], n) * scale for r < R, c < C (R * C <= 12 chains in registers); b: rows of type T
static inline __attribute__((always_inline)) void dots_tile(const int T, const int R, const int C, const float *const *a,
                                                          const char *const *b, int n, float scale, float *y,
                                                          long y_stride) {
    __m256 acc[3][4];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) acc[r][c] = _mm256_setzero_ps();
    int j = 0;
    for (; j + 8 <= n; j += 8) {
        __m256 bv[4];
        for (int c = 0; c < C; c++) bv[c] = kv_load8(T, b[c] + (size_t)j * KV_BYTES(T));
        for (int r = 0; r < R; r++) {
            const __m256 av = _mm256_loadu_ps(a[r] + j);
            for (int c = 0; c < C; c++) acc[r][c] = _mm256_fmadd_ps(av, bv[c], acc[r][c]);
        }
    }
    if (C == 4 && j == n) {
        for (int r = 0; r < R; r++)
            _mm_storeu_ps(y + r * y_stride, _mm_mul_ps(hsum8x4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]),
                                                       _mm_set1_ps(scale)));
        return;
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) {
            float s = hsum8(acc[r][c]);
            for (int t = j; t < n; t++) s += a[r][t] * kv_load1(T, b[c] + (size_t)t * KV_BYTES(T));
            y[r * y_stride + c] = s * scale;
        }
}

// o[r][d0 .. d0 + 32) (+)= sum over keys k in [k0, k1) of p[r][k] v[k][d0 ..], R rows, one FMA chain per
// output over the keys in order; v: rows of type T. While k - k0 < pfn it also prefetches pf_bytes of pf[k - k0].
// A key's V vectors are loaded one at a time, after its R weights are broadcast: 12 accumulators, 3 weights and
// one V vector fill AVX2's 16 registers. Loading all 4 V vectors first needed 17, and gcc kept one accumulator
// on the stack, a store and a reload in every key's chain (prefill attention 1.23x without it).
static inline __attribute__((always_inline)) void pv_tile(const int T, const int R, float *const *o,
                                                        const float *const *p, const char *const *v, int k0, int k1,
                                                        int d0, const char *const *pf, int pfn, int pf_bytes) {
    __m256 acc[3][4];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < 4; c++) acc[r][c] = _mm256_loadu_ps(o[r] + d0 + 8 * c);
    for (int k = k0; k < k1; k++) {
        if (k - k0 < pfn)
            for (int b = 0; b < pf_bytes; b += 64) _mm_prefetch(pf[k - k0] + b, _MM_HINT_T0);
        __m256 pr[3];
        for (int r = 0; r < R; r++) pr[r] = _mm256_set1_ps(p[r][k]);
        for (int c = 0; c < 4; c++) {
            const __m256 vv = kv_load8(T, v[k] + (size_t)(d0 + 8 * c) * KV_BYTES(T));
            for (int r = 0; r < R; r++) acc[r][c] = _mm256_fmadd_ps(pr[r], vv, acc[r][c]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < 4; c++) _mm256_storeu_ps(o[r] + d0 + 8 * c, acc[r][c]);
}

// a tile's call for R rows (R <= 3, known at run time) with R a compile-time constant, as the tiles need it
#define TILE_R(R, call3, call2, call1) \
    do {                               \
        if ((R) == 3) call3;           \
        else if ((R) == 2) call2;      \
        else call1;                    \
    } while (0)

// Decode attention over the paged cache: request i's one query (token tokens[i] of q [T, Hq, D], rows
// `q_stride` floats apart) attends its kv_lens[i] cached tokens (the last `window` only if window > 0),
// whose blocks are block_tables[i, :], from caches [blocks, block_size, Hkv, D]; query head h reads kv head
// h / (Hq / Hkv). out [T, Hq, D] (contiguous) gets the rows of those tokens. Exact softmax in float32.
// A task is one request's query heads or one kv head's; it reads each cached row once for all of its heads
// (decode_tasks). When there are too few of those tasks to keep the threads busy, the split order below splits a
// request's keys and dims between the threads instead (decode_split).
// Every head gets dot()'s and axpy's arithmetic, in tiles (each tile's chains are theirs), so the same bits
// for the same values however the tasks and tiles fall.

// The paged cache's rows are a few hundred bytes in blocks scattered over the cache: the hardware prefetchers,
// which follow streams within a 4 KiB page, lose them at every block, and a decode step's attention ran at
// ~6 GB/s, a third of this memory's bandwidth (benchmarks/bench_kernels_ab.py --what attention). So the
// kernels fetch the rows KV_PREFETCH keys ahead of the scores (and the next DECODE_KEYS of V) while they work.
// The scores' fetches go to L2 (T1): a key's K and V rows of all heads are 24 lines at float32, 8 keys ahead
// ~200 in flight, more than L1's miss buffers hold; into L2 they ran a step's attention 1.2-1.6x as fast at 4-32
// rows (170 and 1024 tokens, both cache layouts; session 26, a Zen 4), even at 1-2 rows. 16 keys ahead ran
// 0.94-0.96x, 4 keys 1.02-1.07x at 170 tokens but 0.91x at 1024.
#define KV_PREFETCH 8
#define DECODE_KEYS 16  // keys a block of the output loop (their V rows stay in L1)

// query heads per task for n requests on nthreads threads: all of a request's (its token rows read whole, in
// order) on one thread or with requests enough to share out, else one KV head's group (fewer requests still:
// decode_split's order instead)
int decode_heads_per_task(int n, int Hq, int Hkv, int nthreads) {
    return nthreads <= 1 || n >= 2 * nthreads ? Hq : Hq / Hkv;
}

// the first of the L cached tokens a query at position L - 1 attends (the last `window` only if window > 0)
static inline int window_start(int L, int window) { return window > 0 && L > window ? L - window : 0; }

// bytes [0, nbytes) from p into L2
static inline __attribute__((always_inline)) void prefetch_bytes(const char *p, int nbytes) {
    for (int b = 0; b < nbytes; b += 64) _mm_prefetch(p + b, _MM_HINT_T1);
}

// the heads in the tile from head h0 + g on, g < hs: those of its kv head (G query heads a kv head), at most 3
static inline void head_tiles(int h0, int hs, int G, int *tile) {
    for (int g = 0; g < hs; g++) {
        const int left = ((h0 + g) / G + 1) * G - (h0 + g);
        tile[g] = left < 3 ? left : 3;
        if (tile[g] > hs - g) tile[g] = hs - g;
    }
}

// a request's keys [j0, j1) of its kv_len - start: their rows' byte offsets in the caches (each key's block
// looked up once, not five times with a division each)
static inline void key_offsets(size_t *ro, const int32_t *bt, int start, int j0, int j1, int block_size, long row) {
    for (int j = j0, b = (start + j0) / block_size, o = (start + j0) % block_size; j < j1; j++) {
        ro[j - j0] = ((size_t)bt[b] * block_size + o) * row;
        if (++o == block_size) o = 0, b++;
    }
}

// Scores of keys 0 .. nkeys of ro (row offsets, nro of them) for the hs query heads from h0 (queries qr, tiles
// `tile`): S[g * s_stride + j] = dot(qr[g], K_j) * scale, KS keys a tile (KS is 4 over a 16-bit cache: prefill
// attention's tiles, its conversions make the loop compute-bound (session 14); 1 over a float32 one: 4 keys'
// tiles ask for 4 rows at once and ran 0.86-1.0x from memory there, 1.5-1.7x with the rows in cache
// (docs/design-notes.md, session 22)). Each key `ahead` keys on is fetched into L2 meanwhile, pf_bytes of its
// K row from pf_off and (pf_v) of its V row.
static inline __attribute__((always_inline)) void decode_scores(
    const int T, const size_t *ro, int nkeys, int nro, const char *kcache, const char *vcache, int pf_v,
    long pf_off, int pf_bytes, int ahead, const float *const *qr, const int *tile, int hs, int h0, int G,
    long head_bytes, int D, float scale, float *S, long s_stride) {
    const int KS = T == KV_F32 ? 1 : 4;  // keys a score tile
    for (int j = 0; j < nkeys; j += KS) {
        const int nk = nkeys - j < KS ? nkeys - j : KS;
        for (int c = ahead; c < ahead + KS && j + c < nro; c++) {
            prefetch_bytes(kcache + ro[j + c] + pf_off, pf_bytes);
            if (pf_v) prefetch_bytes(vcache + ro[j + c] + pf_off, pf_bytes);
        }
        const char *kp[4];
        for (int c = 0; c < nk; c++) kp[c] = kcache + ro[j + c];
        for (int g = 0; g < hs; g += tile[g]) {
            const long off = (long)((h0 + g) / G) * head_bytes;
            const char *kb[4];
            for (int c = 0; c < nk; c++) kb[c] = kp[c] + off;
            float *y = S + (size_t)g * s_stride + j;
            if (nk == 4)
                TILE_R(tile[g], dots_tile(T, 3, 4, qr + g, kb, D, scale, y, s_stride),
                       dots_tile(T, 2, 4, qr + g, kb, D, scale, y, s_stride),
                       dots_tile(T, 1, 4, qr + g, kb, D, scale, y, s_stride));
            else
                for (int c = 0; c < nk; c++)
                    TILE_R(tile[g], dots_tile(T, 3, 1, qr + g, kb + c, D, scale, y + c, s_stride),
                           dots_tile(T, 2, 1, qr + g, kb + c, D, scale, y + c, s_stride),
                           dots_tile(T, 1, 1, qr + g, kb + c, D, scale, y + c, s_stride));
        }
    }
}

// the softmax of hs rows of scores (row g at S + g * s_stride, len of them) in place, without the division:
// exp(s - max) and inv[g] = 1 / their sum (0 for an empty row: zeros, not NaN)
static inline void softmax_rows(float *S, long s_stride, int hs, int len, float *inv) {
    for (int g = 0; g < hs; g++) {
        float *sr = S + (size_t)g * s_stride;
        const float sum = exp_shift_sum(sr, len, row_max(sr, len));
        inv[g] = sum > 0.f ? 1.f / sum : 0.f;
    }
}

// Outputs [d_lo, d_hi) of the hs heads from h0 (rows orow, weights P [hs, p_stride] from softmax_rows):
// orow[g][d] = inv[g] * sum over the len keys of ro, in order, of P[g][j] V_j[d], DECODE_KEYS keys at a time in
// tiles of 3 heads x 32 dims held in registers (D % 32 == 0, d_lo and d_hi multiples of 32), else one axpy a
// head and key (all of D). The first tile of a block fetches the rows of the DECODE_KEYS keys `ahead` keys on,
// pf_bytes from pf_off.
static inline __attribute__((always_inline)) void decode_outputs(
    const int T, const size_t *ro, int len, const char *vcache, long pf_off, int pf_bytes, int ahead,
    const float *P, long p_stride, const float *inv, float *const *orow, const int *tile, int hs, int h0, int G,
    long head_bytes, int D, int d_lo, int d_hi) {
    for (int g = 0; g < hs; g++) memset(orow[g] + d_lo, 0, sizeof(float) * (d_hi - d_lo));
    for (int j0 = 0; j0 < len; j0 += DECODE_KEYS) {
        const int nkeys = len - j0 < DECODE_KEYS ? len - j0 : DECODE_KEYS;
        const int pfn = len - j0 - ahead < DECODE_KEYS ? len - j0 - ahead : DECODE_KEYS;
        const char *vp[DECODE_KEYS], *pfr[DECODE_KEYS];  // this block's rows, the next ones' parts
        for (int c = 0; c < nkeys; c++) vp[c] = vcache + ro[j0 + c];
        for (int c = 0; c < pfn; c++) pfr[c] = vcache + ro[j0 + ahead + c] + pf_off;
        for (int g = 0; g < hs; g += tile[g]) {
            const long off = (long)((h0 + g) / G) * head_bytes;
            const char *vb[DECODE_KEYS];
            const float *pg[3];
            for (int c = 0; c < nkeys; c++) vb[c] = vp[c] + off;
            for (int r = 0; r < tile[g]; r++) pg[r] = P + (size_t)(g + r) * p_stride + j0;
            if (D % 32 == 0) {
                for (int d0 = d_lo; d0 < d_hi; d0 += 32) {
                    const int n = g == 0 && d0 == d_lo ? pfn : 0;  // the first tile fetches
                    TILE_R(tile[g], pv_tile(T, 3, orow + g, pg, vb, 0, nkeys, d0, pfr, n, pf_bytes),
                           pv_tile(T, 2, orow + g, pg, vb, 0, nkeys, d0, pfr, n, pf_bytes),
                           pv_tile(T, 1, orow + g, pg, vb, 0, nkeys, d0, pfr, n, pf_bytes));
                }
            } else {
                for (int r = 0; r < tile[g]; r++)
                    for (int c = 0; c < nkeys; c++) axpy(T, orow[g + r], pg[r][c], vb[c], D);
            }
        }
    }
    for (int g = 0; g < hs; g++)
        for (int d = d_lo; d < d_hi; d++) orow[g][d] *= inv[g];
}

// The tasks over a cache of type T, each key's row read once for the task's heads in the score pass (its V
// part fetched with it, KV_PREFETCH keys ahead: on a Zen 3 the V rows then come from L3, its victim cache, in
// the output pass even where they outgrow L2; not fetching them there ran 0.78-0.94x at 1024 tokens) and once
// in the output pass (the next DECODE_KEYS keys' V rows fetched by a block's first tile).
static inline __attribute__((always_inline)) int decode_tasks(
    const int T, const float *q, long q_stride, const int64_t *tokens, const int32_t *kv_lens,
    const int32_t *block_tables, int bt_stride, const char *kcache, const char *vcache, long kv_row, long kv_head,
    int block_size, int Hq, int Hkv, int D, float scale, int window, float *out, int hs, int t0, int t1) {
    const int G = Hq / Hkv, per_req = Hq / hs, es = KV_BYTES(T);
    const long row = kv_row * es, head_bytes = kv_head * es;  // bytes
    int rc = 0;
    for (int task = t0; task < t1; task++) {
        const int i = task / per_req, h0 = task % per_req * hs, hk0 = h0 / G, hk1 = (h0 + hs - 1) / G;
        const long pf_off = hk0 * head_bytes;  // the task's part of a row: bytes [pf_off, + pf_bytes)
        const int pf_bytes = (int)((hk1 - hk0) * head_bytes + D * es);
        const int64_t tok = tokens ? tokens[i] : i;
        const int L = kv_lens[i], start = window_start(L, window), len = L - start;
        // the keys' row offsets, then scores [hs, len] and the inverse sums
        size_t *ro = (size_t *)malloc(sizeof(size_t) * (size_t)len + sizeof(float) * (size_t)hs * (len + 1));
        if (!ro) {
            rc = -2;
            continue;
        }
        float *S = (float *)(ro + len), *inv = S + (size_t)hs * len;
        key_offsets(ro, block_tables + (size_t)i * bt_stride, start, 0, len, block_size, row);
        const float *qr[hs];
        float *orow[hs];
        int tile[hs];
        for (int g = 0; g < hs; g++) {
            qr[g] = q + tok * q_stride + (size_t)(h0 + g) * D;
            orow[g] = out + (size_t)tok * Hq * D + (size_t)(h0 + g) * D;
        }
        head_tiles(h0, hs, G, tile);
        decode_scores(T, ro, len, len, kcache, vcache, 1, pf_off, pf_bytes, KV_PREFETCH, qr, tile, hs, h0, G,
                      head_bytes, D, scale, S, len);
        softmax_rows(S, len, hs, len, inv);
        decode_outputs(T, ro, len, vcache, pf_off, pf_bytes, DECODE_KEYS, S, len, inv, orow, tile, hs, h0, G,
                       head_bytes, D, 0, D);
        free(ro);
    }
    return rc;
}

// ---- decode attention in the split order: too few requests for the threads ----
// With fewer requests than the threads can share out by kv head (n * Hkv < 2 * nthreads: batch 1 on 2 threads,
// batch <= 10 of SmolLM2's 3 kv heads on 16), the tasks above take one query head each: the G query heads of a
// kv head read its rows G times (from L2 or L3 after the first) in parts of a quarter row, and a row's keys
// stay on one thread. Batch 1 at 1024 tokens read ~7-9 GB/s. The split order reads each row once, whole, with
// every thread busy, in two phases: phase 0, tasks of (request, split_keys keys), writes every query head's
// scores of those keys and the keys' row offsets into a buffer the phases share (fetching each key's K and V rows SPLIT_AHEAD keys
// ahead, whole: V then comes from L2 or L3 in phase 1), and the task that finishes a request's last keys takes
// its softmax (an atomic count of the finished chunks); phase 1, tasks of (request, kv head, 32 dims), sums its
// dims of the kv head's G outputs over every key's V row, in order. A head gets decode_tasks' arithmetic (dot's
// chains a score, exp_shift_sum over the whole row, one FMA chain a dim over the keys in order, the same final
// scale), so the same bits; the tests hold the two orders to each other. Batch 1 (bench_kernels_ab --what
// attention, session 39, a Zen 3): 1.6x at 170 tokens, 1.6-1.9x at 1024, 1.8x at 4096 (17.7 GB/s). Chunks of 32
// or 128 keys and 8 or 32 ahead ran within 10% of these; phase 0 by (request, kv head, keys), reading a third of
// each row, 0.8x.
#define SPLIT_KEYS 64  // keys a phase-0 task
#define SPLIT_AHEAD 16  // keys the split order fetches ahead

int decode_split(int n, int Hkv, int nthreads) { return nthreads > 1 && n * Hkv < 2 * nthreads; }

// keys a phase-0 task of a row of len: SPLIT_KEYS, or a quarter of a short row (at least 16)
static inline int split_keys(int len) {
    const int quarter = (len / 4 + 15) & ~15;
    return quarter < 16 ? 16 : quarter < SPLIT_KEYS ? quarter : SPLIT_KEYS;
}

// phase 0's tasks of a row of len: one for an empty row too (its softmax writes its inverse sums, zeros)
static inline int split_chunks(int len) { return len > 0 ? (len + split_keys(len) - 1) / split_keys(len) : 1; }

// The split order's tasks of phase 0 or 1 for n requests, and (bytes != NULL) the bytes of the buffer its
// phases share (zeroed when allocated: it holds the counts, which every call leaves at zero again)
long decode_split_tasks(int phase, int n, const int32_t *kv_lens, int window, int Hq, int Hkv, int D, long *bytes) {
    long t = 0, keys = 0;
    for (int i = 0; i < n; i++) {
        const int len = kv_lens[i] - window_start(kv_lens[i], window);
        keys += len;
        t += phase == 0 ? split_chunks(len) : (long)Hkv * (D % 32 ? 1 : D / 32);
    }
    if (bytes) *bytes = sizeof(size_t) * keys + sizeof(int) * (long)n + sizeof(float) * ((long)n * Hq + keys * Hq);
    return t;
}

// Tasks [t0, t1) of phase 0 or 1 of the split order on the calling thread (request by request, then its keys,
// or its kv heads and dims), buf: decode_split_tasks' (each request's keys' row offsets [len], counts [n], inverse
// sums [n, Hq], then each request's scores [Hq, len]).
static inline __attribute__((always_inline)) int decode_split_run(
    const int T, int phase, const float *q, long q_stride, const int64_t *tokens, const int32_t *kv_lens,
    const int32_t *block_tables, int bt_stride, const char *kcache, const char *vcache, long kv_row, long kv_head,
    int block_size, int Hq, int Hkv, int D, float scale, int window, void *buf, float *out, int n, int t0, int t1) {
    const int G = Hq / Hkv, es = KV_BYTES(T), parts = D % 32 ? 1 : D / 32;
    const long row = kv_row * es, head_bytes = kv_head * es, row_bytes = Hkv * head_bytes;  // a token's K (V) bytes
    long keys = 0;
    for (int i = 0; i < n; i++) keys += kv_lens[i] - window_start(kv_lens[i], window);
    size_t *ro = (size_t *)buf;  // request i's keys' offsets from ro, its scores from S
    int *count = (int *)(ro + keys);
    float *inv = (float *)(count + n), *S = inv + (size_t)n * Hq;
    int task = 0;
    for (int i = 0, len; i < n && task < t1; S += (size_t)Hq * len, ro += len, i++) {
        const int L = kv_lens[i], start = window_start(L, window);
        len = L - start;
        const int K = split_keys(len), chunks = split_chunks(len), ntasks = phase == 0 ? chunks : Hkv * parts;
        if (task + ntasks <= t0) {
            task += ntasks;
            continue;
        }
        const int32_t *bt = block_tables + (size_t)i * bt_stride;
        const int64_t tok = tokens ? tokens[i] : i;
        for (int c = 0; c < ntasks; c++, task++) {
            if (task < t0 || task >= t1) continue;
            if (phase == 0) {  // keys [j0, j0 + nk) of every head
                const int j0 = c * K, nk = len - j0 < K ? len - j0 : K;
                const int nro = len - j0 < K + SPLIT_AHEAD ? len - j0 : K + SPLIT_AHEAD;
                size_t kro[SPLIT_KEYS + SPLIT_AHEAD];  // (and the keys fetched ahead: the next task writes theirs)
                key_offsets(kro, bt, start, j0, j0 + nro, block_size, row);
                memcpy(ro + j0, kro, sizeof(size_t) * nk);  // for phase 1
                for (int k = 0; k < nk && k < SPLIT_AHEAD; k++) {  // the first keys, not fetched ahead
                    prefetch_bytes(kcache + kro[k], row_bytes);
                    prefetch_bytes(vcache + kro[k], row_bytes);
                }
                const float *qr[Hq];
                int tile[Hq];
                for (int g = 0; g < Hq; g++) qr[g] = q + tok * q_stride + (size_t)g * D;
                head_tiles(0, Hq, G, tile);
                decode_scores(T, kro, nk, nro, kcache, vcache, 1, 0, row_bytes, SPLIT_AHEAD, qr, tile, Hq, 0, G,
                              head_bytes, D, scale, S + j0, len);
                // the request's last chunk takes the softmax (acq_rel: it sees the others' scores; phase 1, after
                // the caller's barrier, sees its results) and puts the count back to zero for the next call
                if (__atomic_add_fetch(count + i, 1, __ATOMIC_ACQ_REL) == chunks) {
                    softmax_rows(S, len, Hq, len, inv + (size_t)i * Hq);
                    __atomic_store_n(count + i, 0, __ATOMIC_RELAXED);
                }
                continue;
            }
            const int hk = c / parts, h0 = hk * G;  // kv head hk's query heads, dims [d_lo, d_hi)
            const int d_lo = parts == 1 ? 0 : 32 * (c % parts), d_hi = parts == 1 ? D : d_lo + 32;
            const long pf_off = hk * head_bytes + (long)d_lo * es;
            const int pf_bytes = (d_hi - d_lo) * es;
            for (int k = 0; k < len && k < SPLIT_AHEAD; k++) prefetch_bytes(vcache + ro[k] + pf_off, pf_bytes);
            float *orow[G];
            int tile[G];
            for (int g = 0; g < G; g++) orow[g] = out + (size_t)tok * Hq * D + (size_t)(h0 + g) * D;
            head_tiles(h0, G, G, tile);
            decode_outputs(T, ro, len, vcache, pf_off, pf_bytes, SPLIT_AHEAD, S + (size_t)h0 * len, len,
                           inv + (size_t)i * Hq + h0, orow, tile, G, h0, G, head_bytes, D, d_lo, d_hi);
        }
    }
    return 0;
}

// Tasks [t0, t1) of phase `phase` of decode attention's split order (decode_split_tasks) on the calling thread:
// decode_attention_tasks' arguments and the phases' buffer. Returns 0, or -1 for an unknown kv_type.
int decode_split_phase(int phase, const float *q, long q_stride, const int64_t *tokens, const int32_t *kv_lens,
                       const int32_t *block_tables, int bt_stride, const void *kcache, const void *vcache,
                       long kv_row, long kv_head, int block_size, int Hq, int Hkv, int D, float scale, int window,
                       void *buf, float *out, int n, int t0, int t1, int kv_type) {
#define SPLIT_RUN(T)                                                                                              \
    decode_split_run(T, phase, q, q_stride, tokens, kv_lens, block_tables, bt_stride, (const char *)kcache,     \
                     (const char *)vcache, kv_row, kv_head, block_size, Hq, Hkv, D, scale, window, buf, out, n, t0, t1)
    switch (kv_type) {
        case KV_F32: return SPLIT_RUN(KV_F32);
        case KV_F16: return SPLIT_RUN(KV_F16);
        case KV_BF16: return SPLIT_RUN(KV_BF16);
    }
#undef SPLIT_RUN
    return -1;
}

// Tasks [t0, t1) of decode attention on the calling thread (task t: request t / (Hq / hs), query heads from
// t % (Hq / hs) * hs, each with its own KV head; every head's scores, sums and output are computed the same way
// whatever hs). A cached token's row of a cache is `kv_row` elements long, kv head hk at hk * kv_head:
// torch's separate K and V caches [blocks, block_size, Hkv, D] are kv_row = Hkv * D, kv_head = D; jaxengine's
// one cache [blocks, block_size, 2 * Hkv, D] with K and V of head hk at 2hk and 2hk + 1 is kcache = cache,
// vcache = cache + D elements, kv_row = 2 * Hkv * D, kv_head = 2 * D. tokens == NULL: request i's query is row
// i of q and of out. Returns 0, -1 for an unknown kv_type, or -2 if a task's scores could not be allocated.
int decode_attention_tasks(const float *q, long q_stride, const int64_t *tokens, const int32_t *kv_lens,
                           const int32_t *block_tables, int bt_stride, const void *kcache, const void *vcache,
                           long kv_row, long kv_head, int block_size, int Hq, int Hkv, int D, float scale,
                           int window, float *out, int hs, int t0, int t1, int kv_type) {
#define DECODE_TASKS(T)                                                                                         \
    decode_tasks(T, q, q_stride, tokens, kv_lens, block_tables, bt_stride, (const char *)kcache,              \
                 (const char *)vcache, kv_row, kv_head, block_size, Hq, Hkv, D, scale, window, out, hs, t0, t1)
    switch (kv_type) {
        case KV_F32: return DECODE_TASKS(KV_F32);
        case KV_F16: return DECODE_TASKS(KV_F16);
        case KV_BF16: return DECODE_TASKS(KV_BF16);
    }
#undef DECODE_TASKS
    return -1;
}

int decode_attention(const float *q, long q_stride, int n, const int64_t *tokens, const int32_t *kv_lens,
                     const int32_t *block_tables, int bt_stride, const void *kcache, const void *vcache,
                     int block_size, int Hq, int Hkv, int D, float scale, int window, float *out, int nthreads,
                     int kv_type) {
    if (n < 0 || Hq <= 0 || Hkv <= 0 || Hq % Hkv || D <= 0 || block_size <= 0) return -1;
    if (kv_type < KV_F32 || kv_type > KV_BF16) return -1;
    if (nthreads <= 0) nthreads = omp_get_max_threads();
    long work = 0;  // multiply-adds of the scores
    for (int i = 0; i < n; i++) work += (long)kv_lens[i] * Hq * D;
    if (work < PARALLEL_WORK) nthreads = 1;  // less than waking a sleeping thread costs
    const long W = (long)Hkv * D;  // elements per cached token
    int rc = 0;
    if (decode_split(n, Hkv, nthreads)) {
        long bytes, ntasks[2];  // each phase's
        for (int phase = 0; phase < 2; phase++)
            ntasks[phase] = decode_split_tasks(phase, n, kv_lens, window, Hq, Hkv, D, &bytes);
        void *buf = calloc(1, bytes);
        if (!buf) return -2;
#pragma omp parallel num_threads(nthreads)
        for (int phase = 0; phase < 2; phase++) {
#pragma omp for schedule(dynamic, 1)
            for (long task = 0; task < ntasks[phase]; task++)
                if (decode_split_phase(phase, q, q_stride, tokens, kv_lens, block_tables, bt_stride, kcache, vcache, W,
                                       D, block_size, Hq, Hkv, D, scale, window, buf, out, n, (int)task,
                                       (int)task + 1, kv_type))
                    rc = -2;
        }
        free(buf);
        return rc;
    }
    const int hs = decode_heads_per_task(n, Hq, Hkv, nthreads);
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads)
    for (int task = 0; task < n * (Hq / hs); task++)
        if (decode_attention_tasks(q, q_stride, tokens, kv_lens, block_tables, bt_stride, kcache, vcache, W, D,
                                   block_size, Hq, Hkv, D, scale, window, out, hs, task, task + 1, kv_type))
            rc = -2;
    return rc;
}

// Attention of prefill (and mixed) rows: request i's q_lens[i] queries (tokens q_start[i] ... of q, rows
// q_stride floats apart, positions kv_lens[i] - q_lens[i] ...) over its cached tokens, causal (and the last
// `window` only when window > 0). Every query row gets decode_attention's arithmetic for a query at its
// position, bit for bit: each score the same dot() (one 8-lane FMA chain over d, hsum8) times scale, the
// same exact two-pass softmax on the same contiguous run of scores (exp_shift_sum), the same FMA chain over
// the keys in order for each output (axpy's), the same final scale. So a token's attention does not depend
// on whether it was decoded, prefilled, prefilled in chunks or recomputed, nor on the backend. The work is
// organized in tiles instead of one query at a time: a task is (request, block of bq queries, kv head); its
// G * nq rows (query, head) score the union of their key ranges in 3-row x 4-key tiles (four horizontal sums
// at a time), 64 keys for all rows before the next 64 (their K rows stay in L1); each query's G heads, which
// share its key range, sum V in tiles of 3 heads x 32 dims, again 64 keys for all queries at a time (the
// output chains go back to memory between key blocks; their order stays). Tasks are numbered request by
// request, then query block,
// then kv head; t0..t1 picks a range (prefill_attention splits them between threads, jaxengine's custom
// call between XLA's). Returns -2 if a buffer cannot be allocated (those rows are left unwritten).
#define PREFILL_BQ 32  // queries a task (prefill_attention)
#define PREFILL_KEYS 64  // keys a block of a task's score and output loops

int prefill_attention_num_tasks(int n, const int32_t *q_lens, int Hkv, int bq) {
    long t = 0;
    for (int i = 0; i < n; i++) t += (long)(q_lens[i] > 0 ? (q_lens[i] + bq - 1) / bq : 0) * Hkv;
    return t > INT32_MAX ? -1 : (int)t;
}

// n elements of type T at src -> float32 (exact)
static inline __attribute__((always_inline)) void to_f32(const int T, const char *src, float *dst, int n) {
    int j = 0;
    for (; j + 8 <= n; j += 8) _mm256_storeu_ps(dst + j, kv_load8(T, src + (size_t)j * KV_BYTES(T)));
    for (; j < n; j++) dst[j] = kv_load1(T, src + (size_t)j * KV_BYTES(T));
}

int prefill_attention_tasks(const float *q, long q_stride, const int32_t *q_start, const int32_t *q_lens,
                            const int32_t *kv_lens, const int32_t *block_tables, int bt_stride, const void *kcache,
                            const void *vcache, long kv_row, long kv_head, int block_size, int Hq, int Hkv, int D,
                            float scale, int window, float *out, long out_stride, int n, int bq, int t0, int t1,
                            int kv_type) {
    if (kv_type < KV_F32 || kv_type > KV_BF16) return -1;
    const int G = Hq / Hkv, es = KV_BYTES(kv_type);
    int rc = 0, task = 0;
    for (int i = 0; i < n && task < t1; i++) {
        const int ql = q_lens[i], nblk = ql > 0 ? (ql + bq - 1) / bq : 0;
        if (task + nblk * Hkv <= t0) {
            task += nblk * Hkv;
            continue;
        }
        const int32_t *bt = block_tables + (size_t)i * bt_stride;
        const int first = kv_lens[i] - ql;  // position of query 0
        for (int qb = 0; qb < nblk; qb++)
            for (int hk = 0; hk < Hkv; hk++, task++) {
                if (task < t0 || task >= t1) continue;
                const int q0 = qb * bq, nq = ql - q0 < bq ? ql - q0 : bq, M = nq * G;
                const int p_lo = first + q0, p_hi = first + q0 + nq - 1;  // positions of the block's queries
                const int k_lo = window_start(p_lo + 1, window), nk = p_hi + 1 - k_lo;
                // scores [M, nk] (row m: query m / G, head hk * G + m % G), then M query, M output and nk key
                // and value row pointers, then (a 16-bit cache) the task's K and V rows in float32: each row
                // converted once, not once for every tile of queries that reads it
                const size_t conv = kv_type == KV_F32 ? 0 : 2 * (size_t)nk * D;
                char *buf = (char *)malloc(sizeof(float) * ((size_t)M * nk + M) + sizeof(void *) * (3 * (size_t)M + 2 * nk)
                                           + sizeof(float) * conv);
                if (!buf) {
                    rc = -2;
                    continue;
                }
                float *S = (float *)buf, *inv = S + (size_t)M * nk;
                const float **qr = (const float **)(buf + sizeof(float) * ((size_t)M * nk + M));
                float **orow = (float **)(qr + M);
                const float **prow = (const float **)(orow + M);
                const char **kr = (const char **)(prow + M), **vr = kr + nk;
                for (int m = 0; m < M; m++) {
                    const size_t tok = (size_t)q_start[i] + q0 + m / G, h = (size_t)hk * G + m % G;
                    qr[m] = q + tok * q_stride + h * D;
                    orow[m] = out + tok * out_stride + h * D;
                    prow[m] = S + (size_t)m * nk;
                }
                for (int k = 0; k < nk; k++) {
                    const int pos = k_lo + k;
                    const size_t slot = (size_t)bt[pos / block_size] * block_size + pos % block_size;
                    kr[k] = (const char *)kcache + (slot * kv_row + hk * kv_head) * es;
                    vr[k] = (const char *)vcache + (slot * kv_row + hk * kv_head) * es;
                }
                if (conv) {
                    float *f = (float *)(vr + nk);
                    for (int k = 0; k < 2 * nk; k++, f += D) {
                        if (kv_type == KV_F16) to_f32(KV_F16, kr[k], f, D);  // kr[nk + k] is vr[k]
                        else to_f32(KV_BF16, kr[k], f, D);
                        kr[k] = (const char *)f;
                    }
                }
                // scores: each row needs keys [its window start, its position]; the tiles score the union up to
                // their last row's position, 64 keys (16 KiB of K at D = 64, in L1) for every row tile at a time
                for (int c0 = 0; c0 < nk; c0 += PREFILL_KEYS) {
                    const int c1 = c0 + PREFILL_KEYS < nk ? c0 + PREFILL_KEYS : nk;
                    int m = 0;
                    for (; m < M; m += 3) {
                        const int R = M - m < 3 ? M - m : 3, last = p_lo + (m + R - 1) / G - k_lo + 1;
                        const int e = c1 < last ? c1 : last;
                        int k = c0;
                        if (R == 3) {
                            // a last tile of 4 keys past e while the keys exist (their scores go unread): a tile
                            // of 1 key has 3 chains, and ran ~3x as long a score
                            for (; k < e && k + 4 <= nk; k += 4)
                                dots_tile(KV_F32, 3, 4, qr + m, kr + k, D, scale, S + (size_t)m * nk + k, nk);
                            for (; k < e; k++) dots_tile(KV_F32, 3, 1, qr + m, kr + k, D, scale, S + (size_t)m * nk + k, nk);
                        } else {
                            for (int r = m; r < m + R; r++) {
                                int kk = c0;
                                for (; kk < e && kk + 4 <= nk; kk += 4)  // (past e as above)
                                    dots_tile(KV_F32, 1, 4, qr + r, kr + kk, D, scale, S + (size_t)r * nk + kk, nk);
                                for (; kk < e; kk++) dots_tile(KV_F32, 1, 1, qr + r, kr + kk, D, scale, S + (size_t)r * nk + kk, nk);
                            }
                        }
                    }
                }
                // per query: its G rows' softmax over its own run of keys
                for (int qi = 0; qi < nq; qi++) {
                    const int pos = p_lo + qi, start = window_start(pos + 1, window);
                    const int a = start - k_lo, len = pos + 1 - start;
                    for (int g = 0; g < G; g++) {
                        float *sr = S + (size_t)(qi * G + g) * nk;
                        const float mx = row_max(sr + a, len);
                        const float sum = exp_shift_sum(sr + a, len, mx);
                        inv[qi * G + g] = sum > 0.f ? 1.f / sum : 0.f;
                        memset(orow[qi * G + g], 0, sizeof(float) * D);
                    }
                }
                // outputs: every query's G heads share its run of keys; 64 keys of V (in L1) for every query
                // at a time, each output one FMA chain over its keys in order (the accumulators go back to
                // memory between key blocks, the order stays)
                for (int c0 = 0; c0 < nk; c0 += PREFILL_KEYS) {
                    const int c1 = c0 + PREFILL_KEYS < nk ? c0 + PREFILL_KEYS : nk;
                    for (int qi = 0; qi < nq; qi++) {
                        const int pos = p_lo + qi, start = window_start(pos + 1, window);
                        const int a = (start - k_lo > c0 ? start - k_lo : c0), b = pos + 1 - k_lo < c1 ? pos + 1 - k_lo : c1;
                        if (a >= b) continue;
                        float *const *og = orow + (size_t)qi * G;
                        const float **pg = (const float **)prow + (size_t)qi * G;
                        if (D % 32 == 0) {
                            int g = 0;
                            for (; g + 3 <= G; g += 3)
                                for (int d0 = 0; d0 < D; d0 += 32) pv_tile(KV_F32, 3, og + g, pg + g, vr, a, b, d0, NULL, 0, 0);
                            for (; g < G; g++)
                                for (int d0 = 0; d0 < D; d0 += 32) pv_tile(KV_F32, 1, og + g, pg + g, vr, a, b, d0, NULL, 0, 0);
                        } else {
                            for (int g = 0; g < G; g++)
                                for (int k = a; k < b; k++) axpy(KV_F32, og[g], pg[g][k], vr[k], D);
                        }
                    }
                }
                for (int m = 0; m < M; m++)
                    for (int d = 0; d < D; d++) orow[m][d] *= inv[m];
                free(buf);
            }
    }
    return rc;
}

// prefill_attention_tasks over all tasks, split between OpenMP threads (heaviest-first is not needed: tasks
// are small and taken one at a time). Checks the arguments it can: -1 on a bad one.
int prefill_attention(const float *q, long q_stride, int n, const int32_t *q_start, const int32_t *q_lens,
                      const int32_t *kv_lens, const int32_t *block_tables, int bt_stride, const void *kcache,
                      const void *vcache, int block_size, int Hq, int Hkv, int D, float scale, int window,
                      float *out, long out_stride, int nthreads, int kv_type) {
    if (n < 0 || Hq <= 0 || Hkv <= 0 || Hq % Hkv || D <= 0 || block_size <= 0 || kv_type < KV_F32 || kv_type > KV_BF16)
        return -1;
    for (int i = 0; i < n; i++)
        if (q_lens[i] < 0 || kv_lens[i] < q_lens[i]) return -1;
    if (nthreads <= 0) nthreads = omp_get_max_threads();
    const int ntasks = prefill_attention_num_tasks(n, q_lens, Hkv, PREFILL_BQ);
    if (ntasks < 0) return -1;
    const long W = (long)Hkv * D;  // elements per cached token
    int rc = 0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads) if (ntasks > 1)
    for (int task = 0; task < ntasks; task++)
        if (prefill_attention_tasks(q, q_stride, q_start, q_lens, kv_lens, block_tables, bt_stride, kcache, vcache, W,
                                    D, block_size, Hq, Hkv, D, scale, window, out, out_stride, n, PREFILL_BQ, task,
                                    task + 1, kv_type))
            rc = -2;
    return rc;
}

int prefill_attention_bq(void) { return PREFILL_BQ; }

// out[M, I] = silu(gu[:, :I]) * gu[:, I:], gu [M, 2I] (a fused gate/up projection's output); silu(x) = x / (1 + e^-x)
int silu_mul(const float *gu, int M, int I, float *out) {
    if (M < 0 || I <= 0) return -1;
#pragma omp parallel for if ((long)M * I >= 65536) schedule(static)
    for (int i = 0; i < M; i++) {
        const float *g = gu + (size_t)i * 2 * I, *u = g + I;
        float *o = out + (size_t)i * I;
        int j = 0;
        for (; j + 8 <= I; j += 8) {
            const __m256 x = _mm256_loadu_ps(g + j);
            const __m256 sig = _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), x))));
            _mm256_storeu_ps(o + j, _mm256_mul_ps(sig, _mm256_loadu_ps(u + j)));
        }
        for (; j < I; j++) o[j] = g[j] / (1.f + expf(-g[j])) * u[j];
    }
    return 0;
}

// ---- the samplers' rows (both backends on a CPU) ----------------------------------------------------------
//
// log_softmax, softmax and the inverse-CDF draw of `enginecore.sampling_ref`, one row on one thread in a fixed
// order: a row's result depends neither on the other rows nor on the thread count, and the jax backend's
// custom calls run this same code, so on a CPU both backends give the same logprobs and the same seeded draws,
// bit for bit (their own exp / sum orders differed by an ulp or so, which could move a draw at a boundary).

// exp8 with sampling_ref's infinities: e^-inf = 0 (a masked token has probability 0, not exp8's tiny
// normal) and e^+inf = +inf
static inline __m256 exp8_inf(__m256 x) {
    const __m256 inf = _mm256_set1_ps(INFINITY);
    const __m256 e = _mm256_blendv_ps(exp8(x), _mm256_setzero_ps(), _mm256_cmp_ps(x, _mm256_sub_ps(_mm256_setzero_ps(), inf), _CMP_EQ_OQ));
    return _mm256_blendv_ps(e, inf, _mm256_cmp_ps(x, inf, _CMP_EQ_OQ));
}

// 8 floats from x[j..j+n) (n < 8), the rest `fill`
static inline __m256 load_tail(const float *x, int n, float fill) {
    float buf[8];
    for (int i = 0; i < 8; i++) buf[i] = i < n ? x[i] : fill;
    return _mm256_loadu_ps(buf);
}

static inline void store_tail(float *x, int n, __m256 v) {
    float buf[8];
    _mm256_storeu_ps(buf, v);
    memcpy(x, buf, sizeof(float) * n);
}

// One row: out = x - m - log(sum(e^(x - m))) (m the row's maximum, 0 when that is not finite), or, with
// probs, e^ of that (sampling_ref.softmax). The sum: four 8-lane accumulators over blocks of 32 columns, the
// tail as a padded vector, then a fixed tree. NaN anywhere makes the row NaN, as in the reference.
static void log_softmax_row(const float *x, int V, float *out, int probs) {
    __m256 mx = _mm256_set1_ps(-INFINITY);
    int j = 0;
    for (; j + 8 <= V; j += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(x + j));
    if (j < V) mx = _mm256_max_ps(mx, load_tail(x + j, V - j, -INFINITY));
    float m = -INFINITY, lanes[8];
    _mm256_storeu_ps(lanes, mx);
    for (int i = 0; i < 8; i++) m = lanes[i] > m ? lanes[i] : m;
    if (!isfinite(m)) m = 0.f;
    const __m256 vm = _mm256_set1_ps(m);
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    j = 0;
    for (; j + 32 <= V; j += 32) {
        a0 = _mm256_add_ps(a0, exp8_inf(_mm256_sub_ps(_mm256_loadu_ps(x + j), vm)));
        a1 = _mm256_add_ps(a1, exp8_inf(_mm256_sub_ps(_mm256_loadu_ps(x + j + 8), vm)));
        a2 = _mm256_add_ps(a2, exp8_inf(_mm256_sub_ps(_mm256_loadu_ps(x + j + 16), vm)));
        a3 = _mm256_add_ps(a3, exp8_inf(_mm256_sub_ps(_mm256_loadu_ps(x + j + 24), vm)));
    }
    for (; j + 8 <= V; j += 8) a0 = _mm256_add_ps(a0, exp8_inf(_mm256_sub_ps(_mm256_loadu_ps(x + j), vm)));
    if (j < V) a1 = _mm256_add_ps(a1, exp8_inf(_mm256_sub_ps(load_tail(x + j, V - j, -INFINITY), vm)));
    const float lse = logf(hsum8(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3))));
    const __m256 vl = _mm256_set1_ps(lse);
    j = 0;
    for (; j + 8 <= V; j += 8) {
        __m256 v = _mm256_sub_ps(_mm256_sub_ps(_mm256_loadu_ps(x + j), vm), vl);
        _mm256_storeu_ps(out + j, probs ? exp8_inf(v) : v);
    }
    if (j < V) {
        __m256 v = _mm256_sub_ps(_mm256_sub_ps(load_tail(x + j, V - j, 0.f), vm), vl);
        store_tail(out + j, V - j, probs ? exp8_inf(v) : v);
    }
}

// out [M, V] = log_softmax (probs = 0) or softmax (probs = 1) of each row of x [M, V] (rows x_stride floats
// apart; out contiguous)
int log_softmax_rows(const float *x, int M, int V, long x_stride, float *out, int probs) {
    if (M < 0 || V <= 0 || x_stride < V) return -1;
#pragma omp parallel for if ((long)M * V >= 65536) schedule(static)
    for (int i = 0; i < M; i++) log_softmax_row(x + (size_t)i * x_stride, V, out + (size_t)i * V, probs);
    return 0;
}

// The n largest of each row of x [M, V] (rows x_stride floats apart), in descending order, ties by lower
// index first (a stable descending sort's first n; lax.top_k's order): one pass keeping a sorted list of n.
int top_n_rows(const float *x, int M, int V, long x_stride, int n, int64_t *ids, float *vals) {
    if (M < 0 || V <= 0 || x_stride < V || n < 0 || n > V) return -1;
    if (n == 0) return 0;
#pragma omp parallel for if ((long)M * V >= 65536) schedule(static)
    for (int i = 0; i < M; i++) {
        const float *r = x + (size_t)i * x_stride;
        float *v = vals + (size_t)i * n;
        int64_t *d = ids + (size_t)i * n;
        int c = 0;
        for (int j = 0; j < V; j++) {
            const float y = r[j];
            if (c == n && !(y > v[n - 1])) continue;  // the common case: not among the n largest
            int at = c < n ? c : n - 1;  // the slot it takes before shifting: after every value >= it
            while (at > 0 && v[at - 1] < y) {
                v[at] = v[at - 1];
                d[at] = d[at - 1];
                at--;
            }
            v[at] = y;
            d[at] = j;
            if (c < n) c++;
        }
    }
    return 0;
}

#define CDF_BLOCK 256

// p[a, b) summed in double: four 4-lane accumulators, then a fixed tree (b - a a multiple of 16 but the tail)
static inline double block_sum(const float *p, int a, int b) {
    __m256d s0 = _mm256_setzero_pd(), s1 = s0, s2 = s0, s3 = s0;
    int j = a;
    for (; j + 16 <= b; j += 16) {
        s0 = _mm256_add_pd(s0, _mm256_cvtps_pd(_mm_loadu_ps(p + j)));
        s1 = _mm256_add_pd(s1, _mm256_cvtps_pd(_mm_loadu_ps(p + j + 4)));
        s2 = _mm256_add_pd(s2, _mm256_cvtps_pd(_mm_loadu_ps(p + j + 8)));
        s3 = _mm256_add_pd(s3, _mm256_cvtps_pd(_mm_loadu_ps(p + j + 12)));
    }
    double l[4];
    _mm256_storeu_pd(l, _mm256_add_pd(_mm256_add_pd(s0, s1), _mm256_add_pd(s2, s3)));
    double s = (l[0] + l[1]) + (l[2] + l[3]);
    for (; j < b; j++) s += p[j];
    return s;
}

// One row's draw (sampling_ref.inverse_cdf): the first token whose cumulative probability exceeds u * total,
// in double. The cumulative sum is taken over blocks of CDF_BLOCK tokens (each block's sum by block_sum), then
// token by token inside the block that crosses; if rounding lets that block's running sum fall short, or no
// block crosses, the last token with a nonzero probability up to there (V - 1 if none) is drawn, never a
// token of probability 0.
static int64_t inverse_cdf_row(const float *p, int V, float u) {
    const int nb = (V + CDF_BLOCK - 1) / CDF_BLOCK;
    double sums[nb];  // each block's sum, taken once
    double total = 0.0;
    for (int b = 0; b < nb; b++) {
        const int a = b * CDF_BLOCK;
        total += sums[b] = block_sum(p, a, a + CDF_BLOCK < V ? a + CDF_BLOCK : V);
    }
    const double target = (double)u * total;
    double cum = 0.0;
    int end = V;  // the fallback searches below it
    for (int b = 0; b < nb; b++) {
        if (cum + sums[b] > target) {
            const int a = b * CDF_BLOCK, e = a + CDF_BLOCK < V ? a + CDF_BLOCK : V;
            double r = cum;
            for (int j = a; j < e; j++)
                if ((r += p[j]) > target && p[j] > 0.f) return j;
            end = e;
            break;
        }
        cum += sums[b];
    }
    for (int j = end - 1; j >= 0; j--)
        if (p[j] > 0.f) return j;
    return V - 1;
}

// out[i] = the token drawn from row i of probs [M, V] (rows p_stride floats apart) with uniform u[i] in [0, 1)
int inverse_cdf_rows(const float *probs, int M, int V, long p_stride, const float *u, int64_t *out) {
    if (M < 0 || V <= 0 || p_stride < V) return -1;
#pragma omp parallel for if ((long)M * V >= 65536) schedule(static)
    for (int i = 0; i < M; i++) out[i] = inverse_cdf_row(probs + (size_t)i * p_stride, V, u[i]);
    return 0;
}

static int desc_floats(const void *a, const void *b) {
    const float x = *(const float *)a, y = *(const float *)b;
    return (x < y) - (x > y);
}

// One row's top-p cut (sampling_ref.filter_logits): the probabilities sorted in descending order, their running
// sum in double, the first position where it reaches top_p (the last if none does); the token's probability
// there is the threshold (keep p >= it). Only the head of the order is sorted: the tokens with p >= t, for t a
// bucket edge of a histogram of the probabilities' float bits (exponent and 3 mantissa bits) where the
// buckets' mass reaches top_p (lowered a bucket at a time if the sorted sum falls short by rounding). Below t
// every token is smaller than all those above, so their sorted running sum is the full order's first terms,
// whatever t. `buf` holds V floats.
#define TOP_P_BUCKET_SHIFT 20
static float top_p_threshold_row(const float *p, int V, float top_p, float *buf) {
    double mass[1 << (31 - TOP_P_BUCKET_SHIFT)] = {0};
    int hi = -1;
    for (int j = 0; j < V; j++) {
        if (!(p[j] > 0.f)) continue;  // 0 and NaN
        uint32_t bits;
        memcpy(&bits, &p[j], 4);
        const int k = (int)(bits >> TOP_P_BUCKET_SHIFT);  // p > 0: sign bit clear
        mass[k] += p[j];
        hi = k > hi ? k : hi;
    }
    if (hi < 0) return 0.f;
    double acc = 0.0;
    int k = hi;
    for (; k > 0 && (acc += mass[k]) < top_p; k--) {}
    for (;; k--) {
        uint32_t edge = (uint32_t)(k > 0 ? k : 0) << TOP_P_BUCKET_SHIFT;
        float t;
        memcpy(&t, &edge, 4);
        int n = 0;
        for (int j = 0; j < V; j++)
            if (p[j] >= t && p[j] > 0.f) buf[n++] = p[j];
        qsort(buf, n, sizeof(float), desc_floats);
        double cum = 0.0;
        for (int i = 0; i < n; i++)
            if ((cum += buf[i]) >= top_p) return buf[i];
        if (k <= 0) return n < V ? 0.f : buf[n - 1];  // never reached: the last of the order, 0 if any is 0
    }
}

// out[i] = row i's top-p threshold (probs [M, V], rows p_stride floats apart); 0 (keep all) where top_p[i] >= 1
int top_p_thresholds(const float *probs, int M, int V, long p_stride, const float *top_p, float *out) {
    if (M < 0 || V <= 0 || p_stride < V) return -1;
    int rc = 0;
#pragma omp parallel if ((long)M * V >= 65536)
    {
        float *buf = malloc(sizeof(float) * V);
        if (!buf) {
#pragma omp atomic write
            rc = -2;
        }
#pragma omp for schedule(static)
        for (int i = 0; i < M; i++)
            out[i] = buf && top_p[i] < 1.f ? top_p_threshold_row(probs + (size_t)i * p_stride, V, top_p[i], buf) : 0.f;
        free(buf);
    }
    return rc;
}

// y [M, N] = x [M, K] . w [N, K]^T in float32, any M, on [out, in] weights (the model packs its weights for
// panel_gemm below at load; this one serves weights that are not packed, and bench_dense).
//
// Every output is one 8-lane FMA chain over k in ascending order, then hsum8, then the scalar tail: the
// same arithmetic whatever tile computes it, so a row's result does not depend on how many rows share the
// call (a token's hidden state is the same in a decode step, a mixed step or a recompute after
// preemption). Tiles are R rows x C weight rows (4 x 3 for throughput: 12 chains in registers; 1 x 1
// for a single row, which is memory-bound and reads one weight row at a time, the access the hardware
// prefetcher follows best). Threads split the weight rows; each walks its share in panels that stay in
// L2 while all activation rows pass over them, in blocks that stay in L2 too.
// On a 2-core AVX2 machine: 1.6-2.5x MKL's sgemm (on [N, K] weights) at 1-32 rows, about even at 64,
// 0.8-0.95x from 128 rows on (prefill) (benchmarks/bench_dense.py).
static inline __attribute__((always_inline)) void f32_tile(
    const int R, const int C, const float *x, int K, const float *w, float *y, int N) {
    __m256 acc[4][3];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) acc[r][c] = _mm256_setzero_ps();
    int k = 0;
    for (; k + 8 <= K; k += 8) {
        __m256 wv[3];
        for (int c = 0; c < C; c++) wv[c] = _mm256_loadu_ps(w + (size_t)c * K + k);
        for (int r = 0; r < R; r++) {
            const __m256 xv = _mm256_loadu_ps(x + (size_t)r * K + k);
            for (int c = 0; c < C; c++) acc[r][c] = _mm256_fmadd_ps(wv[c], xv, acc[r][c]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) {
            float s = hsum8(acc[r][c]);
            for (int j = k; j < K; j++) s += w[(size_t)c * K + j] * x[(size_t)r * K + j];
            y[(size_t)r * N + c] = s;
        }
}

// rows m0..m1 (R = m1 - m0 <= 4) times weight rows n0..n1, C columns at a time
static inline __attribute__((always_inline)) void f32_rows(
    const int R, const int C, const float *x, int m0, int K, const float *w, int N, float *y, int n0, int n1) {
    const float *xm = x + (size_t)m0 * K;
    float *ym = y + (size_t)m0 * N;
    int n = n0;
    for (; n + C <= n1; n += C) f32_tile(R, C, xm, K, w + (size_t)n * K, ym + n, N);
    for (; n < n1; n++) f32_tile(R, 1, xm, K, w + (size_t)n * K, ym + n, N);
}

// Output columns [a, b) of f32_gemm on the calling thread (any split gives the same bits, see above).
static int f32_gemm_part(const float *x, int M, int K, const float *w, int N, float *y, int a, int b) {
    if (M < 1 || K <= 0 || N <= 0 || a < 0 || b > N || a > b) return -1;
    // a panel of 256 KiB of weights in L2, activation blocks of 32 KiB (L1): measured best of 16-128 KiB
    // blocks and 64-256 KiB panels at prefill sizes
    int NB = (int)(65536 / K), MB = (int)(8192 / K) & ~3;
    if (NB < 3) NB = 3;
    if (MB < 4) MB = 4;
    for (int n0 = a; n0 < b; n0 += NB) {
        const int n1 = n0 + NB < b ? n0 + NB : b;
        for (int m0 = 0; m0 < M; m0 += MB) {
            const int m1 = m0 + MB < M ? m0 + MB : M;
            int m = m0;
            for (; m + 4 <= m1; m += 4) f32_rows(4, 3, x, m, K, w, N, y, n0, n1);
            switch (m1 - m) {
                case 3: f32_rows(3, 3, x, m, K, w, N, y, n0, n1); break;
                case 2: f32_rows(2, 2, x, m, K, w, N, y, n0, n1); break;
                case 1: f32_rows(1, 1, x, m, K, w, N, y, n0, n1); break;
            }
        }
    }
    return 0;
}

int f32_gemm(const float *x, int M, int K, const float *w, int N, float *y, int nthreads) {
    if (M < 1 || K <= 0 || N <= 0) return -1;
    if (nthreads <= 0) nthreads = omp_get_max_threads();
    const int chunks = (N + 23) / 24;
    const int nt = gemm_threads(M, K, N, nthreads, chunks);
#pragma omp parallel num_threads(nt)
    {
        const int t = omp_get_thread_num(), T = omp_get_num_threads();
        const int a = (int)((long)chunks * t / T) * 24, be = (int)((long)chunks * (t + 1) / T) * 24;
        f32_gemm_part(x, M, K, w, N, y, a, be < N ? be : N);
    }
    return 0;
}

// Every float32 linear of a CPU step and the LM head, y[M, V] = x[M, K] . w[V, K]^T, from weights packed in
// panels of 16 output rows, k-major: wp[(p * K + k) * 16 + j] = w[16 p + j][k] (zero rows pad V to a multiple
// of 16; cpu_kernels.pack_panels). A tile is R activation rows x P panels: per k, 2P weight loads, R
// broadcasts, 2RP FMAs, and no horizontal sum, which costs as much as the FMAs themselves at small hidden
// sizes (K = 64: f32_gemm's 8-lane chains are 8 FMAs long). Every output is one scalar FMA chain over k in
// ascending order (its lane of an accumulator), whatever the tile, the panel block or the thread: a row's
// outputs do not depend on the row count. With `argmax` (not NULL) the tile's outputs are not stored but
// folded into each row's running maximum (the first index of the maximum, NaN counting as the largest as in
// torch.argmax): greedy sampling without writing and re-reading [M, V] logits (12.6 MB at 64 rows of
// SmolLM2's vocabulary).
#define HEAD_ROWS 6
typedef struct {
    float v[8];
    int32_t i[8];
    int32_t nan;  // first NaN column seen, INT32_MAX if none
} head_best;

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

// One k of a tile of R rows x P panels: every accumulator a[r * 2P + j] += x[r][k] * (panel's 8 lanes j at k).
// The only arithmetic of panel_gemm: both its loop orders (head_tile, kblock_tile) step through it.
static inline __attribute__((always_inline)) void panel_k_step(const int R, const int P, const float *x, int K,
                                                             const float *w, int k, __m256 *a) {
    __m256 wv[8];
#pragma GCC unroll 4
    for (int p = 0; p < P; p++) {
        wv[2 * p] = _mm256_loadu_ps(w + ((size_t)p * K + k) * 16);
        wv[2 * p + 1] = _mm256_loadu_ps(w + ((size_t)p * K + k) * 16 + 8);
    }
#pragma GCC unroll 6
    for (int r = 0; r < R; r++) {
        const __m256 xv = _mm256_broadcast_ss(x + (size_t)r * K + k);
#pragma GCC unroll 8
        for (int j = 0; j < 2 * P; j++) a[r * 2 * P + j] = _mm256_fmadd_ps(xv, wv[j], a[r * 2 * P + j]);
    }
}

// pf_lines cache lines from pf are prefetched, evenly over the k loop (head_rows): with P > 1, pf_run of a
// panel, then as many from pf_stride lines on (the next panel's)
static inline __attribute__((always_inline)) void head_tile(
    const int R, const int P, const float *x, int K, const float *wp, int p0, int V, float *y, head_best *best,
    const char *pf, int pf_lines, int pf_run, int pf_stride) {
    __m256 a[HEAD_ROWS * 2];  // R * 2P <= 12 accumulators
#pragma GCC unroll 12
    for (int i = 0; i < R * 2 * P; i++) a[i] = _mm256_setzero_ps();
    const float *w = wp + (size_t)p0 * K * 16;
    int acc = 0, left = pf_run;
    for (int k = 0; k < K; k++) {
        if (P == 1) {  // (at most K lines, one panel's: the loop's only extra work is this counter)
            acc += pf_lines;
            if (acc >= K) {
                acc -= K;
                _mm_prefetch(pf, _MM_HINT_T1);  // (head_rows: into L2)
                pf += 64;
            }
        } else {  // pf_run lines of each of several panels, pf_stride lines apart: up to P * pf_run
            for (acc += pf_lines; acc >= K; acc -= K) {
                _mm_prefetch(pf, _MM_HINT_T1);
                pf += 64;
                if (--left == 0) pf += (size_t)(pf_stride - pf_run) * 64, left = pf_run;
            }
        }
        panel_k_step(R, P, x, K, w, k, a);
    }
    float o[HEAD_ROWS * 2 * 8];  // the tile's logits, row r's at o[r * 16 P ...]
#pragma GCC unroll 12
    for (int i = 0; i < R * 2 * P; i++) _mm256_storeu_ps(o + 8 * i, a[i]);
    for (int r = 0; r < R; r++)
        for (int j = 0; j < 2 * P; j++) {
            const int col0 = p0 * 16 + j * 8;
            const float *t = o + 8 * (r * 2 * P + j);
            if (best != NULL) {
                head_fold(_mm256_loadu_ps(t), col0, V, best + r);
            } else {
                for (int c = 0; c < 8 && col0 + c < V; c++) y[(size_t)r * V + col0 + c] = t[c];
            }
        }
}

// rows m0..m0+R-1 over panels p0..p1, P panels a tile (single panels at the end). Each tile also prefetches
// slice mi of nm of the P panels it will meet in the next block (p1.. < pe), spread over its k loop: the rows'
// first tile of a block then finds its weights in cache instead of waiting on memory while later tiles, which
// read them from L2, leave the memory idle (5-12% faster linears at 32-64 rows). Into L2 (T1), not L1: a
// block's 7 panels (252 KiB at K = 576) only pass through L1, and there they evicted the tile's own; T1 ran a
// decode step's linears 1.11-1.34x as fast at 8-16 rows (T0 kept for kblock_part, whose panels' k blocks fit
// L1: T1 ran 0.98x there). With one row block (up to 6 rows at K >= 342: a block is 4096 / K rows) only the
// one-panel tiles (4-6 rows) prefetch:
// 1.13-1.22x at 5-6 rows; the 1-3-row tiles, 2-4 panels wide, leave it to the hardware's streams (prefetching
// their next block ran 0.92-0.97x). After whole blocks of 6 rows (nm: the row blocks that prefetch, counted by
// panel_gemm_part), a last one of 2-3 rows fetches its slice of all its tiles' panels (it fetched only the first
// panel's, leaving the rest of the block to the hardware: 1.04-1.12x at 8, 9 and 13-15 rows, session 27), one of
// a single row none (the others' slices widen: 1.10-1.17x at 7 rows).
static inline __attribute__((always_inline)) void head_rows(
    const int R, const int P, const float *x, int m0, int K, const float *wp, int p0, int p1, int V, float *y,
    head_best *best, int pe, int mi, int nm) {
    const float *xm = x + (size_t)m0 * K;
    float *ym = y == NULL ? NULL : y + (size_t)m0 * V;
    head_best *bm = best == NULL ? NULL : best + m0;
    const int l0 = nm > 0 ? (int)((long)K * mi / nm) : 0, l1 = nm > 0 ? (int)((long)K * (mi + 1) / nm) : 0;
    const int run = mi < nm && (R >= 4 || (R >= 2 && nm > 1)) ? l1 - l0 : 0;  // lines of each panel
    for (int p = p0; p < p1;) {
        const int w = p + P <= p1 ? P : 1, q = p1 + (p - p0), nq = pe - q < w ? pe - q : w;
        const char *pf = (const char *)(wp + ((size_t)q * K + l0) * 16);
        const int lines = nq > 0 ? nq * run : 0;
        if (w == P)
            head_tile(R, P, xm, K, wp, p, V, ym, bm, pf, lines, run, K);
        else
            head_tile(R, 1, xm, K, wp, p, V, ym, bm, pf, lines, run, K);
        p += w;
    }
}

// From blocked_rows() rows on (a prefill's linears, and a decode step's from batch 19, or 6: below),
// panel_gemm_part changes its loop order, where the unblocked one leans on L3 and memory: with threads split by
// panels (panel_gemm_plan), each thread would stream all the activations past every block of its panels, and a
// long k (K > 1024: the down projection's panel, K * 64 bytes, is 96 KiB) pushes the 6-row activation tile out of
// L1 too. kblock_part takes blocks of ROW_BLOCK rows (110 KiB of activations at K = 576: L2) past one panel's
// KBLOCK k values at a time (36 KiB). In this machine's fast minutes both orders run gate / up and down at its
// peak (~175 GFLOP/s at 2048 rows); when its shared caches and memory are busy, the blocked one holds up better:
// 1.13-1.37x at 512-2048 rows.
// A tile's accumulators start at zero (k0 == 0) or at the partial sums the previous k block left in y, and
// go back to y (the next tile's prefetched meanwhile): each output is still one FMA chain over k in
// ascending order (a float32 store and load in between change nothing), so the bits are those of the
// unblocked tiles. The threshold was 256 rows until the blocked order learnt to prefetch the next panel
// (kblock_part) and to fold the LM head's argmax: from 24 rows it then runs a decode step's linears and greedy
// head 1.07-1.14x as fast as the unblocked order (bench_kernels_ab, 24-64 rows); at 8 rows 0.87-0.92x, at 16
// even. Session 26 (a 2-core Zen 4): once head_rows prefetched into L2 (below), the blocked order ran 19-23
// rows 1.02-1.12x as fast and 12-16 rows 0.83-0.87x, so it starts at 19 (18 rows are three whole tiles of 6).
// Session 38 (a 2-core Zen 3 without AVX-512): there the blocked order wins from 6 rows, the same bits
// (`bench_kernels_ab --what linears --rows 4,8,12,16 --reps 20`: 1.11x / 1.06x / 1.25x medians at 8 / 12 / 16
// rows, 0.98-0.99x at 1-4; `--what layers --rows 6,10,15,16`: 1.08x / 0.99x / 1.26x / 1.24x), not because the
// unblocked order's L2 blocks overflow its 512 KiB L2 (blocks of 3 panels instead of 7: 1.01-1.03x) nor its
// prefetch hint (T0: 0.95-1.02x). Only those two machines were measured, so the start goes by what tells them
// apart: whether the CPU has AVX-512 (avx512f).
#define COMPUTE_BOUND_ROWS 19  // with AVX-512 (the Zen 4s)
#define COMPUTE_BOUND_ROWS_AVX2 6  // without (the Zen 3s)
static int blocked_rows_state;  // 0: not yet chosen (panel_blocked_rows)

static int blocked_rows_default(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") ? COMPUTE_BOUND_ROWS : COMPUTE_BOUND_ROWS_AVX2;
}

static inline int blocked_rows(void) {
    if (blocked_rows_state == 0) blocked_rows_state = blocked_rows_default();
    return blocked_rows_state;
}

// The rows from which panel_gemm blocks k (see COMPUTE_BOUND_ROWS): `set` > 0 makes it that, 0 this CPU's own
// again, -1 only asks; returns the value before. For the tests (each order's bits on any CPU); not for calls in
// flight.
int panel_blocked_rows(int set) {
    const int before = blocked_rows();
    if (set >= 0) blocked_rows_state = set > 0 ? set : blocked_rows_default();
    return before;
}
#define KBLOCK 576
#define ROW_BLOCK 48  // a multiple of HEAD_ROWS

// rows x[0..R), y[0..R) (x starting at column k0), P panels from p0, k in [k0, k1). With `best` (argmax mode,
// one k block: k0 == 0, k1 == K) the sums are folded into rows best[0..R) instead of stored. pf_lines cache lines
// from pf are prefetched, evenly over the k loop.
static inline __attribute__((always_inline)) void kblock_tile(
    const int R, const int P, const float *x, int K, const float *wp, int p0, int k0, int k1, int V, float *y,
    head_best *best, const float *ynext, const char *pf, int pf_lines) {
    __m256 a[HEAD_ROWS * 2];
    float *yt = y == NULL ? NULL : y + (size_t)p0 * 16;
    if (ynext != NULL)  // the next tile's partial sums (6 rows of 16), while this one computes
        for (int r = 0; r < HEAD_ROWS; r++) _mm_prefetch((const char *)(ynext + (size_t)r * V), _MM_HINT_T0);
#pragma GCC unroll 6
    for (int r = 0; r < R; r++)
#pragma GCC unroll 8
        for (int j = 0; j < 2 * P; j++)
            a[r * 2 * P + j] = k0 == 0 ? _mm256_setzero_ps() : _mm256_loadu_ps(yt + (size_t)r * V + 8 * j);
    const float *w = wp + ((size_t)p0 * K + k0) * 16;
    if (pf_lines == 0) {  // (the loop without the prefetch's counter: 6-20% faster at 1024 rows)
        for (int k = 0; k < k1 - k0; k++) panel_k_step(R, P, x, K, w, k, a);
    } else {
        int acc = 0;
        for (int k = 0; k < k1 - k0; k++) {
            acc += pf_lines;
            if (acc >= k1 - k0) {
                acc -= k1 - k0;
                _mm_prefetch(pf, _MM_HINT_T0);
                pf += 64;
            }
            panel_k_step(R, P, x, K, w, k, a);
        }
    }
    if (best != NULL) {  // (unrolled, as every loop over `a`: an indexed one would keep `a` in memory)
#pragma GCC unroll 6
        for (int r = 0; r < R; r++)
#pragma GCC unroll 8
            for (int j = 0; j < 2 * P; j++) head_fold(a[r * 2 * P + j], p0 * 16 + j * 8, V, best + r);
        return;
    }
#pragma GCC unroll 6
    for (int r = 0; r < R; r++)
#pragma GCC unroll 8
        for (int j = 0; j < 2 * P; j++) _mm256_storeu_ps(yt + (size_t)r * V + 8 * j, a[r * 2 * P + j]);
}

// the last R < HEAD_ROWS rows of a row block over panels [p0, p1), P panels a tile (single ones at the end)
static inline __attribute__((always_inline)) void kblock_tail(
    const int R, const int P, const float *x, int K, const float *wp, int p0, int p1, int k0, int k1, int V, float *y,
    head_best *best) {
    for (int p = p0; p < p1;) {
        if (p + P <= p1) {
            kblock_tile(R, P, x, K, wp, p, k0, k1, V, y, best, NULL, NULL, 0);
            p += P;
        } else {
            kblock_tile(R, 1, x, K, wp, p, k0, k1, V, y, best, NULL, NULL, 0);
            p++;
        }
    }
}

// rows [0, M) times panels [a, b) (the partial last panel, if among them, unblocked by head_tile); with `best` (argmax
// mode, K <= KBLOCK) into the rows' running maxima instead of y. In the first row block, each row tile of a panel also
// prefetches a share of the next panel's k block, so the panel's first tile finds it in cache instead of waiting on
// memory (later row blocks find the panels in L3; prefetching there too made 256-1024 rows 6-15% slower). When b < pe
// the last panel prefetches panel b's first k block in the last k block: the caller's next range starts there
// (shares_claim).
static __attribute__((noinline)) void kblock_part(const float *x, int M, int K, const float *wp, int V, float *y,
                                                  head_best *best, int a, int b, int pe) {
    const int whole = V / 16 < b ? V / 16 : b, pf_end = V / 16 < pe ? V / 16 : pe;
    for (int k0 = 0; k0 < K; k0 += KBLOCK) {
        const int k1 = k0 + KBLOCK < K ? k0 + KBLOCK : K;
        for (int m0 = 0; m0 < M; m0 += ROW_BLOCK) {
            const int m1 = m0 + ROW_BLOCK < M ? m0 + ROW_BLOCK : M;
            for (int p0 = a; p0 < whole; p0 += 4) {  // groups of 4 panels: a tail of one row takes 4 at a time
                const int p1 = p0 + 4 < whole ? p0 + 4 : whole;
                const int m = m0 + (m1 - m0) / HEAD_ROWS * HEAD_ROWS;  // the tail's first row
                const int nr = (m - m0) / HEAD_ROWS;
                for (int p = p0; p < p1; p++) {
                    // whether this panel's tiles prefetch the next panel: its k block k0 within the range; past
                    // the range (where the caller's next one starts), its first k block, during the last one
                    const int pf = m0 == 0 && (p + 1 < whole || (p + 1 < pf_end && k1 == K));
                    const char *next = !pf ? NULL
                                       : (const char *)(wp + ((size_t)(p + 1) * K + (p + 1 < whole ? k0 : 0)) * 16);
                    for (int r = m0, i = 0; r < m; r += HEAD_ROWS, i++) {
                        const int l0 = (k1 - k0) * i / nr, l1 = (k1 - k0) * (i + 1) / nr;
                        kblock_tile(6, 1, x + (size_t)r * K + k0, K, wp, p, k0, k1, V,
                                    y == NULL ? NULL : y + (size_t)r * V, best == NULL ? NULL : best + r,
                                    y == NULL ? NULL
                                    : r + HEAD_ROWS < m ? y + (size_t)(r + HEAD_ROWS) * V + p * 16
                                                        : y + (size_t)m0 * V + (p + 1) * 16,
                                    pf ? next + (size_t)l0 * 64 : NULL, pf ? l1 - l0 : 0);
                    }
                }
                const float *xm = x + (size_t)m * K + k0;
                float *ym = y == NULL ? NULL : y + (size_t)m * V;
                head_best *bm = best == NULL ? NULL : best + m;
                switch (m1 - m) {
                    case 5: kblock_tail(5, 1, xm, K, wp, p0, p1, k0, k1, V, ym, bm); break;
                    case 4: kblock_tail(4, 1, xm, K, wp, p0, p1, k0, k1, V, ym, bm); break;
                    case 3: kblock_tail(3, 2, xm, K, wp, p0, p1, k0, k1, V, ym, bm); break;
                    case 2: kblock_tail(2, 3, xm, K, wp, p0, p1, k0, k1, V, ym, bm); break;
                    case 1: kblock_tail(1, 4, xm, K, wp, p0, p1, k0, k1, V, ym, bm); break;
                }
            }
        }
    }
    if (whole < b && whole >= a) {  // head_tile stores (or folds) only the columns < V
        int m = 0;
        for (; m + HEAD_ROWS <= M; m += HEAD_ROWS)
            head_tile(6, 1, x + (size_t)m * K, K, wp, whole, V, y == NULL ? NULL : y + (size_t)m * V,
                      best == NULL ? NULL : best + m, NULL, 0, 0, 0);
        for (; m < M; m++)
            head_tile(1, 1, x + (size_t)m * K, K, wp, whole, V, y == NULL ? NULL : y + (size_t)m * V,
                      best == NULL ? NULL : best + m, NULL, 0, 0, 0);
    }
}

// w [V, K] float32, rows `ld` floats apart -> out [ceil(V / 16), K, 16], panel_gemm's layout (row v at
// [v / 16, :, v % 16]; zero rows pad the last panel): how both backends pack their weights at load. A panel's
// 16 rows are read in blocks of 64 k (4 KiB of output, in L1), ~10x a strided tensor copy's speed.
int pack_panels_f32(const float *w, int V, int K, long ld, float *out) {
    if (V <= 0 || K <= 0 || ld < K) return -1;
    for (int p = 0; p < (V + 15) / 16; p++) {
        float *o = out + (size_t)p * K * 16;
        const int rows = V - p * 16 < 16 ? V - p * 16 : 16;
        for (int k0 = 0; k0 < K; k0 += 64) {
            const int k1 = k0 + 64 < K ? k0 + 64 : K;
            for (int j = 0; j < 16; j++) {
                const float *src = w + (size_t)(p * 16 + j) * ld;
                for (int k = k0; k < k1; k++) o[(size_t)k * 16 + j] = j < rows ? src[k] : 0.f;
            }
        }
    }
    return 0;
}

// How panel_gemm splits its work between threads: parts of 4 panels, or, from blocked_rows() rows on
// (kblock_part: each share streams all the rows past its panels), parts of one panel, so the threads' shares are
// even (a prefill's q/k/v linear, 60 panels, is 8 / 7 chunks of 4 between 2 threads, 30 / 30 panels). Tiles of
// rows split between the threads, the other way to balance, ran the narrow linears (K = 576: q/k/v, o)
// 0.72-0.96x as fast as even panel shares at 256-2048 rows (benchmarks/README.md, session 13).
// The single panels are claimed (shares_claim, at least *claim of them a claim: kblock_part's tail rows' tiles
// cover up to 4 panels); parts of 4 panels are split once (*claim = 0: head_rows prefetches within its range, and
// claims there ran 0.96x).
// Returns the number of parts, sets *unit (panels a part) and *nt (the threads worth waking, <= nthreads, <= the
// parts). jaxengine's custom call splits the same parts between XLA's threads.
int panel_gemm_plan(int M, int K, int V, int nthreads, int *unit, int *nt, int *claim) {
    const int NP = (V + 15) / 16;
    *unit = M >= blocked_rows() ? 1 : 4;
    *claim = *unit == 1 ? 4 : 0;
    const int parts = (NP + *unit - 1) / *unit;
    *nt = gemm_threads(M, K, V, nthreads, parts);
    return parts;
}

// Parts [lo, hi) of panel_gemm_plan's split (`unit` panels each): panels in blocks of 256 KiB (L2) times
// activation blocks of 16 KiB (L1), or blocked in k too (kblock_part, above), whose last panel prefetches the
// first of part hi when hi < pf_hi (the caller's next parts; pf_hi = hi: none). `best` (argmax mode) is the
// caller's M running maxima, or NULL.
void panel_gemm_part(const float *x, int M, int K, const float *wp, int V, float *y, head_best *best, int unit,
                     int lo, int hi, int pf_hi) {
    const int NP = (V + 15) / 16, a = lo * unit, b = hi * unit < NP ? hi * unit : NP;
    if (M >= blocked_rows() && (best == NULL || K <= KBLOCK)) {  // see COMPUTE_BOUND_ROWS
        kblock_part(x, M, K, wp, V, y, best, a, b, pf_hi * unit);
        return;
    }
    int NB = (int)(4096 / K), MB = (int)(4096 / K) / HEAD_ROWS * HEAD_ROWS;
    if (NB < 4) NB = 4;
    if (MB < HEAD_ROWS) MB = HEAD_ROWS;
    for (int p0 = a; p0 < b; p0 += NB) {
        const int p1 = p0 + NB < b ? p0 + NB : b;
        // the row blocks that prefetch (head_rows): all but a last one of a single row, or a lone one of 1-3 rows
        const int pe = p1 + NB < b ? p1 + NB : b, nm = M / MB + (M % MB >= (M < MB ? 4 : 2));
        for (int m0 = 0, mi = 0; m0 < M; m0 += MB, mi++) {
            const int m1 = m0 + MB < M ? m0 + MB : M;
            int m = m0;
            for (; m + HEAD_ROWS <= m1; m += HEAD_ROWS) head_rows(6, 1, x, m, K, wp, p0, p1, V, y, best, pe, mi, nm);
            switch (m1 - m) {
                case 5: head_rows(5, 1, x, m, K, wp, p0, p1, V, y, best, pe, mi, nm); break;
                case 4: head_rows(4, 1, x, m, K, wp, p0, p1, V, y, best, pe, mi, nm); break;
                case 3: head_rows(3, 2, x, m, K, wp, p0, p1, V, y, best, pe, mi, nm); break;
                case 2: head_rows(2, 3, x, m, K, wp, p0, p1, V, y, best, pe, mi, nm); break;
                case 1: head_rows(1, 4, x, m, K, wp, p0, p1, V, y, best, pe, mi, nm); break;
            }
        }
    }
}

// The argmax mode's running maxima, for callers that split panel_gemm_part's parts themselves (the jax
// backend's custom call): `head_best_bytes` each, `head_best_init` before the parts fold into them, and
// `head_best_argmax` to merge a row's n sets (`stride_bytes` apart: one a thread, or a slice of parts) into its
// token.
int head_best_bytes(void) { return (int)sizeof(head_best); }

void head_best_init(head_best *b, size_t n) {
    for (size_t i = 0; i < n; i++) {
        for (int j = 0; j < 8; j++) {
            b[i].v[j] = -INFINITY;
            b[i].i[j] = 0;
        }
        b[i].nan = INT32_MAX;
    }
}

// the first index of the maximum over the sets' lanes, NaN first: the same whatever order the sets come in
int32_t head_best_argmax(const head_best *b, int n, size_t stride_bytes) {
    float bv = -INFINITY;
    int32_t bi = 0, nan = INT32_MAX;
    for (int t = 0; t < n; t++) {
        const head_best *h = (const head_best *)((const char *)b + stride_bytes * t);
        if (h->nan < nan) nan = h->nan;
        for (int j = 0; j < 8; j++)
            if (h->v[j] > bv || (h->v[j] == bv && h->i[j] < bi)) {
                bv = h->v[j];
                bi = h->i[j];
            }
    }
    return nan != INT32_MAX ? nan : bi;
}

// Parts [0, n) of a phase shared out between nt threads, whatever their speed: thread t starts on its share
// [n t / nt, n (t + 1) / nt) and takes it from the front, half of what is left at a time (at least `min` parts),
// so its claims follow each other (kblock_part's prefetch runs on into the next) and what it has not claimed yet
// stays free; with its share empty, it takes half of what is left of the fullest other share, from the back. A
// thread slowed down (by a busy core, or a helper that starts late or not at all) has its unclaimed parts taken,
// and the threads end a phase within about one claim of each other. With a static split the first one to finish
// waited for the other: 4-11% of a decode step's linears on this 2-core VM (docs/design-notes.md, session 23).
// A share is one 64-bit word, lo | hi << 32, changed by compare-and-swap only: its owner moves lo, others hi
// (lo only grows and hi only shrinks, so a word never comes back to an earlier value). A claim publishes no
// data (the phase's end does: OpenMP's barrier, the team's `done`), so the atomics are relaxed.
static inline uint64_t share_word(int lo, int hi) { return (uint64_t)(uint32_t)lo | (uint64_t)(uint32_t)hi << 32; }
static inline int share_lo(uint64_t w) { return (int)(uint32_t)w; }
static inline int share_hi(uint64_t w) { return (int)(uint32_t)(w >> 32); }

void shares_init(uint64_t *s, int n, int nt) {
    if (n < 0) n = 0;
    for (int t = 0; t < nt; t++)
        __atomic_store_n(s + t, share_word((int)((long)n * t / nt), (int)((long)n * (t + 1) / nt)), __ATOMIC_RELAXED);
}

// Thread t's next parts [*a, *b), or 0 when all are claimed (t outside [0, nt): only from others' shares); *pe
// bounds panel_gemm_part's prefetch past *b: the end of t's share, where its next claim continues, or *b for
// parts taken from another.
int shares_claim(uint64_t *s, int nt, int t, int min, int *a, int *b, int *pe) {
    if (min < 1) min = 1;
    if (t >= 0 && t < nt) {
        uint64_t w = __atomic_load_n(s + t, __ATOMIC_RELAXED);
        for (;;) {
            const int lo = share_lo(w), hi = share_hi(w), left = hi - lo;
            if (left <= 0) break;
            int c = (left + 1) / 2 > min ? (left + 1) / 2 : min;
            if (c > left) c = left;
            if (__atomic_compare_exchange_n(s + t, &w, share_word(lo + c, hi), 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
                *a = lo, *b = lo + c, *pe = hi;
                return 1;
            }
        }
    }
    for (;;) {
        int v = -1, most = 0;
        uint64_t w = 0;
        for (int u = 0; u < nt; u++) {
            const uint64_t x = __atomic_load_n(s + u, __ATOMIC_RELAXED);
            const int left = share_hi(x) - share_lo(x);
            if (left > most) v = u, most = left, w = x;
        }
        if (v < 0) return 0;
        const int lo = share_lo(w), hi = share_hi(w);
        int c = most / 2 > min ? most / 2 : min;
        if (c > most) c = most;
        if (__atomic_compare_exchange_n(s + v, &w, share_word(lo, hi - c), 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
            *a = hi - c, *b = hi, *pe = hi;
            return 1;
        }
    }
}

// For the tests only: every part of [0, n) claimed from nt (<= 64) shares by nthreads OpenMP threads at once
// (thread t as share t's owner; those past nt only take), claims back to back: counts[i] += 1 each time part i
// is handed out (shares_claim under contention; anything but all ones is a bug).
int shares_count(int n, int nt, int min, int nthreads, int32_t *counts) {
    if (n < 0 || nt < 1 || nt > 64 || nthreads < 1) return -1;
    uint64_t sh[nt];
    shares_init(sh, n, nt);
#pragma omp parallel num_threads(nthreads)
    {
        int a, b, pe;
        while (shares_claim(sh, nt, omp_get_thread_num(), min, &a, &b, &pe))
            for (int i = a; i < b; i++) __atomic_fetch_add(counts + i, 1, __ATOMIC_RELAXED);
    }
    return 0;
}

// M rows' running maxima for each of nt threads (thread t's at best + M t), initialised; NULL if out of memory
static head_best *maxima_new(int M, int nt) {
    head_best *best = (head_best *)malloc(sizeof(head_best) * (size_t)M * nt);
    if (best != NULL) head_best_init(best, (size_t)M * nt);
    return best;
}

// each row's token from the nt threads' maxima (maxima_new's), which are then freed
static void maxima_merge(head_best *best, int M, int nt, int64_t *argmax) {
    for (int m = 0; m < M; m++) argmax[m] = head_best_argmax(best + m, nt, sizeof(head_best) * (size_t)M);
    free(best);
}

int panel_gemm(const float *x, int M, int K, const float *wp, int V, float *y, int64_t *argmax, int nthreads) {
    if (M < 1 || K <= 0 || V <= 0 || (y == NULL) == (argmax == NULL)) return -1;
    if (nthreads <= 0) nthreads = omp_get_max_threads();
    int unit, nt, claim;
    const int parts = panel_gemm_plan(M, K, V, nthreads, &unit, &nt, &claim);
    head_best *best = argmax == NULL ? NULL : maxima_new(M, nt);
    if (argmax != NULL && best == NULL) return -2;
    uint64_t sh[nt];
    if (claim) shares_init(sh, parts, nt);
#pragma omp parallel num_threads(nt)
    {
        const int t = omp_get_thread_num(), T = omp_get_num_threads();
        head_best *own = best == NULL ? NULL : best + (size_t)M * t;  // this thread's running maxima
        if (!claim) {
            const int lo = (int)((long)parts * t / T), hi = (int)((long)parts * (t + 1) / T);
            panel_gemm_part(x, M, K, wp, V, y, own, unit, lo, hi, hi);
        } else {
            int a, b, pe;
            while (shares_claim(sh, nt, t, claim, &a, &b, &pe)) panel_gemm_part(x, M, K, wp, V, y, own, unit, a, b, pe);
        }
    }
    if (argmax != NULL) maxima_merge(best, M, nt, argmax);
    return 0;
}

// A float32 linear (or LM head) whose weight is a GGUF file's Q4_1, Q4_0 or Q8_0 blocks dequantized,
// multiplied from the blocks themselves, to the same bits: each weight is rebuilt as the loader computed it
// (Q4_1 (d * q) + m, Q4_0 d * (q - 8), Q8_0 q * d, rounded to float32: enginecore/gguf_dequant.c; d * q, 11
// significant bits times at most 8, is exact, so a compiler's fusing it with the sum changes nothing) and every
// output is the same single FMA chain over k in ascending order as panel_gemm's (with `argmax`, folded as its
// greedy head folds them). So a step's outputs do not depend on which of the two ran, and a decode step of
// few rows, which streams its weights from memory, reads 0.625 (Q4), 1.06 (Q8) or 2 (BF16, below) bytes a weight
// instead of 4.
// Panels of 16 output rows as panel_gemm's, each K / 32 groups: the 16 rows' d (float16), for Q4_1 their m
// (float16; zeros for Q4_0), then per k the 16 rows' q: Q4 in 8 bytes, byte j holding row j's q in its low
// nibble and row j + 8's in its high one; Q8 in 16 bytes (torchengine.cpu_kernels.pack_q4x / pack_q8x).
// QX_BF16: a float32 weight that is bfloat16-exact (a bfloat16 checkpoint served in float32: its low 16 bits are
// zero) as its high halves, per k the 16 rows' in 32 bytes, no scales (enginecore.qx.bf16_panels): rebuilt by a
// shift, exactly, half the bytes.
// QX_Q4_K: Q4_1's form with float32 d and m, for a GGUF file's Q4_K: per group of 32 its weights are
// (d * sc) * q - dmin * mn (the gguf package's dequantization, which the loader runs), d * sc (11 significant bits
// times 6) and dmin * mn exact in float32, so a group's d = d * sc and m = -(dmin * mn) rebuild it as Q4_1's
// (d * q) + m, one rounding, the same bits; they take 17 bits, more than a float16's 11. 0.75 bytes a weight.
#define QX_Q4_0 0
#define QX_Q4_1 1
#define QX_Q8_0 2
#define QX_BF16 3
#define QX_Q4_K 4
// QX_I8: any of them (and a GGUF file's Q5_K, Q6_K, Q3_K, Q2_K and Q5_1, whose groups are 16 wide or whose q has
// five bits) in one form, for a linear whose fused parts or layers are stored in several types (QX_IQ4's too,
// their values as int8): per group of 32 k and row, a float32 scale and offset for
// k 0-15 and another pair for k 16-31, then per k the 16 rows' q as int8; w = (q * d) + m, one rounding of an
// exact product (m -0.0 for the forms without one: x + -0.0 is x, a zero's sign kept). 1.5 bytes a weight.
#define QX_I8 5
// QX_F16: QX_BF16's layout for a float16-exact weight (a float16 checkpoint, or a GGUF file's F16 tensor, served in
// float32) as float16s: rebuilt by the exact conversion.
#define QX_F16 6
// QX_IQ4: a GGUF file's IQ4_NL (d * value, d a float16) and IQ4_XS ((d * (sc - 32)) * value, sc six bits a
// sub-block of 32), value one of 16 int8s a nibble indexes: per group of 32 k the 16 rows' float32 scales, then
// Q4's nibbles; w = value * scale, an exact product (at most 11 + 6 + 7 = 24 significant bits), the gguf
// package's. 0.625 bytes a weight.
#define QX_IQ4 7
// QX_BDOT: not a form of the float32 weights but bfloat16 arithmetic (--dtype bfloat16 on a CPU with
// AVX512-BF16): the weights rounded to bfloat16, per pair of k the 16 rows' two values (k even in the low half),
// 1024 bytes a group of 32 k, multiplied by the activations rounded to bfloat16 (bdot_panels below), for every
// row count. 2 bytes a weight, and twice float32's multiply-adds a cycle.
#define QX_BDOT 8
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
// a decode step's Q4_1 linears and Q8_0 head (`bench_kernels_ab --what qx`, session 37, a 2-core Zen 3 without
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
// with it (enginecore.qx.rebuilds). -1 for bad arguments.
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
// a pair of k (the hardware's streams alone left memory idle while a pair's later tiles ran from cache: session
// 35, the embedded model's decode linears, 16 rows 12.0-12.2 -> 9.8-9.9 ms, 1.16-1.19x at 12 rows, 1.04-1.10x
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
// session 36, 2-core Zen 4): Q4_1 6.7 -> 5.7 ms at 1 row, 9.9 -> 7.9 at 4, 19.2 -> 12.5 at 8, 28.0 -> 18.3 at 12,
// 37.2 -> 22.4 at 16 (~188 GFLOP/s, the FMA peak), so enginecore.qx.QX512_MAX_ROWS keeps them to 20 rows.
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

// A decode step of a float32 Llama-family decoder, every layer in one call: each of the T tokens is its own
// request's only query token (kv_lens[i] cached tokens after this step, block table row i). The same kernels
// in the same order, on the same shapes, as torchengine.model's layers run them through Python with these
// kernels (rms_norm with the residual add, panel_gemm or q4_gemm, the bias add, rope, kv_write, decode_attention,
// silu_mul),
// so the hidden states are bit-identical to that path: a token's outputs do not depend on whether its step
// went through here. What this saves is the Python between the kernels (~15 calls a layer, ~150 us a layer
// at one token on a 2-core VM). x [T, H] (the embeddings) -> out [T, H] (residual + the last MLP's output,
// before the final norm). cos / sin are the model's tables [positions, D]; ws: decode_workspace(T) floats.
typedef struct {  // *_w: panel_gemm's panels
    const float *attn_norm, *qkv_w, *qkv_b, *o_w, *mlp_norm, *gate_up_w, *down_w;
    void *key_cache, *value_cache;  // of decode_layers' kv_type
    // --quantization gguf: a linear's 4-bit blocks (NULL: none) for steps of at most *_rows tokens (<= MAX_ROWS),
    // as torchengine.quant.Int4Linear chooses between them and the float32 weight
    const void *qkv_q4, *o_q4, *gate_up_q4, *down_q4;
    int qkv_rows, o_rows, gate_up_rows, down_rows;
    // the float32 weights as stored (a GGUF file's 4-bit blocks, a bfloat16 checkpoint's halves: qx_gemm's
    // panels, NULL: none), the same bits as them, for steps of at most qx_rows tokens; *_qx_kind: their QX_*
    const void *qkv_qx, *o_qx, *gate_up_qx, *down_qx;
    int qx_rows, qkv_qx_kind, o_qx_kind, gate_up_qx_kind, down_qx_kind;
} decode_layer;

// w: the float32 weight in panel_gemm's panels; qx: the same weight's qx_gemm panels (of qx_kind), or NULL
static int linear(const decode_layer *ly, const float *x, int T, int K, const float *w, const void *q4,
                  int q4_rows, const void *qx, int qx_kind, int N, float *y, int nthreads) {
    if (q4 != NULL && T <= q4_rows) return q4_gemm(x, T, K, q4, N, y, nthreads);
    if (qx != NULL && T <= ly->qx_rows) return qx_gemm(x, T, K, qx, N, y, NULL, qx_kind, nthreads);
    return panel_gemm(x, T, K, w, N, y, NULL, nthreads);
}

long decode_workspace(int T, int H, int Hq, int Hkv, int D, int I) {
    return (long)T * (3L * H + (long)(Hq + 2 * Hkv) * D + (long)Hq * D + 3L * I + 2L * D) + T * 2L;
}

// Any step's layers in one call (the torch backend's on a CPU, but a step with prompt logprobs): decode_layers'
// kernels in its order, the attention as TorchAttention's C groups run it: n_dec decode rows (dec_tokens their
// token rows, dec_kv_lens, dec_tables [n_dec, dec_stride]) by decode_attention, n_pre prefill requests
// (pre_start, pre_lens, pre_kv_lens, pre_tables [n_pre, pre_stride]) by prefill_attention, which between them
// hold each of the T tokens once. keep [S] (NULL: all T rows): the rows wanted (distinct); the last layer runs its
// o linear and MLP on them alone (every row's K and V are still written), and out [S, H] holds them in keep's
// order, as Transformer.forward's `keep` gives them. The same bits as the Python layers. ws: decode_workspace(T).
int step_layers(const decode_layer *layers, int L, const float *x, int T, const int64_t *positions, int n_positions,
                const float *rope_cos, const float *rope_sin, const int64_t *slots, int n_dec,
                const int64_t *dec_tokens, const int32_t *dec_kv_lens, const int32_t *dec_tables, int dec_stride,
                int n_pre, const int32_t *pre_start, const int32_t *pre_lens, const int32_t *pre_kv_lens,
                const int32_t *pre_tables, int pre_stride, const int64_t *keep, int S, int block_size, int H, int Hq,
                int Hkv, int D, int I, float eps, float scale, int window, float *ws, float *out, int nthreads,
                int kv_type) {
    if (L <= 0 || T <= 0 || H <= 0 || Hq <= 0 || Hkv <= 0 || D <= 0 || D % 2 || I <= 0 || n_dec < 0 || n_pre < 0)
        return -1;
    const int QKV = (Hq + 2 * Hkv) * D;
    for (int t = 0; t < T; t++)
        if (positions[t] < 0 || positions[t] >= n_positions) return -1;  // past the RoPE tables
    long covered = n_dec;  // every token is one group's query, once (then every attention row is written)
    for (int i = 0; i < n_dec; i++)
        if (dec_tokens[i] < 0 || dec_tokens[i] >= T) return -1;
    for (int i = 0; i < n_pre; i++) {
        if (pre_start[i] < 0 || pre_lens[i] < 1 || pre_start[i] + pre_lens[i] > T) return -1;
        covered += pre_lens[i];
    }
    if (covered != T || (keep != NULL && (S < 1 || S > T))) return -1;
    if (keep != NULL)
        for (int i = 0; i < S; i++)
            if (keep[i] < 0 || keep[i] >= T) return -1;
    // (the first 2T floats: decode_layers' token rows)
    float *residual = ws + 2L * T, *h = residual + (size_t)T * H, *y = h + (size_t)T * H, *qkv = y + (size_t)T * H;
    float *att = qkv + (size_t)T * QKV, *gu = att + (size_t)T * Hq * D, *act = gu + (size_t)T * 2 * I;
    float *cos = act + (size_t)T * I, *sin = cos + (size_t)T * D;
    for (int t = 0; t < T; t++) {
        memcpy(cos + (size_t)t * D, rope_cos + positions[t] * D, sizeof(float) * D);
        memcpy(sin + (size_t)t * D, rope_sin + positions[t] * D, sizeof(float) * D);
    }
    memcpy(residual, x, sizeof(float) * (size_t)T * H);
    int rc = 0, M = T;
    for (int l = 0; l < L && rc == 0; l++) {
        const decode_layer *ly = layers + l;
        // the first layer normalises the embeddings; later ones add the last MLP's output to the stream first
        rc |= rms_norm(l == 0 ? residual : y, T, H, H, l == 0 ? NULL : residual, ly->attn_norm, eps, h);
        rc |= linear(ly, h, T, H, ly->qkv_w, ly->qkv_q4, ly->qkv_rows, ly->qkv_qx, ly->qkv_qx_kind, QKV, qkv, nthreads);
        if (ly->qkv_b != NULL)
            for (int t = 0; t < T; t++)
                for (int j = 0; j < QKV; j++) qkv[(size_t)t * QKV + j] += ly->qkv_b[j];
        rc |= rope(qkv, T, Hq + Hkv, D, QKV, cos, sin);
        rc |= kv_write(qkv + (size_t)Hq * D, qkv + (size_t)(Hq + Hkv) * D, QKV, QKV, T, slots, ly->key_cache,
                       ly->value_cache, Hkv * D, kv_type);
        if (n_dec > 0)
            rc |= decode_attention(qkv, QKV, n_dec, dec_tokens, dec_kv_lens, dec_tables, dec_stride, ly->key_cache,
                                   ly->value_cache, block_size, Hq, Hkv, D, scale, window, att, nthreads, kv_type);
        if (n_pre > 0)
            rc |= prefill_attention(qkv, QKV, n_pre, pre_start, pre_lens, pre_kv_lens, pre_tables, pre_stride,
                                    ly->key_cache, ly->value_cache, block_size, Hq, Hkv, D, scale, window, att,
                                    (long)Hq * D, nthreads, kv_type);
        float *at = att;
        if (l == L - 1 && keep != NULL) {  // the kept rows' stream and attention, in keep's order (qkv is free)
            M = S, at = qkv;
            for (int i = 0; i < S; i++) {
                memcpy(h + (size_t)i * H, residual + (size_t)keep[i] * H, sizeof(float) * H);
                memcpy(at + (size_t)i * Hq * D, att + (size_t)keep[i] * Hq * D, sizeof(float) * Hq * D);
            }
            memcpy(residual, h, sizeof(float) * (size_t)S * H);
        }
        rc |= linear(ly, at, M, Hq * D, ly->o_w, ly->o_q4, ly->o_rows, ly->o_qx, ly->o_qx_kind, H, y, nthreads);
        rc |= rms_norm(y, M, H, H, residual, ly->mlp_norm, eps, h);
        rc |= linear(ly, h, M, H, ly->gate_up_w, ly->gate_up_q4, ly->gate_up_rows, ly->gate_up_qx, ly->gate_up_qx_kind, 2 * I, gu, nthreads);
        rc |= silu_mul(gu, M, I, act);
        rc |= linear(ly, act, M, I, ly->down_w, ly->down_q4, ly->down_rows, ly->down_qx, ly->down_qx_kind, H, y, nthreads);
    }
    for (size_t i = 0; i < (size_t)M * H; i++) out[i] = residual[i] + y[i];
    return rc;
}

// A decode step (each of the T tokens its request's only query: kv_lens [T], block_tables [T, bt_stride]):
// step_layers with T decode rows and every row kept.
int decode_layers(const decode_layer *layers, int L, const float *x, int T, const int64_t *positions,
                  int n_positions, const float *rope_cos, const float *rope_sin, const int64_t *slots, const int32_t *kv_lens,
                  const int32_t *block_tables, int bt_stride, int block_size, int H, int Hq, int Hkv, int D, int I,
                  float eps, float scale, int window, float *ws, float *out, int nthreads, int kv_type) {
    if (T <= 0) return -1;
    int64_t *tokens = (int64_t *)ws;  // T int64 = 2T floats, first: aligned as the workspace is
    for (int t = 0; t < T; t++) tokens[t] = t;
    return step_layers(layers, L, x, T, positions, n_positions, rope_cos, rope_sin, slots, T, tokens, kv_lens,
                       block_tables, bt_stride, 0, NULL, NULL, NULL, NULL, 0, NULL, T, block_size, H, Hq, Hkv, D, I,
                       eps, scale, window, ws, out, nthreads, kv_type);
}
