// Fused elementwise steps of a decoder layer on the CPU: rotary embedding of q and k, and SiLU(gate) * up.
//
// Why: in eager mode each is several ATen ops (rope: slice, neg, cat, two muls and an add, for q and for k;
// the MLP: split, silu, mul), and at decode batch sizes the tensors are tiny, so dispatch and the temporary
// tensors cost more than the arithmetic: measured 65 us for rope of q and k and 72 us for silu * up at 32
// tokens per layer on one thread (x 30 layers per step), against a few us here.
//
// rope_(q, k, cos, sin): q [T, H, D], k [T, Hkv, D] (last dim contiguous; any row strides, e.g. views into
// the fused qkv projection) rotated in place with the rotate-half convention:
//   x' = x * cos + rotate_half(x) * sin, rotate_half(x) = cat(-x[D/2:], x[:D/2]); cos, sin [T, D] float32
//   with a contiguous last dim (row strides free: they may be the two halves of one [T, 2D] table).
// silu_mul(x): x [T, 2I] (gate | up) -> [T, I] = silu(gate) * up, computed in float32.
// rms_norm(x, w, eps): x [..., N] contiguous -> x * rsqrt(mean(x^2) + eps) * w, a new tensor.
// fused_add_rms_norm_(x, residual, w, eps): in place, residual += x, then x = rms_norm(residual) * w: the
//   decoder's "h = h + sublayer(...); norm(h)" as one call, with the residual carried beside the normed x
//   (each is one ATen call of ~10 sub-ops plus an add otherwise, per norm, per layer).
// Rows go parallel only past ~32K elements: at decode a parallel region costs more than the row.
// Rounding follows the eager path: float32 is F.rms_norm's (x * r) * w; bfloat16/float16 round the sum, the
// normalised x and the product with w to the storage type, as RMSNorm.forward's half-precision branch does.
// Tensors may be float32, bfloat16 or float16 (math in float32). The ops are declared from Python
// (runtime/models/native_kernels.py); this file adds their CPU implementations.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>
#include <cstdint>
#include <type_traits>

#if defined(__AVX2__) && defined(__FMA__) && !defined(RADIXLM_PORTABLE)
#define RADIXLM_AVX2 1
#include <immintrin.h>
#endif

