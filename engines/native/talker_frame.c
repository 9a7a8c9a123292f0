/*
 * One talker frame in one native call (CPU, int8 / int4 weights in ONNX Runtime's MatMulNBits
 * layout): the code predictor's 15 passes with their sampling, the sum of the frame's code
 * embeddings, the talker's decoder layers over the paged K/V cache and its final norm.
 * engines/native/__init__.py loads it with ctypes (which releases the GIL for the call) and
 * describes the structs below; engines/models/quantize_native.py fills them from the quantized
 * model; docs/QUANTIZATION.md ("The native frame") says what runs and why.
 *
 * Arithmetic (the same on every instruction set, so AVX-512 VNNI, AVX2 and the scalar fallback
 * give the same bits, and a row's result never depends on its batch):
 *   - weights: blocks of 128 input channels, u8 codes (8 bits; or two 4-bit codes a byte, low
 *     nibble first), an fp32 scale and a u8 zero point per block (MatMulNBits' layout, bits as
 *     engines/models/quantize_nbits.pack_nbits writes them);
 *   - activations: per row and block of 128, scale = max|a| / 127, q = round-half-even(a * 127 /
 *     max|a|) in int8 (ONNX Runtime's accuracy_level 4 quantisation, the same integers);
 *   - a block's products are summed in int32 exactly, in 16 "lanes" (lane l: bytes 4l..4l+3 of
 *     each 64-byte chunk; for 4 bits, the two nibbles of bytes 4l..4l+3), the zero point's
 *     correction -zp * sum(q) added to lane 0; each lane is converted to fp32 and accumulated
 *     over the blocks with one fused multiply-add by (activation scale * weight scale);
 *   - the 16 lanes are summed in one fixed tree (l + l+8, then + 4, + 2, + 1).
 *   Float dot products (norms, attention scores) use the same 16 lanes and tree; e^x (the SiLU, the
 *   softmax) is this file's own (exp_scalar: the same operations on every instruction set, not libm's).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define QBLOCK 128
#define LANES 16
#ifndef PREFETCH
#define PREFETCH 8192 /* bytes ahead of the weight loads, into L1, every line: the 0.6B frame's int8 products at
                          1.04x a plain read (4 KB 1.11x, 12-16 KB 1.07-1.10x, 24 KB 1.12x; none 1.56x; a line
                          in two 1.49x; a second stream into L2 1.38x; benchmarks/bench_qgemv.py, load 1-4) */
#endif

/* ------------------------------------------------------------------ the structs (mirrored in __init__.py) */

typedef struct {
    const uint8_t *w;     /* [n, k / 128, 128] (8 bits) or [n, k / 128, 64] (4 bits) */
    const float *scale;   /* [n * k / 128] */
    const uint8_t *zero;  /* [n * k / 128] (8 bits) or [n * ceil(k / 256)] nibbles, low first (4 bits) */
    const float *bias;    /* [n] or NULL */
    int32_t n, k, bits, pad;
} sv_qlinear;

typedef struct {
    sv_qlinear qkv, o, gate_up, down;
    const float *input_norm, *post_norm, *q_norm, *k_norm; /* q_norm / k_norm: NULL when absent */
} sv_layer;

typedef struct {
    int32_t hidden, heads, kv_heads, head_dim, intermediate, n_layers;
    float eps, qk_eps, attn_scale, pad;
    const sv_layer *layers;
    const float *final_norm;
} sv_decoder;

typedef struct {
    sv_decoder talker, predictor;
    const sv_qlinear *heads;             /* [G - 1] the predictor's lm heads */
    const sv_qlinear *proj;              /* small_to_mtp_projection, NULL when the identity */
    const float *talker_codec_emb;       /* [talker codec vocab, Dt] */
    const float *const *pred_codec_emb;  /* [G - 1] tables [V, Dt]; table g embeds code g + 1 */
    const float *pred_cos, *pred_sin;    /* [G, hd]: RoPE tables, prepared (sin's first half negated) */
    int32_t groups, vocab, talker_hidden, pad;
} sv_model;

typedef struct {
    int32_t rows, run_talker, block_size, table_stride;
    const float *h;               /* [B, Dt] the talker's last hidden state (after its norm) */
    const int64_t *code0;         /* [B] code 0 of the frame, as a codec id */
    const int64_t *forced;        /* [B, G - 1] teacher-forced codes 1.., fed to the passes and the talker
                                     (NULL: the sampled ones) */
    const uint8_t *greedy;        /* [B] */
    const float *temperature;     /* [B] */
    const int64_t *top_k;         /* [B] (<= 0: off) */
    const float *gumbel;          /* [B, G - 1, V] keyed Gumbel noise, or NULL when every row is greedy */
    const float *text;            /* [B, Dt] the text part of the talker's next input */
    const float *cos, *sin;       /* [B, hd] the talker's RoPE rows at each row's position, prepared */
    float *const *pool_k;         /* [talker layers] -> [slots, KVH, hd] */
    float *const *pool_v;
    const int64_t *write_slot;    /* [B] */
    const int64_t *table;         /* [B, table_stride] each row's block table */
    const int64_t *length;        /* [B] positions attended (the row's position + 1) */
    int64_t *codes;               /* out [B, G] */
    float *h_out;                 /* out [B, Dt] */
    float *logits;                /* out [B, G - 1, V], or NULL */
} sv_frame_args;

/* ------------------------------------------------------------------ profiling (built with -DSV_PROFILE only) */

#ifdef SV_PROFILE
#include <x86intrin.h>
static uint64_t prof[4]; /* TSC ticks: the frame, the products (with their quantisation), the attention */
#define PROF_START(v) uint64_t v = __rdtsc()
#define PROF_ADD(i, v) (prof[i] += __rdtsc() - (v))
void sv_profile(uint64_t *out, int reset)
{
    memcpy(out, prof, sizeof(prof));
    if (reset) memset(prof, 0, sizeof(prof));
}
#else
#define PROF_START(v) ((void)0)
#define PROF_ADD(i, v) ((void)0)
#endif

/* ------------------------------------------------------------------ instruction sets */

enum { ISA_SCALAR = 0, ISA_AVX2 = 1, ISA_AVX512VNNI = 2 };

int sv_isa_supported(int isa)
{
    __builtin_cpu_init();
    switch (isa) {
    case ISA_SCALAR:
        return 1;
    case ISA_AVX2:
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    case ISA_AVX512VNNI:
        return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vnni") &&
               __builtin_cpu_supports("fma");
    }
    return 0;
}

typedef struct {
    int8_t *q;      /* [rows, k] (4-bit matrices: each block as its 64 even then 64 odd elements) */
    float *scale;   /* [rows, k / 128] */
    int32_t *sum;   /* [rows, k / 128] sum of q per block */
    int k, bits;
} sv_act;

typedef void (*qgemv_fn)(const sv_qlinear *W, int rows, const sv_act *a, float *y, size_t ystride);
typedef float (*dot_fn)(const float *a, const float *b, int n);
typedef void (*axpy_fn)(float a, const float *x, float *y, int n);

typedef void (*silu_fn)(const float *g, const float *u, float *o, int n);
typedef void (*exps_fn)(const float *x, float m, float *out, int n);

static qgemv_fn qgemv_impl;
static silu_fn silu_impl;
static exps_fn exps_impl;
static dot_fn dot_impl;
static axpy_fn axpy_impl;
static int isa_now = -1;

/* ------------------------------------------------------------------ scalar (the definition) */

static float reduce16_scalar(const float *v)
{
    float t8[8], t4[4], t2[2];
    for (int l = 0; l < 8; l++) t8[l] = v[l] + v[l + 8];
    for (int l = 0; l < 4; l++) t4[l] = t8[l] + t8[l + 4];
    for (int l = 0; l < 2; l++) t2[l] = t4[l] + t4[l + 2];
    return t2[0] + t2[1];
}

