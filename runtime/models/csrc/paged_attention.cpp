// CPU paged attention for decode and short extends, reading K/V in place from the slot pool.
//
// Why: the torch path gathers every request's K/V out of the pool (index_select: a copy of the whole
// context per layer and step) and then runs SDPA over the copy. Over a long cached prefix the copy alone
// costs as much as the attention, and SDPA's fp32 single-query path carries per-call overhead that
// dominates short contexts. Here each (request, KV head, key split) is one task that walks the request's
// slots through req_to_token and keeps an online softmax per query row (the G query heads of the KV head
// and the request's new tokens, so each K/V row is read and widened once for all of them); splits of one
// request are merged with their log-sum-exp afterwards (flash-decoding), so one long request still uses
// every thread. Requests whose slots are the same over a whole split (a prefix the radix cache shares, as
// agents sharing a tool catalogue do) are one task for it: the shared K/V is read once per step, not once
// per request.
//
// Shapes: q [T, H, D] (T = sum of ext_lens; request b's queries are its last ext_lens[b] positions, query j
// at position seq_lens[b] - ext_lens[b] + j, causal); k_cache, v_cache [S, Hkv, D] (float32, bfloat16 or
// float16); req_to_token [R, C] int64; req_pool_indices, seq_lens, ext_lens [B] int64. Query head h reads KV
// head h / (H / Hkv). Math is float32 whatever the storage types (a bfloat16 cache on an AMX CPU: tile products
// with queries and weights at ~16 bits, see "AMX tiles"); the output is a contiguous [T, H, D] of q's dtype.
// q may be a strided view (last dim contiguous), e.g. straight out of the fused qkv projection's split.
// Optional sinks (float32 [H], gpt-oss's): one more logit per query head in its softmax's denominator, with no
// value, applied where a row is normalised (a whole request) or its splits merged. Optional soft-capping (softcap
// > 0, Gemma 2's): each scaled score s becomes softcap * tanh(s / softcap) before the softmax.
//
// paged_attention_kv(q, k, v, out_cache_loc, k_cache, v_cache, ...) first stores the new tokens' k, v
// ([T, Hkv, D] views, last dim contiguous, any dtype of the three) converted to the cache's dtype at slots
// out_cache_loc [T], then attends as above: one call instead of two index_copy_ and two dtype casts.
//
// The op is declared from Python (runtime/models/native_kernels.py); this file adds its CPU implementation.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <unordered_map>
#include <vector>

// Vector paths: AVX-512 where the CPU has it (16-wide fp16/bf16 widening, masked softmax), else AVX2 + FMA; the
// AVX2 helpers stay compiled under AVX-512 (exp for the merge, the KV write's F16C casts). -DRADIXLM_PORTABLE
// builds the scalar loops and -DRADIXLM_FORCE_AVX2 the AVX2 path on an AVX-512 CPU: tests compare all three.
#if defined(__AVX2__) && defined(__FMA__) && !defined(RADIXLM_PORTABLE)
#define RADIXLM_AVX2 1
#include <immintrin.h>
#if defined(__AVX512F__) && !defined(RADIXLM_FORCE_AVX2)
#define RADIXLM_AVX512 1
#endif
#endif
// AMX tiles for bfloat16 caches where the CPU has them (Sapphire Rapids on); -DRADIXLM_NO_AMX builds the AVX-512
// loops instead (tests compare the two).
#if defined(RADIXLM_AVX512) && defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && \
    !defined(RADIXLM_NO_AMX)
#define RADIXLM_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

constexpr int64_t BLOCK = 32;        // keys scored together before the softmax update
constexpr int64_t SPLIT = 256;       // keys per task (the last split of a request may be shorter)
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

// ------------------------------------------------------------------------------------------- vector math
inline float dot(const float* a, const float* b, int64_t n) {
#ifdef RADIXLM_AVX2
  if (n % 16 == 0) {
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; i += 16) {
      s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
      s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
    }
    const __m256 s = _mm256_add_ps(s0, s1);
    const __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    const __m128 q = _mm_add_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_add_ss(q, _mm_shuffle_ps(q, q, 1)));
  }
#endif
  float s = 0.f;
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

// acc[i] = acc[i] * keep + w * x[i]
inline void scale_add(float* acc, float keep, float w, const float* x, int64_t n) {
#ifdef RADIXLM_AVX2
  if (n % 8 == 0) {
    const __m256 k = _mm256_set1_ps(keep), ww = _mm256_set1_ps(w);
    for (int64_t i = 0; i < n; i += 8)
      _mm256_storeu_ps(acc + i, _mm256_fmadd_ps(ww, _mm256_loadu_ps(x + i), _mm256_mul_ps(k, _mm256_loadu_ps(acc + i))));
    return;
  }
#endif
  for (int64_t i = 0; i < n; ++i) acc[i] = acc[i] * keep + w * x[i];
}