namespace {

#ifdef RADIXLM_AVX2
// exp(x) for any float x (clamped to [-87.3, 88.3]): Cody-Waite reduction and a degree-6 polynomial, ~2 ulp.
inline __m256 exp256(__m256 v) {
  v = _mm256_min_ps(_mm256_max_ps(v, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
  const __m256 fx = _mm256_round_ps(_mm256_mul_ps(v, _mm256_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  v = _mm256_sub_ps(v, _mm256_mul_ps(fx, _mm256_set1_ps(0.693359375f)));
  v = _mm256_sub_ps(v, _mm256_mul_ps(fx, _mm256_set1_ps(-2.12194440e-4f)));
  const __m256 z = _mm256_mul_ps(v, v);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, v, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, v, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, v, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, v, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, v, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, z, _mm256_add_ps(v, _mm256_set1_ps(1.f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}
#endif

template <typename T>
void rope_rows(T* x, int64_t T_, int64_t heads, int64_t s0, int64_t s1, int64_t D, const float* cos,
               const float* sin, int64_t cs) {
  const int64_t half = D / 2;
  at::parallel_for(0, T_ * heads, 64, [&](int64_t lo, int64_t hi) {
    float a[512], b[512];  // D <= 1024 (checked)
    for (int64_t i = lo; i < hi; ++i) {
      const int64_t t = i / heads, h = i % heads;
      T* row = x + t * s0 + h * s1;
      const float* c = cos + t * cs;
      const float* s = sin + t * cs;
      for (int64_t j = 0; j < half; ++j) {
        a[j] = static_cast<float>(row[j]);
        b[j] = static_cast<float>(row[j + half]);
      }
      for (int64_t j = 0; j < half; ++j) {  // first half: x*cos - x2*sin; second: x2*cos + x*sin
        row[j] = static_cast<T>(a[j] * c[j] - b[j] * s[j]);
        row[j + half] = static_cast<T>(b[j] * c[j + half] + a[j] * s[j + half]);
      }
    }
  });
}

template <typename T>
void rope_one(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  rope_rows<T>(x.data_ptr<T>(), x.size(0), x.size(1), x.stride(0), x.stride(1), x.size(2),
               cos.data_ptr<float>(), sin.data_ptr<float>(), cos.stride(0));
}

void rope_(at::Tensor q, at::Tensor k, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.dim() == 2 &&
                  cos.sizes() == sin.sizes() && cos.stride(1) == 1 && sin.stride(1) == 1 &&
                  cos.stride(0) == sin.stride(0),
              "rope_: cos and sin must be float32 [T, D] with a contiguous last dim and one row stride");
  for (at::Tensor* x : {&q, &k}) {
    TORCH_CHECK(x->dim() == 3 && x->stride(2) == 1 && x->size(0) == cos.size(0) && x->size(2) == cos.size(1) &&
                    x->size(2) % 2 == 0 && x->size(2) <= 1024,
                "rope_: q and k must be [T, heads, D] with a contiguous last dim matching cos [T, D]");
    switch (x->scalar_type()) {
      case at::kFloat: rope_one<float>(*x, cos, sin); break;
      case at::kBFloat16: rope_one<c10::BFloat16>(*x, cos, sin); break;
      case at::kHalf: rope_one<c10::Half>(*x, cos, sin); break;
      default: TORCH_CHECK(false, "rope_: q and k must be float32, bfloat16 or float16");
    }
  }
}

template <typename T>
void silu_mul_rows(const T* x, T* y, int64_t rows, int64_t inter, int64_t xs) {
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / inter), [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) {
      const T* g = x + r * xs;
      const T* u = g + inter;
      T* o = y + r * inter;
      int64_t j = 0;
#ifdef RADIXLM_AVX2
      if constexpr (std::is_same_v<T, float>) {
        for (; j + 8 <= inter; j += 8) {
          const __m256 gv = _mm256_loadu_ps(g + j);
          const __m256 den = _mm256_add_ps(_mm256_set1_ps(1.f), exp256(_mm256_sub_ps(_mm256_setzero_ps(), gv)));
          _mm256_storeu_ps(o + j, _mm256_mul_ps(_mm256_div_ps(gv, den), _mm256_loadu_ps(u + j)));
        }
      }
#endif
      for (; j < inter; ++j) {
        const float gv = static_cast<float>(g[j]);
        o[j] = static_cast<T>(gv / (1.f + std::exp(-gv)) * static_cast<float>(u[j]));
      }
    }
  });
}

at::Tensor silu_mul(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) % 2 == 0,
              "silu_mul: x must be [T, 2 * intermediate] with a contiguous last dim");
  const int64_t inter = x.size(1) / 2;
  at::Tensor y = at::empty({x.size(0), inter}, x.options());
  switch (x.scalar_type()) {
    case at::kFloat: silu_mul_rows<float>(x.data_ptr<float>(), y.data_ptr<float>(), x.size(0), inter, x.stride(0)); break;
    case at::kBFloat16:
      silu_mul_rows<c10::BFloat16>(x.data_ptr<c10::BFloat16>(), y.data_ptr<c10::BFloat16>(), x.size(0), inter,
                                   x.stride(0));
      break;
    case at::kHalf:
      silu_mul_rows<c10::Half>(x.data_ptr<c10::Half>(), y.data_ptr<c10::Half>(), x.size(0), inter, x.stride(0));
      break;
    default: TORCH_CHECK(false, "silu_mul: x must be float32, bfloat16 or float16");
  }
  return y;
}

// ------------------------------------------------------------------------------------------- greedy pick
// Per row of float32 logits: the first index of the maximum, and the maximum. torch.argmax tracks an index
// per element and is not vectorised on the CPU (~90 us for one 49k-vocabulary row, 640 us for eight); a
// vector max and a scan for its first occurrence take a few us. NaN is the maximum, as in torch.argmax.
// The max runs four independent vector chains (one chain waits on _mm256_max_ps's latency every 8 floats),
// and the scan compares 8 floats at a time: ~5x less time per row than one chain and a scalar scan.
void argmax_row(const float* x, int64_t n, int64_t* id, float* value) {
  float m = x[0];
  bool has_nan = false;
  int64_t j = 0;
#ifdef RADIXLM_AVX2
  if (n >= 32) {
    __m256 m0 = _mm256_loadu_ps(x), m1 = _mm256_loadu_ps(x + 8), m2 = _mm256_loadu_ps(x + 16),
           m3 = _mm256_loadu_ps(x + 24);
    // unordered(a, b) is true where either is NaN: one compare covers two vectors
    __m256 nan = _mm256_or_ps(_mm256_cmp_ps(m0, m1, _CMP_UNORD_Q), _mm256_cmp_ps(m2, m3, _CMP_UNORD_Q));
    for (j = 32; j + 32 <= n; j += 32) {
      const __m256 v0 = _mm256_loadu_ps(x + j), v1 = _mm256_loadu_ps(x + j + 8);
      const __m256 v2 = _mm256_loadu_ps(x + j + 16), v3 = _mm256_loadu_ps(x + j + 24);
      m0 = _mm256_max_ps(m0, v0);
      m1 = _mm256_max_ps(m1, v1);
      m2 = _mm256_max_ps(m2, v2);
      m3 = _mm256_max_ps(m3, v3);
      nan = _mm256_or_ps(nan, _mm256_or_ps(_mm256_cmp_ps(v0, v1, _CMP_UNORD_Q), _mm256_cmp_ps(v2, v3, _CMP_UNORD_Q)));
    }
    const __m256 mv = _mm256_max_ps(_mm256_max_ps(m0, m1), _mm256_max_ps(m2, m3));
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, mv);
    m = lanes[0];
    for (int i = 1; i < 8; ++i) m = std::max(m, lanes[i]);
    has_nan = _mm256_movemask_ps(nan) != 0;
  }
#endif
  for (; j < n; ++j) {  // the tail, or the whole row
    if (std::isnan(x[j])) has_nan = true;
    else if (x[j] > m || std::isnan(m)) m = x[j];
  }
  int64_t i = 0;
#ifdef RADIXLM_AVX2
  if (!has_nan) {  // the first occurrence of the maximum, 8 at a time
    const __m256 mv = _mm256_set1_ps(m);
    for (; i + 8 <= n; i += 8) {
      const int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), mv, _CMP_EQ_OQ));
      if (hit) {
        i += __builtin_ctz(static_cast<unsigned>(hit));
        *id = i;
        *value = x[i];
        return;
      }
    }
  }