static int zero_point(const sv_qlinear *W, int n, int b)
{
    int nb = W->k / QBLOCK;
    if (W->bits == 8) return W->zero[(size_t)n * nb + b];
    int per_row = (nb + 1) / 2;
    uint8_t z = W->zero[(size_t)n * per_row + b / 2];
    return (b & 1) ? (z >> 4) : (z & 15);
}

static void qgemv_scalar(const sv_qlinear *W, int rows, const sv_act *a, float *y, size_t ystride)
{
    const int nb = W->k / QBLOCK, bpb = W->bits == 8 ? QBLOCK : QBLOCK / 2;
    for (int n = 0; n < W->n; n++) {
        const uint8_t *w = W->w + (size_t)n * nb * bpb;
        for (int r = 0; r < rows; r++) {
            const int8_t *q = a->q + (size_t)r * a->k;
            float acc[LANES] = {0};
            for (int b = 0; b < nb; b++) {
                int32_t lane[LANES] = {0};
                const uint8_t *wb = w + (size_t)b * bpb;
                const int8_t *qb = q + (size_t)b * QBLOCK;
                if (W->bits == 8) {
                    for (int c = 0; c < 2; c++)
                        for (int l = 0; l < LANES; l++)
                            for (int j = 0; j < 4; j++) lane[l] += wb[c * 64 + 4 * l + j] * qb[c * 64 + 4 * l + j];
                } else {
                    for (int l = 0; l < LANES; l++)
                        for (int j = 0; j < 4; j++) {
                            uint8_t byte = wb[4 * l + j];
                            lane[l] += (byte & 15) * qb[4 * l + j] + (byte >> 4) * qb[64 + 4 * l + j];
                        }
                }
                lane[0] -= zero_point(W, n, b) * a->sum[(size_t)r * nb + b];
                float s = a->scale[(size_t)r * nb + b] * W->scale[(size_t)n * nb + b];
                for (int l = 0; l < LANES; l++) acc[l] = fmaf((float)lane[l], s, acc[l]);
            }
            float out = reduce16_scalar(acc);
            y[(size_t)r * ystride + n] = W->bias ? out + W->bias[n] : out;
        }
    }
}

static float dot_scalar(const float *a, const float *b, int n)
{
    float acc[LANES] = {0};
    for (int i = 0; i < n; i += LANES)
        for (int l = 0; l < LANES; l++) acc[l] = fmaf(a[i + l], b[i + l], acc[l]);
    return reduce16_scalar(acc);
}

static void axpy_scalar(float a, const float *x, float *y, int n)
{
    for (int i = 0; i < n; i++) y[i] = fmaf(a, x[i], y[i]);
}

/* e^x, the same operations on every instruction set (so the SiLU and the softmax give the same bits on
   each; libm's expf may differ from one library to the next): x = n ln 2 + r (Cody-Waite, two fused
   multiply-adds), e^r by Cephes' degree-5 polynomial with fused multiply-adds (about 1 ulp), times 2^n;
   0 below -87, +inf above 88 */
#define EXP_LO -87.0f
#define EXP_HI 88.0f
#define EXP_LOG2E 1.44269504088896341f
#define EXP_C1 0.693359375f
#define EXP_C2 -2.12194440e-4f
#define EXP_P0 1.9875691500e-4f
#define EXP_P1 1.3981999507e-3f
#define EXP_P2 8.3334519073e-3f
#define EXP_P3 4.1665795894e-2f
#define EXP_P4 1.6666665459e-1f
#define EXP_P5 5.0000001201e-1f

static inline float exp_scalar(float x)
{
    if (x < EXP_LO) return 0.0f;
    if (x > EXP_HI) return INFINITY;
    float n = nearbyintf(x * EXP_LOG2E);
    float r = fmaf(n, -EXP_C1, x);
    r = fmaf(n, -EXP_C2, r);
    float p = fmaf(EXP_P0, r, EXP_P1);
    p = fmaf(p, r, EXP_P2);
    p = fmaf(p, r, EXP_P3);
    p = fmaf(p, r, EXP_P4);
    p = fmaf(p, r, EXP_P5);
    float y = fmaf(p, r * r, r) + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, 4);
    return y * scale;
}

/* o = silu(g) * u: g * (1 / (1 + e^-g)) * u */
static void silu_scalar(const float *g, const float *u, float *o, int n)
{
    for (int i = 0; i < n; i++) {
        float sig = 1.0f / (1.0f + exp_scalar(-g[i]));
        float gs = g[i] * sig;
        o[i] = gs * u[i];
    }
}

/* out = e^(x - m) */
static void exps_scalar(const float *x, float m, float *out, int n)
{
    for (int i = 0; i < n; i++) out[i] = exp_scalar(x[i] - m);
}

/* ------------------------------------------------------------------ AVX2 (+ FMA) */

#define AVX2 __attribute__((target("avx2,fma")))

AVX2 static inline float reduce8x2_avx2(__m256 lo, __m256 hi)
{
    __m256 a = _mm256_add_ps(lo, hi);                                          /* l + l+8 */
    __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1)); /* + 4 */
    __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));                            /* + 2 */
    __m128 d = _mm_add_ss(c, _mm_movehdup_ps(c));                             /* + 1 */
    return _mm_cvtss_f32(d);
}

/* 32 u8 weights x 32 s8 activations -> the 8 lanes of these bytes, in the order [0 1 4 5 2 3 6 7] */
AVX2 static inline __m256i dot32_avx2(__m128i w0, __m128i w1, const int8_t *a)
{
    __m256i p0 = _mm256_madd_epi16(_mm256_cvtepu8_epi16(w0), _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)a)));
    __m256i p1 = _mm256_madd_epi16(_mm256_cvtepu8_epi16(w1),
                                   _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(a + 16))));
    return _mm256_hadd_epi32(p0, p1);
}

AVX2 static void qgemv_avx2(const sv_qlinear *W, int rows, const sv_act *a, float *y, size_t ystride)
{
    const int nb = W->k / QBLOCK, bpb = W->bits == 8 ? QBLOCK : QBLOCK / 2;
    const __m256i unshuffle = _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7);
    const __m128i low4 = _mm_set1_epi8(15);
    for (int n = 0; n < W->n; n++) {
        const uint8_t *w = W->w + (size_t)n * nb * bpb;
        for (int r0 = 0; r0 < rows; r0 += 4) {
            int rr = rows - r0 < 4 ? rows - r0 : 4;
            __m256 lo[4], hi[4];
            for (int r = 0; r < rr; r++) lo[r] = hi[r] = _mm256_setzero_ps();
            for (int b = 0; b < nb; b++) {
                const uint8_t *wb = w + (size_t)b * bpb;
                __m128i v[8];
                if (W->bits == 8) {
                    for (int i = 0; i < 8; i++) v[i] = _mm_loadu_si128((const __m128i *)(wb + 16 * i));
                } else {
                    for (int i = 0; i < 4; i++) {
                        __m128i byte = _mm_loadu_si128((const __m128i *)(wb + 16 * i));
                        v[i] = _mm_and_si128(byte, low4);                            /* even elements */
                        v[4 + i] = _mm_and_si128(_mm_srli_epi16(byte, 4), low4);     /* odd elements */
                    }
                }
                int z = zero_point(W, n, b);
                float sw = W->scale[(size_t)n * nb + b];
                for (int r = 0; r < rr; r++) {
                    const int8_t *qb = a->q + (size_t)(r0 + r) * a->k + (size_t)b * QBLOCK;
                    /* lanes 0..7 and 8..15, each in the hadd order; 8 bits: v[0..3] and v[4..7] are the block's
                       two 64-byte chunks; 4 bits: its low and high nibbles, against the even and odd activations */
                    __m256i l0 = _mm256_add_epi32(dot32_avx2(v[0], v[1], qb), dot32_avx2(v[4], v[5], qb + 64));
                    __m256i l1 = _mm256_add_epi32(dot32_avx2(v[2], v[3], qb + 32), dot32_avx2(v[6], v[7], qb + 96));
                    int32_t corr = -z * a->sum[(size_t)(r0 + r) * nb + b];
                    l0 = _mm256_add_epi32(l0, _mm256_setr_epi32(corr, 0, 0, 0, 0, 0, 0, 0));
                    __m256 s = _mm256_set1_ps(a->scale[(size_t)(r0 + r) * nb + b] * sw);
                    lo[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(l0), s, lo[r]);
                    hi[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(l1), s, hi[r]);
                }
            }
            for (int r = 0; r < rr; r++) {
                float out = reduce8x2_avx2(_mm256_permutevar8x32_ps(lo[r], unshuffle),
                                           _mm256_permutevar8x32_ps(hi[r], unshuffle));
                y[(size_t)(r0 + r) * ystride + n] = W->bias ? out + W->bias[n] : out;
            }
        }
    }
}