// exp for x <= 0 (softmax arguments): Cody-Waite range reduction and a degree-6 polynomial, ~2 ulp.
inline void exp_inplace(float* x, int64_t n) {
  int64_t i = 0;
#ifdef RADIXLM_AVX2
  const __m256 lo = _mm256_set1_ps(-87.3f), log2e = _mm256_set1_ps(1.44269504088896341f);
  const __m256 c1 = _mm256_set1_ps(0.693359375f), c2 = _mm256_set1_ps(-2.12194440e-4f);
  const __m256 p0 = _mm256_set1_ps(1.9875691500e-4f), p1 = _mm256_set1_ps(1.3981999507e-3f),
               p2 = _mm256_set1_ps(8.3334519073e-3f), p3 = _mm256_set1_ps(4.1665795894e-2f),
               p4 = _mm256_set1_ps(1.6666665459e-1f), p5 = _mm256_set1_ps(5.0000001201e-1f),
               one = _mm256_set1_ps(1.f);
  for (; i + 8 <= n; i += 8) {
    __m256 v = _mm256_max_ps(_mm256_loadu_ps(x + i), lo);  // exp(-87.3) ~ 1e-38: below it, 0 is exact enough
    const __m256 fx = _mm256_round_ps(_mm256_mul_ps(v, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    v = _mm256_sub_ps(v, _mm256_mul_ps(fx, c1));
    v = _mm256_sub_ps(v, _mm256_mul_ps(fx, c2));
    const __m256 z = _mm256_mul_ps(v, v);
    __m256 y = p0;
    y = _mm256_fmadd_ps(y, v, p1);
    y = _mm256_fmadd_ps(y, v, p2);
    y = _mm256_fmadd_ps(y, v, p3);
    y = _mm256_fmadd_ps(y, v, p4);
    y = _mm256_fmadd_ps(y, v, p5);
    y = _mm256_fmadd_ps(y, z, _mm256_add_ps(v, one));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
    _mm256_storeu_ps(x + i, _mm256_mul_ps(y, _mm256_castsi256_ps(e)));
  }
#endif
  for (; i < n; ++i) x[i] = std::exp(x[i]);
}

// A K or V row as float32: float32 rows are read in place, half-precision rows widened into `buf`.
template <typename T>
inline const float* as_float(const T* src, float* buf, int64_t n) {
  for (int64_t i = 0; i < n; ++i) buf[i] = static_cast<float>(src[i]);
  return buf;
}
template <>
inline const float* as_float<float>(const float* src, float*, int64_t) {
  return src;
}
#ifdef RADIXLM_AVX2
template <>
inline const float* as_float<c10::BFloat16>(const c10::BFloat16* src, float* buf, int64_t n) {
  if (n % 8 != 0) {
    for (int64_t i = 0; i < n; ++i) buf[i] = static_cast<float>(src[i]);
    return buf;
  }
  for (int64_t i = 0; i < n; i += 8) {  // bf16 is the top half of a float32
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    _mm256_storeu_ps(buf + i, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)));
  }
  return buf;
}
#ifdef __F16C__
template <>
inline const float* as_float<c10::Half>(const c10::Half* src, float* buf, int64_t n) {
  if (n % 8 != 0) {
    for (int64_t i = 0; i < n; ++i) buf[i] = static_cast<float>(src[i]);
    return buf;
  }
  for (int64_t i = 0; i < n; i += 8)
    _mm256_storeu_ps(buf + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
  return buf;
}
#endif
#endif

// ------------------------------------------------------------------------------------------- one task
// Rows of a task: each member request's ext queries x the G query heads of one KV head, row = j * G + g.

#ifdef RADIXLM_AVX2
// 8 K/V elements as float32, widened in registers: half-precision rows are read in place, never copied into a
// float buffer first (that copy's stores were most of a decode step's attention time).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline __m256 load8(const c10::BFloat16* p) {  // bf16 is the top half of a float32
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// R query rows (R <= 4) against n keys: the key is loaded once per 8 dims for all R rows.
template <int R, typename T>
inline void scores_rows(const float* q, const T* const* keys, int64_t n, int64_t D, float* scores) {
  for (int64_t t = 0; t < n; ++t) {
    __m256 a[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t c = 0; c < D; c += 8) {
      const __m256 k = load8(keys[t] + c);
      for (int i = 0; i < R; ++i) a[i] = _mm256_fmadd_ps(_mm256_loadu_ps(q + i * D + c), k, a[i]);
    }
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    const __m128 sum = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    alignas(16) float out[4];
    _mm_store_ps(out, sum);
    for (int i = 0; i < R; ++i) scores[i * BLOCK + t] = out[i];
  }
}

// R accumulator rows += p[r][t] * value_t over n values, 16 dims at a time: 2R independent FMA chains.
template <int R, typename T>
inline void accumulate_rows(float* acc, const float* p, const T* const* values, int64_t n, int64_t D) {
  for (int64_t c = 0; c < D; c += 16) {
    __m256 lo[4], hi[4];
    for (int i = 0; i < R; ++i) {
      lo[i] = _mm256_loadu_ps(acc + i * D + c);
      hi[i] = _mm256_loadu_ps(acc + i * D + c + 8);
    }
    for (int64_t t = 0; t < n; ++t) {
      const __m256 v0 = load8(values[t] + c), v1 = load8(values[t] + c + 8);
      for (int i = 0; i < R; ++i) {
        const __m256 w = _mm256_broadcast_ss(p + i * BLOCK + t);
        lo[i] = _mm256_fmadd_ps(w, v0, lo[i]);
        hi[i] = _mm256_fmadd_ps(w, v1, hi[i]);
      }
    }
    for (int i = 0; i < R; ++i) {
      _mm256_storeu_ps(acc + i * D + c, lo[i]);
      _mm256_storeu_ps(acc + i * D + c + 8, hi[i]);
    }
  }
}

#endif

#ifdef RADIXLM_AVX512
// 16 K/V elements as float32, widened in registers.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __m256 fold256(__m512 a) {  // lanes i + i+8: the first step of a horizontal sum
  return _mm256_add_ps(_mm512_castps512_ps256(a), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
}

// R query rows (R <= 4) against n keys, 16 dims per FMA; the four rows' sums reduced together (one hadd tree).
// Each row's sum is formed in the same order whatever R is, so a row's score never depends on its neighbours.
template <int R, typename T>
inline void scores_rows16(const float* q, const T* const* keys, int64_t n, int64_t D, float* scores) {
  for (int64_t t = 0; t < n; ++t) {
    __m512 a[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    const T* key = keys[t];
    for (int64_t c = 0; c < D; c += 16) {
      const __m512 k = load16(key + c);
      for (int i = 0; i < R; ++i) a[i] = _mm512_fmadd_ps(_mm512_loadu_ps(q + i * D + c), k, a[i]);
    }
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(fold256(a[0]), fold256(a[1])),
                                    _mm256_hadd_ps(fold256(a[2]), fold256(a[3])));
    const __m128 sum = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    alignas(16) float out[4];
    _mm_store_ps(out, sum);
    for (int i = 0; i < R; ++i) scores[i * BLOCK + t] = out[i];
  }
}

// R accumulator rows += p[r][t] * value_t over n values, U * 16 dims per pass (R * U accumulators in registers).
template <int R, int U, typename T>
inline void accumulate_pass16(float* acc, const float* p, const T* const* values, int64_t n, int64_t D, int64_t c,
                              int64_t rs, int64_t ts) {
  __m512 a[R][U];
  for (int i = 0; i < R; ++i)
    for (int u = 0; u < U; ++u) a[i][u] = _mm512_loadu_ps(acc + i * D + c + 16 * u);
  for (int64_t t = 0; t < n; ++t) {
    __m512 v[U];
    for (int u = 0; u < U; ++u) v[u] = load16(values[t] + c + 16 * u);
    for (int i = 0; i < R; ++i) {
      const __m512 w = _mm512_set1_ps(p[i * rs + t * ts]);
      for (int u = 0; u < U; ++u) a[i][u] = _mm512_fmadd_ps(w, v[u], a[i][u]);
    }
  }
  for (int i = 0; i < R; ++i)
    for (int u = 0; u < U; ++u) _mm512_storeu_ps(acc + i * D + c + 16 * u, a[i][u]);
}

// p[i * rs + t * ts] is row i's weight of value t.
template <int R, typename T>
inline void accumulate_rows16(float* acc, const float* p, const T* const* values, int64_t n, int64_t D,
                              int64_t rs = BLOCK, int64_t ts = 1) {
  int64_t c = 0;
  for (; c + 64 <= D; c += 64) accumulate_pass16<R, 4, T>(acc, p, values, n, D, c, rs, ts);
  for (; c < D; c += 16) accumulate_pass16<R, 1, T>(acc, p, values, n, D, c, rs, ts);
}

// exp(x) for x <= 0 (or -inf -> 0), 16 lanes: the same reduction and polynomial as exp_inplace, scaled by 2^k
// with scalef.
inline __m512 exp16(__m512 x) {
  const __m512 v0 = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
  const __m512 fx = _mm512_roundscale_ps(_mm512_mul_ps(v0, _mm512_set1_ps(1.44269504088896341f)),
                                         _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 v = _mm512_fnmadd_ps(fx, _mm512_set1_ps(0.693359375f), v0);
  v = _mm512_fnmadd_ps(fx, _mm512_set1_ps(-2.12194440e-4f), v);
  const __m512 z = _mm512_mul_ps(v, v);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, v, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, v, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, v, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, v, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, v, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_fmadd_ps(y, z, _mm512_add_ps(v, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(y, fx);
}

inline __mmask16 first_lanes(int64_t k) {  // the first k of 16 lanes (k clipped to 0..16)
  return k >= 16 ? __mmask16(0xFFFF) : k <= 0 ? __mmask16(0) : __mmask16((1u << k) - 1);
}

// cap * tanh(x / cap), 16 lanes: tanh(y) = sign(y) (1 - e) / (1 + e) with e = exp(-2|y|) <= 1, which exp16 takes.
inline __m512 soft_cap16(__m512 x, float cap) {
  const __m512 e = exp16(_mm512_mul_ps(_mm512_abs_ps(x), _mm512_set1_ps(-2.f / cap)));
  const __m512 one = _mm512_set1_ps(1.f);
  const __m512 t = _mm512_div_ps(_mm512_sub_ps(one, e), _mm512_add_ps(one, e));
  const __m512i sign = _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(int32_t(0x80000000u)));
  return _mm512_mul_ps(_mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(t), sign)), _mm512_set1_ps(cap));
}

// Rows in lanes: 16 query rows of a task as the lanes of a vector, qt[d * 16 + i] = row i's dim d, so that a
// key's 16 scores (one per row) come from vertical FMAs with the key's dims broadcast, and the online softmax
// runs on whole vectors too: no transpose per block and no horizontal sum per key or row.
inline void transpose_rows(const float* q, int64_t cnt, int64_t D, float* qt) {
  for (int64_t d = 0; d < D; ++d)
    for (int64_t i = 0; i < 16; ++i) qt[d * 16 + i] = i < cnt ? q[i * D + d] : 0.f;
}

// The lanes m and m + 8 of scores_rows16's accumulator summed (its f_m) for K keys, each over 16 rows.
template <int K>
inline void lane_pair_keys(const float* qt, const float* const* keys, int64_t D, int m, __m512* f) {
  __m512 a[K], b[K];
  for (int i = 0; i < K; ++i) a[i] = b[i] = _mm512_setzero_ps();
  for (int64_t c = 0; c < D; c += 16) {
    const __m512 qa = _mm512_loadu_ps(qt + (c + m) * 16), qb = _mm512_loadu_ps(qt + (c + m + 8) * 16);
    for (int i = 0; i < K; ++i) {
      a[i] = _mm512_fmadd_ps(qa, _mm512_set1_ps(keys[i][c + m]), a[i]);
      b[i] = _mm512_fmadd_ps(qb, _mm512_set1_ps(keys[i][c + m + 8]), b[i]);
    }
  }
  for (int i = 0; i < K; ++i) f[i] = _mm512_add_ps(a[i], b[i]);
}

// s[i * 16 + r] = row r's score of key i (K keys), summed in scores_rows16's order: the FMA chain of each of
// its 16 lanes l (q[c + l] * k[c + l] over chunks c, from zero), f_m = lanes m + (m + 8) (fold256), then the
// hadd tree ((f0 + f1) + (f2 + f3)) + ((f4 + f5) + (f6 + f7)). So a row's scores have the same bits here as
// in a decode's 4-row pass.
template <int K>
inline void scores_keys(const float* qt, const float* const* keys, int64_t D, float* s) {
  __m512 x[K], y[K], lo[K], hi[K];
  lane_pair_keys<K>(qt, keys, D, 0, x);
  lane_pair_keys<K>(qt, keys, D, 1, y);
  for (int i = 0; i < K; ++i) lo[i] = _mm512_add_ps(x[i], y[i]);
  lane_pair_keys<K>(qt, keys, D, 2, x);
  lane_pair_keys<K>(qt, keys, D, 3, y);
  for (int i = 0; i < K; ++i) lo[i] = _mm512_add_ps(lo[i], _mm512_add_ps(x[i], y[i]));
  lane_pair_keys<K>(qt, keys, D, 4, x);
  lane_pair_keys<K>(qt, keys, D, 5, y);
  for (int i = 0; i < K; ++i) hi[i] = _mm512_add_ps(x[i], y[i]);
  lane_pair_keys<K>(qt, keys, D, 6, x);
  lane_pair_keys<K>(qt, keys, D, 7, y);
  for (int i = 0; i < K; ++i)
    _mm512_storeu_ps(s + i * 16, _mm512_add_ps(lo[i], _mm512_add_ps(hi[i], _mm512_add_ps(x[i], y[i]))));
}

inline void block_scores_lanes(const float* qt, const float* const* keys, int64_t n, int64_t D, float* s) {
  int64_t t = 0;
  for (; t + 4 <= n; t += 4) scores_keys<4>(qt, keys + t, D, s + t * 16);
  switch (n - t) {
    case 3: scores_keys<3>(qt, keys + t, D, s + t * 16); break;
    case 2: scores_keys<2>(qt, keys + t, D, s + t * 16); break;
    case 1: scores_keys<1>(qt, keys + t, D, s + t * 16); break;
    default: break;
  }
}

// softmax_update for the (up to 16) rows of a group at once, s[t * 16 + i] being row i's score of key t < n and
// valid[i] its valid keys (softmax_update's, clipped to n; <= 0 for unused lanes). Bit for bit the same per row:
// exp16 is lane-wise, and the maximum and the sum over a row's keys are reduced in the order of
// _mm512_reduce_max_ps and _mm512_reduce_add_ps (GCC's: halves 256, 128, then pairs), with each of their lanes
// a vector over the rows. keep[i] gets row i's accumulator factor.
inline void softmax_lanes(float* s, int64_t n, const int32_t* valid, float* m, float* l, float* keep) {
  static_assert(BLOCK == 32, "a row's block is two 16-lane halves, as in softmax_update");
  const __m512i vv = _mm512_loadu_si512(valid);
  const __m512 ninf = _mm512_set1_ps(NEG_INF);
  auto live = [&](int64_t t) { return t < n ? _mm512_cmpgt_epi32_mask(vv, _mm512_set1_epi32(int32_t(t))) : 0; };
  auto x = [&](int64_t t) { return t < n ? _mm512_mask_loadu_ps(ninf, live(t), s + t * 16) : ninf; };
  __m512 a[16];
  for (int j = 0; j < 16; ++j) a[j] = _mm512_max_ps(x(j), x(j + 16));
  for (int j = 0; j < 8; ++j) a[j] = _mm512_max_ps(a[j + 8], a[j]);
  for (int j = 0; j < 4; ++j) a[j] = _mm512_max_ps(a[j + 4], a[j]);
  const __m512 red = _mm512_max_ps(_mm512_max_ps(a[0], a[2]), _mm512_max_ps(a[1], a[3]));
  const __m512 mv = _mm512_loadu_ps(m);
  const __m512 mx = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(mv, red, _CMP_LT_OQ), mv, red);  // std::max(m, red)
  for (int j = 0; j < 16; ++j) {
    __m512 e[2];
    for (int h = 0; h < 2; ++h) {
      const int64_t t = j + 16 * h;
      e[h] = _mm512_setzero_ps();
      if (t < n) {
        e[h] = _mm512_maskz_mov_ps(live(t), exp16(_mm512_sub_ps(_mm512_loadu_ps(s + t * 16), mx)));
        _mm512_storeu_ps(s + t * 16, e[h]);
      }
    }
    a[j] = _mm512_add_ps(e[0], e[1]);
  }
  for (int j = 0; j < 8; ++j) a[j] = _mm512_add_ps(a[j + 8], a[j]);
  for (int j = 0; j < 4; ++j) a[j] = _mm512_add_ps(a[j + 4], a[j]);
  alignas(64) float mxs[16], sums[16];
  _mm512_store_ps(mxs, mx);
  _mm512_store_ps(sums, _mm512_add_ps(_mm512_add_ps(a[0], a[2]), _mm512_add_ps(a[1], a[3])));
  for (int i = 0; i < 16; ++i) {
    keep[i] = 1.f;
    if (valid[i] <= 0) continue;  // every key of the block is in this row's future
    keep[i] = m[i] == mxs[i] && std::isfinite(m[i]) ? 1.f : std::exp(m[i] - mxs[i]);  // exp(0) is 1 exactly
    l[i] = l[i] * keep[i] + sums[i];
    m[i] = mxs[i];
  }
}
#endif

