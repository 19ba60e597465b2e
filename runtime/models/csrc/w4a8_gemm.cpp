// CPU GEMM kernels for --quantization w4a8: GGUF-style blocked weights times int8 activations.
//
// Weights come in blocks of 32 along the input dim, as in GGUF:
//   Q4_1 (linear layers): w = q * d + m, q in 0..15, d and m fp16 per block;
//   Q8_0 (LM head):       w = q * d, q int8, d fp16 per block (stored here as q + 128, unsigned).
// Activations are quantized per call, per row and block of 32: a = qa * da (qa int8 in -127..127), with
// asum = sum(qa) and sa = da * asum. One output n of row r is then
//   Q4_1: sum_b  d_nb * da_rb * dot(q_nb, qa_rb) + m_nb * sa_rb
//   Q8_0: sum_b  d_nb * da_rb * (dot(q_nb + 128, qa_rb) - 128 * asum_rb)
// the arithmetic llama.cpp uses for the same file, reading 0.625 (Q4_1) / 1.06 (Q8_0) bytes per weight.
//
// Layout (built by runtime/models/w4a8.py): weight rows are interleaved in groups of 16 so that one 512-bit
// u8 x s8 dot-product instruction (vpdpbusd) advances 16 outputs by 4 inputs each, or with AVX2 one vpmaddubsw
// + vpmaddwd pair advances 8 (each 64-byte quad row is read as two 256-bit halves). For a group g, block b:
//   Q4_1 qs[g][b][p][i][t] (p, t < 4, i < 16): GGUF's nibble byte 4p + t of row 16g + i, i.e. low nibble =
//        element 4p + t, high nibble = element 16 + 4p + t;
//   Q8_0 qs[g][b][j][i][t] (j < 8): element 4j + t of row 16g + i, plus 128;
//   d, m [g][b][i] fp16.
// Rows past out_features are zero padding.
//
// Three builds, one layout and the same int32 block dots: AVX512-VNNI, else AVX2 + FMA + F16C (vpmaddubsw
// saturates at int16: Q4_1's 16 products of <= 15 * 127 per lane stay below 32767, and Q8_0 multiplies |q| by
// sign(q) * qa, llama.cpp's trick, so a pair is <= 2 * 128 * 127), else a scalar loop. -DRADIXLM_FORCE_AVX2
// skips the AVX512 path and -DRADIXLM_PORTABLE both vector paths, so every build can be tested on one CPU;
// radixlm_w4a8_isa() says which one was compiled.
//
// The ops are declared from Python (runtime/models/w4a8.py); this file only adds their CPU implementations.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && !defined(RADIXLM_PORTABLE) && \
    !defined(RADIXLM_FORCE_AVX2)
#define RADIXLM_AVX512 1
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(RADIXLM_PORTABLE)
#define RADIXLM_AVX2 1
#include <immintrin.h>
#endif

namespace {

constexpr int64_t QK = 32;  // elements per block
constexpr int64_t NG = 16;  // weight rows per interleaved group
#if defined(RADIXLM_AVX2)
constexpr int ROW_TILE = 32; // activation rows sharing one pass over a weight group
#elif defined(RADIXLM_AVX512)
constexpr int ROW_TILE = 4;  // activation rows sharing one unpacked weight block (sums in registers)
#else
constexpr int ROW_TILE = 4;
#endif

struct Acts {  // quantized activations: rows of K int8 and per-block da / sa / asum
  const int8_t* qa;
  const float* da;
  const float* sa;
  const int32_t* asum;
  int64_t K, nb;
};

#if defined(RADIXLM_AVX2) || defined(RADIXLM_AVX512)
// Four int8 activations broadcast to every 32-bit lane, read straight from memory. Copying a block's 32 into a
// local int32 array first made the compiler move them through general registers and broadcast from there
// (two extra uops per dot instruction; the AVX512 GEMM ran 1.35x slower for it); a 4-byte load lets it use a
// broadcast load instead.
inline __m256i broadcast4_256(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof(v));
  return _mm256_set1_epi32(v);
}
#endif
#if defined(RADIXLM_AVX512)
inline __m512i broadcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof(v));
  return _mm512_set1_epi32(v);
}
#endif