AVX2 static float dot_avx2(const float *a, const float *b, int n)
{
    __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
    for (int i = 0; i < n; i += LANES) {
        lo = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), lo);
        hi = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), hi);
    }
    return reduce8x2_avx2(lo, hi);
}

AVX2 static void axpy_avx2(float a, const float *x, float *y, int n)
{
    __m256 va = _mm256_set1_ps(a);
    int i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_fmadd_ps(va, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
    for (; i < n; i++) y[i] = fmaf(a, x[i], y[i]);
}

AVX2 static void silu_avx2(const float *g, const float *u, float *o, int n) { silu_scalar(g, u, o, n); }
AVX2 static void exps_avx2(const float *x, float m, float *out, int n) { exps_scalar(x, m, out, n); }

/* ------------------------------------------------------------------ AVX-512 VNNI */

#define AVX512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma")))

AVX512 static inline float reduce16_avx512(__m512 v)
{
    __m256 a = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
    __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));
    __m128 d = _mm_add_ss(c, _mm_movehdup_ps(c));
    return _mm_cvtss_f32(d);
}

/* rows R (1..4) of one matrix, C (1, 2, 4 or 8) columns at a time: the weights stream from memory once (in
   their order, a few KB ahead of the loads), each block used R times, each activation block loaded once
   for the C columns. Per chunk of up to 16 blocks the zero points' corrections (-zp * sum(q), exact in
   int32) and the scale products (activation scale * weight scale, one fp32 multiply) of every (column,
   row) are computed 16 at a time into small tables; each block's product then starts from its
   correction in lane 0 (an exact int32 sum either way: the same lanes as adding it after the two dot
   products) and is accumulated with one fma whose broadcast operand comes from the table. */
#define CHUNK 16
/* rows r0 .. r0 + R of the quantized activations, as a tile reads them */
typedef struct {
    const int8_t *q[4];
    const float *as[4];
    const int32_t *sum[4];
} act_rows;

static inline __attribute__((always_inline)) void act_rows_at(const sv_act *a, int R, int r0, int nb, act_rows *out)
{
    for (int r = 0; r < R; r++) {
        out->q[r] = a->q + (size_t)(r0 + r) * a->k;
        out->as[r] = a->scale + (size_t)(r0 + r) * nb;
        out->sum[r] = a->sum + (size_t)(r0 + r) * nb;
    }
}

/* a tile's accumulator summed into output column col of a row (its bias added) */
AVX512 static inline __attribute__((always_inline)) void store_product(const sv_qlinear *W, __m512 acc, int col,
                                                                      float *y_row)
{
    float out = reduce16_avx512(acc);
    y_row[col] = W->bias ? out + W->bias[col] : out;
}
AVX512 static inline __attribute__((always_inline)) void qgemv_avx512_tile(const sv_qlinear *W, const int BITS,
                                                                          const int R, const int C, int r0, int n,
                                                                          const sv_act *a, float *y, size_t ystride)
{
    const int nb = W->k / QBLOCK, bpb = BITS == 8 ? QBLOCK : QBLOCK / 2;
    const __m512i low4 = _mm512_set1_epi8(15);
    const __m512i nib_shift = _mm512_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4);
    act_rows rows;
    act_rows_at(a, R, r0, nb, &rows);
    const uint8_t *wc[8];
    for (int c = 0; c < C; c++) wc[c] = W->w + (size_t)(n + c) * nb * bpb;
    __attribute__((aligned(64))) int32_t corr[8][4][CHUNK];
    __attribute__((aligned(64))) float sc[8][4][CHUNK];
    __m512 acc[8][4];
    for (int c = 0; c < C; c++)
        for (int r = 0; r < R; r++) acc[c][r] = _mm512_setzero_ps();
    for (int b0 = 0; b0 < nb; b0 += CHUNK) {
        const int nc = nb - b0 < CHUNK ? nb - b0 : CHUNK;
        const __mmask16 m = (__mmask16)((1u << nc) - 1);
        __m512i sumv[4];
        __m512 asv[4];
        for (int r = 0; r < R; r++) {
            sumv[r] = _mm512_maskz_loadu_epi32(m, rows.sum[r] + b0);
            asv[r] = _mm512_maskz_loadu_ps(m, rows.as[r] + b0);
        }
        for (int c = 0; c < C; c++) {
            __m512i zv;
            if (BITS == 8) {
                zv = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(m, W->zero + (size_t)(n + c) * nb + b0));
            } else { /* two nibbles a byte, low first; b0 is even */
                const int per_row = (nb + 1) / 2;
                __m128i zb = _mm_maskz_loadu_epi8((__mmask16)((1u << ((nc + 1) / 2)) - 1),
                                                  W->zero + (size_t)(n + c) * per_row + b0 / 2);
                zv = _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(zb, zb));
                zv = _mm512_and_si512(_mm512_srlv_epi32(zv, nib_shift), _mm512_set1_epi32(15));
            }
            __m512 swv = _mm512_maskz_loadu_ps(m, W->scale + (size_t)(n + c) * nb + b0);
            for (int r = 0; r < R; r++) {
                _mm512_store_si512(corr[c][r], _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_mullo_epi32(zv, sumv[r])));
                _mm512_store_ps(sc[c][r], _mm512_mul_ps(asv[r], swv));
            }
        }
        for (int j = 0; j < nc; j++) {
            const int b = b0 + j;
            __m512i a0[4], a1[4];
            for (int r = 0; r < R; r++) {
                a0[r] = _mm512_loadu_si512(rows.q[r] + (size_t)b * QBLOCK);
                a1[r] = _mm512_loadu_si512(rows.q[r] + (size_t)b * QBLOCK + 64);
            }
            if (PREFETCH) { /* the tile's bytes as one stream: C blocks' bytes a step, PREFETCH ahead of its start */
                const char *pf = (const char *)wc[0] + PREFETCH + (size_t)b * C * bpb;
                for (int i = 0; i < C * bpb; i += 64) _mm_prefetch(pf + i, _MM_HINT_T0);
            }
            for (int c = 0; c < C; c++) {
                const uint8_t *wb = wc[c] + (size_t)b * bpb;
                __m512i w0, w1;
                if (BITS == 8) {
                    w0 = _mm512_loadu_si512(wb);
                    w1 = _mm512_loadu_si512(wb + 64);
                } else {
                    __m512i byte = _mm512_loadu_si512(wb);
                    __asm__("" : "+v"(byte)); /* one load of the bytes, not one for each nibble's operation */
                    w0 = _mm512_and_si512(byte, low4);
                    w1 = _mm512_and_si512(_mm512_srli_epi16(byte, 4), low4);
                }
                for (int r = 0; r < R; r++) {
                    __m512i t = _mm512_maskz_set1_epi32(1, corr[c][r][j]);
                    float sj = sc[c][r][j];
                    t = _mm512_dpbusd_epi32(t, w0, a0[r]);
                    t = _mm512_dpbusd_epi32(t, w1, a1[r]);
                    acc[c][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), _mm512_set1_ps(sj), acc[c][r]);
                }
            }
        }
    }
    for (int c = 0; c < C; c++)
        for (int r = 0; r < R; r++) store_product(W, acc[c][r], n + c, y + (size_t)(r0 + r) * ystride);
}

