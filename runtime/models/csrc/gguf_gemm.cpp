// y = x @ W^T straight from a GGUF tensor's blocks (the file's bytes, or the same bits interleaved 16 rows at a
// time: see "interleaved layout" below), for the common block types: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, MXFP4 (blocks
// of 32) and Q2_K, Q3_K, Q4_K, Q5_K, Q6_K (super-blocks of 256).
//
// Every type is read the same way. A weight row is first unpacked, block by block, into
//   u[k]      one unsigned integer per element (0..63; Q8_0 keeps its signed int8),
//   ls[k/4]   the float scale of each group of 4 elements (the scale of the sub-block it lies in),
//   off[k/16] the float offset of each group of 16 elements,
// so that w[k] = ls[k/4] * u[k] + off[k/16] is exactly gguf-py's dequantization (`gguf.quants.dequantize`).
// MXFP4 (a byte of E8M0 exponent e, then 16 bytes of E2M1 nibbles in Q4_0's element order) fits it too: twice an
// E2M1 value is one of the integers 0, ±1, ±2, ±3, ±4, ±6, ±8, ±12, so u = 2 * e2m1 + 12 (0..24), ls = 0.5 *
// 2**(e - 127) and off = -12 * ls, all exact in float32. An exponent of 255 (E8M0's NaN) is not checked per
// block: the loaders refuse it (runtime/models/mxfp4.py, gguf_linear.check_blocks).
// Activations are quantized per call, per row and block (32 elements for the 32-blocks, 256 for the K types,
// as llama.cpp's Q8_0 / Q8_K): a = qa * da, qa int8 in -127..127, da = max|a| / 127, rounded half to even.
// One output is then
//   y = sum_k ls[k/4] * da * (u[k] * qa[k]) + sum_g off[g] * da * (sum of qa over group g)
// where the products of 4 consecutive elements are summed in int32 by one u8 x s8 dot instruction
// (vpdpbusd with AVX512-VNNI, vpmaddubsw + vpmaddwd with AVX2: u <= 63 keeps vpmaddubsw's int16 pairs from
// saturating, and Q8_0 multiplies |q| by sign(q) * qa, llama.cpp's trick), converted to float and scaled per
// lane. A row is unpacked once per call and kept in L1 while every activation row is multiplied by it, so
// decode (1-4 rows) reads each weight byte once and prefill / verify (many rows) reuses the unpacked row.
// With AVX512-VNNI every type instead has a register path (`decode_rows` below): 64 weights unpacked in
// registers and multiplied by up to 4 activation rows at a time, sums kept in int32 per super-block. Q4_K,
// Q5_K, Q6_K, Q8_0 and MXFP4 tensors repacked at load into the interleaved layout (`gguf_repack`) take the
// interleaved paths instead (`interleaved_group`: one vpdpbusd advances 16 rows by 4 inputs, at any number
// of activation rows, 4 at a time), 2x (Q4_K) / 1.5x (Q6_K) faster at one row from L3 and 2-3x at 16-64.
//
// Builds: AVX512-VNNI (+VL, BW), else AVX2 + FMA + F16C, else a scalar loop; -DRADIXLM_FORCE_AVX2 and
// -DRADIXLM_PORTABLE pick the slower ones on any CPU so tests compare all three; radixlm_gguf_gemm_isa() says
// which was compiled. The op is declared from Python (runtime/models/gguf_linear.py).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <vector>

#include <sys/mman.h>

#if defined(__F16C__) && !defined(RADIXLM_PORTABLE)
#include <immintrin.h>
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__AVX512VL__) && \
    !defined(RADIXLM_PORTABLE) && !defined(RADIXLM_FORCE_AVX2)
#define RADIXLM_AVX512 1
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(RADIXLM_PORTABLE)
#define RADIXLM_AVX2 1
#include <immintrin.h>
#endif

namespace {

// ggml's type ids (GGMLQuantizationType)
enum : int64_t { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13,
                 Q6_K = 14, MXFP4 = 39 };

inline float h2f(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
#if defined(__F16C__) && !defined(RADIXLM_PORTABLE)
  return _cvtsh_ss(v);
#else
  return c10::detail::fp16_ieee_to_fp32_value(v);
#endif
}

inline void fill(float* p, int n, float v) {
  for (int i = 0; i < n; ++i) p[i] = v;
}

// 0.5 * 2**(e - 127) for an E8M0 exponent e < 255, by its bits (subnormal for e < 2), as ggml computes it
inline float e8m0_half(uint8_t e) {
  const uint32_t bits = e < 2 ? 0x00200000u << e : static_cast<uint32_t>(e - 1) << 23;
  float v;
  std::memcpy(&v, &bits, 4);
  return v;
}

// MXFP4's u per nibble: 2 * e2m1(code) + 12 (codes 8..15 are the negatives of 0..7)
constexpr uint8_t MXFP4_U[16] = {12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0};

#if defined(RADIXLM_AVX2) || defined(RADIXLM_AVX512)
#define RADIXLM_VEC 1
inline __m256i load32(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline void store32(uint8_t* p, __m256i v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v); }
inline __m256i lo_nib(__m256i q) { return _mm256_and_si256(q, _mm256_set1_epi8(0x0F)); }
inline __m256i hi_nib(__m256i q) { return _mm256_and_si256(_mm256_srli_epi16(q, 4), _mm256_set1_epi8(0x0F)); }
// 0x`bit` in each byte where (h & mask) != 0
inline __m256i bit_if(__m256i h, uint8_t mask, uint8_t bit) {
  const __m256i m = _mm256_set1_epi8(static_cast<char>(mask));
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(h, m), m), _mm256_set1_epi8(static_cast<char>(bit)));
}
// 16 nibble bytes -> 32 values: low nibbles then high nibbles (the 32-blocks' element order)
inline __m256i nibbles16(const uint8_t* qs) {
  const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m128i m = _mm_set1_epi8(0x0F);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), m), _mm_and_si128(q, m));
}
// MXFP4's 16 nibble bytes -> 32 u values (MXFP4_U looked up by one byte shuffle per 16)
inline __m256i mxfp4_u32(const uint8_t* qs) {
  const __m256i lut = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(MXFP4_U)));
  return _mm256_shuffle_epi8(lut, nibbles16(qs));
}
#endif

// ------------------------------------------------------------------------------------- one block, unpacked
// Each writes u[0..QK), ls[0..QK/4), off[0..QK/16) for one block.
void unpack_q4_0(const uint8_t* b, uint8_t* u, float* ls, float* off) {
  const float d = h2f(b);
  const uint8_t* qs = b + 2;
#if defined(RADIXLM_VEC)
  store32(u, nibbles16(qs));
#else
  for (int j = 0; j < 16; ++j) {
    u[j] = qs[j] & 0x0F;
    u[j + 16] = qs[j] >> 4;
  }
#endif
  fill(ls, 8, d);
  fill(off, 2, -8.f * d);
}

void unpack_q4_1(const uint8_t* b, uint8_t* u, float* ls, float* off) {
  const float d = h2f(b), m = h2f(b + 2);
  const uint8_t* qs = b + 4;
#if defined(RADIXLM_VEC)
  store32(u, nibbles16(qs));
#else
  for (int j = 0; j < 16; ++j) {
    u[j] = qs[j] & 0x0F;
    u[j + 16] = qs[j] >> 4;
  }
#endif
  fill(ls, 8, d);
  fill(off, 2, m);
}

void unpack_mxfp4(const uint8_t* b, uint8_t* u, float* ls, float* off) {
  const float d = e8m0_half(b[0]);
  const uint8_t* qs = b + 1;
#if defined(RADIXLM_VEC)
  store32(u, mxfp4_u32(qs));
#else
  for (int j = 0; j < 16; ++j) {
    u[j] = MXFP4_U[qs[j] & 0x0F];
    u[j + 16] = MXFP4_U[qs[j] >> 4];
  }
#endif
  fill(ls, 8, d);
  fill(off, 2, -12.f * d);
}