#if defined(RADIXLM_AVX2) || defined(RADIXLM_AVX512)
// Software prefetch of the weight stream PREFETCH_BLOCKS blocks ahead (4 KB of Q4_1, 8 KB of Q8_0; past the
// group's end it runs into the next group, which is the next to be read). Why: at decode a layer's blocks come
// from DRAM or L3 once per step and the hardware prefetcher alone left the dot loop waiting on them
// (bench/quant_matmul.py --sequence, 2 threads: the 30 layers' Q4_1 linears at M = 4 took 4.7-4.9 ms a step
// without it and 3.2-3.3 ms with it, the Q8_0 head 1.5-1.6 ms and 1.0-1.1 ms). A prefetch past the end of the
// array is dropped, never faults.
constexpr int64_t PREFETCH_BLOCKS = 16;
inline void prefetch_ahead(const uint8_t* wb, int64_t blk_bytes, const c10::Half* d, const c10::Half* m,
                           int64_t b) {
  const char* w = reinterpret_cast<const char*>(wb + PREFETCH_BLOCKS * blk_bytes);
  for (int64_t o = 0; o < blk_bytes; o += 64) _mm_prefetch(w + o, _MM_HINT_T0);
  if ((b & 1) == 0) {  // a block's 16 fp16 scales (or mins) are half a cache line
    _mm_prefetch(reinterpret_cast<const char*>(d + (b + PREFETCH_BLOCKS) * NG), _MM_HINT_T0);
    if (m != nullptr) _mm_prefetch(reinterpret_cast<const char*>(m + (b + PREFETCH_BLOCKS) * NG), _MM_HINT_T0);
  }
}
#endif

// ------------------------------------------------------------------------------------------- activations
#if defined(RADIXLM_AVX2) || defined(RADIXLM_AVX512)
// One block of 32 with AVX2: the same numbers as the scalar loop below (cvtps rounds half to even under the
// default MXCSR, as nearbyint does; the scale is the same float division). Returns false, leaving the block to
// the scalar loop, when the MXCSR rounding mode is not round-to-nearest.
inline bool quantize_block_avx2(const float* xb, int8_t* qb, float* da, float* sa, int32_t* asum) {
  if ((_mm_getcsr() & 0x6000) != 0) return false;
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 v[4];
  __m256 mx = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(xb + 8 * i);
    mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, v[i]));
  }
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
  const float d = _mm_cvtss_f32(m4) / 127.f;
  const float id = d != 0.f ? 1.f / d : 0.f;
  const __m256 scale = _mm256_set1_ps(id);
  __m256i q[4];
  __m256i sum = _mm256_setzero_si256();
  for (int i = 0; i < 4; ++i) {
    q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], scale));
    sum = _mm256_add_epi32(sum, q[i]);
  }
  // int32 -> int8 in element order: packs interleave 128-bit lanes, the permute puts them back.
  const __m256i p16a = _mm256_packs_epi32(q[0], q[1]);
  const __m256i p16b = _mm256_packs_epi32(q[2], q[3]);
  const __m256i p8 = _mm256_packs_epi16(p16a, p16b);
  const __m256i ordered = _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(qb), ordered);
  __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
  const int32_t total = _mm_cvtsi128_si32(s4);
  *da = d;
  *asum = total;
  *sa = d * static_cast<float>(total);
  return true;
}
#endif

// x [M, K] fp32 -> qa int8 (round half to even, as torch.round), da = max|x| / 127, asum, sa per block.
void quantize_rows(const float* x, int64_t M, int64_t K, int8_t* qa, float* da, float* sa, int32_t* asum) {
  const int64_t nb = K / QK;
  at::parallel_for(0, M, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      for (int64_t b = 0; b < nb; ++b) {
        const float* xb = x + r * K + b * QK;
        int8_t* qb = qa + r * K + b * QK;
#if defined(RADIXLM_AVX2) || defined(RADIXLM_AVX512)
        if (quantize_block_avx2(xb, qb, da + r * nb + b, sa + r * nb + b, asum + r * nb + b)) continue;
#endif
        float amax = 0.f;
        for (int j = 0; j < QK; ++j) amax = std::max(amax, std::fabs(xb[j]));
        const float d = amax / 127.f;
        const float id = d != 0.f ? 1.f / d : 0.f;
        int32_t sum = 0;
        for (int j = 0; j < QK; ++j) {
          const int32_t v = static_cast<int32_t>(std::nearbyint(xb[j] * id));
          qb[j] = static_cast<int8_t>(v);
          sum += v;
        }
        da[r * nb + b] = d;
        asum[r * nb + b] = sum;
        sa[r * nb + b] = d * static_cast<float>(sum);
      }
    }
  });
}