#ifndef TILE_C1_8
#define TILE_C1_8 1 /* columns a tile at one row, 8-bit weights (the served int8 step: 2 columns 10 %, 4 15 % slower) */
#endif
#ifndef TILE_C1_4
#define TILE_C1_4 2 /* 4-bit, where OLD_TILE_4 is 0 (the served int4 step: 1 column 19 %, 4 columns 6 % slower) */
#endif
#ifndef TILE_CN
#define TILE_CN 2 /* at 2..4 rows */
#endif

/* each (bits, rows, columns) tile shape in a function of its own: its own registers and loop */
#define TILE_FN(BITS, R, C)                                                                                          \
    AVX512 __attribute__((noinline)) static int qgemv_avx512_##BITS##_##R##x##C(                                     \
        const sv_qlinear *W, int r0, int n, const sv_act *a, float *y, size_t ystride)                                 \
    {                                                                                                                \
        for (; n + C <= W->n; n += C) qgemv_avx512_tile(W, BITS, R, C, r0, n, a, y, ystride);                         \
        return n;                                                                                                    \
    }
#define TILE_FNS(BITS)                                                                                               \
    TILE_FN(BITS, 1, 8) TILE_FN(BITS, 1, 4) TILE_FN(BITS, 1, 2) TILE_FN(BITS, 1, 1)                                  \
    TILE_FN(BITS, 2, 4) TILE_FN(BITS, 2, 2) TILE_FN(BITS, 2, 1)                                                      \
    TILE_FN(BITS, 3, 4) TILE_FN(BITS, 3, 2) TILE_FN(BITS, 3, 1)                                                      \
    TILE_FN(BITS, 4, 4) TILE_FN(BITS, 4, 2) TILE_FN(BITS, 4, 1)                                                      \
                                                                                                                     \
    AVX512 static void qgemv_avx512_##BITS(const sv_qlinear *W, int rows, const sv_act *a, float *y, size_t ystride)  \
    {                                                                                                                \
        for (int r0 = 0; r0 < rows; r0 += 4) {                                                                       \
            int n = 0;                                                                                               \
            switch (rows - r0) {                                                                                     \
            case 1:                                                                                                  \
                if (TILE_C1_##BITS >= 8) n = qgemv_avx512_##BITS##_1x8(W, r0, n, a, y, ystride);                            \
                if (TILE_C1_##BITS >= 4) n = qgemv_avx512_##BITS##_1x4(W, r0, n, a, y, ystride);                            \
                if (TILE_C1_##BITS >= 2) n = qgemv_avx512_##BITS##_1x2(W, r0, n, a, y, ystride);                            \
                qgemv_avx512_##BITS##_1x1(W, r0, n, a, y, ystride);                                                  \
                break;                                                                                               \
            case 2:                                                                                                  \
                if (TILE_CN >= 4) n = qgemv_avx512_##BITS##_2x4(W, r0, n, a, y, ystride);                            \
                if (TILE_CN >= 2) n = qgemv_avx512_##BITS##_2x2(W, r0, n, a, y, ystride);                            \
                qgemv_avx512_##BITS##_2x1(W, r0, n, a, y, ystride);                                                  \
                break;                                                                                               \
            case 3:                                                                                                  \
                if (TILE_CN >= 4) n = qgemv_avx512_##BITS##_3x4(W, r0, n, a, y, ystride);                            \
                if (TILE_CN >= 2) n = qgemv_avx512_##BITS##_3x2(W, r0, n, a, y, ystride);                            \
                qgemv_avx512_##BITS##_3x1(W, r0, n, a, y, ystride);                                                  \
                break;                                                                                               \
            default:                                                                                                 \
                if (TILE_CN >= 4) n = qgemv_avx512_##BITS##_4x4(W, r0, n, a, y, ystride);                            \
                if (TILE_CN >= 2) n = qgemv_avx512_##BITS##_4x2(W, r0, n, a, y, ystride);                            \
                qgemv_avx512_##BITS##_4x1(W, r0, n, a, y, ystride);                                                  \
                break;                                                                                               \
            }                                                                                                        \
        }                                                                                                            \
    }
TILE_FNS(8)
TILE_FNS(4)

/* 4-bit weights: the earlier tile, rows R (1..4) of one matrix, C (1 or 2) columns at a time, each block's
   zero point and scales read as it comes (the same arithmetic as qgemv_avx512_tile). In the served int4
   step it was 1-6 % faster than the tile above (bench_talker, alternating rounds; from L2 the tile above
   is 1.5x faster: the difference is in how its loads meet memory, not understood yet) */
AVX512 static inline __attribute__((always_inline)) void qgemv_avx512_tile_z(const sv_qlinear *W, const int R,
                                                                          const int C, int r0, int n,
                                                                          const sv_act *a, float *y, size_t ystride)
{
    const int nb = W->k / QBLOCK, bpb = W->bits == 8 ? QBLOCK : QBLOCK / 2;
    const __m512i low4 = _mm512_set1_epi8(15);
    act_rows rows;
    act_rows_at(a, R, r0, nb, &rows);
    __m512 acc[2][4];
    for (int c = 0; c < C; c++)
        for (int r = 0; r < R; r++) acc[c][r] = _mm512_setzero_ps();
    for (int b = 0; b < nb; b++) {
        for (int c = 0; c < C; c++) {
            const uint8_t *wb = W->w + ((size_t)(n + c) * nb + b) * bpb;
            _mm_prefetch((const char *)(wb + PREFETCH), _MM_HINT_T0);
            __m512i w0, w1;
            if (W->bits == 8) {
                w0 = _mm512_loadu_si512(wb);
                w1 = _mm512_loadu_si512(wb + 64);
                _mm_prefetch((const char *)(wb + PREFETCH + 64), _MM_HINT_T0);
            } else {
                __m512i byte = _mm512_loadu_si512(wb);
                w0 = _mm512_and_si512(byte, low4);
                w1 = _mm512_and_si512(_mm512_srli_epi16(byte, 4), low4);
            }
            int z = zero_point(W, n + c, b);
            float sw = W->scale[(size_t)(n + c) * nb + b];
            for (int r = 0; r < R; r++) {
                const int8_t *qb = rows.q[r] + (size_t)b * QBLOCK;
                __m512i t = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w0, _mm512_loadu_si512(qb));
                t = _mm512_dpbusd_epi32(t, w1, _mm512_loadu_si512(qb + 64));
                t = _mm512_mask_add_epi32(t, 1, t, _mm512_set1_epi32(-z * rows.sum[r][b]));
                acc[c][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), _mm512_set1_ps(rows.as[r][b] * sw), acc[c][r]);
            }
        }
    }
    for (int c = 0; c < C; c++)
        for (int r = 0; r < R; r++) store_product(W, acc[c][r], n + c, y + (size_t)(r0 + r) * ystride);
}

AVX512 static inline __attribute__((always_inline)) void qgemv_avx512_rows_z(const sv_qlinear *W, const int R, int r0,
                                                                          const sv_act *a, float *y, size_t ystride)
{
    int n = 0;
    for (; n + 2 <= W->n; n += 2) qgemv_avx512_tile_z(W, R, 2, r0, n, a, y, ystride);
    for (; n < W->n; n++) qgemv_avx512_tile_z(W, R, 1, r0, n, a, y, ystride);
}


AVX512 static void qgemv_avx512_z(const sv_qlinear *W, int rows, const sv_act *a, float *y, size_t ystride)
{
    for (int r0 = 0; r0 < rows; r0 += 4) {
        switch (rows - r0) {
        case 1: qgemv_avx512_rows_z(W, 1, r0, a, y, ystride); break;
        case 2: qgemv_avx512_rows_z(W, 2, r0, a, y, ystride); break;
        case 3: qgemv_avx512_rows_z(W, 3, r0, a, y, ystride); break;
        default: qgemv_avx512_rows_z(W, 4, r0, a, y, ystride); break;
        }
    }
}

#ifndef OLD_TILE_4
#define OLD_TILE_4 1
#endif
#ifndef NEW_TILE_ROWS
#define NEW_TILE_ROWS 1 /* 8-bit weights: the new tile up to this many rows (at 2 and 4 rows it was 5-7 % slower
                           than the earlier one, benchmarks/bench_qgemv.py --rows) */