template <bool MIN>
void unpack_q5(const uint8_t* b, uint8_t* u, float* ls, float* off) {
  const float d = h2f(b);
  const float m = MIN ? h2f(b + 2) : -16.f * d;
  const uint8_t* p = b + (MIN ? 4 : 2);
  uint32_t qh;
  std::memcpy(&qh, p, 4);
  const uint8_t* qs = p + 4;
  for (int j = 0; j < 16; ++j) {
    u[j] = (qs[j] & 0x0F) | (((qh >> j) & 1) << 4);
    u[j + 16] = (qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
  }
  fill(ls, 8, d);
  fill(off, 2, m);
}

void unpack_q8_0(const uint8_t* b, uint8_t* u, float* ls, float* off) {
  std::memcpy(u, b + 2, 32);  // signed: the dot reads it as int8
  fill(ls, 8, h2f(b));
  fill(off, 2, 0.f);
}

// 6-bit scale and min of sub-block j of Q4_K / Q5_K (ggml's get_scale_min_k4)
inline void scale_min_k4(int j, const uint8_t* q, int& sc, int& mn) {
  if (j < 4) {
    sc = q[j] & 63;
    mn = q[j + 4] & 63;
  } else {
    sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    mn = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

template <bool HIGH>
void unpack_q45_k(const uint8_t* b, uint8_t* u, float* ls, float* off) {
  const float d = h2f(b), dmin = h2f(b + 2);
  const uint8_t* scales = b + 4;
  const uint8_t* qh = b + 16;                  // Q5_K only
  const uint8_t* qs = b + (HIGH ? 48 : 16);
#if defined(RADIXLM_VEC)
  const __m256i h = HIGH ? load32(qh) : _mm256_setzero_si256();
  for (int j = 0; j < 4; ++j) {
    const __m256i q = load32(qs + 32 * j);
    __m256i lo = lo_nib(q), hi = hi_nib(q);
    if (HIGH) {
      lo = _mm256_or_si256(lo, bit_if(h, static_cast<uint8_t>(1u << (2 * j)), 0x10));
      hi = _mm256_or_si256(hi, bit_if(h, static_cast<uint8_t>(2u << (2 * j)), 0x10));
    }
    store32(u + 64 * j, lo);
    store32(u + 64 * j + 32, hi);
  }
#else
  for (int j = 0; j < 4; ++j) {
    const uint8_t* q = qs + 32 * j;
    uint8_t* o = u + 64 * j;
    for (int l = 0; l < 32; ++l) {
      uint8_t lo = q[l] & 0x0F, hi = q[l] >> 4;
      if (HIGH) {
        lo |= ((qh[l] >> (2 * j)) & 1) << 4;
        hi |= ((qh[l] >> (2 * j + 1)) & 1) << 4;
      }
      o[l] = lo;
      o[l + 32] = hi;
    }
  }
#endif
  for (int s = 0; s < 8; ++s) {
    int sc, mn;
    scale_min_k4(s, scales, sc, mn);
    fill(ls + 8 * s, 8, d * static_cast<float>(sc));
    fill(off + 2 * s, 2, -dmin * static_cast<float>(mn));
  }
}

void unpack_q6_k(const uint8_t* b, uint8_t* u, float* ls, float* off) {
  const uint8_t* ql = b;
  const uint8_t* qh = b + 128;
  const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
  const float d = h2f(b + 208);
#if defined(RADIXLM_VEC)
  const __m256i m30 = _mm256_set1_epi8(0x30);
  for (int h = 0; h < 2; ++h) {
    const __m256i a = load32(ql + 64 * h), c = load32(ql + 64 * h + 32), hh = load32(qh + 32 * h);
    uint8_t* o = u + 128 * h;
    store32(o, _mm256_or_si256(lo_nib(a), _mm256_and_si256(_mm256_slli_epi16(hh, 4), m30)));
    store32(o + 32, _mm256_or_si256(lo_nib(c), _mm256_and_si256(_mm256_slli_epi16(hh, 2), m30)));
    store32(o + 64, _mm256_or_si256(hi_nib(a), _mm256_and_si256(hh, m30)));
    store32(o + 96, _mm256_or_si256(hi_nib(c), _mm256_and_si256(_mm256_srli_epi16(hh, 2), m30)));
  }
#else
  for (int h = 0; h < 2; ++h) {
    const uint8_t* l0 = ql + 64 * h;
    const uint8_t* hh = qh + 32 * h;
    uint8_t* o = u + 128 * h;
    for (int l = 0; l < 32; ++l) {
      o[l] = (l0[l] & 0x0F) | (((hh[l] >> 0) & 3) << 4);
      o[l + 32] = (l0[l + 32] & 0x0F) | (((hh[l] >> 2) & 3) << 4);
      o[l + 64] = (l0[l] >> 4) | (((hh[l] >> 4) & 3) << 4);
      o[l + 96] = (l0[l + 32] >> 4) | (((hh[l] >> 6) & 3) << 4);
    }
  }
#endif
  for (int s = 0; s < 16; ++s) {  // sub-blocks of 16, in element order
    const float dl = d * static_cast<float>(sc[s]);
    fill(ls + 4 * s, 4, dl);
    off[s] = -32.f * dl;
  }
}

void unpack_q2_k(const uint8_t* b, uint8_t* u, float* ls, float* off) {
  const uint8_t* scales = b;
  const uint8_t* qs = b + 16;
  const float d = h2f(b + 80), dmin = h2f(b + 82);
  for (int h = 0; h < 2; ++h) {
    const uint8_t* q = qs + 32 * h;
    for (int j = 0; j < 4; ++j) {
      uint8_t* o = u + 128 * h + 32 * j;
      for (int l = 0; l < 32; ++l) o[l] = (q[l] >> (2 * j)) & 3;
    }
  }
  for (int s = 0; s < 16; ++s) {
    fill(ls + 4 * s, 4, d * static_cast<float>(scales[s] & 0xF));
    off[s] = -dmin * static_cast<float>(scales[s] >> 4);
  }
}

void unpack_q3_k(const uint8_t* b, uint8_t* u, float* ls, float* off) {
  const uint8_t* hm = b;
  const uint8_t* qs = b + 32;
  const float d = h2f(b + 108);
  uint32_t aux[4];
  std::memcpy(aux, b + 96, 12);
  const uint32_t k1 = 0x03030303, k2 = 0x0f0f0f0f, tmp = aux[2];
  aux[2] = ((aux[0] >> 4) & k2) | (((tmp >> 4) & k1) << 4);
  aux[3] = ((aux[1] >> 4) & k2) | (((tmp >> 6) & k1) << 4);
  aux[0] = (aux[0] & k2) | (((tmp >> 0) & k1) << 4);
  aux[1] = (aux[1] & k2) | (((tmp >> 2) & k1) << 4);
  const int8_t* scales = reinterpret_cast<const int8_t*>(aux);
  for (int h = 0; h < 2; ++h) {
    const uint8_t* q = qs + 32 * h;
    for (int j = 0; j < 4; ++j) {
      const uint8_t mask = static_cast<uint8_t>(1u << (4 * h + j));
      uint8_t* o = u + 128 * h + 32 * j;
      for (int l = 0; l < 32; ++l) o[l] = ((q[l] >> (2 * j)) & 3) | ((hm[l] & mask) ? 4 : 0);
    }
  }
  for (int s = 0; s < 16; ++s) {
    const float dl = d * static_cast<float>(scales[s] - 32);
    fill(ls + 4 * s, 4, dl);
    off[s] = -4.f * dl;
  }
}

using UnpackFn = void (*)(const uint8_t*, uint8_t*, float*, float*);

struct TypeInfo {
  int64_t qk, bytes;
  bool is_signed;
  UnpackFn unpack;
};

bool type_info(int64_t t, TypeInfo& info) {
  switch (t) {
    case Q4_0: info = {32, 18, false, unpack_q4_0}; return true;
    case Q4_1: info = {32, 20, false, unpack_q4_1}; return true;
    case Q5_0: info = {32, 22, false, unpack_q5<false>}; return true;
    case Q5_1: info = {32, 24, false, unpack_q5<true>}; return true;
    case Q8_0: info = {32, 34, true, unpack_q8_0}; return true;
    case MXFP4: info = {32, 17, false, unpack_mxfp4}; return true;
    case Q2_K: info = {256, 84, false, unpack_q2_k}; return true;
    case Q3_K: info = {256, 110, false, unpack_q3_k}; return true;
    case Q4_K: info = {256, 144, false, unpack_q45_k<false>}; return true;
    case Q5_K: info = {256, 176, false, unpack_q45_k<true>}; return true;
    case Q6_K: info = {256, 210, false, unpack_q6_k}; return true;
    default: return false;
  }
}

// --------------------------------------------------------------------------------------- interleaved layout
// For the AVX512 decode paths, a tensor of Q4_K, Q5_K, Q6_K, Q8_0 or MXFP4 may be repacked once at load
// (`gguf_repack`): every group of NR = 16 consecutive rows is rewritten so that the same bytes of the 16 rows'
// block b lie side by side, and one 64-byte load holds 4 consecutive quantized bytes of each of the 16 rows (one
// 32-bit lane per row), which one vpdpbusd multiplies by 4 broadcast activations. The bits are only moved (Q8_0's
// int8 q is stored as q + 128, unsigned), never re-quantized, and the tensor keeps its shape and size: group g's
// block b is the CHUNK = 16 * BYTES bytes at g * 16 * row bytes + b * CHUNK, a list of pieces, each piece a few
// bytes of the file's block (`Piece`) for the 16 rows side by side ([16 rows][size]), in the order the kernel
// reads them. Q6_K's and Q8_0's chunks are 32 bytes past a multiple of 64 long: a chunk that starts 32 bytes past
// a 64-byte boundary of the tensor puts its 32 bytes of fp16 d first, so the quantized bytes' 64-byte loads stay
// aligned. Rows past the last whole group keep the file's layout in place. The part's type id is then the GGML
// id + INTERLEAVED.
constexpr int64_t INTERLEAVED = 256;
constexpr int64_t NR = 16;

struct Piece {
  int off, size;  // bytes [off, off + size) of the file's block: 1, 2 or 4
  uint8_t flip;   // xor'ed into every byte (Q8_0: q + 128)
};
struct Place {  // a piece's bytes of row i lie at chunk + at + i * size
  int off, at, size;
  uint32_t flip;
};
struct Layout {
  int bytes = 0;
  std::vector<Piece> pieces;
  int lead = -1;              // the piece (d) put first in a chunk that starts 32 bytes past a 64-byte boundary
  std::vector<Place> places[2];  // the pieces placed, without and with the lead piece first
};

void place_pieces(Layout& l) {
  for (int lead = 0; lead < 2; ++lead) {
    int at = 0;
    auto put = [&](const Piece& p) {
      l.places[lead].push_back({p.off, at, p.size, p.flip * 0x01010101u});
      at += static_cast<int>(NR) * p.size;
    };
    if (lead && l.lead >= 0) put(l.pieces[l.lead]);
    for (int j = 0; j < static_cast<int>(l.pieces.size()); ++j)
      if (!(lead && j == l.lead)) put(l.pieces[j]);
  }
}

Layout make_layout(int64_t t) {
  Layout l;
  auto add = [&](int off, int size, uint8_t flip = 0) { l.pieces.push_back({off, size, flip}); };
  switch (t) {
    case Q4_K:  // d, dmin, the 12 bytes of 6-bit scales and mins one by one, qs 4 bytes at a time
    case Q5_K:  // the same, then qh, then qs
      l.bytes = t == Q4_K ? 144 : 176;
      add(0, 2), add(2, 2);
      for (int j = 0; j < 12; ++j) add(4 + j, 1);
      if (t == Q5_K)
        for (int p = 0; p < 8; ++p) add(16 + 4 * p, 4);
      for (int c = 0; c < 32; ++c) add((t == Q4_K ? 16 : 48) + 4 * c, 4);
      break;
    case Q6_K:  // per half h and p < 8: ql[64h + 4p], ql[64h + 32 + 4p], qh[32h + 4p]; the 16 scales; d
      l.bytes = 210;
      for (int h = 0; h < 2; ++h)
        for (int p = 0; p < 8; ++p) add(64 * h + 4 * p, 4), add(64 * h + 32 + 4 * p, 4), add(128 + 32 * h + 4 * p, 4);
      for (int s = 0; s < 16; ++s) add(192 + s, 1);
      add(208, 2);
      l.lead = static_cast<int>(l.pieces.size()) - 1;
      break;
    case Q8_0:  // qs + 128, 4 bytes at a time; d
      l.bytes = 34;
      for (int p = 0; p < 8; ++p) add(2 + 4 * p, 4, 0x80);
      add(0, 2);
      l.lead = 8;
      break;
    case MXFP4:  // the nibble bytes 4 at a time (elements j..j+3 low, j+16..j+19 high); the exponent byte
      l.bytes = 17;
      for (int p = 0; p < 4; ++p) add(1 + 4 * p, 4);
      add(0, 1);
      break;
    default: break;
  }
  place_pieces(l);
  return l;
}

const Layout* interleaved_layout(int64_t t) {
  static const Layout q4k = make_layout(Q4_K), q5k = make_layout(Q5_K), q6k = make_layout(Q6_K),
                      q80 = make_layout(Q8_0), mx = make_layout(MXFP4);
  switch (t) {
    case Q4_K: return &q4k;
    case Q5_K: return &q5k;
    case Q6_K: return &q6k;
    case Q8_0: return &q80;
    case MXFP4: return &mx;
    default: return nullptr;
  }
}

// Moves one row's block between the file's layout (`blk`) and its place in an interleaved chunk (row i < 16);
// `lead`: the chunk starts 32 bytes past a 64-byte boundary.
template <bool TO_CHUNK>
inline void move_block(const Layout& l, uint8_t* blk, uint8_t* chunk, int64_t i, bool lead) {
  for (const Place& p : l.places[lead ? 1 : 0]) {
    uint8_t* c = chunk + p.at + i * p.size;
    uint8_t* f = blk + p.off;
    uint8_t* dst = TO_CHUNK ? c : f;
    const uint8_t* src = TO_CHUNK ? f : c;
    if (p.size == 4) {
      uint32_t v;
      std::memcpy(&v, src, 4);
      v ^= p.flip;
      std::memcpy(dst, &v, 4);
    } else if (p.size == 2) {
      std::memcpy(dst, src, 2);
    } else {
      *dst = *src;
    }
  }
}

// Whether the chunk at byte `offset` of an interleaved tensor puts its lead piece first.
inline bool lead_first(int64_t offset) { return (offset & 63) == 32; }

// Row n of an interleaved tensor W (rows of rb bytes) in the file's layout, into out [rb].
void gather_row(const Layout& l, const uint8_t* W, int64_t rows, int64_t rb, int64_t n, uint8_t* out) {
  if (n >= rows / NR * NR) {
    std::memcpy(out, W + n * rb, rb);
    return;
  }
  const int64_t group = n / NR * NR * rb;
  for (int64_t b = 0; b < rb / l.bytes; ++b) {
    const int64_t chunk = group + b * NR * l.bytes;
    move_block<false>(l, out + b * l.bytes, const_cast<uint8_t*>(W + chunk), n % NR, lead_first(chunk));
  }
}

// ------------------------------------------------------------------------------------------- activations
// Rows of x quantized per block of `qk`: qa int8 [M, K], dl = da per group of 4 [M, K/4], sg = da * (sum of
// qa over each group of 16) [M, K/16].
struct Acts {
  std::vector<int8_t> qa;
  std::vector<float> dl, sg, s32;  // s32: da * (sum of qa) per group of 32 [M, K/32]
  std::vector<int32_t> i16;        // sum of qa per group of 16 [M, K/16] (the interleaved paths' offsets)
};

void quantize_rows(const float* x, int64_t M, int64_t K, int64_t qk, Acts& a) {
  a.qa.resize(M * K);
  a.dl.resize(M * K / 4);
  a.sg.resize(M * K / 16);
  a.s32.resize(M * K / 32);
  a.i16.resize(M * K / 16);
  at::parallel_for(0, M, 8, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      for (int64_t b0 = 0; b0 < K; b0 += qk) {
        const float* xb = x + r * K + b0;
        int8_t* q = a.qa.data() + r * K + b0;
        float d;
#if defined(RADIXLM_AVX512)
        // the same float operations 16 lanes at a time (vcvtps2dq rounds half to even, as nearbyint does,
        // under the default MXCSR, checked here)
        if ((_mm_getcsr() & 0x6000) == 0) {
          __m512 mx = _mm512_setzero_ps();
          for (int64_t i = 0; i < qk; i += 16) mx = _mm512_max_ps(mx, _mm512_abs_ps(_mm512_loadu_ps(xb + i)));
          d = _mm512_reduce_max_ps(mx) / 127.f;
          const __m512 id = _mm512_set1_ps(d != 0.f ? 1.f / d : 0.f);
          for (int64_t g = 0; g < qk / 16; ++g) {
            __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xb + 16 * g), id));
            v = _mm512_min_epi32(_mm512_max_epi32(v, _mm512_set1_epi32(-127)), _mm512_set1_epi32(127));
            _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16 * g), _mm512_cvtepi32_epi8(v));
            const int32_t sum = _mm512_reduce_add_epi32(v);
            a.sg[(r * K + b0) / 16 + g] = d * static_cast<float>(sum);
            a.i16[(r * K + b0) / 16 + g] = sum;
          }
        } else
#endif
        {
          float amax = 0.f;
          for (int64_t i = 0; i < qk; ++i) amax = std::max(amax, std::fabs(xb[i]));
          d = amax / 127.f;
          const float id = d != 0.f ? 1.f / d : 0.f;
          for (int64_t i = 0; i < qk; ++i) {
            const float v = std::nearbyint(xb[i] * id);
            q[i] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, v)));
          }
          for (int64_t g = 0; g < qk / 16; ++g) {
            int32_t s = 0;
            for (int i = 0; i < 16; ++i) s += q[16 * g + i];
            a.sg[(r * K + b0) / 16 + g] = d * static_cast<float>(s);
            a.i16[(r * K + b0) / 16 + g] = s;
          }
        }
        fill(a.dl.data() + (r * K + b0) / 4, static_cast<int>(qk / 4), d);
        for (int64_t g = 0; g < qk / 32; ++g)
          a.s32[(r * K + b0) / 32 + g] = a.sg[(r * K + b0) / 16 + 2 * g] + a.sg[(r * K + b0) / 16 + 2 * g + 1];
      }
    }
  });
}