// s[0..n) <- cap * tanh(s / cap): Gemma 2's attention logit soft-capping of scaled scores. On AVX-512 every
// score goes through soft_cap16 (the tail in masked lanes), so a score's result never depends on where it lies:
// a decode and an extend of the same tokens keep the same bits.
inline void soft_cap(float* s, int64_t n, float cap) {
#ifdef RADIXLM_AVX512
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 k = first_lanes(n - i);
    _mm512_mask_storeu_ps(s + i, k, soft_cap16(_mm512_maskz_loadu_ps(k, s + i), cap));
  }
#else
  for (int64_t i = 0; i < n; ++i) s[i] = cap * std::tanh(s[i] / cap);
#endif
}

// dst[0..n) = src[0..n), returning dst: one slot's run of K or V staged. Inline 64-byte moves where the run
// is whole cache lines: a libc memcpy call per run (128-384 bytes, ~250K of them a step over a 1,400-token
// shared prefix) spent more in the call than in the copy.
template <typename KV>
inline const KV* copy_run(KV* dst, const KV* src, int64_t n) {
  const int64_t bytes = n * int64_t(sizeof(KV));
#ifdef RADIXLM_AVX512
  if (bytes % 64 == 0) {
    auto* d = reinterpret_cast<char*>(dst);
    const auto* s = reinterpret_cast<const char*>(src);
    for (int64_t o = 0; o < bytes; o += 64) _mm512_storeu_si512(d + o, _mm512_loadu_si512(s + o));
    return dst;
  }
#endif
  return static_cast<const KV*>(std::memcpy(dst, src, bytes));
}

// Whether a task with `rows` query rows reads K/V rows of head_dim D in place (as T) in the vector loops;
// otherwise attend_split widens each block into float rows first. AVX-512 reads in place up to 4 rows (a
// decode); more (an extend, or requests sharing a prefix) would widen again in each pass, and are mostly
// taken in lanes anyway (lane_rows).
template <typename T>
inline bool reads_in_place(int64_t D, int64_t rows) {
#if defined(RADIXLM_AVX512)
  return D % 16 == 0 && rows <= 4;
#elif defined(RADIXLM_AVX2)
  (void)rows;
  return D % 16 == 0;
#else
  (void)D;
  (void)rows;
  return false;
#endif
}

// How many of a task's rows attend_split takes 16 at a time as the lanes of vectors (see transpose_rows): on
// AVX-512, for more than 4 rows, every whole group of 16 and a last group of 10 or more (bench: rows in lanes
// beat 4-row passes over widened keys from about 10 rows of 16 on). The other rows go the 4-row way.
inline int64_t lane_rows(int64_t D, int64_t rows) {
#if defined(RADIXLM_AVX512)
  if (D % 16 != 0 || rows <= 4) return 0;
  return rows % 16 >= 10 ? rows : rows / 16 * 16;
#else
  (void)D;
  (void)rows;
  return 0;
#endif
}

// scores[r][t] = dot(q_r, key_t) for rows r (q rows of D floats) and n keys (row pointers; T other than float
// only when reads_in_place(D)).
template <typename T>
inline void block_scores(const float* q, int64_t rows, const T* const* keys, int64_t n, int64_t D,
                         float* scores) {
#if defined(RADIXLM_AVX512)
  if (D % 16 == 0) {
    int64_t r = 0;
    for (; r + 4 <= rows; r += 4) scores_rows16<4, T>(q + r * D, keys, n, D, scores + r * BLOCK);
    switch (rows - r) {
      case 3: scores_rows16<3, T>(q + r * D, keys, n, D, scores + r * BLOCK); break;
      case 2: scores_rows16<2, T>(q + r * D, keys, n, D, scores + r * BLOCK); break;
      case 1: scores_rows16<1, T>(q + r * D, keys, n, D, scores + r * BLOCK); break;
      default: break;
    }
    return;
  }
#elif defined(RADIXLM_AVX2)
  if (D % 16 == 0) {
    int64_t r = 0;
    for (; r + 4 <= rows; r += 4) scores_rows<4, T>(q + r * D, keys, n, D, scores + r * BLOCK);
    switch (rows - r) {
      case 3: scores_rows<3, T>(q + r * D, keys, n, D, scores + r * BLOCK); break;
      case 2: scores_rows<2, T>(q + r * D, keys, n, D, scores + r * BLOCK); break;
      case 1: scores_rows<1, T>(q + r * D, keys, n, D, scores + r * BLOCK); break;
      default: break;
    }
    return;
  }
#endif
  if constexpr (std::is_same_v<T, float>) {
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t t = 0; t < n; ++t) scores[r * BLOCK + t] = dot(q + r * D, keys[t], D);
  }
}

// acc[r] += sum_t p[r][t] * value_t for rows r and n values (row pointers, as for block_scores).
template <typename T>
inline void block_accumulate(float* acc, int64_t rows, const float* p, const T* const* values, int64_t n,
                             int64_t D) {
#if defined(RADIXLM_AVX512)
  if (D % 16 == 0) {
    int64_t r = 0;
    for (; r + 4 <= rows; r += 4) accumulate_rows16<4, T>(acc + r * D, p + r * BLOCK, values, n, D);
    switch (rows - r) {
      case 3: accumulate_rows16<3, T>(acc + r * D, p + r * BLOCK, values, n, D); break;
      case 2: accumulate_rows16<2, T>(acc + r * D, p + r * BLOCK, values, n, D); break;
      case 1: accumulate_rows16<1, T>(acc + r * D, p + r * BLOCK, values, n, D); break;
      default: break;
    }
    return;
  }
#elif defined(RADIXLM_AVX2)
  if (D % 16 == 0) {
    int64_t r = 0;
    for (; r + 4 <= rows; r += 4) accumulate_rows<4, T>(acc + r * D, p + r * BLOCK, values, n, D);
    switch (rows - r) {
      case 3: accumulate_rows<3, T>(acc + r * D, p + r * BLOCK, values, n, D); break;
      case 2: accumulate_rows<2, T>(acc + r * D, p + r * BLOCK, values, n, D); break;
      case 1: accumulate_rows<1, T>(acc + r * D, p + r * BLOCK, values, n, D); break;
      default: break;
    }
    return;
  }
#endif
  if constexpr (std::is_same_v<T, float>) {
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t t = 0; t < n; ++t) scale_add(acc + r * D, 1.f, p[r * BLOCK + t], values[t], D);
  }
}