#endif

AVX512 static void qgemv_avx512(const sv_qlinear *W, int rows, const sv_act *a, float *y, size_t ystride)
{
    if (W->bits == 8 && rows <= NEW_TILE_ROWS) qgemv_avx512_8(W, rows, a, y, ystride);
    else if (W->bits == 4 && !OLD_TILE_4) qgemv_avx512_4(W, rows, a, y, ystride);
    else qgemv_avx512_z(W, rows, a, y, ystride);
}

AVX512 static float dot_avx512(const float *a, const float *b, int n)
{
    __m512 acc = _mm512_setzero_ps();
    for (int i = 0; i < n; i += LANES) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
    return reduce16_avx512(acc);
}

AVX512 static void axpy_avx512(float a, const float *x, float *y, int n)
{
    __m512 va = _mm512_set1_ps(a);
    int i = 0;
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(y + i, _mm512_fmadd_ps(va, _mm512_loadu_ps(x + i), _mm512_loadu_ps(y + i)));
    for (; i < n; i++) y[i] = fmaf(a, x[i], y[i]);
}

/* exp_scalar on 16 lanes: the same operations */
AVX512 static inline __m512 exp_avx512(__m512 x)
{
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(EXP_LOG2E)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(-EXP_C1), x);
    r = _mm512_fmadd_ps(n, _mm512_set1_ps(-EXP_C2), r);
    __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(EXP_P0), r, _mm512_set1_ps(EXP_P1));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P2));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P3));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P4));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P5));
    __m512 y = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0f));
    __m512 scale = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
    __m512 e = _mm512_mul_ps(y, scale);
    e = _mm512_mask_mov_ps(e, _mm512_cmp_ps_mask(x, _mm512_set1_ps(EXP_LO), _CMP_LT_OQ), _mm512_setzero_ps());
    return _mm512_mask_mov_ps(e, _mm512_cmp_ps_mask(x, _mm512_set1_ps(EXP_HI), _CMP_GT_OQ), _mm512_set1_ps(INFINITY));
}

AVX512 static void silu_avx512(const float *g, const float *u, float *o, int n)
{
    int i = 0;
    for (; i + 16 <= n; i += 16) {
        __m512 gv = _mm512_loadu_ps(g + i);
        __m512 e = exp_avx512(_mm512_sub_ps(_mm512_setzero_ps(), gv));
        __m512 sig = _mm512_div_ps(_mm512_set1_ps(1.0f), _mm512_add_ps(_mm512_set1_ps(1.0f), e));
        _mm512_storeu_ps(o + i, _mm512_mul_ps(_mm512_mul_ps(gv, sig), _mm512_loadu_ps(u + i)));
    }
    silu_scalar(g + i, u + i, o + i, n - i);
}

AVX512 static void exps_avx512(const float *x, float m, float *out, int n)
{
    int i = 0;
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(out + i, exp_avx512(_mm512_sub_ps(_mm512_loadu_ps(x + i), _mm512_set1_ps(m))));
    exps_scalar(x + i, m, out + i, n - i);
}

/* ------------------------------------------------------------------ dispatch */

int sv_set_isa(int isa)
{
    if (!sv_isa_supported(isa)) return -1;
    if (isa == ISA_AVX512VNNI) {
        qgemv_impl = qgemv_avx512; dot_impl = dot_avx512; axpy_impl = axpy_avx512;
        silu_impl = silu_avx512; exps_impl = exps_avx512;
    } else if (isa == ISA_AVX2) {
        qgemv_impl = qgemv_avx2; dot_impl = dot_avx2; axpy_impl = axpy_avx2;
        silu_impl = silu_avx2; exps_impl = exps_avx2;
    } else {
        qgemv_impl = qgemv_scalar; dot_impl = dot_scalar; axpy_impl = axpy_scalar;
        silu_impl = silu_scalar; exps_impl = exps_scalar;
    }
    isa_now = isa;
    return 0;
}

int sv_get_isa(void)
{
    if (isa_now < 0)
        sv_set_isa(sv_isa_supported(ISA_AVX512VNNI) ? ISA_AVX512VNNI : sv_isa_supported(ISA_AVX2) ? ISA_AVX2 : ISA_SCALAR);
    return isa_now;
}

/* ------------------------------------------------------------------ activations */

/* x [rows, k] (row stride xstride) -> int8 blocks, scales and sums (for a ``bits``-bit matrix) */
static void quantize_rows_scalar(const float *x, size_t xstride, int rows, int k, int bits, sv_act *a)
{
    const int nb = k / QBLOCK;
    a->k = k;
    a->bits = bits;
    for (int r = 0; r < rows; r++) {
        const float *xr = x + (size_t)r * xstride;
        for (int b = 0; b < nb; b++) {
            const float *xb = xr + (size_t)b * QBLOCK;
            float amax = 0.0f;
            for (int i = 0; i < QBLOCK; i++) {
                float v = fabsf(xb[i]);
                amax = v > amax ? v : amax;
            }
            float inv = amax != 0.0f ? 127.0f / amax : 0.0f;
            int8_t *qb = a->q + (size_t)r * k + (size_t)b * QBLOCK;
            int32_t sum = 0;
            for (int i = 0; i < QBLOCK; i++) {
                int v = (int)nearbyintf(xb[i] * inv); /* the default rounding: half to even */
                int at = bits == 8 ? i : (i & 1) * 64 + i / 2;
                qb[at] = (int8_t)v;
                sum += v;
            }
            a->scale[(size_t)r * nb + b] = amax / 127.0f;
            a->sum[(size_t)r * nb + b] = sum;
        }
    }
}

/* the same integers with AVX-512: the block's max |x| (exact in any order), the same fp32 multiply by
   127 / max, the same rounding (the default mode, half to even), int32 sums (exact) */