// --------------------------------------------------------------------------------------------- row dots
// sum_k ls[k/4] * dl[k/4] * u[k] * qa[k] over one row of K (K a multiple of 32).
template <bool SIGNED>
inline float row_dot(const uint8_t* u, const float* ls, const int8_t* qa, const float* dl, int64_t K) {
#if defined(RADIXLM_AVX512)
  __m512 acc = _mm512_setzero_ps(), acc2 = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 128 <= K; k += 128) {  // two independent chains (fma latency)
    __m512i w = _mm512_loadu_si512(u + k), w2 = _mm512_loadu_si512(u + k + 64);
    __m512i a = _mm512_loadu_si512(qa + k), a2 = _mm512_loadu_si512(qa + k + 64);
    if (SIGNED) {
      a = _mm512_mask_sub_epi8(a, _mm512_movepi8_mask(w), _mm512_setzero_si512(), a);
      a2 = _mm512_mask_sub_epi8(a2, _mm512_movepi8_mask(w2), _mm512_setzero_si512(), a2);
      w = _mm512_abs_epi8(w);
      w2 = _mm512_abs_epi8(w2);
    }
    const __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, a);
    const __m512i p2 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w2, a2);
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p),
                          _mm512_mul_ps(_mm512_loadu_ps(ls + k / 4), _mm512_loadu_ps(dl + k / 4)), acc);
    acc2 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p2),
                           _mm512_mul_ps(_mm512_loadu_ps(ls + k / 4 + 16), _mm512_loadu_ps(dl + k / 4 + 16)), acc2);
  }
  acc = _mm512_add_ps(acc, acc2);
  for (; k + 64 <= K; k += 64) {
    __m512i w = _mm512_loadu_si512(u + k);
    __m512i a = _mm512_loadu_si512(qa + k);
    if (SIGNED) {  // |w| * (sign(w) * a): vpdpbusd multiplies unsigned by signed
      const __mmask64 neg = _mm512_movepi8_mask(w);
      a = _mm512_mask_sub_epi8(a, neg, _mm512_setzero_si512(), a);
      w = _mm512_abs_epi8(w);
    }
    const __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, a);
    const __m512 s = _mm512_mul_ps(_mm512_loadu_ps(ls + k / 4), _mm512_loadu_ps(dl + k / 4));
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), s, acc);
  }
  float total = _mm512_reduce_add_ps(acc);
  if (k < K) {  // one block of 32 left
    __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(u + k));
    __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qa + k));
    if (SIGNED) {
      a = _mm256_sign_epi8(a, w);
      w = _mm256_abs_epi8(w);
    }
    const __m256i p = _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, a);
    const __m256 s = _mm256_mul_ps(_mm256_loadu_ps(ls + k / 4), _mm256_loadu_ps(dl + k / 4));
    const __m256 v = _mm256_mul_ps(_mm256_cvtepi32_ps(p), s);
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_shuffle_ps(h, h, 1));
    total += _mm_cvtss_f32(h);
  }
  return total;
#elif defined(RADIXLM_AVX2)
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 32) {
    __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(u + k));
    __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qa + k));
    if (SIGNED) {
      a = _mm256_sign_epi8(a, w);
      w = _mm256_abs_epi8(w);
    }
    const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(w, a), ones);
    const __m256 s = _mm256_mul_ps(_mm256_loadu_ps(ls + k / 4), _mm256_loadu_ps(dl + k / 4));
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), s, acc);
  }
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_shuffle_ps(h, h, 1));
  return _mm_cvtss_f32(h);
#else
  float total = 0.f;
  for (int64_t g = 0; g < K / 4; ++g) {
    int32_t s = 0;
    for (int i = 0; i < 4; ++i) {
      const int32_t w = SIGNED ? static_cast<int32_t>(static_cast<int8_t>(u[4 * g + i])) : u[4 * g + i];
      s += w * qa[4 * g + i];
    }
    total += static_cast<float>(s) * (ls[g] * dl[g]);
  }
  return total;
#endif
}

inline float offset_dot(const float* off, const float* sg, int64_t n) {
  int64_t g = 0;
  float s = 0.f;
#if defined(RADIXLM_AVX512)
  __m512 acc = _mm512_setzero_ps();
  for (; g + 16 <= n; g += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(off + g), _mm512_loadu_ps(sg + g), acc);
  s = _mm512_reduce_add_ps(acc);
#elif defined(RADIXLM_AVX2)
  __m256 acc = _mm256_setzero_ps();
  for (; g + 8 <= n; g += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(off + g), _mm256_loadu_ps(sg + g), acc);
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_shuffle_ps(h, h, 1));
  s = _mm_cvtss_f32(h);
#endif
  for (; g < n; ++g) s += off[g] * sg[g];
  return s;
}