#if defined(RADIXLM_AVX2)
// ------------------------------------------------------------------------------------------- AVX2 dots
// One 8-row half of a block: int32 dots of 8 weight rows with a block's 32 int8 activations aq.
// Q4_1: w = nibbles 0..15; int16 lanes sum 16 products of <= 15 * 127, exact.
inline __m256i dot_q4_avx2(const __m256i* w, const int8_t* aq, __m256i ones) {
  __m256i s0 = _mm256_maddubs_epi16(w[0], broadcast4_256(aq));
  __m256i s1 = _mm256_maddubs_epi16(w[1], broadcast4_256(aq + 4));
  for (int j = 2; j < 8; j += 2) {
    s0 = _mm256_add_epi16(s0, _mm256_maddubs_epi16(w[j], broadcast4_256(aq + 4 * j)));
    s1 = _mm256_add_epi16(s1, _mm256_maddubs_epi16(w[j + 1], broadcast4_256(aq + 4 * j + 4)));
  }
  return _mm256_madd_epi16(_mm256_add_epi16(s0, s1), ones);
}

// Q8_0: w = |q| as u8, sg = q; |q| * (sign(q) * qa) = q * qa, pairs widened to int32 at once.
inline __m256i dot_q8_avx2(const __m256i* w, const __m256i* sg, const int8_t* aq, __m256i ones) {
  __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();
  for (int j = 0; j < 8; j += 2) {
    const __m256i x0 = _mm256_sign_epi8(broadcast4_256(aq + 4 * j), sg[j]);
    const __m256i x1 = _mm256_sign_epi8(broadcast4_256(aq + 4 * j + 4), sg[j + 1]);
    s0 = _mm256_add_epi32(s0, _mm256_madd_epi16(_mm256_maddubs_epi16(w[j], x0), ones));
    s1 = _mm256_add_epi32(s1, _mm256_madd_epi16(_mm256_maddubs_epi16(w[j + 1], x1), ones));
  }
  return _mm256_add_epi32(s0, s1);
}

// ------------------------------------------------------------------------------------------- AVX2 group
// y[r][0..valid) for `rows` (<= ROW_TILE) activation rows and one group of 16 weight rows, one pass over the
// group's blocks (rows innermost, sums in a small array): re-walking a group per few rows, as the AVX512
// path does, defeated the hardware prefetcher on AMD Zen 3 once the weights outgrew the cache (5x slower).
template <bool kQ4>
void group_avx2(const uint8_t* qs, const c10::Half* d, const c10::Half* m, const Acts& a, int rows, float* y,
                int64_t ldy, int64_t valid) {
  const int64_t nb = a.nb;
  constexpr int64_t blk_bytes = kQ4 ? QK / 2 * NG : QK * NG;
  alignas(32) float acc[ROW_TILE][NG];
  std::memset(acc, 0, sizeof(float) * NG * rows);
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t b = 0; b < nb; ++b) {
    for (int h = 0; h < 2; ++h) {  // the 8 rows of each 32-byte half of a 64-byte quad row
      const uint8_t* wb = qs + b * blk_bytes + 32 * h;
      __m256i w[8];   // Q4_1: nibbles 0..15; Q8_0: |q| as u8
      __m256i sg[8];  // Q8_0: q (int8), whose sign goes onto the activations
      if (kQ4) {
        for (int p = 0; p < 4; ++p) {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 64 * p));
          w[p] = _mm256_and_si256(v, low4);
          w[p + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
        }
      } else {
        for (int j = 0; j < 8; ++j) {
          sg[j] = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 64 * j)), flip);
          w[j] = _mm256_sign_epi8(sg[j], sg[j]);  // |q|; -128 stays 0x80 = 128 as u8
        }
      }
      const int64_t s = b * NG + 8 * h;
      const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(d + s)));
      __m256 mw;
      if (kQ4) mw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(m + s)));
      for (int r = 0; r < rows; ++r) {
        const int8_t* aq = a.qa + r * a.K + b * QK;
        const __m256i dot32 = kQ4 ? dot_q4_avx2(w, aq, ones) : dot_q8_avx2(w, sg, aq, ones);
        float* out = acc[r] + 8 * h;
        __m256 sum = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot32),
                                     _mm256_mul_ps(dw, _mm256_set1_ps(a.da[r * nb + b])), _mm256_load_ps(out));
        if (kQ4) sum = _mm256_fmadd_ps(mw, _mm256_set1_ps(a.sa[r * nb + b]), sum);
        _mm256_store_ps(out, sum);
      }
    }
  }
  for (int r = 0; r < rows; ++r) std::memcpy(y + r * ldy, acc[r], valid * sizeof(float));
}