AVX512 static void quantize_rows_avx512(const float *x, size_t xstride, int rows, int k, int bits, sv_act *a)
{
    const int nb = k / QBLOCK;
    const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
    a->k = k;
    a->bits = bits;
    for (int r = 0; r < rows; r++) {
        const float *xr = x + (size_t)r * xstride;
        for (int b = 0; b < nb; b++) {
            const float *xb = xr + (size_t)b * QBLOCK;
            __m512 v[8];
            __m512 m = _mm512_setzero_ps();
            for (int i = 0; i < 8; i++) {
                v[i] = _mm512_loadu_ps(xb + 16 * i);
                m = _mm512_max_ps(m, _mm512_abs_ps(v[i]));
            }
            float amax = _mm512_reduce_max_ps(m);
            float inv = amax != 0.0f ? 127.0f / amax : 0.0f;
            const __m512 vinv = _mm512_set1_ps(inv);
            int8_t *qb = a->q + (size_t)r * k + (size_t)b * QBLOCK;
            __m512i sum = _mm512_setzero_si512();
            __m512i qi[8];
            for (int i = 0; i < 8; i++) {
                qi[i] = _mm512_cvtps_epi32(_mm512_mul_ps(v[i], vinv));
                sum = _mm512_add_epi32(sum, qi[i]);
            }
            if (bits == 8) {
                for (int i = 0; i < 8; i++) _mm_storeu_si128((__m128i *)(qb + 16 * i), _mm512_cvtepi32_epi8(qi[i]));
            } else { /* each block as its 64 even then 64 odd elements */
                for (int i = 0; i < 4; i++) {
                    _mm_storeu_si128((__m128i *)(qb + 16 * i),
                                     _mm512_cvtepi32_epi8(_mm512_permutex2var_epi32(qi[2 * i], even, qi[2 * i + 1])));
                    _mm_storeu_si128((__m128i *)(qb + 64 + 16 * i),
                                     _mm512_cvtepi32_epi8(_mm512_permutex2var_epi32(qi[2 * i], odd, qi[2 * i + 1])));
                }
            }
            a->scale[(size_t)r * nb + b] = amax / 127.0f;
            a->sum[(size_t)r * nb + b] = _mm512_reduce_add_epi32(sum);
        }
    }
}

static void quantize_rows(const float *x, size_t xstride, int rows, int k, int bits, sv_act *a)
{
    if (isa_now == ISA_AVX512VNNI) quantize_rows_avx512(x, xstride, rows, k, bits, a);
    else quantize_rows_scalar(x, xstride, rows, k, bits, a);
}

/* ------------------------------------------------------------------ the small ops */

static void rms_norm(const float *x, const float *w, int n, float eps, float *out)
{
    float ms = dot_impl(x, x, n) / (float)n;
    float denom = sqrtf(ms + eps);
    for (int i = 0; i < n; i++) out[i] = x[i] / denom * w[i];
}

/* x * cos + rotate_half(x) * sin over one head, with sin's first half negated (prepare_rope) */
static void rope(float *x, const float *cos, const float *sin, int hd)
{
    float tmp[512];
    int h = hd / 2;
    memcpy(tmp, x, sizeof(float) * hd);
    for (int i = 0; i < hd; i++) {
        float rolled = i < h ? tmp[i + h] : tmp[i - h];
        float a = tmp[i] * cos[i], b = rolled * sin[i];
        x[i] = a + b;
    }
}

static int argmax_first(const float *x, int n)
{
    int best = 0;
    for (int i = 1; i < n; i++)
        if (x[i] > x[best]) best = i;
    return best;
}

static float kth_largest(float *v, int n, int k) /* k >= 1; reorders v */
{
    int lo = 0, hi = n - 1, want = k - 1;
    while (lo < hi) {
        float pivot = v[(lo + hi) / 2];
        int i = lo, j = hi;
        while (i <= j) {
            while (v[i] > pivot) i++;
            while (v[j] < pivot) j--;
            if (i <= j) {
                float t = v[i]; v[i] = v[j]; v[j] = t;
                i++; j--;
            }
        }
        if (want <= j) hi = j;
        else if (want >= i) lo = i;
        else break;
    }
    return v[want];
}

/* sample_rows (engines/models/sampling.py) for one row and group: top-k, temperature, Gumbel-max */
static int sample(const float *logits, int V, int greedy, float temperature, int64_t top_k, const float *gumbel,
                  float *scratch)
{
    if (greedy || gumbel == NULL) return argmax_first(logits, V);
    int k = top_k > 0 && top_k < V ? (int)top_k : V;
    if (k < 1) k = 1;
    memcpy(scratch, logits, sizeof(float) * V);
    float kth = kth_largest(scratch, V, k);
    float t = temperature > 1e-5f ? temperature : 1e-5f;
    for (int i = 0; i < V; i++) {
        float x = logits[i] < kth ? -INFINITY : logits[i];
        scratch[i] = x / t + gumbel[i];
    }
    return argmax_first(scratch, V);
}

/* ------------------------------------------------------------------ one decoder layer */

typedef struct {
    float *const *pool_k, *const *pool_v; /* per layer: [slots, KVH, hd] */
    const int64_t *table;                 /* paged (talker): each token's row table; NULL: slot = row * G + position */
    int table_stride, block_size, groups;
} sv_kv;

static inline int64_t slot_of(const sv_kv *kv, int row, int pos)
{
    if (kv->table == NULL) return (int64_t)row * kv->groups + pos;
    return kv->table[(size_t)row * kv->table_stride + pos / kv->block_size] * kv->block_size + pos % kv->block_size;
}

typedef struct {
    float *xn, *qkv, *attn, *gu, *act, *scores;
    sv_act a;
} sv_work;

/* x [T, D] in place; token t: row tok_row[t] at position tok_pos[t], written at write_slot[t], RoPE rows
   cos/sin [T, hd] */
static void layer_forward(const sv_decoder *dec, int li, int T, float *x, const int *tok_row, const int *tok_pos,
                          const int64_t *write_slot, const float *cos, const float *sin, const sv_kv *kv, sv_work *w)
{
    const sv_layer *L = &dec->layers[li];
    const int D = dec->hidden, H = dec->heads, KVH = dec->kv_heads, hd = dec->head_dim, I = dec->intermediate;
    const int qkv_w = (H + 2 * KVH) * hd, group = H / KVH;
    float *pk = kv->pool_k[li], *pv = kv->pool_v[li];

    for (int t = 0; t < T; t++) rms_norm(x + (size_t)t * D, L->input_norm, D, dec->eps, w->xn + (size_t)t * D);
    {
    PROF_START(t_q);
    quantize_rows(w->xn, D, T, D, L->qkv.bits, &w->a);
    qgemv_impl(&L->qkv, T, &w->a, w->qkv, qkv_w);
    PROF_ADD(1, t_q);
    }
    for (int t = 0; t < T; t++) {
        float *q = w->qkv + (size_t)t * qkv_w, *k = q + H * hd, *v = k + KVH * hd;
        for (int h = 0; h < H; h++) {
            if (L->q_norm) rms_norm(q + h * hd, L->q_norm, hd, dec->qk_eps, q + h * hd);
            rope(q + h * hd, cos + (size_t)t * hd, sin + (size_t)t * hd, hd);
        }
        for (int h = 0; h < KVH; h++) {
            if (L->k_norm) rms_norm(k + h * hd, L->k_norm, hd, dec->qk_eps, k + h * hd);
            rope(k + h * hd, cos + (size_t)t * hd, sin + (size_t)t * hd, hd);
        }
        memcpy(pk + write_slot[t] * KVH * hd, k, sizeof(float) * KVH * hd);
        memcpy(pv + write_slot[t] * KVH * hd, v, sizeof(float) * KVH * hd);
    }
    PROF_START(t_att);
    for (int t = 0; t < T; t++) { /* every token's K/V is written before any attends (a row's 2 positions) */
        const float *q = w->qkv + (size_t)t * qkv_w;
        float *out = w->attn + (size_t)t * H * hd;
        const int n = tok_pos[t] + 1;
        memset(out, 0, sizeof(float) * H * hd);
        /* positions outer, heads inner: each position's K (then V) rows of every head read once, in their
           order in memory (a block of the paged cache holds consecutive positions); every head's scores,
           softmax and sums computed as that head alone computes them (the same operations, in the same
           order of positions) */
        float *sc = w->scores; /* [H, n] */
        float m[256], total[256];
        for (int h = 0; h < H; h++) m[h] = -INFINITY, total[h] = 0.0f;
        for (int p = 0; p < n; p++) {
            const float *kp = pk + slot_of(kv, tok_row[t], p) * KVH * hd;
            for (int h = 0; h < H; h++) {
                float v = dot_impl(q + h * hd, kp + (h / group) * hd, hd) * dec->attn_scale;
                sc[(size_t)h * n + p] = v;
                m[h] = v > m[h] ? v : m[h];
            }
        }
        for (int h = 0; h < H; h++) {
            exps_impl(sc + (size_t)h * n, m[h], sc + (size_t)h * n, n);
            for (int p = 0; p < n; p++) total[h] += sc[(size_t)h * n + p];
        }
        for (int p = 0; p < n; p++) {
            const float *vp = pv + slot_of(kv, tok_row[t], p) * KVH * hd;
            for (int h = 0; h < H; h++) axpy_impl(sc[(size_t)h * n + p] / total[h], vp + (h / group) * hd, out + h * hd, hd);
        }
    }
    PROF_ADD(2, t_att);
    {
    PROF_START(t_q);
    quantize_rows(w->attn, H * hd, T, H * hd, L->o.bits, &w->a);
    qgemv_impl(&L->o, T, &w->a, w->xn, D);
    PROF_ADD(1, t_q);
    }
    for (size_t i = 0; i < (size_t)T * D; i++) x[i] = x[i] + w->xn[i];
    for (int t = 0; t < T; t++) rms_norm(x + (size_t)t * D, L->post_norm, D, dec->eps, w->xn + (size_t)t * D);
    {
    PROF_START(t_q);
    quantize_rows(w->xn, D, T, D, L->gate_up.bits, &w->a);
    qgemv_impl(&L->gate_up, T, &w->a, w->gu, 2 * I);
    PROF_ADD(1, t_q);
    }
    for (int t = 0; t < T; t++) {
        const float *g = w->gu + (size_t)t * 2 * I, *u = g + I;
        float *o = w->act + (size_t)t * I;
        silu_impl(g, u, o, I);
    }
    {
    PROF_START(t_q);
    quantize_rows(w->act, I, T, I, L->down.bits, &w->a);
    qgemv_impl(&L->down, T, &w->a, w->xn, D);
    PROF_ADD(1, t_q);
    }
    for (size_t i = 0; i < (size_t)T * D; i++) x[i] = x[i] + w->xn[i];
}