// One row's online-softmax step over a block: s[0..n) are its scores, keys t >= valid lie in its future
// (causal) and get weight 0. s becomes the block's weights exp(s - new max); m, l (running max, sum of
// weights) are updated; returns the factor the row's accumulator must be scaled by (1 when the max stayed).
inline float softmax_update(float* s, int64_t n, int64_t valid, float& m, float& l) {
  valid = std::min(valid, n);
  if (valid <= 0) {  // every key of the block is in this row's future: nothing to add
    std::fill(s, s + n, 0.f);
    return 1.f;
  }
#ifdef RADIXLM_AVX512
  static_assert(BLOCK == 32, "the masked softmax takes a block as two 16-lane registers");
  const __m512 ninf = _mm512_set1_ps(NEG_INF);
  const __mmask16 k0 = first_lanes(valid), k1 = first_lanes(valid - 16);
  const __m512 x0 = _mm512_mask_loadu_ps(ninf, k0, s), x1 = _mm512_mask_loadu_ps(ninf, k1, s + 16);
  const float mx = std::max(m, _mm512_reduce_max_ps(_mm512_max_ps(x0, x1)));
  const __m512 mv = _mm512_set1_ps(mx);
  const __m512 e0 = _mm512_maskz_mov_ps(k0, exp16(_mm512_sub_ps(x0, mv)));
  const __m512 e1 = _mm512_maskz_mov_ps(k1, exp16(_mm512_sub_ps(x1, mv)));
  _mm512_mask_storeu_ps(s, first_lanes(n), e0);
  _mm512_mask_storeu_ps(s + 16, first_lanes(n - 16), e1);
  const float sum = _mm512_reduce_add_ps(_mm512_add_ps(e0, e1));
#else
  float mx = m;
  for (int64_t t = 0; t < valid; ++t) mx = std::max(mx, s[t]);
  for (int64_t t = 0; t < valid; ++t) s[t] -= mx;
  exp_inplace(s, valid);
  std::fill(s + valid, s + n, 0.f);
  float sum = 0.f;
  for (int64_t t = 0; t < valid; ++t) sum += s[t];
#endif
  const float keep = std::exp(m - mx);  // 0 on the row's first block (m = -inf)
  l = l * keep + sum;
  m = mx;
  return keep;
}

// The running max and sum of rows [0, count) of each of nheads heads (rows per head) back from the layout
// where they were lanes: head h, group g of 16 rows, lane i at lm[(h * groups + g) * 16 + i].
inline void rows_from_lanes(const float* lm, const float* ll, int64_t nheads, int64_t rows, int64_t count, float* m,
                            float* l) {
  const int64_t groups = (count + 15) / 16;
  for (int64_t h = 0; h < nheads; ++h)
    for (int64_t r = 0; r < count; ++r) {
      m[h * rows + r] = lm[(h * groups + r / 16) * 16 + r % 16];
      l[h * rows + r] = ll[(h * groups + r / 16) * 16 + r % 16];
    }
}

#ifdef RADIXLM_AMX
// ------------------------------------------------------------------------------------------- AMX tiles
// Why: with vector FMAs an extend row (a speculative draft token) costs as much attention as a decode row: every
// row x key x dim is one multiply-add, so at 2,300 keys a draft token cost ~1.3 ms of a 10 ms step. An AMX tile
// product does 16 x 16 x 32 of them in one instruction; once a block's K and V are laid out as tiles, 16 query
// rows cost little more than one. Only for a bfloat16 cache: its K/V go into tiles as they are (a copy, a
// shuffle), where a float16 cache would need a split into two bfloat16 halves per value, which measured slower
// than the vector loops for a decode (`--kv-cache-dtype auto` picks bfloat16 on AMX CPUs: server_args.py).
//
// Precision: K/V are exact in the tiles. Queries and softmax weights (float32) are split into x = hi + lo, two
// bfloat16 rounded to nearest, and multiplied as hi * k + lo * k in float32: ~16 significant bits per product,
// where bfloat16 K/V carry 8. The online softmax, its sums and the accumulators stay float32 in vectors.
//
// Per block of 32 keys and KV head: K rows copied (tile A: 16 keys x 32 dims); the task's query rows, split once,
// laid out as VNNI pairs (tile B: 32 dims x R rows), so the scores tile is keys x rows, the layout
// softmax_lanes takes; each row's weights then go into tile A (R rows x 32 keys) and V is laid out as VNNI key
// pairs (tile B: 32 keys x 16 dims), giving the block's output rows x dims, added to each row's accumulator
// after its softmax factor. A row's arithmetic never depends on the other rows of its tile (a tile product is
// per row and column) nor on keys it does not see (their weight is exactly 0), and softmax_update gives a row
// the bits softmax_lanes gives it, so a decode and an extend of the same tokens give the same bits, as on the
// vector path.

