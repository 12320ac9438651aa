// GGUF's Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and IQ4_NL blocks and Q2_K, Q3_K, Q4_K, Q5_K, Q6_K and IQ4_XS super-blocks
// to float32, the arithmetic of the gguf package's numpy code (what enginecore.model_loader used for every GGUF
// tensor) value for value: Q4_0 d * (q - 8), Q4_1 (d * q) + m,
// Q8_0 q * d, each product and sum rounded to float32 in that order (built with -ffp-contract=off: no fused
// multiply-add). Plain C, no intrinsics: it builds wherever a C compiler does. numpy's version made ~5
// temporaries of every tensor and took ~2.5 s of every start for the embedded model on 2 cores.
//
// Blocks of 32 weights: Q4_0 {f16 d, 16 bytes}, Q4_1 {f16 d, f16 m, 16 bytes}, byte j holding weight j (low
// nibble) and j + 16 (high); Q8_0 {f16 d, 32 int8}.

#include <stdint.h>
#include <string.h>

// IEEE half -> float, exactly (subnormals, infinities and NaNs included)
static float half_to_float(const uint8_t *p) {
    const uint16_t h = (uint16_t)(p[0] | (p[1] << 8));
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000 | (man << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man == 0) {
        bits = sign;
    } else {  // subnormal: normalise
        exp = 113;
        while (!(man & 0x400)) {
            man <<= 1;
            exp--;
        }
        bits = sign | (exp << 23) | ((man & 0x3ff) << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

// IQ4_NL's (and IQ4_XS's) 16 values, a 4-bit index each (the gguf package's table)
static const int8_t iq4_values[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

// Q4_K's and Q5_K's 6-bit scale (j < 8) and min (8 + j) of sub-block j from their 12 bytes s
static int k_scale(const uint8_t *s, int j) {
    if (j < 4) return s[j] & 63;
    if (j < 8) return (s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4);
    j -= 8;
    if (j < 4) return s[j + 4] & 63;
    return (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
}

// type: GGML's type id (2 Q4_0, 3 Q4_1, 6 Q5_0, 7 Q5_1, 8 Q8_0, 20 IQ4_NL: blocks of 32; 10 Q2_K, 11 Q3_K, 12
// Q4_K, 13 Q5_K, 14 Q6_K, 23 IQ4_XS: super-blocks of 256); src: n blocks; out: n blocks' values. Returns 0, or -1
// for a type it does not read. The K-quants as the gguf package computes them: Q4_K / Q5_K a sub-block of 32 (d *
// sc) * q - dmin * mn, Q6_K one of 16 (d * sc) * (q - 32), Q3_K one of 16 (d * (sc - 32)) * q, Q2_K one of 16 (d *
// sc) * q - dmin * mn, IQ4_XS one of 32 (d * (sc - 32)) * value, sc and mn integers made float32 first.
int gguf_dequantize(int type, const uint8_t *src, long n, float *out) {
    switch (type) {
        case 6:  // Q5_0 {f16 d, 4 bytes of fifth bits, 16 bytes}: d * (q - 16)
            for (long b = 0; b < n; b++, src += 22, out += 32) {
                const float d = half_to_float(src);
                const uint32_t qh = (uint32_t)src[2] | (uint32_t)src[3] << 8 | (uint32_t)src[4] << 16 |
                                    (uint32_t)src[5] << 24;
                for (int j = 0; j < 16; j++) {
                    out[j] = d * (float)((int)((src[6 + j] & 0x0f) | ((qh >> j) & 1) << 4) - 16);
                    out[j + 16] = d * (float)((int)((src[6 + j] >> 4) | ((qh >> (j + 16)) & 1) << 4) - 16);
                }
            }
            return 0;
        case 7:  // Q5_1 {f16 d, f16 m, 4 bytes of fifth bits, 16 bytes}: (d * q) + m
            for (long b = 0; b < n; b++, src += 24, out += 32) {
                const float d = half_to_float(src), m = half_to_float(src + 2);
                const uint32_t qh = (uint32_t)src[4] | (uint32_t)src[5] << 8 | (uint32_t)src[6] << 16 |
                                    (uint32_t)src[7] << 24;
                for (int j = 0; j < 16; j++) {
                    const float lo = d * (float)((src[8 + j] & 0x0f) | ((qh >> j) & 1) << 4);
                    const float hi = d * (float)((src[8 + j] >> 4) | ((qh >> (j + 16)) & 1) << 4);
                    out[j] = lo + m;
                    out[j + 16] = hi + m;
                }
            }
            return 0;
        case 10:  // Q2_K {16 bytes of scales (low nibble) and mins (high), 64 bytes of two-bit q, f16 d, f16 dmin}
        case 11:  // Q3_K {32 bytes of high-bit masks, 64 bytes of two-bit q, 12 bytes of six-bit scales, f16 d}
            for (long b = 0; b < n; b++, src += type == 10 ? 84 : 110, out += 256) {
                // group g of 16 values: bits 2 ((g % 8) / 2) of bytes 32 (g / 8) + 16 (g % 2) .. + 16 of the q
                // (and bit g / 2 of mask bytes 16 (g % 2) .. + 16: 4 off the q where it is clear)
                const uint8_t *qs = src + (type == 10 ? 16 : 32);
                const float d = half_to_float(src + (type == 10 ? 80 : 108));
                const float dmin = type == 10 ? half_to_float(src + 82) : 0.f;
                for (int g = 0; g < 16; g++) {
                    const uint8_t *qg = qs + 32 * (g / 8) + 16 * (g % 2);
                    const int shift = 2 * ((g % 8) / 2);
                    float *o = out + 16 * g;
                    if (type == 10) {
                        const float dl = d * (float)(src[g] & 0x0f), ml = dmin * (float)(src[g] >> 4);
                        for (int e = 0; e < 16; e++) o[e] = dl * (float)((qg[e] >> shift) & 3) - ml;
                    } else {  // the scale: the low nibble of byte g % 8 (the high one from 8 on), two high bits
                        const uint8_t *sc = src + 96, *hg = src + 16 * (g % 2);  // scales; the group's mask bytes
                        const int s6 =
                            ((sc[g % 8] >> (4 * (g / 8))) & 0x0f) | ((sc[8 + g % 4] >> (2 * (g / 4))) & 3) << 4;
                        const float dl = d * (float)(s6 - 32);
                        for (int e = 0; e < 16; e++)
                            o[e] = dl * (float)(((qg[e] >> shift) & 3) - (((hg[e] >> (g / 2)) & 1) ? 0 : 4));
                    }
                }
            }
            return 0;
        case 12:  // Q4_K {f16 d, f16 dmin, 12 bytes of scales, 128 bytes}
        case 13:  // Q5_K {f16 d, f16 dmin, 12 bytes of scales, 32 bytes of fifth bits, 128 bytes}
            for (long b = 0; b < n; b++, out += 256) {
                const float d = half_to_float(src), dmin = half_to_float(src + 2);
                const uint8_t *sc = src + 4, *qh = src + 16, *qs = src + (type == 12 ? 16 : 48);
                for (int j = 0; j < 8; j++) {  // sub-block j: nibbles of bytes 32 (j / 2) .. +32, low for even j
                    const float dj = d * (float)k_scale(sc, j), mj = dmin * (float)k_scale(sc, 8 + j);
                    for (int e = 0; e < 32; e++) {
                        int q = (qs[32 * (j / 2) + e] >> (4 * (j % 2))) & 0x0f;
                        if (type == 13) q |= ((qh[e] >> j) & 1) << 4;
                        out[32 * j + e] = dj * (float)q - mj;
                    }
                }
                src += type == 12 ? 144 : 176;
            }
            return 0;
        case 14:  // Q6_K {128 bytes low nibbles, 64 bytes high 2 bits, 16 int8 scales, f16 d}
            for (long b = 0; b < n; b++, src += 210, out += 256) {
                const uint8_t *ql = src, *qh = src + 128;
                const int8_t *sc = (const int8_t *)(src + 192);
                const float d = half_to_float(src + 208);
                for (int h = 0; h < 2; h++)
                    for (int r = 0; r < 128; r++) {
                        const int lo = (ql[64 * h + r % 64] >> (4 * (r / 64))) & 0x0f;
                        const int hi = (qh[32 * h + r % 32] >> (2 * (r / 32))) & 3;
                        const int v = 128 * h + r;
                        out[v] = d * (float)sc[v / 16] * (float)((lo | hi << 4) - 32);
                    }
            }
            return 0;
        case 20:  // IQ4_NL {f16 d, 16 bytes of indices}: d * value
            for (long b = 0; b < n; b++, src += 18, out += 32) {
                const float d = half_to_float(src);
                for (int j = 0; j < 16; j++) {
                    out[j] = d * (float)iq4_values[src[2 + j] & 0x0f];
                    out[j + 16] = d * (float)iq4_values[src[2 + j] >> 4];
                }
            }
            return 0;
        case 23:  // IQ4_XS {f16 d, u16 of the scales' high bits, 4 bytes of their low nibbles, 8 x 16 bytes}
            for (long b = 0; b < n; b++, src += 136, out += 256) {
                const float d = half_to_float(src);
                const int hs = src[2] | src[3] << 8;
                for (int j = 0; j < 8; j++) {  // sub-block j of 32: scale bits 2j of hs over nibble j % 2 of 4 + j / 2
                    const int sc = ((src[4 + j / 2] >> (4 * (j % 2))) & 0x0f) | ((hs >> (2 * j)) & 3) << 4;
                    const float dl = d * (float)(sc - 32);
                    const uint8_t *qs = src + 8 + 16 * j;
                    for (int e = 0; e < 16; e++) {
                        out[32 * j + e] = dl * (float)iq4_values[qs[e] & 0x0f];
                        out[32 * j + e + 16] = dl * (float)iq4_values[qs[e] >> 4];
                    }
                }
            }
            return 0;
        case 2:
            for (long b = 0; b < n; b++, src += 18, out += 32) {
                const float d = half_to_float(src);
                for (int j = 0; j < 16; j++) {
                    out[j] = d * (float)((src[2 + j] & 0x0f) - 8);
                    out[j + 16] = d * (float)((src[2 + j] >> 4) - 8);
                }
            }
            return 0;
        case 3:
            for (long b = 0; b < n; b++, src += 20, out += 32) {
                const float d = half_to_float(src), m = half_to_float(src + 2);
                for (int j = 0; j < 16; j++) {
                    const float lo = d * (float)(src[4 + j] & 0x0f), hi = d * (float)(src[4 + j] >> 4);
                    out[j] = lo + m;
                    out[j + 16] = hi + m;
                }
            }
            return 0;
        case 8:
            for (long b = 0; b < n; b++, src += 34, out += 32) {
                const float d = half_to_float(src);
                for (int j = 0; j < 32; j++) out[j] = (float)(int8_t)src[2 + j] * d;
            }
            return 0;
        default:
            return -1;
    }
}
