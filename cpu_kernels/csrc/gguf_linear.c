#include "cpu_kernels.h"
#include "simd.h"

// The torch backend's CPU kernels, x86 with AVX2: 4- and 8-bit GGUF linears, y[M, N] = x[M, K] . w[N, K]^T
// with w in Q4_1 or Q8_0 blocks, and (at the end) the float32 glue of a decode step.
//
// Built and loaded by cpu_kernels/torch_ops.py (gcc -O3 -mavx2 -mfma -mf16c -fopenmp); the OpenMP runtime is
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

#define QK 32

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