// One part: rows [n0, n1) of W (N rows of K elements of type `info`) against M activation rows, quantized as
// `quantize_rows` leaves them (qa [M, K], dl [M, K/4], sg [M, K/16]; the MoE op passes a slice of its rows).
template <bool SIGNED, int64_t QK, int64_t BYTES, UnpackFn UNPACK>
void part_rows(const uint8_t* W, int64_t K, const int8_t* qa, const float* dl, const float* sg, int64_t M,
               float* y, int64_t ldy, int64_t n0, int64_t n1) {
  const int64_t nb = K / QK, row_bytes = nb * BYTES;
  // one unpacked row, 64-byte aligned
  struct Free {
    void operator()(void* p) const { std::free(p); }
  };
  const size_t bytes = static_cast<size_t>(K + K + K / 4) + 256;
  std::unique_ptr<uint8_t, Free> buf(static_cast<uint8_t*>(std::aligned_alloc(64, (bytes + 63) / 64 * 64)));
  uint8_t* u = buf.get();
  float* ls = reinterpret_cast<float*>(u + K);
  float* off = ls + K / 4;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = W + n * row_bytes;
    for (int64_t b = 0; b < nb; ++b)
      UNPACK(row + b * BYTES, u + b * QK, ls + b * QK / 4, off + b * QK / 16);
    for (int64_t m = 0; m < M; ++m) {
      const float v = row_dot<SIGNED>(u, ls, qa + m * K, dl + m * K / 4, K) + offset_dot(off, sg + m * K / 16, K / 16);
      y[m * ldy + n] = v;
    }
  }
}

#if defined(RADIXLM_AVX512)
// ------------------------------------------------------------------------------ decode rows (1..4), AVX-512
// The common types read in registers, no row buffer: each 64 weights are unpacked once and multiplied by up
// to four activation rows. Q4_K / Q5_K / Q6_K sum u * qa in int16 pairs (vpmaddubsw: u <= 63) and multiply by the
// integer sub-block scales while accumulating in int32 (vpdpwssd), one float FMA per super-block and row;
// their mins / -32 offsets use the activations' group sums. Q8_0 and the other 32-blocks take two blocks per
// 512-bit dot.
// rows m0.. of the quantized activations (Acts), as the register paths read them
struct ActView {
  const int8_t* qa;
  const float *dl, *sg, *s32;
  const int32_t* i16;
};

inline __m512i two32(__m256i lo, __m256i hi) { return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1); }
inline __m512 two_scales(float a, float b) {
  return _mm512_castpd_ps(
      _mm512_insertf64x4(_mm512_castps_pd(_mm512_set1_ps(a)), _mm256_castps_pd(_mm256_set1_ps(b)), 1));
}
// int16 lane i of the result = s[g(i)], for 16 lanes per 2 groups of 32 (K4) or 8 lanes per group of 16 (K6)
inline __m512i lane_index(int first, int lanes_per_group) {
  alignas(64) int16_t idx[32];
  for (int i = 0; i < 32; ++i) idx[i] = static_cast<int16_t>(first + i / lanes_per_group);
  return _mm512_load_si512(idx);
}

template <int MR, bool HIGH>  // HIGH: Q5_K (a fifth bit per weight in qh), else Q4_K
void q45_k_rows(const uint8_t* W, int64_t K, const ActView& a, float* y, int64_t ldy, int64_t n0, int64_t n1) {
  constexpr int64_t BYTES = HIGH ? 176 : 144, QS = HIGH ? 48 : 16;
  const int64_t nb = K / 256, rb = nb * BYTES;
  const __m512i idx[4] = {lane_index(0, 16), lane_index(2, 16), lane_index(4, 16), lane_index(6, 16)};
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = W + n * rb;
    __m512 facc[MR];
    __m256 oacc[MR];
    for (int m = 0; m < MR; ++m) facc[m] = _mm512_setzero_ps(), oacc[m] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = row + b * BYTES;
      const float d = h2f(blk), dmin = h2f(blk + 2);
      const __m256i qh = HIGH ? load32(blk + 16) : _mm256_setzero_si256();
      // ggml's 12-byte scales -> 8 scales, 8 mins (bytes), as llama.cpp unpacks them
      uint32_t ut[4];
      std::memcpy(ut, blk + 4, 12);
      const uint32_t k1 = 0x3f3f3f3f, k2 = 0x0f0f0f0f, k3 = 0x03030303;
      ut[3] = ((ut[2] >> 4) & k2) | (((ut[1] >> 6) & k3) << 4);
      const uint32_t aux = ut[1] & k1;
      ut[1] = (ut[2] & k2) | (((ut[0] >> 6) & k3) << 4);
      ut[2] = aux;
      ut[0] &= k1;
      const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(ut));
      const __m512i scv = _mm512_castsi128_si512(_mm_cvtepu8_epi16(packed));
      const __m256 mins = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(packed, 8))),
                                        _mm256_set1_ps(-dmin));
      __m512i iacc[MR];
      for (int m = 0; m < MR; ++m) iacc[m] = _mm512_setzero_si512();
      for (int j = 0; j < 4; ++j) {
        const __m256i q = load32(blk + QS + 32 * j);
        __m256i lo = lo_nib(q), hi = hi_nib(q);
        if (HIGH) {
          lo = _mm256_or_si256(lo, bit_if(qh, static_cast<uint8_t>(1u << (2 * j)), 0x10));
          hi = _mm256_or_si256(hi, bit_if(qh, static_cast<uint8_t>(2u << (2 * j)), 0x10));
        }
        const __m512i u = two32(lo, hi);
        const __m512i s = _mm512_permutexvar_epi16(idx[j], scv);
        for (int m = 0; m < MR; ++m) {
          const __m512i av = _mm512_loadu_si512(a.qa + m * K + b * 256 + 64 * j);
          iacc[m] = _mm512_dpwssd_epi32(iacc[m], _mm512_maddubs_epi16(u, av), s);
        }
      }
      for (int m = 0; m < MR; ++m) {
        const float da = a.dl[(m * K + b * 256) / 4];
        facc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(iacc[m]), _mm512_set1_ps(d * da), facc[m]);
        oacc[m] = _mm256_fmadd_ps(mins, _mm256_loadu_ps(a.s32 + (m * K + b * 256) / 32), oacc[m]);
      }
    }
    for (int m = 0; m < MR; ++m) {
      __m128 h = _mm_add_ps(_mm256_castps256_ps128(oacc[m]), _mm256_extractf128_ps(oacc[m], 1));
      h = _mm_add_ps(h, _mm_movehl_ps(h, h));
      h = _mm_add_ss(h, _mm_shuffle_ps(h, h, 1));
      y[m * ldy + n] = _mm512_reduce_add_ps(facc[m]) + _mm_cvtss_f32(h);
    }
  }
}

template <int MR>
void q6_k_rows(const uint8_t* W, int64_t K, const ActView& a, float* y, int64_t ldy, int64_t n0, int64_t n1) {
  const int64_t nb = K / 256, rb = nb * 210;
  const __m512i idx[4] = {lane_index(0, 8), lane_index(4, 8), lane_index(8, 8), lane_index(12, 8)};
  const __m256i m30 = _mm256_set1_epi8(0x30);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = W + n * rb;
    __m512 facc[MR], oacc[MR];
    for (int m = 0; m < MR; ++m) facc[m] = _mm512_setzero_ps(), oacc[m] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = row + b * 210;
      const float d = h2f(blk + 208);
      const __m128i sc8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 192));
      const __m512i scv = _mm512_castsi256_si512(_mm256_cvtepi8_epi16(sc8));
      const __m512 offs = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(sc8)), _mm512_set1_ps(-32.f * d));
      __m512i iacc[MR];
      for (int m = 0; m < MR; ++m) iacc[m] = _mm512_setzero_si512();
      for (int h = 0; h < 2; ++h) {
        const __m256i l0 = load32(blk + 64 * h), l1 = load32(blk + 64 * h + 32), hh = load32(blk + 128 + 32 * h);
        const __m512i u0 = two32(_mm256_or_si256(lo_nib(l0), _mm256_and_si256(_mm256_slli_epi16(hh, 4), m30)),
                                 _mm256_or_si256(lo_nib(l1), _mm256_and_si256(_mm256_slli_epi16(hh, 2), m30)));
        const __m512i u1 = two32(_mm256_or_si256(hi_nib(l0), _mm256_and_si256(hh, m30)),
                                 _mm256_or_si256(hi_nib(l1), _mm256_and_si256(_mm256_srli_epi16(hh, 2), m30)));
        const __m512i s0 = _mm512_permutexvar_epi16(idx[2 * h], scv);
        const __m512i s1 = _mm512_permutexvar_epi16(idx[2 * h + 1], scv);
        for (int m = 0; m < MR; ++m) {
          const int8_t* q = a.qa + m * K + b * 256 + 128 * h;
          iacc[m] = _mm512_dpwssd_epi32(iacc[m], _mm512_maddubs_epi16(u0, _mm512_loadu_si512(q)), s0);
          iacc[m] = _mm512_dpwssd_epi32(iacc[m], _mm512_maddubs_epi16(u1, _mm512_loadu_si512(q + 64)), s1);
        }
      }
      for (int m = 0; m < MR; ++m) {
        const float da = a.dl[(m * K + b * 256) / 4];
        facc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(iacc[m]), _mm512_set1_ps(d * da), facc[m]);
        oacc[m] = _mm512_fmadd_ps(offs, _mm512_loadu_ps(a.sg + (m * K + b * 256) / 16), oacc[m]);
      }
    }
    for (int m = 0; m < MR; ++m) y[m * ldy + n] = _mm512_reduce_add_ps(_mm512_add_ps(facc[m], oacc[m]));
  }
}

template <int MR>
void q8_0_rows(const uint8_t* W, int64_t K, const ActView& a, float* y, int64_t ldy, int64_t n0, int64_t n1) {
  const int64_t nb = K / 32, rb = nb * 34;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = W + n * rb;
    __m512 facc[MR];
    for (int m = 0; m < MR; ++m) facc[m] = _mm512_setzero_ps();
    float tail[MR] = {};
    int64_t b = 0;
    for (; b + 2 <= nb; b += 2) {
      const uint8_t* b0 = row + b * 34;
      const __m512i w = two32(load32(b0 + 2), load32(b0 + 36));
      const __mmask64 neg = _mm512_movepi8_mask(w);
      const __m512i aw = _mm512_abs_epi8(w);
      const float d0 = h2f(b0), d1 = h2f(b0 + 34);
      for (int m = 0; m < MR; ++m) {
        __m512i av = _mm512_loadu_si512(a.qa + m * K + b * 32);
        av = _mm512_mask_sub_epi8(av, neg, _mm512_setzero_si512(), av);
        const __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), aw, av);
        const float* dl = a.dl + (m * K + b * 32) / 4;
        facc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), two_scales(d0 * dl[0], d1 * dl[8]), facc[m]);
      }
    }
    for (; b < nb; ++b) {  // an odd last block
      const uint8_t* b0 = row + b * 34;
      const float d0 = h2f(b0);
      const __m256i w = load32(b0 + 2);
      for (int m = 0; m < MR; ++m) {
        // |w| * (sign(w) * qa) in intrinsics: a plain int8 x int8 loop here gave wrong sums in this build
        // (GCC 12, -march=native; test_odd_block_counts), not investigated further
        const __m256i av = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.qa + m * K + b * 32));
        const __m256i p = _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_abs_epi8(w), _mm256_sign_epi8(av, w));
        __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(p), _mm256_extracti128_si256(p, 1));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
        tail[m] += d0 * a.dl[(m * K + b * 32) / 4] * static_cast<float>(_mm_cvtsi128_si32(s4));
      }
    }
    for (int m = 0; m < MR; ++m) y[m * ldy + n] = _mm512_reduce_add_ps(facc[m]) + tail[m];
  }
}