/* ------------------------------------------------------------------ the frame */

static size_t max_i(size_t a, size_t b) { return a > b ? a : b; }

int sv_frame(const sv_model *m, const sv_frame_args *args)
{
    PROF_START(t_frame);
    if (isa_now < 0) sv_get_isa();
    const int B = args->rows, G = m->groups, V = m->vocab, Dt = m->talker_hidden;
    const sv_decoder *pd = &m->predictor, *td = &m->talker;
    const int Dp = pd->hidden, T = 2 * B, hdp = pd->head_dim;
    /* scratch: every buffer sized for the larger of the two decoders */
    size_t D = max_i(Dt, Dp), HD = max_i((size_t)td->heads * td->head_dim, (size_t)pd->heads * pd->head_dim);
    size_t QKV = max_i((size_t)(td->heads + 2 * td->kv_heads) * td->head_dim,
                       (size_t)(pd->heads + 2 * pd->kv_heads) * pd->head_dim);
    size_t I = max_i(td->intermediate, pd->intermediate);
    size_t K = max_i(max_i(D, HD), I);
    size_t positions = 1;
    if (args->run_talker)
        for (int r = 0; r < B; r++) positions = max_i(positions, (size_t)args->length[r]);
    positions = max_i(positions, (size_t)G);
    size_t pred_cache = (size_t)B * G * pd->kv_heads * hdp;
    size_t heads = max_i(td->heads, pd->heads);
    if (heads > 256) return -1; /* the attention's per-head state (layer_forward) */
    size_t floats = T * (D /* x */ + D /* xn */ + QKV + HD + 2 * I + I + D /* x_in */) + heads * positions + 2 * (size_t)V
                    + 2 * (size_t)pd->n_layers * pred_cache + T * (size_t)K / QBLOCK + 2 * (size_t)T * hdp;
    float *buf = malloc(sizeof(float) * floats);
    int8_t *qbuf = malloc((size_t)T * K);
    int32_t *sums = malloc(sizeof(int32_t) * T * (K / QBLOCK + 1));
    float **kcache = malloc(sizeof(float *) * 2 * pd->n_layers);
    int *tok = malloc(sizeof(int) * 2 * T);
    int64_t *wslot = malloc(sizeof(int64_t) * T);
    if (!buf || !qbuf || !sums || !kcache || !tok || !wslot) {
        free(buf); free(qbuf); free(sums); free(kcache); free(tok); free(wslot);
        return -1;
    }
    float *x = buf, *x_in = x + T * D;
    sv_work w;
    w.xn = x_in + T * D;
    w.qkv = w.xn + T * D;
    w.attn = w.qkv + T * QKV;
    w.gu = w.attn + T * HD;
    w.act = w.gu + T * 2 * I;
    w.scores = w.act + T * I;
    float *logits = w.scores + heads * positions, *scratch = logits + V;
    float *cache_base = scratch + V;
    for (int l = 0; l < 2 * pd->n_layers; l++) kcache[l] = cache_base + (size_t)l * pred_cache;
    w.a.scale = cache_base + 2 * (size_t)pd->n_layers * pred_cache;
    float *pcos = w.a.scale + T * K / QBLOCK, *psin = pcos + (size_t)T * hdp;
    w.a.q = qbuf;
    w.a.sum = sums;
    int *tok_row = tok, *tok_pos = tok + T;
    sv_kv pkv = {kcache, kcache + pd->n_layers, NULL, 0, 0, G};

    /* ---- the code predictor: pass 0 over [h, embedding(code 0)], then one position per code */
    for (int r = 0; r < B; r++) {
        args->codes[(size_t)r * G] = args->code0[r];
        memcpy(x_in + (size_t)(2 * r) * Dt, args->h + (size_t)r * Dt, sizeof(float) * Dt);
        memcpy(x_in + (size_t)(2 * r + 1) * Dt, m->talker_codec_emb + args->code0[r] * Dt, sizeof(float) * Dt);
    }
    for (int g = 1; g < G; g++) {
        int n_tok = g == 1 ? T : B, per_row = g == 1 ? 2 : 1;
        if (g > 1)
            for (int r = 0; r < B; r++) {
                int64_t code = args->forced ? args->forced[(size_t)r * (G - 1) + g - 2] : args->codes[(size_t)r * G + g - 1];
                memcpy(x_in + (size_t)r * Dt, m->pred_codec_emb[g - 2] + code * Dt, sizeof(float) * Dt);
            }
        if (m->proj) {
            quantize_rows(x_in, Dt, n_tok, Dt, m->proj->bits, &w.a);
            qgemv_impl(m->proj, n_tok, &w.a, x, Dp);
        } else {
            memcpy(x, x_in, sizeof(float) * n_tok * Dp);
        }
        for (int t = 0; t < n_tok; t++) {
            tok_row[t] = t / per_row;
            tok_pos[t] = g == 1 ? t % 2 : g;
            wslot[t] = slot_of(&pkv, tok_row[t], tok_pos[t]);
            memcpy(pcos + (size_t)t * hdp, m->pred_cos + (size_t)tok_pos[t] * hdp, sizeof(float) * hdp);
            memcpy(psin + (size_t)t * hdp, m->pred_sin + (size_t)tok_pos[t] * hdp, sizeof(float) * hdp);
        }
        for (int l = 0; l < pd->n_layers; l++) layer_forward(pd, l, n_tok, x, tok_row, tok_pos, wslot, pcos, psin, &pkv, &w);
        for (int r = 0; r < B; r++) { /* the row's last position: final norm, head g - 1, the sampled code */
            const float *last = x + (size_t)(r * per_row + per_row - 1) * Dp;
            rms_norm(last, pd->final_norm, Dp, pd->eps, w.xn);
            {
            PROF_START(t_q);
            quantize_rows(w.xn, Dp, 1, Dp, m->heads[g - 1].bits, &w.a);
            qgemv_impl(&m->heads[g - 1], 1, &w.a, logits, V);
            PROF_ADD(1, t_q);
            }
            if (args->logits) memcpy(args->logits + ((size_t)r * (G - 1) + g - 1) * V, logits, sizeof(float) * V);
            const float *noise = args->gumbel ? args->gumbel + ((size_t)r * (G - 1) + g - 1) * V : NULL;
            args->codes[(size_t)r * G + g] =
                sample(logits, V, args->greedy[r], args->temperature[r], args->top_k[r], noise, scratch);
        }
    }

    /* ---- the talker: the sum of the frame's code embeddings (+ its text part), its layers, its norm */
    if (args->run_talker) {
        for (int r = 0; r < B; r++) {
            float *xr = x + (size_t)r * Dt;
            const int64_t *codes = args->codes + (size_t)r * G;
            memcpy(xr, m->talker_codec_emb + codes[0] * Dt, sizeof(float) * Dt);
            for (int g = 1; g < G; g++) { /* teacher forcing: the talker is fed the forced frame too */
                int64_t code = args->forced ? args->forced[(size_t)r * (G - 1) + g - 1] : codes[g];
                const float *e = m->pred_codec_emb[g - 1] + code * Dt;
                for (int i = 0; i < Dt; i++) xr[i] = xr[i] + e[i];
            }
            const float *text = args->text + (size_t)r * Dt;
            for (int i = 0; i < Dt; i++) xr[i] = xr[i] + text[i];
            tok_row[r] = r;
            tok_pos[r] = (int)args->length[r] - 1;
        }
        sv_kv tkv = {args->pool_k, args->pool_v, args->table, args->table_stride, args->block_size, 0};
        for (int l = 0; l < td->n_layers; l++)
            layer_forward(td, l, B, x, tok_row, tok_pos, args->write_slot, args->cos, args->sin, &tkv, &w);
        for (int r = 0; r < B; r++) rms_norm(x + (size_t)r * Dt, td->final_norm, Dt, td->eps, args->h_out + (size_t)r * Dt);
    }
    free(buf); free(qbuf); free(sums); free(kcache); free(tok); free(wslot);
    PROF_ADD(0, t_frame);
    return 0;
}