// The same dots for R <= 4 activation rows (decode), sums held in registers. group_avx2 keeps them in memory,
// which at one row makes every block wait on the previous block's store (a loop-carried store-to-load chain):
// at M = 1 that ran 3x below this loop.
template <int R, bool kQ4>
void group_avx2_small(const uint8_t* qs, const c10::Half* d, const c10::Half* m, const Acts& a, float* y,
                      int64_t ldy, int64_t valid) {
  const int64_t nb = a.nb;
  constexpr int64_t blk_bytes = kQ4 ? QK / 2 * NG : QK * NG;
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t b = 0; b < nb; ++b) {
    float da[R], sa[R];
    const int8_t* aq[R];
    for (int r = 0; r < R; ++r) {
      da[r] = a.da[r * nb + b];
      sa[r] = a.sa[r * nb + b];
      aq[r] = a.qa + r * a.K + b * QK;
    }
    prefetch_ahead(qs + b * blk_bytes, blk_bytes, d, kQ4 ? m : nullptr, b);
    for (int h = 0; h < 2; ++h) {
      const uint8_t* wb = qs + b * blk_bytes + 32 * h;
      const int64_t s = b * NG + 8 * h;
      const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(d + s)));
      if (kQ4) {
        __m256i w[8];
        for (int p = 0; p < 4; ++p) {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 64 * p));
          w[p] = _mm256_and_si256(v, low4);
          w[p + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
        }
        const __m256 mw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(m + s)));
        for (int r = 0; r < R; ++r) {
          const __m256 dot = _mm256_cvtepi32_ps(dot_q4_avx2(w, aq[r], ones));
          acc[r][h] = _mm256_fmadd_ps(dot, _mm256_mul_ps(dw, _mm256_set1_ps(da[r])), acc[r][h]);
          acc[r][h] = _mm256_fmadd_ps(mw, _mm256_set1_ps(sa[r]), acc[r][h]);
        }
      } else {
        __m256i w[8], sg[8];
        for (int j = 0; j < 8; ++j) {
          sg[j] = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 64 * j)), flip);
          w[j] = _mm256_sign_epi8(sg[j], sg[j]);
        }
        for (int r = 0; r < R; ++r) {
          const __m256 dot = _mm256_cvtepi32_ps(dot_q8_avx2(w, sg, aq[r], ones));
          acc[r][h] = _mm256_fmadd_ps(dot, _mm256_mul_ps(dw, _mm256_set1_ps(da[r])), acc[r][h]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    alignas(32) float out[NG];
    _mm256_store_ps(out, acc[r][0]);
    _mm256_store_ps(out + 8, acc[r][1]);
    std::memcpy(y + r * ldy, out, valid * sizeof(float));
  }
}
#endif

// ------------------------------------------------------------------------------------------- one group