// bit j of 32 -> byte j: 0xFF where set (llama.cpp's bytes_from_bits_32)
inline __m256i bytes_from_bits_32(const uint8_t* x) {
  uint32_t x32;
  std::memcpy(&x32, x, 4);
  const __m256i shuf = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
  __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(x32)), shuf);
  bytes = _mm256_or_si256(bytes, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
  return _mm256_cmpeq_epi8(bytes, _mm256_set1_epi64x(-1));
}

// Q4_0, Q4_1, Q5_0, Q5_1, MXFP4: two blocks of 32 per 512-bit dot; the per-block offset (-8d, m, -16d, m, -12d)
// times the block's activation sum.
template <int MR, int64_t T>
void legacy_rows(const uint8_t* W, int64_t K, const ActView& a, float* y, int64_t ldy, int64_t n0, int64_t n1) {
  constexpr bool MIN = T == Q4_1 || T == Q5_1, FIVE = T == Q5_0 || T == Q5_1, MX = T == MXFP4;
  constexpr int64_t BYTES = T == Q4_0 ? 18 : T == Q4_1 ? 20 : T == Q5_0 ? 22 : T == MXFP4 ? 17 : 24;
  constexpr int64_t QS = MX ? 1 : (MIN ? 4 : 2) + (FIVE ? 4 : 0);
  const int64_t nb = K / 32, rb = nb * BYTES;
  auto unpack = [](const uint8_t* blk, float& d, float& off) {
    if constexpr (MX) {
      d = e8m0_half(blk[0]);
      off = -12.f * d;
      return mxfp4_u32(blk + QS);
    }
    d = h2f(blk);
    off = MIN ? h2f(blk + 2) : (FIVE ? -16.f : -8.f) * d;
    __m256i u = nibbles16(blk + QS);
    if (FIVE) u = _mm256_or_si256(u, _mm256_and_si256(bytes_from_bits_32(blk + QS - 4), _mm256_set1_epi8(0x10)));
    return u;
  };
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = W + n * rb;
    __m512 facc[MR];
    float off[MR] = {};
    for (int m = 0; m < MR; ++m) facc[m] = _mm512_setzero_ps();
    int64_t b = 0;
    for (; b + 2 <= nb; b += 2) {
      float d0, d1, o0, o1;
      const __m256i u0 = unpack(row + b * BYTES, d0, o0);
      const __m256i u1 = unpack(row + (b + 1) * BYTES, d1, o1);
      const __m512i u = two32(u0, u1);
      for (int m = 0; m < MR; ++m) {
        const __m512i av = _mm512_loadu_si512(a.qa + m * K + b * 32);
        const __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, av);
        const float* dl = a.dl + (m * K + b * 32) / 4;
        facc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), two_scales(d0 * dl[0], d1 * dl[8]), facc[m]);
        const float* s32 = a.s32 + (m * K + b * 32) / 32;
        off[m] += o0 * s32[0] + o1 * s32[1];
      }
    }
    for (; b < nb; ++b) {  // an odd last block
      float d0, o0;
      alignas(32) uint8_t u[32];
      _mm256_store_si256(reinterpret_cast<__m256i*>(u), unpack(row + b * BYTES, d0, o0));
      for (int m = 0; m < MR; ++m) {
        int32_t sacc = 0;
        for (int i = 0; i < 32; ++i) sacc += u[i] * a.qa[m * K + b * 32 + i];
        off[m] += d0 * a.dl[(m * K + b * 32) / 4] * static_cast<float>(sacc) + o0 * a.s32[(m * K + b * 32) / 32];
      }
    }
    for (int m = 0; m < MR; ++m) y[m * ldy + n] = _mm512_reduce_add_ps(facc[m]) + off[m];
  }
}

template <int MR>
void q4_k_rows(const uint8_t* W, int64_t K, const ActView& a, float* y, int64_t ldy, int64_t n0, int64_t n1) {
  q45_k_rows<MR, false>(W, K, a, y, ldy, n0, n1);
}
template <int MR>
void q5_k_rows(const uint8_t* W, int64_t K, const ActView& a, float* y, int64_t ldy, int64_t n0, int64_t n1) {
  q45_k_rows<MR, true>(W, K, a, y, ldy, n0, n1);
}
template <int MR>
void q4_0_rows(const uint8_t* W, int64_t K, const ActView& a, float* y, int64_t ldy, int64_t n0, int64_t n1) {
  legacy_rows<MR, Q4_0>(W, K, a, y, ldy, n0, n1);
}
template <int MR>
void q4_1_rows(const uint8_t* W, int64_t K, const ActView& a, float* y, int64_t ldy, int64_t n0, int64_t n1) {
  legacy_rows<MR, Q4_1>(W, K, a, y, ldy, n0, n1);
}
template <int MR>
void q5_0_rows(const uint8_t* W, int64_t K, const ActView& a, float* y, int64_t ldy, int64_t n0, int64_t n1) {
  legacy_rows<MR, Q5_0>(W, K, a, y, ldy, n0, n1);
}
template <int MR>
void q5_1_rows(const uint8_t* W, int64_t K, const ActView& a, float* y, int64_t ldy, int64_t n0, int64_t n1) {
  legacy_rows<MR, Q5_1>(W, K, a, y, ldy, n0, n1);
}
template <int MR>
void mxfp4_rows(const uint8_t* W, int64_t K, const ActView& a, float* y, int64_t ldy, int64_t n0, int64_t n1) {
  legacy_rows<MR, MXFP4>(W, K, a, y, ldy, n0, n1);
}

// Q2_K and Q3_K: 2-bit (+ a third bit from hmask) weights, 16 sub-blocks of 16 with integer scales as Q6_K;
// Q2_K's mins and Q3_K's -4 offset use the activations' group sums.
template <int MR, bool Q3>
void q23_k_rows(const uint8_t* W, int64_t K, const ActView& a, float* y, int64_t ldy, int64_t n0, int64_t n1) {
  constexpr int64_t BYTES = Q3 ? 110 : 84;
  const int64_t nb = K / 256, rb = nb * BYTES;
  const __m512i idx[4] = {lane_index(0, 8), lane_index(4, 8), lane_index(8, 8), lane_index(12, 8)};
  const __m256i m3 = _mm256_set1_epi8(3);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = W + n * rb;
    __m512 facc[MR], oacc[MR];
    for (int m = 0; m < MR; ++m) facc[m] = _mm512_setzero_ps(), oacc[m] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = row + b * BYTES;
      const uint8_t* qs = blk + (Q3 ? 32 : 16);
      float d;
      __m128i sc8;  // 16 signed scales
      __m512 offs;  // per group of 16: the offset per unit of activation sum
      if (Q3) {
        d = h2f(blk + 108);
        uint32_t aux[4];
        std::memcpy(aux, blk + 96, 12);
        const uint32_t k1 = 0x03030303, k2 = 0x0f0f0f0f, tmp = aux[2];
        aux[2] = ((aux[0] >> 4) & k2) | (((tmp >> 4) & k1) << 4);
        aux[3] = ((aux[1] >> 4) & k2) | (((tmp >> 6) & k1) << 4);
        aux[0] = (aux[0] & k2) | (((tmp >> 0) & k1) << 4);
        aux[1] = (aux[1] & k2) | (((tmp >> 2) & k1) << 4);
        sc8 = _mm_sub_epi8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(aux)), _mm_set1_epi8(32));
        offs = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(sc8)), _mm512_set1_ps(-4.f * d));
      } else {
        d = h2f(blk + 80);
        const float dmin = h2f(blk + 82);
        const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk));
        sc8 = _mm_and_si128(raw, _mm_set1_epi8(0x0F));
        const __m128i mins = _mm_and_si128(_mm_srli_epi16(raw, 4), _mm_set1_epi8(0x0F));
        offs = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(mins)), _mm512_set1_ps(-dmin));
      }
      const __m512i scv = _mm512_castsi256_si512(_mm256_cvtepi8_epi16(sc8));
      const __m256i hm = Q3 ? load32(blk) : _mm256_setzero_si256();
      __m512i iacc[MR];
      for (int m = 0; m < MR; ++m) iacc[m] = _mm512_setzero_si512();
      for (int h = 0; h < 2; ++h) {
        const __m256i q = load32(qs + 32 * h);
        __m256i u[4];
        for (int j = 0; j < 4; ++j) {
          u[j] = _mm256_and_si256(_mm256_srli_epi16(q, 2 * j), m3);
          if (Q3) u[j] = _mm256_or_si256(u[j], bit_if(hm, static_cast<uint8_t>(1u << (4 * h + j)), 4));
        }
        const __m512i u0 = two32(u[0], u[1]), u1 = two32(u[2], u[3]);
        const __m512i s0 = _mm512_permutexvar_epi16(idx[2 * h], scv);
        const __m512i s1 = _mm512_permutexvar_epi16(idx[2 * h + 1], scv);
        for (int m = 0; m < MR; ++m) {
          const int8_t* qa = a.qa + m * K + b * 256 + 128 * h;
          iacc[m] = _mm512_dpwssd_epi32(iacc[m], _mm512_maddubs_epi16(u0, _mm512_loadu_si512(qa)), s0);
          iacc[m] = _mm512_dpwssd_epi32(iacc[m], _mm512_maddubs_epi16(u1, _mm512_loadu_si512(qa + 64)), s1);
        }
      }
      for (int m = 0; m < MR; ++m) {
        const float da = a.dl[(m * K + b * 256) / 4];
        facc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(iacc[m]), _mm512_set1_ps(d * da), facc[m]);
        oacc[m] = _mm512_fmadd_ps(offs, _mm512_loadu_ps(a.sg + (m * K + b * 256) / 16), oacc[m]);
      }
    }
    for (int m = 0; m < MR; ++m) y[m * ldy + n] = _mm512_reduce_add_ps(_mm512_add_ps(facc[m], oacc[m]));
  }
}
template <int MR>
void q2_k_rows(const uint8_t* W, int64_t K, const ActView& a, float* y, int64_t ldy, int64_t n0, int64_t n1) {
  q23_k_rows<MR, false>(W, K, a, y, ldy, n0, n1);
}
template <int MR>
void q3_k_rows(const uint8_t* W, int64_t K, const ActView& a, float* y, int64_t ldy, int64_t n0, int64_t n1) {
  q23_k_rows<MR, true>(W, K, a, y, ldy, n0, n1);
}