// Linux gives a process the tile registers' state only on request (arch_prctl, once); without it, the loops.
inline bool amx_ready() {
  static const bool ok = [] {
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  return ok;
}

inline bool uses_amx(int64_t D) {  // for a bfloat16 cache (attend_split checks the type at compile time)
  return D % 32 == 0 && amx_ready();
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// R = the rows of a tile group (16, or a lone group's own count: a decode's 3 rows then cost 3 tile rows in the
// weighted sum, not 16). Tiles: 0, 1 K of keys 0-15, 16-31, then V chunks (16 x 64 B); 2, 3 the queries' hi,
// lo (B: 16 dim pairs x R columns); 4 scores (16 keys x R); 5 the output (R x 16 dims); 6, 7 the weights' hi,
// lo (A: R rows x 32 keys). The intrinsics take tile numbers as literals.
inline void amx_configure(int64_t R) {
  TileConfig cfg;
  const uint16_t cols = static_cast<uint16_t>(4 * R);
  const uint8_t rows = static_cast<uint8_t>(R);
  const uint16_t colsb[8] = {64, 64, cols, cols, cols, 64, 64, 64};
  const uint8_t nrows[8] = {16, 16, 16, 16, 16, rows, rows, rows};
  for (int i = 0; i < 8; ++i) {
    cfg.colsb[i] = colsb[i];
    cfg.rows[i] = nrows[i];
  }
  _tile_loadconfig(&cfg);
}

// 0, 16, 32, ..., 240: a gather or scatter index over every 16th float (one column of a 16-wide layout).
inline __m512i every_16th() {
  return _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                            _mm512_set1_epi32(16));
}

// The 32 floats a (first) then b as bfloat16 hi + lo (hi rounded to nearest even, lo the rest rounded), in
// that order.
inline void split_bf16(__m512 a, __m512 b, __m512i& hi, __m512i& lo) {
  hi = (__m512i)_mm512_cvtne2ps_pbh(b, a);
  const __m512 ha = _mm512_cvtpbh_ps((__m256bh)_mm512_castsi512_si256(hi));
  const __m512 hb = _mm512_cvtpbh_ps((__m256bh)_mm512_extracti64x4_epi64(hi, 1));
  lo = (__m512i)_mm512_cvtne2ps_pbh(_mm512_sub_ps(b, hb), _mm512_sub_ps(a, ha));
}

// Rows r < cnt of q ([cnt, D], cnt <= 16) as VNNI tiles B, one per 32 dims: 32-bit word p * 16 + r of chunk c
// holds row r's dims c + 2p and c + 2p + 1. Columns past cnt keep whatever they held: their scores land in
// lanes no row reads.
inline void query_tiles(const float* q, int64_t cnt, int64_t D, uint16_t* th, uint16_t* tl) {
  const __m512i at = every_16th();
  for (int64_t c = 0; c < D; c += 32)
    for (int64_t r = 0; r < cnt; ++r) {
      __m512i hi, lo;
      split_bf16(_mm512_loadu_ps(q + r * D + c), _mm512_loadu_ps(q + r * D + c + 16), hi, lo);
      const __m512i idx = _mm512_add_epi32(at, _mm512_set1_epi32(int32_t(r)));
      _mm512_i32scatter_epi32(th + c * 16, idx, hi, 4);
      _mm512_i32scatter_epi32(tl + c * 16, idx, lo, 4);
    }
}

// Value rows 2i and 2i+1 (null: past the block, zeros) as key pair i of the VNNI tiles B, one per 16 dims:
// 32-bit word j * 256 + i * 16 + d holds dim 16 j + d of both.
inline void stage_value_pair(const c10::BFloat16* v0, const c10::BFloat16* v1, int64_t D, int64_t i, uint16_t* out) {
  static const __m512i lo_dims = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7,
                                                  38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  static const __m512i hi_dims = _mm512_add_epi16(lo_dims, _mm512_set1_epi16(16));
  for (int64_t c = 0; c < D; c += 32) {
    const __m512i a = v0 ? _mm512_loadu_si512(v0 + c) : _mm512_setzero_si512();
    const __m512i b = v1 ? _mm512_loadu_si512(v1 + c) : _mm512_setzero_si512();
    _mm512_storeu_si512(out + (c / 16) * 512 + i * 32, _mm512_permutex2var_epi16(a, lo_dims, b));
    _mm512_storeu_si512(out + (c / 16 + 1) * 512 + i * 32, _mm512_permutex2var_epi16(a, hi_dims, b));
  }
}

constexpr int64_t FEW_ROWS = 4;  // a group of at most this many rows runs its softmax row by row

// attend_split with tiles over a bfloat16 cache (same arguments and results; see the section comment).
void attend_split_amx(const float* q_rows, const int64_t* pos, int64_t rows, int64_t nheads, const int64_t* slots,
                      int64_t begin, int64_t end, const c10::BFloat16* k_cache, const c10::BFloat16* v_cache,
                      int64_t slot_stride, int64_t head_off, int64_t D, float softcap, float* m, float* l,
                      float* acc) {
  static_assert(BLOCK == 32, "a block is two 16-key score tiles and one 32-key weight tile");
  const int64_t groups = (rows + 15) / 16, kv_tile = BLOCK * D;
  thread_local std::vector<uint16_t> qth, qtl, kst, vst;
  thread_local std::vector<float> lm, ll, obuf;
  qth.resize(nheads * groups * D * 16);
  qtl.resize(qth.size());
  kst.resize(nheads * kv_tile);
  vst.resize(nheads * kv_tile);
  obuf.resize(16 * D);
  lm.assign(nheads * groups * 16, NEG_INF);
  ll.assign(nheads * groups * 16, 0.f);
  alignas(64) float s[BLOCK * 16];
  alignas(64) uint16_t ph[16 * 32] = {}, pl[16 * 32] = {};
  std::fill(acc, acc + nheads * rows * D, 0.f);
  for (int64_t h = 0; h < nheads; ++h)
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t at = (h * groups + g) * D * 16;
      query_tiles(q_rows + (h * rows + g * 16) * D, std::min<int64_t>(16, rows - g * 16), D, qth.data() + at,
                  qtl.data() + at);
    }
  amx_configure(groups == 1 ? rows : 16);
  const __m512i lanes16 = every_16th();
  for (int64_t t0 = begin; t0 < end; t0 += BLOCK) {
    const int64_t n = std::min(BLOCK, end - t0);
    // the next block's rows lie scattered over the pool: asked for now, their misses overlap this block's work
    for (int64_t t = t0 + BLOCK; t < std::min(end, t0 + 2 * BLOCK); ++t) {
      const char* kr = reinterpret_cast<const char*>(k_cache + slots[t] * slot_stride + head_off);
      const char* vr = reinterpret_cast<const char*>(v_cache + slots[t] * slot_stride + head_off);
      for (int64_t b = 0; b < nheads * D * int64_t(sizeof(c10::BFloat16)); b += 64) {
        _mm_prefetch(kr + b, _MM_HINT_T0);
        _mm_prefetch(vr + b, _MM_HINT_T0);
      }
    }
    for (int64_t h = 0; h < nheads; ++h) {  // the block's K rows copied, V laid out in key pairs
      uint16_t *kh = kst.data() + h * kv_tile, *vh = vst.data() + h * kv_tile;
      for (int64_t t = 0; t < BLOCK; ++t) {  // (inline copies: a memcpy call per 128-byte row costs more)
        if (t < n) {
          const c10::BFloat16* src = k_cache + slots[t0 + t] * slot_stride + head_off + h * D;
          for (int64_t c = 0; c < D; c += 32) _mm512_storeu_si512(kh + t * D + c, _mm512_loadu_si512(src + c));
        } else {
          for (int64_t c = 0; c < D; c += 32) _mm512_storeu_si512(kh + t * D + c, _mm512_setzero_si512());
        }
      }
      auto value = [&](int64_t t) -> const c10::BFloat16* {
        return t < n ? v_cache + slots[t0 + t] * slot_stride + head_off + h * D : nullptr;
      };
      for (int64_t i = 0; i < BLOCK / 2; ++i) stage_value_pair(value(2 * i), value(2 * i + 1), D, i, vh);
    }
    for (int64_t h = 0; h < nheads; ++h) {
      const uint16_t *kh = kst.data() + h * kv_tile, *vh = vst.data() + h * kv_tile;
      for (int64_t g = 0; g < groups; ++g) {
        const int64_t r0 = g * 16, cnt = std::min<int64_t>(16, rows - r0), hg = (h * groups + g) * 16;
        const uint16_t *qh = qth.data() + hg * D, *ql = qtl.data() + hg * D;
        // scores: s[t * 16 + r] for key t of the block and row r (keys 16-31 only when the block has them)
        const bool two = n > 16;
        for (int64_t half = 0; half < (two ? 2 : 1); ++half) {
          _tile_zero(4);
          for (int64_t c = 0; c < D; c += 32) {
            _tile_loadd(2, qh + c * 16, 64);
            _tile_loadd(3, ql + c * 16, 64);
            if (half) {
              _tile_loadd(1, kh + 16 * D + c, D * 2);
              _tile_dpbf16ps(4, 1, 2);
              _tile_dpbf16ps(4, 1, 3);
            } else {
              _tile_loadd(0, kh + c, D * 2);
              _tile_dpbf16ps(4, 0, 2);
              _tile_dpbf16ps(4, 0, 3);
            }
          }
          _tile_stored(4, s + 256 * half, 64);
        }
        if (softcap > 0.f) soft_cap(s, (two ? 2 : 1) * 256, softcap);
        alignas(64) float keep[16];
        float *mg = lm.data() + hg, *lg = ll.data() + hg;
        if (cnt <= FEW_ROWS) {  // per row: its 32 scores gathered, softmax_update (the same bits as in lanes)
          for (int64_t r = 0; r < cnt; ++r) {
            alignas(64) float row[BLOCK];
            _mm512_store_ps(row, _mm512_i32gather_ps(lanes16, s + r, 4));
            _mm512_store_ps(row + 16, two ? _mm512_i32gather_ps(lanes16, s + 256 + r, 4) : _mm512_setzero_ps());
            keep[r] = softmax_update(row, n, pos[r0 + r] - t0 + 1, mg[r], lg[r]);
            std::fill(row + n, row + BLOCK, 0.f);
            __m512i hi, lo;
            split_bf16(_mm512_load_ps(row), _mm512_load_ps(row + 16), hi, lo);
            _mm512_store_si512(ph + r * 32, hi);
            _mm512_store_si512(pl + r * 32, lo);
          }
        } else {  // every row at once as the lanes of vectors, then each row's weights gathered
          alignas(64) int32_t valid[16];
          for (int64_t i = 0; i < 16; ++i) valid[i] = i < cnt ? int32_t(std::min(pos[r0 + i] - t0 + 1, n)) : 0;
          softmax_lanes(s, n, valid, mg, lg, keep);
          for (int64_t t = n; t < BLOCK; ++t) _mm512_store_ps(s + t * 16, _mm512_setzero_ps());
          for (int64_t r = 0; r < cnt; ++r) {  // weights: row r's 32 keys as one tile row, hi and lo
            __m512i hi, lo;
            split_bf16(_mm512_i32gather_ps(lanes16, s + r, 4), _mm512_i32gather_ps(lanes16, s + 256 + r, 4), hi,
                       lo);
            _mm512_store_si512(ph + r * 32, hi);
            _mm512_store_si512(pl + r * 32, lo);
          }
        }
        _tile_loadd(6, ph, 64);
        _tile_loadd(7, pl, 64);
        for (int64_t j = 0; j < D / 16; ++j) {  // the block's output, rows x 16 dims at a time
          _tile_zero(5);
          if (j % 2) {
            _tile_loadd(1, vh + j * 512, 64);
            _tile_dpbf16ps(5, 6, 1);
            _tile_dpbf16ps(5, 7, 1);
          } else {
            _tile_loadd(0, vh + j * 512, 64);
            _tile_dpbf16ps(5, 6, 0);
            _tile_dpbf16ps(5, 7, 0);
          }
          _tile_stored(5, obuf.data() + j * 16, D * 4);
        }
        float* a = acc + (h * rows + r0) * D;
        for (int64_t i = 0; i < cnt; ++i) {
          const __m512 kf = _mm512_set1_ps(keep[i]);
          for (int64_t c = 0; c < D; c += 16)
            _mm512_storeu_ps(a + i * D + c, _mm512_fmadd_ps(_mm512_loadu_ps(a + i * D + c), kf,
                                                             _mm512_loadu_ps(obuf.data() + i * D + c)));
        }
      }
    }
  }
  _tile_release();
  rows_from_lanes(lm.data(), ll.data(), nheads, rows, rows, m, l);
}
#endif