// y[r][0..valid) for R activation rows and one group of 16 weight rows.
template <int R, bool kQ4>
void group_kernel(const uint8_t* qs, const c10::Half* d, const c10::Half* m, const Acts& a, float* y,
                  int64_t ldy, int64_t valid) {
  const int64_t nb = a.nb;
  constexpr int64_t blk_bytes = kQ4 ? QK / 2 * NG : QK * NG;
#if defined(RADIXLM_AVX512)
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* wb = qs + b * blk_bytes;
    prefetch_ahead(wb, blk_bytes, d, kQ4 ? m : nullptr, b);
    __m512i w[8];
    if (kQ4) {
      for (int p = 0; p < 4; ++p) {
        const __m512i v = _mm512_loadu_si512(wb + 64 * p);
        w[p] = _mm512_and_si512(v, low4);
        w[p + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
      }
    } else {
      for (int j = 0; j < 8; ++j) w[j] = _mm512_loadu_si512(wb + 64 * j);
    }
    const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(d + b * NG)));
    __m512 mw;
    if (kQ4) mw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(m + b * NG)));
    for (int r = 0; r < R; ++r) {
      const int8_t* aq = a.qa + r * a.K + b * QK;  // the block's 32 int8 activations, read 4 at a time
      // two dependent chains of 4 instead of one of 8
      __m512i s0 = kQ4 ? _mm512_setzero_si512() : _mm512_set1_epi32(-128 * a.asum[r * nb + b]);
      __m512i s1 = _mm512_setzero_si512();
      for (int j = 0; j < 8; j += 2) {
        s0 = _mm512_dpbusd_epi32(s0, w[j], broadcast4(aq + 4 * j));
        s1 = _mm512_dpbusd_epi32(s1, w[j + 1], broadcast4(aq + 4 * j + 4));
      }
      const __m512 dot = _mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1));
      acc[r] = _mm512_fmadd_ps(dot, _mm512_mul_ps(dw, _mm512_set1_ps(a.da[r * nb + b])), acc[r]);
      if (kQ4) acc[r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(a.sa[r * nb + b]), acc[r]);
    }
  }
  const __mmask16 keep = static_cast<__mmask16>((1u << valid) - 1u);
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(y + r * ldy, keep, acc[r]);
#else
  for (int r = 0; r < R; ++r) {
    for (int64_t i = 0; i < valid; ++i) {
      float s = 0.f;
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* wb = qs + b * blk_bytes;
        const int8_t* xb = a.qa + r * a.K + b * QK;
        int32_t dot = kQ4 ? 0 : -128 * a.asum[r * nb + b];
        for (int j = 0; j < 8; ++j)
          for (int t = 0; t < 4; ++t) {
            int32_t w;
            if (kQ4) {
              const uint8_t byte = wb[64 * (j % 4) + 4 * i + t];
              w = j < 4 ? (byte & 0x0F) : (byte >> 4);
            } else {
              w = wb[64 * j + 4 * i + t];
            }
            dot += w * xb[4 * j + t];
          }
        s += static_cast<float>(d[b * NG + i]) * a.da[r * nb + b] * static_cast<float>(dot);
        if (kQ4) s += static_cast<float>(m[b * NG + i]) * a.sa[r * nb + b];
      }
      y[r * ldy + i] = s;
    }
  }
#endif
}

template <bool kQ4>
void group_rows(const uint8_t* qs, const c10::Half* d, const c10::Half* m, const Acts& a, int rows, float* y,
                int64_t ldy, int64_t valid) {
#if defined(RADIXLM_AVX2)
  switch (rows) {
    case 1: return group_avx2_small<1, kQ4>(qs, d, m, a, y, ldy, valid);
    case 2: return group_avx2_small<2, kQ4>(qs, d, m, a, y, ldy, valid);
    case 3: return group_avx2_small<3, kQ4>(qs, d, m, a, y, ldy, valid);
    case 4: return group_avx2_small<4, kQ4>(qs, d, m, a, y, ldy, valid);
    default: return group_avx2<kQ4>(qs, d, m, a, rows, y, ldy, valid);
  }
#else
  switch (rows) {
    case 1: return group_kernel<1, kQ4>(qs, d, m, a, y, ldy, valid);
    case 2: return group_kernel<2, kQ4>(qs, d, m, a, y, ldy, valid);
    case 3: return group_kernel<3, kQ4>(qs, d, m, a, y, ldy, valid);
#if defined(RADIXLM_AVX512)
    case 4: return group_kernel<4, kQ4>(qs, d, m, a, y, ldy, valid);
    case 5: return group_kernel<5, kQ4>(qs, d, m, a, y, ldy, valid);
    case 6: return group_kernel<6, kQ4>(qs, d, m, a, y, ldy, valid);
    case 7: return group_kernel<7, kQ4>(qs, d, m, a, y, ldy, valid);
    default: return group_kernel<8, kQ4>(qs, d, m, a, y, ldy, valid);
#else
    default: return group_kernel<4, kQ4>(qs, d, m, a, y, ldy, valid);
#endif
  }
#endif
}