#endif
  for (; i < n; ++i) {  // the first NaN, else the first occurrence of the maximum
    if (has_nan ? std::isnan(x[i]) : x[i] == m) {
      *id = i;
      *value = x[i];
      return;
    }
  }
  *id = 0;  // unreachable: m is one of the row's values
  *value = m;
}

std::tuple<at::Tensor, at::Tensor> row_argmax(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1 && x.size(1) > 0,
              "row_argmax: x must be a float32 [rows, n > 0] tensor with a contiguous last dim, got ",
              x.scalar_type(), " ", x.sizes());
  const int64_t rows = x.size(0), n = x.size(1), stride = x.stride(0);
  at::Tensor ids = at::empty({rows}, x.options().dtype(at::kLong));
  at::Tensor values = at::empty({rows}, x.options());
  const float* xp = x.data_ptr<float>();
  int64_t* ip = ids.data_ptr<int64_t>();
  float* vp = values.data_ptr<float>();
  at::parallel_for(0, rows, 4, [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) argmax_row(xp + r * stride, n, ip + r, vp + r);
  });
  return {ids, values};
}

// ------------------------------------------------------------------------------------------- rms norm
constexpr int64_t NORM_GRAIN = 32768;  // elements per parallel chunk

template <typename T>
inline float sum_squares(const T* x, int64_t n) {
  int64_t j = 0;
  float s = 0.f;
#ifdef RADIXLM_AVX2
  if constexpr (std::is_same_v<T, float>) {
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    for (; j + 16 <= n; j += 16) {
      const __m256 v0 = _mm256_loadu_ps(x + j), v1 = _mm256_loadu_ps(x + j + 8);
      a0 = _mm256_fmadd_ps(v0, v0, a0);
      a1 = _mm256_fmadd_ps(v1, v1, a1);
    }
    const __m256 a = _mm256_add_ps(a0, a1);
    const __m128 h = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    const __m128 q = _mm_add_ps(h, _mm_movehl_ps(h, h));
    s = _mm_cvtss_f32(_mm_add_ss(q, _mm_shuffle_ps(q, q, 1)));
  }
#endif
  for (; j < n; ++j) {
    const float v = static_cast<float>(x[j]);
    s += v * v;
  }
  return s;
}

// out[j] = T(w[j] * T(x[j] * r)), r = 1 / sqrt(mean(x^2) + eps); out may be x itself.
template <typename T>
inline void norm_row(const T* x, T* out, const T* w, int64_t n, float eps) {
  const float r = 1.f / std::sqrt(sum_squares(x, n) / static_cast<float>(n) + eps);
  int64_t j = 0;
#ifdef RADIXLM_AVX2
  if constexpr (std::is_same_v<T, float>) {
    const __m256 rv = _mm256_set1_ps(r);
    for (; j + 8 <= n; j += 8)
      _mm256_storeu_ps(out + j, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + j), rv), _mm256_loadu_ps(w + j)));
  }