/* ------------------------------------------------------------------ kernels alone (tests, benchmarks) */

/* y [rows, n] = the quantized product of x [rows, k] with W (its arithmetic above) */
int sv_qlinear_forward(const sv_qlinear *W, int rows, const float *x, float *y)
{
    if (isa_now < 0) sv_get_isa();
    sv_act a;
    int nb = W->k / QBLOCK;
    a.q = malloc((size_t)rows * W->k);
    a.scale = malloc(sizeof(float) * rows * nb);
    a.sum = malloc(sizeof(int32_t) * rows * nb);
    if (!a.q || !a.scale || !a.sum) {
        free(a.q); free(a.scale); free(a.sum);
        return -1;
    }
    quantize_rows(x, W->k, rows, W->k, W->bits, &a);
    qgemv_impl(W, rows, &a, y, W->n);
    free(a.q); free(a.scale); free(a.sum);
    return 0;
}

/* out [n] = e^(x - m) as the frame's softmax and SiLU compute it (tests) */
void sv_exps(const float *x, float m, float *out, int n)
{
    if (isa_now < 0) sv_get_isa();
    exps_impl(x, m, out, n);
}

/* the bytes' plain read, as fast as this core streams them: the floor a kernel is measured against */
AVX512 static uint64_t read_avx512(const uint8_t *p, size_t n)
{
    __m512i acc = _mm512_setzero_si512();
    for (size_t i = 0; i + 256 <= n; i += 256) {
        acc = _mm512_xor_si512(acc, _mm512_loadu_si512(p + i));
        acc = _mm512_xor_si512(acc, _mm512_loadu_si512(p + i + 64));
        acc = _mm512_xor_si512(acc, _mm512_loadu_si512(p + i + 128));
        acc = _mm512_xor_si512(acc, _mm512_loadu_si512(p + i + 192));
    }
    return (uint64_t)_mm512_reduce_add_epi64(acc);
}

AVX2 static uint64_t read_avx2(const uint8_t *p, size_t n)
{
    __m256i acc = _mm256_setzero_si256();
    for (size_t i = 0; i + 128 <= n; i += 128) {
        acc = _mm256_xor_si256(acc, _mm256_loadu_si256((const __m256i *)(p + i)));
        acc = _mm256_xor_si256(acc, _mm256_loadu_si256((const __m256i *)(p + i + 32)));
        acc = _mm256_xor_si256(acc, _mm256_loadu_si256((const __m256i *)(p + i + 64)));
        acc = _mm256_xor_si256(acc, _mm256_loadu_si256((const __m256i *)(p + i + 96)));
    }
    int64_t lanes[4];
    _mm256_storeu_si256((__m256i *)lanes, acc);
    return (uint64_t)(lanes[0] ^ lanes[1] ^ lanes[2] ^ lanes[3]);
}

uint64_t sv_read_bytes(const uint8_t *p, size_t n)
{
    int isa = sv_get_isa();
    if (isa == ISA_AVX512VNNI) return read_avx512(p, n);
    if (isa == ISA_AVX2) return read_avx2(p, n);
    uint64_t acc = 0;
    for (size_t i = 0; i + 8 <= n; i += 8) {
        uint64_t v;
        memcpy(&v, p + i, 8);
        acc ^= v;
    }
    return acc;
}

/* benchmarks (benchmarks/bench_qgemv.py): the products of `count` matrices in turn, one thread, with the
   input x [rows, kmax] quantized for each as the frame does (quantize != 0) or once per width (0: the
   products alone); y [rows, nmax] */
int sv_bench_products(const sv_qlinear *Ws, int count, int rows, const float *x, int kmax, float *y, int nmax,
                      int quantize)
{
    if (isa_now < 0) sv_get_isa();
    sv_act a;
    a.q = malloc((size_t)rows * kmax);
    a.scale = malloc(sizeof(float) * rows * (kmax / QBLOCK));
    a.sum = malloc(sizeof(int32_t) * rows * (kmax / QBLOCK));
    if (!a.q || !a.scale || !a.sum) {
        free(a.q); free(a.scale); free(a.sum);
        return -1;
    }
    int k_now = -1, bits_now = -1;
    for (int i = 0; i < count; i++) {
        if (quantize || Ws[i].k != k_now || Ws[i].bits != bits_now)
            quantize_rows(x, kmax, rows, Ws[i].k, Ws[i].bits, &a);
        k_now = Ws[i].k;
        bits_now = Ws[i].bits;
        qgemv_impl(&Ws[i], rows, &a, y, nmax);
    }
    free(a.q); free(a.scale); free(a.sum);
    return 0;
}

/* the plain read of the same matrices' bytes (codes, scales, zero points) */
uint64_t sv_bench_read(const sv_qlinear *Ws, int count)
{
    uint64_t acc = 0;
    for (int i = 0; i < count; i++) {
        const sv_qlinear *W = &Ws[i];
        size_t nb = W->k / QBLOCK;
        acc ^= sv_read_bytes(W->w, (size_t)W->n * W->k * W->bits / 8);
        acc ^= sv_read_bytes((const uint8_t *)W->scale, sizeof(float) * W->n * nb);
        acc ^= sv_read_bytes(W->zero, W->bits == 8 ? W->n * nb : W->n * ((nb + 1) / 2));
    }
    return acc;
}

/* a module too, so that the import system finds the library (engines/native/__init__.py opens it with ctypes) */
static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_talker_frame", "see talker_frame.c", -1, NULL};

PyMODINIT_FUNC PyInit__talker_frame(void) { return PyModule_Create(&module); }