// ------------------------------------------------------------------- interleaved groups (1..4 rows), AVX-512
// One group of 16 weight rows in the interleaved layout (above) times MR activation rows: each 64-byte load is
// 4 quantized bytes of every row, multiplied by 4 broadcast activations of each activation row in one vpdpbusd
// (16 outputs x 4 inputs), so a weight byte is loaded and unpacked once for all MR rows and the unpacking is
// shared by 16 rows' outputs. Sub-block sums are kept in int32 and scaled in float once per sub-block.
inline __m512i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}
inline __m512i widen16(const uint8_t* p) {  // 16 bytes -> 16 uint32 lanes
  return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline __m512 half16(const uint8_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
// per bit: c ? a : b
inline __m512i select_bits(__m512i a, __m512i b, __m512i c) { return _mm512_ternarylogic_epi32(a, b, c, 0xE4); }
// per bit: a | (b & c)
inline __m512i or_masked(__m512i a, __m512i b, __m512i c) { return _mm512_ternarylogic_epi32(a, b, c, 0xF8); }

// Q4_K / Q5_K sub-block s's 6-bit scale (k4_scale) and min (k4_min) for the 16 rows, as float, from the 12
// byte planes P (ggml's packing: bytes 0-3 hold scales 0-3 and the top bits of scales 4-7, bytes 4-7 the mins
// likewise, bytes 8-11 the low 4 bits of scale and min 4-7)
inline __m512 k4_scale(const uint8_t* P, int s) {
  if (s < 4) return _mm512_cvtepi32_ps(_mm512_and_si512(widen16(P + 16 * s), _mm512_set1_epi32(63)));
  return _mm512_cvtepi32_ps(
      select_bits(widen16(P + 16 * (s + 4)), _mm512_srli_epi32(widen16(P + 16 * (s - 4)), 2), _mm512_set1_epi32(15)));
}
inline __m512 k4_min(const uint8_t* P, int s) {
  if (s < 4) return _mm512_cvtepi32_ps(_mm512_and_si512(widen16(P + 16 * (s + 4)), _mm512_set1_epi32(63)));
  return _mm512_cvtepi32_ps(select_bits(_mm512_srli_epi32(widen16(P + 16 * (s + 4)), 4),
                                        _mm512_srli_epi32(widen16(P + 16 * s), 2), _mm512_set1_epi32(15)));
}

// Software prefetch of an interleaved group's stream ~PREFETCH_BYTES ahead (whole blocks): at decode each weight is
// read once per step from L3 or DRAM, and the hardware prefetcher alone left the dot loops waiting on it. With
// it (bench.gguf_kernels --rows 8192 --cols 2048 --copies 16, 2 threads) Q6_K reads 25 GB/s at one row against
// 17, and bench.gguf_decode's 1B Q4_K_M file decodes at 23.5 GB/s against 19. Past the tensor's end it is dropped.
constexpr int64_t PREFETCH_BYTES = 4096;
template <int64_t CHUNK>
inline void prefetch_ahead(const uint8_t* c) {
  constexpr int64_t ahead = std::max<int64_t>(1, PREFETCH_BYTES / CHUNK) * CHUNK;
  for (int64_t o = 0; o < CHUNK; o += 64) _mm_prefetch(reinterpret_cast<const char*>(c + ahead + o), _MM_HINT_T0);
}

// Q4_K, or Q5_K (HIGH: a fifth bit per weight from qh). Q4_K's high nibble is used as (byte & 0xF0) = 16 * u,
// its scale divided by 16 (exact); the mins use the activations' sums per 32, once per super-block.
template <int MR, bool HIGH>
void k45_group(const uint8_t* G, int64_t off, int64_t nb, int64_t K, const ActView& a, float* y,
               int64_t ldy, bool ahead) {
  constexpr int64_t CHUNK = NR * (HIGH ? 176 : 144), QS = HIGH ? 768 : 256;
  const __m512i lo4 = _mm512_set1_epi8(0x0F), hi4 = _mm512_set1_epi8(static_cast<char>(0xF0));
  __m512 tot[MR];
  for (int m = 0; m < MR; ++m) tot[m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* c = G + b * CHUNK;
    if (ahead) prefetch_ahead<CHUNK>(c);
    __m512 fs[MR];
    for (int m = 0; m < MR; ++m) fs[m] = _mm512_setzero_ps();
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {  // unrolled: the sub-block's scale decoding is resolved at compile time
      __m512i alo[MR], ahi[MR];
      for (int m = 0; m < MR; ++m) alo[m] = ahi[m] = _mm512_setzero_si512();
#pragma GCC unroll 8
      for (int p = 0; p < 8; ++p) {
        const __m512i q = _mm512_loadu_si512(c + QS + (8 * j + p) * 64);
        __m512i lo = _mm512_and_si512(q, lo4), hi;
        if (HIGH) {  // qh bit 2j of element 64j + l, bit 2j + 1 of element 64j + 32 + l
          const __m512i h = _mm512_loadu_si512(c + 256 + p * 64), bit5 = _mm512_set1_epi8(0x10);
          hi = _mm512_and_si512(_mm512_srli_epi16(q, 4), lo4);
          lo = _mm512_mask_add_epi8(lo, _mm512_test_epi8_mask(h, _mm512_set1_epi8(static_cast<char>(1u << (2 * j)))),
                                    lo, bit5);
          hi = _mm512_mask_add_epi8(hi, _mm512_test_epi8_mask(h, _mm512_set1_epi8(static_cast<char>(2u << (2 * j)))),
                                    hi, bit5);
        } else {
          hi = _mm512_and_si512(q, hi4);  // 16 * u
        }
        for (int m = 0; m < MR; ++m) {
          const int8_t* x = a.qa + m * K + b * 256 + 64 * j + 4 * p;
          alo[m] = _mm512_dpbusd_epi32(alo[m], lo, bcast4(x));
          ahi[m] = _mm512_dpbusd_epi32(ahi[m], hi, bcast4(x + 32));
        }
      }
      const __m512 sc0 = k4_scale(c + 64, 2 * j);
      const __m512 sc1 = _mm512_mul_ps(k4_scale(c + 64, 2 * j + 1), _mm512_set1_ps(HIGH ? 1.f : 1.f / 16));
      for (int m = 0; m < MR; ++m) {
        fs[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(alo[m]), sc0, fs[m]);
        fs[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ahi[m]), sc1, fs[m]);
      }
    }
    const __m512 d = half16(c), dmin = half16(c + 32);
    for (int m = 0; m < MR; ++m)
      tot[m] = _mm512_fmadd_ps(fs[m], _mm512_mul_ps(d, _mm512_set1_ps(a.dl[(m * K + b * 256) / 4])), tot[m]);
#pragma GCC unroll 8
    for (int sb = 0; sb < 8; ++sb) {  // - dmin * min * (da * sum of the sub-block's qa)
      const __m512 mn = _mm512_mul_ps(k4_min(c + 64, sb), dmin);
      for (int m = 0; m < MR; ++m)
        tot[m] = _mm512_fnmadd_ps(mn, _mm512_set1_ps(a.s32[(m * K + b * 256) / 32 + sb]), tot[m]);
    }
  }
  for (int m = 0; m < MR; ++m) _mm512_storeu_ps(y + m * ldy, tot[m]);
}

template <int MR>
void q4_k_group(const uint8_t* G, int64_t off, int64_t nb, int64_t K, const ActView& a, float* y,
                int64_t ldy, bool ahead) {
  k45_group<MR, false>(G, off, nb, K, a, y, ldy, ahead);
}
template <int MR>
void q5_k_group(const uint8_t* G, int64_t off, int64_t nb, int64_t K, const ActView& a, float* y,
                int64_t ldy, bool ahead) {
  k45_group<MR, true>(G, off, nb, K, a, y, ldy, ahead);
}

// Q6_K: u = 4 low bits from ql | 2 high bits from qh (0..63), sums started at -32 * (the sub-block's activation
// sum), so one float scale per sub-block of 16 covers the -32 offset too.
template <int MR>
void q6_k_group(const uint8_t* G, int64_t off, int64_t nb, int64_t K, const ActView& a, float* y,
                int64_t ldy, bool ahead) {
  constexpr int64_t CHUNK = NR * 210;
  const __m512i m0f = _mm512_set1_epi8(0x0F), m30 = _mm512_set1_epi8(0x30);
  __m512 tot[MR];
  for (int m = 0; m < MR; ++m) tot[m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* c = G + b * CHUNK;
    if (ahead) prefetch_ahead<CHUNK>(c);
    const int lead = lead_first(off + b * CHUNK) ? 32 : 0;  // d first
    const uint8_t *q6 = c + lead, *sc = c + lead + 3072;
    __m512 fs[MR];
    for (int m = 0; m < MR; ++m) fs[m] = _mm512_setzero_ps();
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
#pragma GCC unroll 2
      for (int q = 0; q < 2; ++q) {  // sub-blocks 8h + q + 2t, t < 4; elements 128h + 32t + 16q + ...
        __m512i acc[MR][4];
        for (int m = 0; m < MR; ++m)
          for (int t = 0; t < 4; ++t)
            acc[m][t] = _mm512_set1_epi32(-32 * a.i16[(m * K + b * 256) / 16 + 8 * h + q + 2 * t]);
#pragma GCC unroll 4
        for (int pp = 0; pp < 4; ++pp) {
          const int p = 4 * q + pp;
          const uint8_t* abh = q6 + (8 * h + p) * 192;  // ql[64h + 4p], ql[64h + 32 + 4p], qh[32h + 4p]
          const __m512i A = _mm512_loadu_si512(abh), B = _mm512_loadu_si512(abh + 64);
          const __m512i H = _mm512_loadu_si512(abh + 128);
          const __m512i u0 = or_masked(_mm512_and_si512(A, m0f), _mm512_slli_epi16(H, 4), m30);
          const __m512i u1 = or_masked(_mm512_and_si512(B, m0f), _mm512_slli_epi16(H, 2), m30);
          const __m512i u2 = or_masked(_mm512_and_si512(_mm512_srli_epi16(A, 4), m0f), H, m30);
          const __m512i u3 = or_masked(_mm512_and_si512(_mm512_srli_epi16(B, 4), m0f), _mm512_srli_epi16(H, 2), m30);
          for (int m = 0; m < MR; ++m) {
            const int8_t* x = a.qa + m * K + b * 256 + 128 * h + 4 * p;
            acc[m][0] = _mm512_dpbusd_epi32(acc[m][0], u0, bcast4(x));
            acc[m][1] = _mm512_dpbusd_epi32(acc[m][1], u1, bcast4(x + 32));
            acc[m][2] = _mm512_dpbusd_epi32(acc[m][2], u2, bcast4(x + 64));
            acc[m][3] = _mm512_dpbusd_epi32(acc[m][3], u3, bcast4(x + 96));
          }
        }
        for (int t = 0; t < 4; ++t) {
          const __m512 s = _mm512_cvtepi32_ps(
              _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc + 16 * (8 * h + q + 2 * t)))));
          for (int m = 0; m < MR; ++m) fs[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[m][t]), s, fs[m]);
        }
      }
    }
    const __m512 d = half16(lead ? c : c + 3328);
    for (int m = 0; m < MR; ++m)
      tot[m] = _mm512_fmadd_ps(fs[m], _mm512_mul_ps(d, _mm512_set1_ps(a.dl[(m * K + b * 256) / 4])), tot[m]);
  }
  for (int m = 0; m < MR; ++m) _mm512_storeu_ps(y + m * ldy, tot[m]);
}

