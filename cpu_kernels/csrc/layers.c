#include "cpu_kernels.h"
#include "simd.h"

// A decode step of a float32 Llama-family decoder, every layer in one call: each of the T tokens is its own
// request's only query token (kv_lens[i] cached tokens after this step, block table row i). The same kernels
// in the same order, on the same shapes, as torchengine.model's layers run them through Python with these
// kernels (rms_norm with the residual add, panel_gemm or q4_gemm, the bias add, rope, kv_write, decode_attention,
// silu_mul),
// so the hidden states are bit-identical to that path: a token's outputs do not depend on whether its step
// went through here. What this saves is the Python between the kernels (~15 calls a layer, ~150 us a layer
// at one token on a 2-core VM). x [T, H] (the embeddings) -> out [T, H] (residual + the last MLP's output,
// before the final norm). cos / sin are the model's tables [positions, D]; ws: decode_workspace(T) floats.

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