#endif
  for (; j < n; ++j)
    out[j] = static_cast<T>(static_cast<float>(w[j]) * static_cast<float>(static_cast<T>(static_cast<float>(x[j]) * r)));
}

void check_norm(const char* op, const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.dim() >= 1 && x.is_contiguous(), op, ": x must be contiguous [..., hidden]");
  TORCH_CHECK(w.dim() == 1 && w.is_contiguous() && w.size(0) == x.size(-1), op,
              ": weight must be a contiguous [hidden] matching x's last dim (", x.size(-1), ")");
  TORCH_CHECK(w.scalar_type() == x.scalar_type(), op, ": weight and x must have one dtype");
  TORCH_CHECK(x.size(-1) > 0, op, ": hidden size must be positive");
}

template <typename T>
void rms_norm_rows(const T* x, T* out, const T* w, int64_t rows, int64_t n, float eps) {
  at::parallel_for(0, rows, std::max<int64_t>(1, NORM_GRAIN / n), [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) norm_row<T>(x + i * n, out + i * n, w, n, eps);
  });
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  check_norm("rms_norm", x, w);
  at::Tensor out = at::empty(x.sizes(), x.options());
  const int64_t n = x.size(-1), rows = x.numel() / n;
  switch (x.scalar_type()) {
#define RADIXLM_NORM(T) \
  rms_norm_rows<T>(x.data_ptr<T>(), out.data_ptr<T>(), w.data_ptr<T>(), rows, n, static_cast<float>(eps))
    case at::kFloat: RADIXLM_NORM(float); break;
    case at::kBFloat16: RADIXLM_NORM(c10::BFloat16); break;
    case at::kHalf: RADIXLM_NORM(c10::Half); break;
#undef RADIXLM_NORM
    default: TORCH_CHECK(false, "rms_norm: x must be float32, bfloat16 or float16");
  }
  return out;
}

template <typename T>
void add_norm_rows(T* x, T* res, const T* w, int64_t rows, int64_t n, float eps) {
  at::parallel_for(0, rows, std::max<int64_t>(1, NORM_GRAIN / n), [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      T* xr = x + i * n;
      T* rr = res + i * n;
      int64_t j = 0;
#ifdef RADIXLM_AVX2
      if constexpr (std::is_same_v<T, float>) {
        for (; j + 8 <= n; j += 8) _mm256_storeu_ps(rr + j, _mm256_add_ps(_mm256_loadu_ps(rr + j), _mm256_loadu_ps(xr + j)));
      }
#endif
      for (; j < n; ++j) rr[j] = static_cast<T>(static_cast<float>(rr[j]) + static_cast<float>(xr[j]));
      norm_row<T>(rr, xr, w, n, eps);
    }
  });
}

void fused_add_rms_norm_(at::Tensor x, at::Tensor residual, const at::Tensor& w, double eps) {
  check_norm("fused_add_rms_norm_", x, w);
  TORCH_CHECK(residual.is_contiguous() && residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type(),
              "fused_add_rms_norm_: residual must be contiguous with x's shape and dtype");
  TORCH_CHECK(!x.is_alias_of(residual), "fused_add_rms_norm_: x and residual must be different tensors");
  const int64_t n = x.size(-1), rows = x.numel() / n;
  switch (x.scalar_type()) {
#define RADIXLM_ADD_NORM(T) \
  add_norm_rows<T>(x.data_ptr<T>(), residual.data_ptr<T>(), w.data_ptr<T>(), rows, n, static_cast<float>(eps))
    case at::kFloat: RADIXLM_ADD_NORM(float); break;
    case at::kBFloat16: RADIXLM_ADD_NORM(c10::BFloat16); break;
    case at::kHalf: RADIXLM_ADD_NORM(c10::Half); break;
#undef RADIXLM_ADD_NORM
    default: TORCH_CHECK(false, "fused_add_rms_norm_: x must be float32, bfloat16 or float16");
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(radixlm, CPU, lib) {
  lib.impl("rope_", &rope_);
  lib.impl("silu_mul", &silu_mul);
  lib.impl("row_argmax", &row_argmax);
  lib.impl("rms_norm", &rms_norm);
  lib.impl("fused_add_rms_norm_", &fused_add_rms_norm_);
}