// Q8_0: q + 128 (unsigned) times qa, less 128 * (the block's activation sum)
template <int MR>
void q8_0_group(const uint8_t* G, int64_t off, int64_t nb, int64_t K, const ActView& a, float* y,
                int64_t ldy, bool ahead) {
  constexpr int64_t CHUNK = NR * 34;
  __m512 tot[MR];
  for (int m = 0; m < MR; ++m) tot[m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* c = G + b * CHUNK;
    if (ahead) prefetch_ahead<CHUNK>(c);
    const bool lead = lead_first(off + b * CHUNK);  // d first
    const uint8_t* qs = lead ? c + 32 : c;
    __m512i acc[MR], acc2[MR];
    for (int m = 0; m < MR; ++m) {
      const int32_t* s16 = a.i16 + (m * K + b * 32) / 16;
      acc[m] = _mm512_set1_epi32(-128 * (s16[0] + s16[1]));
      acc2[m] = _mm512_setzero_si512();
    }
#pragma GCC unroll 4
    for (int p = 0; p < 8; p += 2) {  // two chains (vpdpbusd latency)
      const __m512i w = _mm512_loadu_si512(qs + 64 * p), w2 = _mm512_loadu_si512(qs + 64 * p + 64);
      for (int m = 0; m < MR; ++m) {
        const int8_t* x = a.qa + m * K + b * 32 + 4 * p;
        acc[m] = _mm512_dpbusd_epi32(acc[m], w, bcast4(x));
        acc2[m] = _mm512_dpbusd_epi32(acc2[m], w2, bcast4(x + 4));
      }
    }
    const __m512 d = half16(lead ? c : c + 512);
    for (int m = 0; m < MR; ++m)
      tot[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(acc[m], acc2[m])),
                               _mm512_mul_ps(d, _mm512_set1_ps(a.dl[(m * K + b * 32) / 4])), tot[m]);
  }
  for (int m = 0; m < MR; ++m) _mm512_storeu_ps(y + m * ldy, tot[m]);
}

// MXFP4: each 64-byte load holds 4 nibble bytes of the 16 rows, i.e. elements j..j+3 (low nibbles) and
// j+16..j+19 (high) of each; both halves become u = 2 * e2m1 + 12 by one byte shuffle and meet their 4 broadcast
// activations in a vpdpbusd each. w = (u - 12) * 2^(e - 128): the -12 is taken off as -12 * (the block's
// activation sum), the 16 rows' scales are built from their exponent bytes in float bits (e8m0_half's, e < 2
// subnormal). The chunk (272 bytes) keeps no 64-byte alignment: its loads are unaligned.
template <int MR>
void mxfp4_group(const uint8_t* G, int64_t, int64_t nb, int64_t K, const ActView& a, float* y,
                 int64_t ldy, bool ahead) {
  constexpr int64_t CHUNK = NR * 17;
  const __m512i lut = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(MXFP4_U)));
  const __m512i low = _mm512_set1_epi8(0x0F);
  __m512 tot[MR];
  for (int m = 0; m < MR; ++m) tot[m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* c = G + b * CHUNK;
    if (ahead) prefetch_ahead<CHUNK>(c);
    __m512i acc[MR], acc2[MR];
    for (int m = 0; m < MR; ++m) {
      const int32_t* s16 = a.i16 + (m * K + b * 32) / 16;
      acc[m] = _mm512_set1_epi32(-12 * (s16[0] + s16[1]));
      acc2[m] = _mm512_setzero_si512();
    }
#pragma GCC unroll 4
    for (int p = 0; p < 4; ++p) {
      const __m512i w = _mm512_loadu_si512(c + 64 * p);
      const __m512i lo = _mm512_shuffle_epi8(lut, _mm512_and_si512(w, low));
      const __m512i hi = _mm512_shuffle_epi8(lut, _mm512_and_si512(_mm512_srli_epi16(w, 4), low));
      for (int m = 0; m < MR; ++m) {
        const int8_t* x = a.qa + m * K + b * 32 + 4 * p;
        acc[m] = _mm512_dpbusd_epi32(acc[m], lo, bcast4(x));
        acc2[m] = _mm512_dpbusd_epi32(acc2[m], hi, bcast4(x + 16));
      }
    }
    const __m512i e = widen16(c + 256);
    const __m512i normal = _mm512_slli_epi32(_mm512_sub_epi32(e, _mm512_set1_epi32(1)), 23);
    const __m512i tiny = _mm512_sllv_epi32(_mm512_set1_epi32(0x00200000), e);
    const __m512 d = _mm512_castsi512_ps(
        _mm512_mask_blend_epi32(_mm512_cmplt_epi32_mask(e, _mm512_set1_epi32(2)), normal, tiny));
    for (int m = 0; m < MR; ++m)
      tot[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(acc[m], acc2[m])),
                               _mm512_mul_ps(d, _mm512_set1_ps(a.dl[(m * K + b * 32) / 4])), tot[m]);
  }
  for (int m = 0; m < MR; ++m) _mm512_storeu_ps(y + m * ldy, tot[m]);
}

// group G (16 rows, `nb` blocks each; at byte `off` of its tensor) of an interleaved part of base type `type`
// times M <= 4 activation rows; `ahead`: prefetch the stream ahead (the first of the tiles over the group only:
// the later ones find it in cache, and prefetching again cost 5-7% at 64 rows)
void interleaved_group(int64_t type, const uint8_t* G, int64_t off, int64_t nb, int64_t K, const ActView& a, int64_t M,
                       float* y, int64_t ldy, bool ahead) {
#define RADIXLM_GROUP(...)                                            \
  switch (M) {                                                        \
    case 1: __VA_ARGS__<1>(G, off, nb, K, a, y, ldy, ahead); return;  \
    case 2: __VA_ARGS__<2>(G, off, nb, K, a, y, ldy, ahead); return;  \
    case 3: __VA_ARGS__<3>(G, off, nb, K, a, y, ldy, ahead); return;  \
    default: __VA_ARGS__<4>(G, off, nb, K, a, y, ldy, ahead); return; \
  }
  if (type == Q4_K) RADIXLM_GROUP(q4_k_group)
  if (type == Q6_K) RADIXLM_GROUP(q6_k_group)
  if (type == Q8_0) RADIXLM_GROUP(q8_0_group)
  if (type == Q5_K) RADIXLM_GROUP(q5_k_group)
  if (type == MXFP4) RADIXLM_GROUP(mxfp4_group)
#undef RADIXLM_GROUP
}

bool has_rows_path(int64_t type) {
  return type == Q2_K || type == Q3_K || type == Q4_K || type == Q5_K || type == Q6_K || type == Q8_0 ||
         type == Q4_0 || type == Q4_1 || type == Q5_0 || type == Q5_1 || type == MXFP4;
}

// true when (type, M) has a register path and it ran
bool decode_rows(int64_t type, const uint8_t* W, int64_t K, const ActView& a, int64_t M, float* y, int64_t ldy,
                 int64_t n0, int64_t n1) {
#define RADIXLM_ROWS(FN)                                  \
  switch (M) {                                            \
    case 1: FN<1>(W, K, a, y, ldy, n0, n1); return true;  \
    case 2: FN<2>(W, K, a, y, ldy, n0, n1); return true;  \
    case 3: FN<3>(W, K, a, y, ldy, n0, n1); return true;  \
    case 4: FN<4>(W, K, a, y, ldy, n0, n1); return true;  \
    default: return false;                                \
  }
  if (type == Q4_K) RADIXLM_ROWS(q4_k_rows)
  if (type == Q6_K) RADIXLM_ROWS(q6_k_rows)
  if (type == Q8_0) RADIXLM_ROWS(q8_0_rows)
  if (type == Q5_K) RADIXLM_ROWS(q5_k_rows)
  if (type == Q2_K) RADIXLM_ROWS(q2_k_rows)
  if (type == Q3_K) RADIXLM_ROWS(q3_k_rows)
  if (type == Q4_0) RADIXLM_ROWS(q4_0_rows)
  if (type == Q4_1) RADIXLM_ROWS(q4_1_rows)
  if (type == Q5_0) RADIXLM_ROWS(q5_0_rows)
  if (type == Q5_1) RADIXLM_ROWS(q5_1_rows)
  if (type == MXFP4) RADIXLM_ROWS(mxfp4_rows)
#undef RADIXLM_ROWS
  return false;
}
#endif

const char* radixlm_isa() {
#if defined(RADIXLM_AVX512)
  return "avx512_vnni";
#elif defined(RADIXLM_AVX2)
  return "avx2";
#else
  return "scalar";
#endif
}

constexpr bool interleaved_kernels() {
#if defined(RADIXLM_AVX512)
  return true;
#else
  return false;
#endif
}