// Rows (query x head, q pre-scaled) against the keys [begin, end) of `nheads` consecutive KV heads from
// head_off, read through `slots`: for head h, rows h * rows .. (h + 1) * rows - 1 of q_rows, m, l and acc
// ([nheads * rows, D]) get the running max, the sum of weights and the unnormalised output; pos[r] is row r's
// position (the same for every head). With every head of a slot in one task, its K/V rows are one contiguous
// run of nheads * D values, read once, instead of nheads strided pieces read by different tasks.
template <typename KV>
void attend_split(const float* q_rows, const int64_t* pos, int64_t rows, int64_t nheads, const int64_t* slots,
                  int64_t begin, int64_t end, const KV* k_cache, const KV* v_cache, int64_t slot_stride,
                  int64_t head_off, int64_t D, bool staged, float softcap, float* m, float* l, float* acc) {
#ifdef RADIXLM_AMX
  if constexpr (std::is_same_v<KV, c10::BFloat16>)
    if (uses_amx(D))
      return attend_split_amx(q_rows, pos, rows, nheads, slots, begin, end, k_cache, v_cache, slot_stride, head_off,
                              D, softcap, m, l, acc);
#endif
  thread_local std::vector<float> scores, kbuf, vbuf;  // reused: a decode step runs thousands of these
  scores.resize(std::max<int64_t>(rows, 16) * BLOCK);
  const bool direct = reads_in_place<KV>(D, rows);
  const int64_t lrows = lane_rows(D, rows), groups = (lrows + 15) / 16;  // rows [0, lrows) in lanes
  if (!direct) {
    kbuf.resize(BLOCK * D);
    vbuf.resize(BLOCK * D);
  }
  const float* keys[BLOCK];
  const float* values[BLOCK];
  const KV* keys_kv[BLOCK];  // direct: one head's rows (in the pool or in `stage`)
  const KV* values_kv[BLOCK];
  std::fill(acc, acc + nheads * rows * D, 0.f);
  for (int64_t r = 0; r < nheads * rows; ++r) {
    m[r] = NEG_INF;
    l[r] = 0.f;
  }
  thread_local std::vector<float> qt, lm, ll;  // lanes: q transposed, and m, l per lane (16 per group)
#ifdef RADIXLM_AVX512
  if (lrows > 0) {
    qt.resize(nheads * groups * 16 * D);
    lm.assign(nheads * groups * 16, NEG_INF);
    ll.assign(nheads * groups * 16, 0.f);
    for (int64_t h = 0; h < nheads; ++h)
      for (int64_t g = 0; g < groups; ++g)
        transpose_rows(q_rows + (h * rows + g * 16) * D, std::min<int64_t>(16, lrows - g * 16), D,
                       qt.data() + (h * groups + g) * 16 * D);
  }
#endif
  // When `staged`, each block's K and V rows (every head of the task, one contiguous run per slot) are first
  // copied into `stage`, then scored and accumulated from there. The slots are scattered over a pool far
  // bigger than the caches: a plain copy keeps many misses in flight at once, while the arithmetic's own
  // loads, one row at a time behind dependent FMAs, wait for each in turn (bench.paged_attention_op, a
  // 32 x 224-token decode step, 30 layers: 28.3 ms read in place, 16.3 ms staged on 2 threads; software
  // prefetching did not help). A small context that stays in cache skips the copy.
  const int64_t run = nheads * D;  // elements per slot and task
  thread_local std::vector<KV> stage;
  if (staged) stage.resize(2 * BLOCK * run);
  KV* kst = stage.data();
  KV* vst = kst + BLOCK * run;
  for (int64_t t0 = begin; t0 < end; t0 += BLOCK) {
    const int64_t n = std::min(BLOCK, end - t0);
    const KV* krow[BLOCK];  // slot t's run of the task's heads, in the pool or in `stage`
    const KV* vrow[BLOCK];
    for (int64_t t = 0; t < n; ++t) {
      krow[t] = k_cache + slots[t0 + t] * slot_stride + head_off;
      vrow[t] = v_cache + slots[t0 + t] * slot_stride + head_off;
    }
    if (staged) {  // K's rows, then V's: two passes of independent loads (one interleaved pass measured slower)
      for (int64_t t = 0; t < n; ++t) krow[t] = copy_run(kst + t * run, krow[t], run);
      for (int64_t t = 0; t < n; ++t) vrow[t] = copy_run(vst + t * run, vrow[t], run);
    }
    for (int64_t h = 0; h < nheads; ++h) {
      const float* qh = q_rows + h * rows * D;
      float *mh = m + h * rows, *lh = l + h * rows, *acch = acc + h * rows * D;
      for (int64_t t = 0; t < n; ++t) {
        keys_kv[t] = krow[t] + h * D;
        values_kv[t] = vrow[t] + h * D;
        if (!direct) {
          keys[t] = as_float(keys_kv[t], kbuf.data() + t * D, D);
          values[t] = as_float(values_kv[t], vbuf.data() + t * D, D);
        }
      }
#ifdef RADIXLM_AVX512
      for (int64_t g = 0; g < groups; ++g) {  // the steps below, for 16 rows at a time
        const int64_t r0 = g * 16, cnt = std::min<int64_t>(16, lrows - r0), hg = (h * groups + g) * 16;
        float* s = scores.data();  // [key][lane]
        block_scores_lanes(qt.data() + hg * D, keys, n, D, s);
        if (softcap > 0.f) soft_cap(s, n * 16, softcap);
        alignas(64) int32_t valid[16];
        alignas(64) float keep[16];
        for (int64_t i = 0; i < 16; ++i) valid[i] = i < cnt ? int32_t(std::min(pos[r0 + i] - t0 + 1, n)) : 0;
        softmax_lanes(s, n, valid, lm.data() + hg, ll.data() + hg, keep);
        float* a = acch + r0 * D;
        for (int64_t i = 0; i < cnt; ++i)
          if (keep[i] != 1.f) scale_add(a + i * D, keep[i], 0.f, a + i * D, D);
        int64_t i = 0;
        for (; i + 4 <= cnt; i += 4) accumulate_rows16<4, float>(a + i * D, s + i, values, n, D, 1, 16);
        switch (cnt - i) {
          case 3: accumulate_rows16<3, float>(a + i * D, s + i, values, n, D, 1, 16); break;
          case 2: accumulate_rows16<2, float>(a + i * D, s + i, values, n, D, 1, 16); break;
          case 1: accumulate_rows16<1, float>(a + i * D, s + i, values, n, D, 1, 16); break;
          default: break;
        }
      }
#endif
      const int64_t rest = rows - lrows;
      if (rest == 0) continue;
      const float* qr = qh + lrows * D;
      float *mr = mh + lrows, *lr = lh + lrows, *accr = acch + lrows * D;
      if (direct) block_scores<KV>(qr, rest, keys_kv, n, D, scores.data());
      else block_scores<float>(qr, rest, keys, n, D, scores.data());
      if (softcap > 0.f)
        for (int64_t r = 0; r < rest; ++r) soft_cap(scores.data() + r * BLOCK, n, softcap);
      for (int64_t r = 0; r < rest; ++r) {
        const float keep = softmax_update(scores.data() + r * BLOCK, n, pos[lrows + r] - t0 + 1, mr[r], lr[r]);
        if (keep != 1.f) scale_add(accr + r * D, keep, 0.f, accr + r * D, D);
      }
      if (direct) block_accumulate<KV>(accr, rest, scores.data(), values_kv, n, D);
      else block_accumulate<float>(accr, rest, scores.data(), values, n, D);
    }
  }
  if (lrows > 0) rows_from_lanes(lm.data(), ll.data(), nheads, rows, lrows, m, l);
}

// 1 / the softmax denominator of a row whose keys' running max is m and sum of exp(score - m) is l, with an
// attention sink (gpt-oss: a learned logit per head with no value) added to the denominator, times the
// exp(m - max) that rescales the row's accumulator to the common max: sum(exp(s - m) v) * inv is the output.
inline float sink_inv(float m, float l, float sink) {
  const float mx = std::max(m, sink);
  const float keep = std::isfinite(m) ? std::exp(m - mx) : 0.f;
  const float den = l * keep + std::exp(sink - mx);
  return den > 0.f ? keep / den : 0.f;
}

