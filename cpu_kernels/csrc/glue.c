#include "cpu_kernels.h"
#include "simd.h"

// ---------------------------------------------------------------------------------------------------------
// The float32 glue of a decode step. In torch each of these is several ops of a few microseconds to tens of
// microseconds of dispatch for a few hundred floats of work; a decode step of a 30-layer model runs them
// 30-60 times. Row strides are in floats, so views into a fused qkv output need no copy.



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
