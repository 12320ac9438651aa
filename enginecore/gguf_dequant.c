// GGUF's Q4_0, Q4_1 and Q8_0 blocks to float32, the arithmetic of the gguf package's numpy code (what
// enginecore.model_loader used for every GGUF tensor) value for value: Q4_0 d * (q - 8), Q4_1 (d * q) + m,
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

// type: GGML's type id (2 Q4_0, 3 Q4_1, 8 Q8_0); src: n blocks; out: 32 n floats. Returns 0, or -1 for a type
// it does not read.
int gguf_dequantize(int type, const uint8_t *src, long n, float *out) {
    switch (type) {
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