template <typename KV, typename QT>
void run(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& req_to_token,
         const at::Tensor& req_pool_indices, const at::Tensor& seq_lens, const at::Tensor& ext_lens, double scale,
         const float* sinks, float softcap, at::Tensor& out) {
  const int64_t H = q.size(1), D = q.size(2), Hkv = k_cache.size(1), G = H / Hkv, B = seq_lens.size(0);
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1);
  const int64_t slot_stride = Hkv * D, C = req_to_token.size(1);
  const int64_t* table = req_to_token.data_ptr<int64_t>();
  const int64_t* rows_idx = req_pool_indices.data_ptr<int64_t>();
  const int64_t* seq = seq_lens.data_ptr<int64_t>();
  const int64_t* ext = ext_lens.data_ptr<int64_t>();
  const QT* qp = q.data_ptr<QT>();
  QT* op = out.data_ptr<QT>();
  const KV* kp = k_cache.data_ptr<KV>();
  const KV* vp = v_cache.data_ptr<KV>();
  const float fscale = static_cast<float>(scale);

  // Splits of SPLIT keys: a request's result never depends on the rest of the batch (the same float sums
  // whatever runs beside it), and a long request still spreads over every thread. A request of one split
  // writes its output directly; the splits of longer ones leave partials (max, sum, output) that are merged
  // with their log-sum-exp afterwards. Partial row (request b, KV head h, split s, row r = j * G + g) lives
  // at part_start[b] + (h * nsplit[b] + s) * ext[b] * G + r.
  std::vector<int64_t> q_start(B + 1, 0), nsplit(B), split_start(B + 1, 0), part_start(B + 1, 0);
  for (int64_t b = 0; b < B; ++b) {
    q_start[b + 1] = q_start[b] + ext[b];
    nsplit[b] = std::max<int64_t>(1, (seq[b] + SPLIT - 1) / SPLIT);
    split_start[b + 1] = split_start[b] + nsplit[b];
    part_start[b + 1] = part_start[b] + (nsplit[b] > 1 ? Hkv * nsplit[b] * ext[b] * G : 0);
  }
  const int64_t parts = part_start[B], NS = split_start[B];
  std::vector<float> pm(parts), pl(parts), pacc(parts * D);
  auto slots_of = [&](int64_t b) { return table + rows_idx[b] * C; };

  // Units of work: a key range of one request's slots together with every other request whose slots over the
  // same range are the same ones (a prefix the radix cache shares): their rows are scored in one pass over
  // K/V, which is then read and widened once instead of once per request. Per row the arithmetic is the
  // same as alone (rows never mix), so sharing changes no result.
  std::vector<int64_t> split_req(NS), unit_of(NS), lead;  // lead[u]: the first split of unit u
  for (int64_t b = 0; b < B; ++b)
    for (int64_t s = 0; s < nsplit[b]; ++s) split_req[split_start[b] + s] = b;
  std::unordered_map<uint64_t, int64_t> by_range;
  if (B > 1) by_range.reserve(NS);
  for (int64_t i = 0; i < NS; ++i) {
    const int64_t b = split_req[i], begin = (i - split_start[b]) * SPLIT, end = std::min(seq[b], begin + SPLIT);
    const int64_t* sl = slots_of(b);
    if (B > 1) {
      uint64_t key = static_cast<uint64_t>(begin) * 0x9E3779B97F4A7C15ull ^ static_cast<uint64_t>(end) << 32;
      key ^= static_cast<uint64_t>(sl[begin]) * 0xC2B2AE3D27D4EB4Full ^ static_cast<uint64_t>(sl[end - 1]) << 17;
      const auto [it, fresh] = by_range.try_emplace(key, static_cast<int64_t>(lead.size()));
      if (!fresh) {
        const int64_t other = lead[it->second], ob = split_req[other];
        const int64_t obegin = (other - split_start[ob]) * SPLIT, oend = std::min(seq[ob], obegin + SPLIT);
        if (obegin == begin && oend == end &&
            std::memcmp(slots_of(ob) + begin, sl + begin, (end - begin) * sizeof(int64_t)) == 0) {
          unit_of[i] = it->second;
          continue;
        }
      }
    }
    unit_of[i] = static_cast<int64_t>(lead.size());  // a new unit (a hash collision just goes unshared)
    lead.push_back(i);
  }
  const int64_t U = static_cast<int64_t>(lead.size());
  std::vector<int64_t> member_start(U + 1, 0), members(NS), unit_rows(U, 0);
  for (int64_t i = 0; i < NS; ++i) {
    ++member_start[unit_of[i] + 1];
    unit_rows[unit_of[i]] += ext[split_req[i]] * G;
  }
  for (int64_t u = 0; u < U; ++u) member_start[u + 1] += member_start[u];
  {
    std::vector<int64_t> fill(member_start.begin(), member_start.end() - 1);
    for (int64_t i = 0; i < NS; ++i) members[fill[unit_of[i]]++] = i;
  }
  // Largest units first, handed out one at a time: a shared unit costs several plain ones.
  std::vector<int64_t> order(U);
  for (int64_t u = 0; u < U; ++u) order[u] = u;
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return unit_rows[a] > unit_rows[b]; });

  // A task is one unit over a group of HG KV heads: every head at once (each slot's K/V read as one run, see
  // attend_split) when there are units enough to keep every thread busy, else one head each, so a lone short
  // request still spreads over the threads. Per row the arithmetic is the same either way.
  const int64_t HG = U >= 4 * static_cast<int64_t>(at::get_num_threads()) ? Hkv : 1, groups = Hkv / HG;
  // Stage K/V (see attend_split) when the call reads more than an L2's worth: a step reads this per layer.
  int64_t kv_bytes = 0;
  for (int64_t u = 0; u < U; ++u) {
    const int64_t first = lead[u], fb = split_req[first], begin = (first - split_start[fb]) * SPLIT;
    kv_bytes += 2 * (std::min(seq[fb], begin + SPLIT) - begin) * slot_stride * static_cast<int64_t>(sizeof(KV));
  }
  const bool staged = kv_bytes >= (256 << 10);
  const int64_t tasks = U * groups;
  auto run_task = [&](int64_t task) {
    const int64_t u = order[task / groups], kvh0 = (task % groups) * HG, rows = unit_rows[u];
    thread_local std::vector<float> qbuf, mbuf, lbuf, accbuf;
    thread_local std::vector<int64_t> pos;
    qbuf.resize(HG * rows * D);
    pos.resize(rows);
    mbuf.resize(HG * rows);
    lbuf.resize(HG * rows);
    accbuf.resize(HG * rows * D);
    for (int64_t h = 0; h < HG; ++h) {
      int64_t row = 0;
      for (int64_t mi = member_start[u]; mi < member_start[u + 1]; ++mi) {
        const int64_t b = split_req[members[mi]];
        for (int64_t j = 0; j < ext[b]; ++j)
          for (int64_t g = 0; g < G; ++g, ++row) {
            const QT* src = qp + (q_start[b] + j) * qs0 + ((kvh0 + h) * G + g) * qs1;
            float* dst = qbuf.data() + (h * rows + row) * D;
            for (int64_t i = 0; i < D; ++i) dst[i] = static_cast<float>(src[i]) * fscale;
            pos[row] = seq[b] - ext[b] + j;
          }
      }
    }
    const int64_t first = lead[u], fb = split_req[first];
    const int64_t begin = (first - split_start[fb]) * SPLIT, end = std::min(seq[fb], begin + SPLIT);
    attend_split<KV>(qbuf.data(), pos.data(), rows, HG, slots_of(fb), begin, end, kp, vp, slot_stride, kvh0 * D, D,
                     staged, softcap, mbuf.data(), lbuf.data(), accbuf.data());
    for (int64_t h = 0; h < HG; ++h) {
      const int64_t kvh = kvh0 + h;
      const float *mh = mbuf.data() + h * rows, *lh = lbuf.data() + h * rows, *acch = accbuf.data() + h * rows * D;
      int64_t row = 0;
      for (int64_t mi = member_start[u]; mi < member_start[u + 1]; ++mi) {
        const int64_t i = members[mi], b = split_req[i], n = ext[b] * G;
        if (nsplit[b] == 1) {  // the whole request: normalise and write the output rows
          for (int64_t r = 0; r < n; ++r) {
            const float inv = sinks != nullptr ? sink_inv(mh[row + r], lh[row + r], sinks[kvh * G + r % G])
                              : lh[row + r] > 0.f ? 1.f / lh[row + r]
                                                  : 0.f;
            const float* a = acch + (row + r) * D;
            QT* dst = op + ((q_start[b] + r / G) * H + kvh * G + r % G) * D;
            for (int64_t c = 0; c < D; ++c) dst[c] = static_cast<QT>(a[c] * inv);
          }
        } else {
          const int64_t p0 = part_start[b] + (kvh * nsplit[b] + (i - split_start[b])) * n;
          std::copy(mh + row, mh + row + n, pm.begin() + p0);
          std::copy(lh + row, lh + row + n, pl.begin() + p0);
          std::copy(acch + row * D, acch + (row + n) * D, pacc.begin() + p0 * D);
        }
        row += n;
      }
    }
  };
  // Tasks are taken from a shared counter rather than in fixed ranges: units differ in size, and on a loaded
  // machine a descheduled thread leaves its share to the others.
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(tasks, at::get_num_threads()), 1, [&](int64_t, int64_t) {
    for (int64_t task; (task = next.fetch_add(1, std::memory_order_relaxed)) < tasks;) run_task(task);
  });

  // Merge the splits of each (request of several splits, KV head, row).
  std::vector<int64_t> long_reqs;
  for (int64_t b = 0; b < B; ++b)
    if (nsplit[b] > 1) long_reqs.push_back(b);
  if (long_reqs.empty()) return;
  at::parallel_for(0, static_cast<int64_t>(long_reqs.size()) * Hkv, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> o(D);
    for (int64_t task = lo; task < hi; ++task) {
      const int64_t b = long_reqs[task / Hkv], kvh = task % Hkv, rows = ext[b] * G;
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t j = r / G, g = r % G;
        float mx = sinks != nullptr ? sinks[kvh * G + g] : NEG_INF;  // the sink: one more logit, no value
        for (int64_t s = 0; s < nsplit[b]; ++s) mx = std::max(mx, pm[part_start[b] + (kvh * nsplit[b] + s) * rows + r]);
        std::fill(o.begin(), o.end(), 0.f);
        float total = 0.f;
        for (int64_t s = 0; s < nsplit[b]; ++s) {
          const int64_t p = part_start[b] + (kvh * nsplit[b] + s) * rows + r;
          if (pl[p] == 0.f) continue;
          const float w = std::exp(pm[p] - mx);
          total += w * pl[p];
          scale_add(o.data(), 1.f, w, pacc.data() + p * D, D);
        }
        if (sinks != nullptr) total += std::exp(sinks[kvh * G + g] - mx);
        const float inv = total > 0.f ? 1.f / total : 0.f;
        QT* dst = op + ((q_start[b] + j) * H + kvh * G + g) * D;
        for (int64_t i = 0; i < D; ++i) dst[i] = static_cast<QT>(o[i] * inv);
      }
    }
  });
}