// x [M, K] float32 times the parts (each uint8 [N_i, K / qk * bytes] of type types[i]) -> y [M, sum N_i].
at::Tensor gguf_linear(const at::Tensor& x, at::TensorList ws, at::IntArrayRef types) {
  // RADIXLM_GGUF_GEMM_ROWS_ONLY=1: skip the register paths (tests compare them with the row-buffer path)
  static const bool no_fast = [] {
    const char* v = std::getenv("RADIXLM_GGUF_GEMM_ROWS_ONLY");
    return v != nullptr && v[0] == '1';
  }();
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "gguf_linear takes contiguous float32 [M, K] activations");
  TORCH_CHECK(ws.size() == types.size() && !ws.empty(), "gguf_linear: one type per weight part");
  const int64_t M = x.size(0), K = x.size(1);
  std::vector<TypeInfo> infos(ws.size());
  int64_t total = 0;
  for (size_t i = 0; i < ws.size(); ++i) {
    const int64_t base = types[i] & ~INTERLEAVED;
    TORCH_CHECK(type_info(base, infos[i]), "gguf_linear: unsupported GGML type ", types[i]);
    TORCH_CHECK(!(types[i] & INTERLEAVED) || (interleaved_layout(base) != nullptr && interleaved_kernels()),
                "gguf_linear: no interleaved kernel for type ", base, " in this build (", radixlm_isa(), ")");
    const at::Tensor& w = ws[i];
    TORCH_CHECK(w.scalar_type() == at::kByte && w.dim() == 2 && w.is_contiguous(),
                "gguf_linear: weights are contiguous uint8 [rows, row bytes]");
    TORCH_CHECK(K % infos[i].qk == 0 && w.size(1) == K / infos[i].qk * infos[i].bytes,
                "gguf_linear: a weight row of ", w.size(1), " bytes does not hold ", K, " elements of type ",
                types[i]);
    total += w.size(0);
  }
  at::Tensor y = at::empty({M, total}, x.options());
  if (M == 0 || total == 0) return y;
  Acts acts32, acts256;
  bool need32 = false, need256 = false;
  for (const auto& info : infos) (info.qk == 32 ? need32 : need256) = true;
  const float* xp = x.data_ptr<float>();
  if (need32) quantize_rows(xp, M, K, 32, acts32);
  if (need256) quantize_rows(xp, M, K, 256, acts256);
  float* yp = y.data_ptr<float>();
  int64_t col = 0;
  for (size_t i = 0; i < ws.size(); ++i) {
    const TypeInfo& info = infos[i];
    const Acts& a = info.qk == 32 ? acts32 : acts256;
    const uint8_t* W = ws[i].data_ptr<uint8_t>();
    const int64_t N = ws[i].size(0);
    const int64_t type = types[i] & ~INTERLEAVED;
    float* yc = yp + col;
    int64_t first = 0;  // rows [0, first) are interleaved groups
#if defined(RADIXLM_AVX512)
    if (types[i] & INTERLEAVED) {
      first = N / NR * NR;
      const int64_t rb = ws[i].size(1), nb = K / info.qk;
      // activation rows 4 at a time over one group (kept in L2 across the tiles)
      at::parallel_for(0, N / NR, 1, [&](int64_t g0, int64_t g1) {
        for (int64_t g = g0; g < g1; ++g)
          for (int64_t m0 = 0; m0 < M; m0 += 4) {
            const ActView v{a.qa.data() + m0 * K, a.dl.data() + m0 * K / 4, a.sg.data() + m0 * K / 16,
                            a.s32.data() + m0 * K / 32, a.i16.data() + m0 * K / 16};
            interleaved_group(type, W + g * NR * rb, g * NR * rb, nb, K, v, std::min<int64_t>(4, M - m0),
                              yc + m0 * total + g * NR, total, m0 == 0);
          }
      });
    }
#endif
    // the file's layout: rows [first, N); grain: enough rows per task that the row buffer and the task
    // overhead pay off
    if (first < N) at::parallel_for(first, N, 16, [&](int64_t n0, int64_t n1) {
#if defined(RADIXLM_AVX512)
      // the register paths, 4 activation rows at a time over 16 weight rows (kept in L2 across the tiles)
      if (!no_fast && has_rows_path(type)) {
        for (int64_t c0 = n0; c0 < n1; c0 += 16) {
          const int64_t c1 = std::min(c0 + 16, n1);
          for (int64_t m0 = 0; m0 < M; m0 += 4) {
            const ActView v{a.qa.data() + m0 * K, a.dl.data() + m0 * K / 4, a.sg.data() + m0 * K / 16,
                            a.s32.data() + m0 * K / 32, a.i16.data() + m0 * K / 16};
            decode_rows(type, W, K, v, std::min<int64_t>(4, M - m0), yc + m0 * total, total, c0, c1);
          }
        }
        return;
      }
#endif
      switch (type) {
#define RADIXLM_PART(T, S, QK_, BYTES_, FN) \
  case T: part_rows<S, QK_, BYTES_, FN>(W, K, a.qa.data(), a.dl.data(), a.sg.data(), M, yc, total, n0, n1); break;
        RADIXLM_PART(Q4_0, false, 32, 18, unpack_q4_0)
        RADIXLM_PART(Q4_1, false, 32, 20, unpack_q4_1)
        RADIXLM_PART(Q5_0, false, 32, 22, unpack_q5<false>)
        RADIXLM_PART(Q5_1, false, 32, 24, unpack_q5<true>)
        RADIXLM_PART(Q8_0, true, 32, 34, unpack_q8_0)
        RADIXLM_PART(MXFP4, false, 32, 17, unpack_mxfp4)
        RADIXLM_PART(Q2_K, false, 256, 84, unpack_q2_k)
        RADIXLM_PART(Q3_K, false, 256, 110, unpack_q3_k)
        RADIXLM_PART(Q4_K, false, 256, 144, unpack_q45_k<false>)
        RADIXLM_PART(Q5_K, false, 256, 176, unpack_q45_k<true>)
        RADIXLM_PART(Q6_K, false, 256, 210, unpack_q6_k)
#undef RADIXLM_PART
      }
    });
    col += N;
  }
  return y;
}

// Rows `ids` of a GGUF tensor w (uint8 [rows, row bytes] of `type`) dequantized to float32 [len(ids), cols]:
// gguf-py's values to float32 rounding (w = ls * u + off, the unpacked form every kernel reads). The token embedding's
// lookup, and the whole tensor at load where a float copy is needed.
at::Tensor gguf_rows(const at::Tensor& w, int64_t type, const at::Tensor& ids, int64_t cols) {
  TypeInfo info;
  const bool interleaved = type & INTERLEAVED;
  const Layout* layout = interleaved_layout(type & ~INTERLEAVED);
  TORCH_CHECK(type_info(type & ~INTERLEAVED, info) && (!interleaved || layout != nullptr),
              "gguf_rows: unsupported GGML type ", type);
  TORCH_CHECK(w.scalar_type() == at::kByte && w.dim() == 2 && w.is_contiguous() && cols % info.qk == 0 &&
                  w.size(1) == cols / info.qk * info.bytes,
              "gguf_rows: weights are contiguous uint8 [rows, row bytes] of whole blocks");
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.dim() == 1, "gguf_rows: ids are int64 [n]");
  const at::Tensor idc = ids.contiguous();
  const int64_t n = idc.size(0), rows = w.size(0), nb = cols / info.qk, rb = w.size(1);
  const int64_t* ip = idc.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) TORCH_CHECK(ip[i] >= 0 && ip[i] < rows, "gguf_rows: id ", ip[i], " out of range");
  at::Tensor out = at::empty({n, cols}, w.options().dtype(at::kFloat));
  const uint8_t* W = w.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, n, 64, [&](int64_t r0, int64_t r1) {
    std::vector<uint8_t> u(info.qk);
    std::vector<float> ls(info.qk / 4), off(info.qk / 16);
    std::vector<uint8_t> file_row(interleaved ? rb : 0);
    for (int64_t r = r0; r < r1; ++r) {
      const uint8_t* row = W + ip[r] * rb;
      if (interleaved) {
        gather_row(*layout, W, rows, rb, ip[r], file_row.data());
        row = file_row.data();
      }
      float* o = op + r * cols;
      for (int64_t b = 0; b < nb; ++b) {
        info.unpack(row + b * info.bytes, u.data(), ls.data(), off.data());
        for (int64_t k = 0; k < info.qk; ++k) {
          const float q = info.is_signed ? static_cast<float>(static_cast<int8_t>(u[k])) : static_cast<float>(u[k]);
          o[b * info.qk + k] = ls[k / 4] * q + off[k / 16];
        }
      }
    }
  });
  return out;
}

// uint8 [rows, cols], uninitialized, on transparent huge pages where the kernel lends them (madvise mode): read
// from DRAM in one stream, 4 KB pages held one thread's interleaved reads ~1.5x below numpy's (huge-page) arrays.
at::Tensor huge_page_bytes(int64_t rows, int64_t cols) {
  constexpr size_t HUGE = 2 << 20;
  const size_t n = static_cast<size_t>(rows * cols);
  if (n < HUGE) return at::empty({rows, cols}, at::TensorOptions().dtype(at::kByte));
  void* p = nullptr;
  if (posix_memalign(&p, HUGE, (n + HUGE - 1) / HUGE * HUGE) != 0) throw std::bad_alloc();
  madvise(p, (n + HUGE - 1) / HUGE * HUGE, MADV_HUGEPAGE);  // advice only: ignored where THP is off
  return at::from_blob(p, {rows, cols}, [](void* q) { std::free(q); }, at::TensorOptions().dtype(at::kByte));
}

// w (uint8 [rows, row bytes] of `type`, one of Q4_K, Q5_K, Q6_K, Q8_0, MXFP4) in the interleaved layout (see above),
// or back to the file's layout when `inverse`; a new tensor of the same shape.
at::Tensor gguf_repack(const at::Tensor& w, int64_t type, bool inverse) {
  const Layout* lp = interleaved_layout(type);
  TORCH_CHECK(lp != nullptr, "gguf_repack: no interleaved layout for GGML type ", type);
  const Layout& l = *lp;
  TORCH_CHECK(w.scalar_type() == at::kByte && w.dim() == 2 && w.is_contiguous() && w.size(1) % l.bytes == 0,
              "gguf_repack: weights are contiguous uint8 [rows, row bytes] of whole blocks");
  at::Tensor out = huge_page_bytes(w.size(0), w.size(1));
  const int64_t rows = w.size(0), rb = w.size(1), nb = rb / l.bytes, groups = rows / NR;
  uint8_t* src = w.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, groups, 4, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t b = 0; b < nb; ++b)
        for (int64_t i = 0; i < NR; ++i) {
          const int64_t file = (g * NR + i) * rb + b * l.bytes, chunk = g * NR * rb + b * NR * l.bytes;
          if (inverse)
            move_block<false>(l, dst + file, src + chunk, i, lead_first(chunk));
          else
            move_block<true>(l, src + file, dst + chunk, i, lead_first(chunk));
        }
  });
  if (groups * NR < rows) std::memcpy(dst + groups * NR * rb, src + groups * NR * rb, (rows - groups * NR) * rb);
  return out;
}

}  // namespace

extern "C" const char* radixlm_gguf_gemm_isa() { return radixlm_isa(); }

TORCH_LIBRARY_IMPL(radixlm, CPU, lib) {
  lib.impl("gguf_linear", &gguf_linear);
  lib.impl("gguf_rows", &gguf_rows);
  lib.impl("gguf_repack", &gguf_repack);
}