template <bool kQ4>
at::Tensor blocked_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d, const at::Tensor* m,
                          int64_t out_features) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "w4a8 linear: x must be a contiguous float32 [M, K] tensor, got ", x.scalar_type(), " ",
              x.sizes());
  const int64_t M = x.size(0), K = x.size(1), nb = K / QK;
  const int64_t groups = qs.size(0);
  const int64_t blk_bytes = kQ4 ? QK / 2 * NG : QK * NG;
  TORCH_CHECK(K % QK == 0, "w4a8 linear: in_features must be a multiple of 32, got ", K);
  TORCH_CHECK(qs.scalar_type() == at::kByte && qs.is_contiguous() && qs.dim() == 2 && qs.size(1) == nb * blk_bytes,
              "w4a8 linear: packed weight [", qs.sizes(), "] does not match in_features ", K);
  TORCH_CHECK(out_features > (groups - 1) * NG && out_features <= groups * NG,
              "w4a8 linear: out_features ", out_features, " does not match ", groups, " row groups");
  TORCH_CHECK(d.scalar_type() == at::kHalf && d.is_contiguous() && d.numel() == groups * nb * NG,
              "w4a8 linear: scales must be float16 [groups, K/32 * 16]");
  if (m != nullptr)
    TORCH_CHECK(m->scalar_type() == at::kHalf && m->is_contiguous() && m->numel() == d.numel(),
                "w4a8 linear: mins must be float16 like the scales");
  at::Tensor y = at::empty({M, out_features}, x.options());
  if (M == 0) return y;
  // One scratch allocation for the quantized activations: da, sa, asum (4 bytes each per block), then qa.
  const int64_t scale_bytes = 3 * M * nb * 4;
  at::Tensor scratch = at::empty({scale_bytes + M * K}, x.options().dtype(at::kByte));
  uint8_t* base = scratch.data_ptr<uint8_t>();
  auto* dap = reinterpret_cast<float*>(base);
  float* sap = dap + M * nb;
  auto* asp = reinterpret_cast<int32_t*>(sap + M * nb);
  auto* qap = reinterpret_cast<int8_t*>(base + scale_bytes);
  quantize_rows(x.data_ptr<float>(), M, K, qap, dap, sap, asp);
  const auto* wq = qs.data_ptr<uint8_t>();
  const auto* wd = d.data_ptr<c10::Half>();
  const c10::Half* wm = m != nullptr ? m->data_ptr<c10::Half>() : nullptr;
  float* out = y.data_ptr<float>();
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t valid = std::min(NG, out_features - g * NG);
      for (int64_t r = 0; r < M; r += ROW_TILE) {
        const Acts a{qap + r * K, dap + r * nb, sap + r * nb, asp + r * nb, K, nb};
        group_rows<kQ4>(wq + g * nb * blk_bytes, wd + g * nb * NG, wm != nullptr ? wm + g * nb * NG : nullptr, a,
                        static_cast<int>(std::min<int64_t>(ROW_TILE, M - r)), out + r * out_features + g * NG,
                        out_features, valid);
      }
    }
  });
  return y;
}

at::Tensor q4_1_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d, const at::Tensor& m,
                       int64_t out_features) {
  return blocked_linear<true>(x, qs, d, &m, out_features);
}

at::Tensor q8_0_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d, int64_t out_features) {
  return blocked_linear<false>(x, qs, d, nullptr, out_features);
}

}  // namespace

// Which path this build compiled (runtime/models/w4a8.py reads it through ctypes).
extern "C" const char* radixlm_w4a8_isa() {
#if defined(RADIXLM_AVX512)
  return "avx512_vnni";
#elif defined(RADIXLM_AVX2)
  return "avx2";
#else
  return "scalar";
#endif
}

TORCH_LIBRARY_IMPL(radixlm, CPU, lib) {
  lib.impl("q4_1_linear", &q4_1_linear);
  lib.impl("q8_0_linear", &q8_0_linear);
}