void check_attention(const char* op, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& req_to_token, const at::Tensor& req_pool_indices, const at::Tensor& seq_lens,
                     const at::Tensor& ext_lens) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, op, ": q must be [T, H, D] with a contiguous last dim (got strides ",
              q.strides(), ")");
  TORCH_CHECK(k_cache.dim() == 3 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  v_cache.sizes() == k_cache.sizes() && v_cache.scalar_type() == k_cache.scalar_type(),
              op, ": k_cache and v_cache must be contiguous [S, Hkv, D] of one dtype");
  TORCH_CHECK(k_cache.size(2) == q.size(2) && q.size(1) % k_cache.size(1) == 0, op,
              ": head_dim differs or H is not a multiple of Hkv");
  for (const at::Tensor* t : {&req_to_token, &req_pool_indices, &seq_lens, &ext_lens})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous(), op, ": index tensors must be int64");
  TORCH_CHECK(seq_lens.size(0) == req_pool_indices.size(0) && ext_lens.size(0) == seq_lens.size(0), op,
              ": req_pool_indices, seq_lens and ext_lens must have one entry per request");
  const int64_t B = seq_lens.size(0), C = req_to_token.size(1), R = req_to_token.size(0);
  const int64_t *seq = seq_lens.data_ptr<int64_t>(), *ext = ext_lens.data_ptr<int64_t>();
  const int64_t* rows = req_pool_indices.data_ptr<int64_t>();
  int64_t total = 0;
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(ext[b] >= 1 && ext[b] <= seq[b] && seq[b] <= C && rows[b] >= 0 && rows[b] < R, op, ": request ", b,
                " needs 1 <= ext_len <= seq_len <= req_to_token's width and a valid row");
    total += ext[b];
  }
  TORCH_CHECK(total == q.size(0), op, ": sum(ext_lens) must equal q.size(0)");
}

// sinks: float32 [H], one logit per query head added to its softmax's denominator (gpt-oss), or none.
const float* sinks_of(const c10::optional<at::Tensor>& sinks, const at::Tensor& q) {
  if (!sinks.has_value()) return nullptr;
  TORCH_CHECK(sinks->scalar_type() == at::kFloat && sinks->dim() == 1 && sinks->is_contiguous() &&
                  sinks->size(0) == q.size(1),
              "paged_attention: sinks must be a contiguous float32 [H] with H = q.size(1) = ", q.size(1), ", got ",
              sinks->scalar_type(), " ", sinks->sizes());
  return sinks->data_ptr<float>();
}

// softcap: Gemma 2's attention logit soft-capping, 0 for none.
float softcap_of(const char* op, double softcap) {
  TORCH_CHECK(softcap >= 0.0 && std::isfinite(softcap), op, ": softcap must be >= 0 (0: none), got ", softcap);
  return static_cast<float>(softcap);
}

at::Tensor attend(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                  const at::Tensor& req_to_token, const at::Tensor& req_pool_indices, const at::Tensor& seq_lens,
                  const at::Tensor& ext_lens, double scale, const float* sinks, float softcap) {
  at::Tensor out = at::empty(q.sizes(), q.options());
  const auto kv = k_cache.scalar_type();
  const auto qt = q.scalar_type();
#define RADIXLM_RUN(KV_T, Q_T) \
  run<KV_T, Q_T>(q, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, ext_lens, scale, sinks, softcap, out)
#define RADIXLM_BY_Q(KV_T)                                        \
  if (qt == at::kFloat) RADIXLM_RUN(KV_T, float);                 \
  else if (qt == at::kBFloat16) RADIXLM_RUN(KV_T, c10::BFloat16); \
  else if (qt == at::kHalf) RADIXLM_RUN(KV_T, c10::Half);         \
  else TORCH_CHECK(false, "paged_attention: q must be float32, bfloat16 or float16");
  if (kv == at::kFloat) { RADIXLM_BY_Q(float) }
  else if (kv == at::kBFloat16) { RADIXLM_BY_Q(c10::BFloat16) }
  else if (kv == at::kHalf) { RADIXLM_BY_Q(c10::Half) }
  else TORCH_CHECK(false, "paged_attention: the KV cache must be float32, bfloat16 or float16");
#undef RADIXLM_BY_Q
#undef RADIXLM_RUN
  return out;
}

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& req_to_token, const at::Tensor& req_pool_indices,
                           const at::Tensor& seq_lens, const at::Tensor& ext_lens, double scale,
                           const c10::optional<at::Tensor>& sinks, double softcap) {
  check_attention("paged_attention", q, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, ext_lens);
  return attend(q, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, ext_lens, scale, sinks_of(sinks, q),
                softcap_of("paged_attention", softcap));
}

// ------------------------------------------------------------------------------------------- KV write
// One row of D values converted as torch's .to() does (round to nearest even), then stored.
template <typename S, typename C>
inline void store_row(const S* src, C* dst, int64_t n) {
  if constexpr (std::is_same_v<S, C>) {
    std::memcpy(dst, src, n * sizeof(C));
  } else {
    int64_t i = 0;
#if defined(RADIXLM_AVX2) && defined(__F16C__)
    if constexpr (std::is_same_v<S, float> && std::is_same_v<C, c10::Half>) {
      for (; i + 8 <= n; i += 8)
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    }
#endif
    for (; i < n; ++i) dst[i] = static_cast<C>(static_cast<float>(src[i]));
  }
}

template <typename S, typename C>
void write_rows(const at::Tensor& x, const int64_t* slots, at::Tensor& cache) {
  const int64_t T = x.size(0), Hkv = x.size(1), D = x.size(2), xs0 = x.stride(0), xs1 = x.stride(1);
  const S* src = x.data_ptr<S>();
  C* dst = cache.data_ptr<C>();
  at::parallel_for(0, T * Hkv, std::max<int64_t>(1, 16384 / D), [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      const int64_t t = i / Hkv, h = i % Hkv;
      store_row<S, C>(src + t * xs0 + h * xs1, dst + (slots[t] * Hkv + h) * D, D);
    }
  });
}

template <typename C>
void write_by_src(const at::Tensor& x, const int64_t* slots, at::Tensor& cache) {
  switch (x.scalar_type()) {
    case at::kFloat: write_rows<float, C>(x, slots, cache); break;
    case at::kBFloat16: write_rows<c10::BFloat16, C>(x, slots, cache); break;
    case at::kHalf: write_rows<c10::Half, C>(x, slots, cache); break;
    default: TORCH_CHECK(false, "paged_attention_kv: k and v must be float32, bfloat16 or float16");
  }
}

void write_kv(const at::Tensor& x, const int64_t* slots, at::Tensor& cache) {
  switch (cache.scalar_type()) {
    case at::kFloat: write_by_src<float>(x, slots, cache); break;
    case at::kBFloat16: write_by_src<c10::BFloat16>(x, slots, cache); break;
    case at::kHalf: write_by_src<c10::Half>(x, slots, cache); break;
    default: TORCH_CHECK(false, "paged_attention_kv: the KV cache must be float32, bfloat16 or float16");
  }
}

at::Tensor paged_attention_kv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                              const at::Tensor& out_cache_loc, at::Tensor k_cache, at::Tensor v_cache,
                              const at::Tensor& req_to_token, const at::Tensor& req_pool_indices,
                              const at::Tensor& seq_lens, const at::Tensor& ext_lens, double scale,
                              const c10::optional<at::Tensor>& sinks, double softcap) {
  const char* op = "paged_attention_kv";
  check_attention(op, q, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, ext_lens);
  const float* sink_logits = sinks_of(sinks, q);  // checked before anything is written
  const float cap = softcap_of(op, softcap);
  for (const at::Tensor* x : {&k, &v})
    TORCH_CHECK(x->dim() == 3 && x->stride(2) == 1 && x->size(0) == q.size(0) && x->size(1) == k_cache.size(1) &&
                    x->size(2) == k_cache.size(2),
                op, ": k and v must be [T, Hkv, D] (T = q's tokens, Hkv and D the cache's) with a contiguous last "
                "dim; got sizes ", x->sizes(), " strides ", x->strides());
  for (const at::Tensor* x : {&k, &v}) {
    const auto dt = x->scalar_type();
    TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf, op,
                ": k and v must be float32, bfloat16 or float16");
  }
  TORCH_CHECK(out_cache_loc.scalar_type() == at::kLong && out_cache_loc.dim() == 1 && out_cache_loc.is_contiguous() &&
                  out_cache_loc.size(0) == q.size(0),
              op, ": out_cache_loc must be a contiguous int64 [T] with one slot per new token");
  const int64_t* slots = out_cache_loc.data_ptr<int64_t>();
  const int64_t S = k_cache.size(0);
  for (int64_t t = 0; t < out_cache_loc.size(0); ++t)  // all checked before anything is written
    TORCH_CHECK(slots[t] >= 0 && slots[t] < S, op, ": out_cache_loc[", t, "] = ", slots[t],
                " is outside the KV pool's ", S, " slots");
  write_kv(k, slots, k_cache);
  write_kv(v, slots, v_cache);
  return attend(q, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, ext_lens, scale, sink_logits, cap);
}

}  // namespace

TORCH_LIBRARY_IMPL(radixlm, CPU, lib) {
  lib.impl("paged_attention", &paged_attention);
  lib.impl("paged_attention_kv", &paged_attention_kv);
}

// Whether bfloat16 caches take the AMX tiles (built with them, and the OS lends them to this process).
extern "C" int radixlm_paged_attention_amx() {
#ifdef RADIXLM_AMX
  return amx_ready() ? 1 : 0;
#else
  return 0;
#endif
}

// Which vector path this build took (tests check that a forced build is the variant it claims to be).
extern "C" const char* radixlm_paged_attention_isa() {
#if defined(RADIXLM_AVX512)
  return "avx512";
#elif defined(RADIXLM_AVX2)
  return "avx2";
#else
  return "scalar";
#endif
}
