// One call for a mixture-of-experts MLP on the CPU: for T tokens routed top-k (weights [T, k] float32, expert
// ids [T, k]), out[t] = sum_j weights[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t])), e = ids[t, j].
// moe_gguf also serves gpt-oss's expert: gate and up with biases (b13 [E, 2I]), its clamped SwiGLU
// (gate clamped above at `limit`, up to [-limit, limit], act = (up + 1) * gate * sigmoid(alpha * gate)), and
// down with a bias (b2 [E, H]); each is optional and the plain path pays nothing for them.
//
// The T * k (token, choice) rows are grouped by expert (a counting sort: tokens ascending within an expert),
// and every step runs over all hit experts at once, parallel over (expert, 16 output rows) work units:
//   1. x is quantized to int8 once per token (per block of 32 or 256 as the weights' type asks), and the
//      quantized rows gathered into grouped order;
//   2. each hit expert's gate and up rows times its tokens' rows -> h [rows, 2I];
//   3. a = silu(h_gate) * h_up (ATen's SiLU; or the clamped SwiGLU), quantized per row -> the down
//      projection's activations;
//   4. each hit expert's down rows -> y [rows, H];
//   5. out[t] = sum over t's k rows of weight * y (one thread per token: no atomics, a fixed order).
// Only the hit experts' weights are read. Each step's units are split over the threads by their rows (an
// expert most tokens chose is shared). Tokens are taken 512 at a time (the scratch stays ~50 MB).
//
// Weight formats (the op per format; each reuses the block kernels of the single-matrix ops, compiled into
// this library by including their sources below, so the arithmetic is theirs byte for byte):
//   moe_gguf:  GGUF blocks stacked [E, rows, row bytes] (gate, up, down; any type gguf_gemm.cpp reads, and
//              the 16-row interleaved layout of Q4_K/Q5_K/Q6_K/Q8_0, each expert's slice repacked on its own);
//   moe_w4a8:  w4a8's interleaved Q4_1 / Q8_0 groups stacked [E, groups, bytes] (gate|up fused, then down);
//   moe_float: float32 / bfloat16 w13 [E, 2I, H], w2 [E, H, I] (ATen matmuls per hit expert, in C++).
// The ops are declared from Python (runtime/models/moe_fused.py), which also builds this library.
#include <ATen/ATen.h>
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

#if defined(__AVX2__) || defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

// The two kernel sources, each in its own namespace; their op registrations become unused functions (the
// ops are registered by their own libraries). Every header they include is included above, so their
// #includes inside the namespaces are no-ops. Python keys this library's cache on both files' text.
#pragma push_macro("TORCH_LIBRARY_IMPL")
#undef TORCH_LIBRARY_IMPL
#define TORCH_LIBRARY_IMPL(ns, k, m) [[maybe_unused]] static void unregistered_##ns##_##k(torch::Library& m)
namespace radixlm_w4a8 {
#include "w4a8_gemm.cpp"
}
#undef RADIXLM_AVX512
#undef RADIXLM_AVX2
namespace radixlm_gguf {
#include "gguf_gemm.cpp"
}
#pragma pop_macro("TORCH_LIBRARY_IMPL")

namespace {

namespace w4 = radixlm_w4a8;
namespace gg = radixlm_gguf;

constexpr int64_t TOKEN_CHUNK = 512;  // tokens per pass (bounds the scratch: rows * (2I + I + H) floats)
constexpr int64_t UNIT_ROWS = 16;     // output rows per work unit (one interleaved group)

// The (token, choice) rows grouped by expert.
struct Routing {
  int64_t T = 0, k = 0;
  std::vector<int64_t> hit;    // experts hit, ascending
  std::vector<int64_t> start;  // rows [start[i], start[i + 1]) are expert hit[i]'s
  std::vector<int64_t> token;  // token of grouped row r
  std::vector<int64_t> slot;   // grouped row of (t, j): slot[t * k + j]
};

Routing group_by_expert(const int64_t* ids, int64_t T, int64_t k, int64_t E) {
  Routing r;
  r.T = T;
  r.k = k;
  std::vector<int64_t> count(E + 1, 0);
  for (int64_t i = 0; i < T * k; ++i) {
    TORCH_CHECK(ids[i] >= 0 && ids[i] < E, "moe: topk_ids holds expert ", ids[i], ", outside [0, ", E, ")");
    ++count[ids[i] + 1];
  }
  std::vector<int64_t> next(E, 0);
  for (int64_t e = 0; e < E; ++e) {
    next[e] = count[e];
    count[e + 1] += count[e];
    if (count[e + 1] > count[e]) {
      r.hit.push_back(e);
      r.start.push_back(count[e]);
    }
  }
  r.start.push_back(T * k);
  r.token.resize(T * k);
  r.slot.resize(T * k);
  for (int64_t i = 0; i < T * k; ++i) {
    const int64_t row = next[ids[i]]++;
    r.token[row] = i / k;
    r.slot[i] = row;
  }
  return r;
}

// out[t] = sum_j w[t, j] * y[slot[t, j]] for t < T (y [rows, H] float32, out [T, H] float32)
void combine(const Routing& r, const float* w, const float* y, int64_t H, float* out) {
  at::parallel_for(0, r.T, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      float* o = out + t * H;
      std::fill(o, o + H, 0.f);
      for (int64_t j = 0; j < r.k; ++j) {
        const float wt = w[t * r.k + j];
        const float* yr = y + r.slot[t * r.k + j] * H;
        for (int64_t c = 0; c < H; ++c) o[c] += wt * yr[c];
      }
    }
  });
}

// silu(h[:, :I]) * h[:, I:] for h [rows, 2I] float32: ATen's vectorized SiLU, the loop's F.silu(gate) * up
// bit for bit (a scalar std::exp here cost ~15 ms of a 256-token prefill's ~210 ms per layer).
at::Tensor silu_mul(const at::Tensor& h, int64_t I) { return at::silu(h.narrow(1, 0, I)).mul_(h.narrow(1, I, I)); }

// gpt-oss's clamped SwiGLU of h [rows, 2I] float32 (gate | up), in ATen ops in the order of
// runtime.models.gpt_oss.GptOssMoe.swiglu (so bit for bit the loop's)
at::Tensor clamped_swiglu(const at::Tensor& h, int64_t I, double alpha, double limit) {
  const at::Tensor gate = h.narrow(1, 0, I).clamp_max(limit);
  const at::Tensor up = h.narrow(1, I, I).clamp(-limit, limit);
  return ((up + 1) * (gate * at::sigmoid(gate * alpha))).contiguous();
}

// y[m * ldy + n] += b[n] for m < rows, n in [n0, n1)
inline void add_bias(float* y, int64_t ldy, int64_t rows, const float* b, int64_t n0, int64_t n1) {
  for (int64_t m = 0; m < rows; ++m)
    for (int64_t n = n0; n < n1; ++n) y[m * ldy + n] += b[n];
}

// A float32 [E, n] bias, or nullptr when absent.
const float* bias_of(const c10::optional<at::Tensor>& b, int64_t E, int64_t n, const char* name) {
  if (!b.has_value()) return nullptr;
  TORCH_CHECK(b->scalar_type() == at::kFloat && b->dim() == 2 && b->is_contiguous() && b->size(0) == E &&
                  b->size(1) == n,
              "moe_gguf: ", name, " must be contiguous float32 [", E, ", ", n, "], got ", b->scalar_type(), " ",
              b->sizes());
  return b->data_ptr<float>();
}

struct Unit {
  int64_t hit;   // index into Routing::hit
  int64_t part;  // which weight part (gate 0 / up 1; 0 for a fused or down part)
  int64_t n0;    // first output row of the part
};

std::vector<Unit> make_units(const Routing& r, int64_t parts, int64_t N) {
  std::vector<Unit> units;
  units.reserve(r.hit.size() * parts * ((N + UNIT_ROWS - 1) / UNIT_ROWS));
  for (int64_t h = 0; h < static_cast<int64_t>(r.hit.size()); ++h)
    for (int64_t p = 0; p < parts; ++p)
      for (int64_t n0 = 0; n0 < N; n0 += UNIT_ROWS) units.push_back({h, p, n0});
  return units;
}

// body(u) for every unit, the units split over the threads in contiguous ranges of about equal cost (a unit's
// activation rows in the kernels' 4-row tiles), so an expert most tokens chose is not one thread's alone.
template <typename F>
void for_units(const std::vector<Unit>& units, const Routing& r, const F& body) {
  const int64_t n = static_cast<int64_t>(units.size());
  std::vector<int64_t> cost(n + 1, 0);  // cost[i]: of units [0, i)
  for (int64_t i = 0; i < n; ++i)
    cost[i + 1] = cost[i] + (r.start[units[i].hit + 1] - r.start[units[i].hit] + 3) / 4;
  const int64_t total = cost[n];
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n));
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      // the units whose prefix cost lies in [total * t / threads, total * (t + 1) / threads)
      const int64_t lo = std::lower_bound(cost.begin(), cost.end(), total * t / threads) - cost.begin();
      const int64_t hi = std::lower_bound(cost.begin(), cost.end(), total * (t + 1) / threads) - cost.begin();
      for (int64_t u = lo; u < std::min(hi, n); ++u) body(units[u]);
    }
  });
}

// ------------------------------------------------------------------------------------------------- GGUF
// Quantized activations of the grouped rows, as gguf_gemm.cpp's kernels read them (gg::Acts, row-major).
void gather_acts(const gg::Acts& a, const Routing& r, int64_t K, gg::Acts& out) {
  const int64_t R = r.T * r.k;
  out.qa.resize(R * K);
  out.dl.resize(R * K / 4);
  out.sg.resize(R * K / 16);
  out.s32.resize(R * K / 32);
  out.i16.resize(R * K / 16);
  at::parallel_for(0, R, 64, [&](int64_t r0, int64_t r1) {
    for (int64_t row = r0; row < r1; ++row) {
      const int64_t t = r.token[row];
      std::memcpy(out.qa.data() + row * K, a.qa.data() + t * K, K);
      std::memcpy(out.dl.data() + row * K / 4, a.dl.data() + t * K / 4, K / 4 * sizeof(float));
      std::memcpy(out.sg.data() + row * K / 16, a.sg.data() + t * K / 16, K / 16 * sizeof(float));
      std::memcpy(out.s32.data() + row * K / 32, a.s32.data() + t * K / 32, K / 32 * sizeof(float));
      std::memcpy(out.i16.data() + row * K / 16, a.i16.data() + t * K / 16, K / 16 * sizeof(int32_t));
    }
  });
}

// Rows [n0, n1) (within one 16-row group) of one expert's part W ([N, rb], kernel type `type`, possibly
// interleaved) times grouped activation rows [r0, r1) of `a`: y[(m - r0) * ldy + n].
void gguf_unit(int64_t type, const uint8_t* W, int64_t N, int64_t rb, int64_t K, const gg::Acts& a, int64_t r0,
               int64_t r1, int64_t n0, int64_t n1, float* y, int64_t ldy) {
  const int64_t base = type & ~gg::INTERLEAVED;
#if defined(RADIXLM_AVX512)
  gg::TypeInfo info;
  gg::type_info(base, info);
  const int64_t nb = K / info.qk;
  const bool group = (type & gg::INTERLEAVED) && n0 + gg::NR <= N / gg::NR * gg::NR;
  if (group || gg::has_rows_path(base)) {
    for (int64_t m0 = r0; m0 < r1; m0 += 4) {
      const gg::ActView v{a.qa.data() + m0 * K, a.dl.data() + m0 * K / 4, a.sg.data() + m0 * K / 16,
                          a.s32.data() + m0 * K / 32, a.i16.data() + m0 * K / 16};
      const int64_t M = std::min<int64_t>(4, r1 - m0);
      float* ym = y + (m0 - r0) * ldy;
      if (group)
        gg::interleaved_group(base, W + n0 * rb, n0 * rb, nb, K, v, M, ym + n0, ldy, m0 == r0);
      else
        gg::decode_rows(base, W, K, v, M, ym, ldy, n0, n1);
    }
    return;
  }
#endif
  TORCH_CHECK(!(type & gg::INTERLEAVED), "moe_gguf: no interleaved kernel in this build");
  const int8_t* qa = a.qa.data() + r0 * K;
  const float* dl = a.dl.data() + r0 * K / 4;
  const float* sg = a.sg.data() + r0 * K / 16;
  const int64_t M = r1 - r0;
  switch (base) {
#define RADIXLM_PART(T, S, QK_, BYTES_, FN) \
  case gg::T: gg::part_rows<S, QK_, BYTES_, gg::FN>(W, K, qa, dl, sg, M, y, ldy, n0, n1); break;
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
}

struct GGUFPart {
  const uint8_t* w;
  int64_t type, N, rb, K, qk, expert_bytes;
};

GGUFPart gguf_part(const at::Tensor& w, int64_t type, int64_t E, int64_t N, int64_t K, const char* name) {
  const int64_t base = type & ~gg::INTERLEAVED;
  gg::TypeInfo info;
  TORCH_CHECK(gg::type_info(base, info), "moe_gguf: ", name, " has unsupported GGML type ", type);
  TORCH_CHECK(!(type & gg::INTERLEAVED) || (gg::interleaved_layout(base) != nullptr && gg::interleaved_kernels()),
              "moe_gguf: ", name, ": no interleaved kernel for type ", base, " in this build (", gg::radixlm_isa(),
              ")");
  TORCH_CHECK(w.scalar_type() == at::kByte && w.dim() == 3 && w.is_contiguous(), "moe_gguf: ", name,
              " must be contiguous uint8 [experts, rows, row bytes], got ", w.scalar_type(), " ", w.sizes());
  TORCH_CHECK(K % info.qk == 0, "moe_gguf: ", name, " rows of ", K, " elements are not whole blocks of ", info.qk);
  TORCH_CHECK(w.size(0) == E && w.size(1) == N && w.size(2) == K / info.qk * info.bytes, "moe_gguf: ", name,
              " has shape ", w.sizes(), ", expected [", E, ", ", N, ", ", K / info.qk * info.bytes, "]");
  return {w.data_ptr<uint8_t>(), type, N, w.size(2), K, info.qk, N * w.size(2)};
}

void check_routing(const at::Tensor& x, const at::Tensor& weights, const at::Tensor& ids, const char* op) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), op, ": x must be a contiguous [T, H] tensor, got ", x.sizes());
  TORCH_CHECK(weights.scalar_type() == at::kFloat && weights.dim() == 2 && weights.is_contiguous() &&
                  weights.size(0) == x.size(0),
              op, ": topk_weights must be contiguous float32 [T, k] with T = ", x.size(0), ", got ",
              weights.scalar_type(), " ", weights.sizes());
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.sizes() == weights.sizes() && ids.is_contiguous(), op,
              ": topk_ids must be contiguous int64 of topk_weights' shape ", weights.sizes(), ", got ",
              ids.scalar_type(), " ", ids.sizes());
}

// `activation`: "silu" (silu(gate) * up) or "clamped_swiglu" (gpt-oss's, with `alpha` and `limit`); b13
// [E, 2I] (gate's then up's) and b2 [E, H] float32 biases, each optional.
at::Tensor moe_gguf(const at::Tensor& x, const at::Tensor& topk_weights, const at::Tensor& topk_ids,
                    const at::Tensor& gate, const at::Tensor& up, const at::Tensor& down, at::IntArrayRef types,
                    const c10::optional<at::Tensor>& b13, const c10::optional<at::Tensor>& b2,
                    c10::string_view activation, double alpha, double limit) {
  check_routing(x, topk_weights, topk_ids, "moe_gguf");
  TORCH_CHECK(x.scalar_type() == at::kFloat, "moe_gguf takes float32 activations, got ", x.scalar_type());
  TORCH_CHECK(types.size() == 3, "moe_gguf: types holds the gate's, up's and down's type");
  const bool clamped = activation == "clamped_swiglu";
  TORCH_CHECK(clamped || activation == "silu", "moe_gguf: activation is silu or clamped_swiglu, got ", activation);
  const int64_t T = x.size(0), H = x.size(1), k = topk_ids.size(1), E = gate.size(0), I = gate.size(1);
  const GGUFPart parts[3] = {gguf_part(gate, types[0], E, I, H, "gate"), gguf_part(up, types[1], E, I, H, "up"),
                             gguf_part(down, types[2], E, H, I, "down")};
  const float* bias13 = bias_of(b13, E, 2 * I, "b13");
  const float* bias2 = bias_of(b2, E, H, "b2");
  at::Tensor out = at::empty({T, H}, x.options());
  if (T == 0) return out;
  const float* xp = x.data_ptr<float>();
  for (int64_t c0 = 0; c0 < T; c0 += TOKEN_CHUNK) {
    const int64_t Tc = std::min(TOKEN_CHUNK, T - c0);
    const Routing r = group_by_expert(topk_ids.data_ptr<int64_t>() + c0 * k, Tc, k, E);
    const int64_t R = Tc * k;
    // 1. x quantized once per token for each block size the gate and up need, gathered into grouped rows
    gg::Acts grouped[2];  // [0]: blocks of 32, [1]: of 256
    for (int q = 0; q < 2; ++q) {
      const int64_t qk = q == 0 ? 32 : 256;
      if (parts[0].qk != qk && parts[1].qk != qk) continue;
      gg::Acts tokens;
      gg::quantize_rows(xp + c0 * H, Tc, H, qk, tokens);
      gather_acts(tokens, r, H, grouped[q]);
    }
    // 2. gate | up of every hit expert -> h [R, 2I]
    // scratch as uninitialized tensors (every element is written before it is read)
    at::Tensor h = at::empty({R, 2 * I}, x.options()), y = at::empty({R, H}, x.options());
    float* hp = h.data_ptr<float>();
    float* yp = y.data_ptr<float>();
    const std::vector<Unit> up_units = make_units(r, 2, I);
    for_units(up_units, r, [&](const Unit& un) {
      const GGUFPart& p = parts[un.part];
      const int64_t r0 = r.start[un.hit], r1 = r.start[un.hit + 1];
      const int64_t n1 = std::min(un.n0 + UNIT_ROWS, I);
      float* hu = hp + r0 * 2 * I + un.part * I;
      gguf_unit(p.type, p.w + r.hit[un.hit] * p.expert_bytes, p.N, p.rb, H, grouped[p.qk == 32 ? 0 : 1], r0, r1,
                un.n0, n1, hu, 2 * I);
      if (bias13 != nullptr) add_bias(hu, 2 * I, r1 - r0, bias13 + r.hit[un.hit] * 2 * I + un.part * I, un.n0, n1);
    });
    // 3. the activation, quantized per row for the down projection
    const at::Tensor act = clamped ? clamped_swiglu(h, I, alpha, limit) : silu_mul(h, I);  // [R, I]
    gg::Acts acts;
    gg::quantize_rows(act.data_ptr<float>(), R, I, parts[2].qk, acts);
    // 4. down of every hit expert -> y [R, H]
    const std::vector<Unit> down_units = make_units(r, 1, H);
    const GGUFPart& p = parts[2];
    for_units(down_units, r, [&](const Unit& un) {
      const int64_t r0 = r.start[un.hit], r1 = r.start[un.hit + 1];
      const int64_t n1 = std::min(un.n0 + UNIT_ROWS, H);
      gguf_unit(p.type, p.w + r.hit[un.hit] * p.expert_bytes, p.N, p.rb, I, acts, r0, r1, un.n0, n1, yp + r0 * H, H);
      if (bias2 != nullptr) add_bias(yp + r0 * H, H, r1 - r0, bias2 + r.hit[un.hit] * H, un.n0, n1);
    });
    // 5. the weighted sum per token
    combine(r, topk_weights.data_ptr<float>() + c0 * k, yp, H, out.data_ptr<float>() + c0 * H);
  }
  return out;
}

// ------------------------------------------------------------------------------------------------- w4a8
// Quantized activations as w4a8_gemm.cpp's kernels read them: qa [rows, K], da / sa / asum [rows, K / 32].
struct W4Acts {
  std::vector<int8_t> qa;
  std::vector<float> da, sa;
  std::vector<int32_t> asum;
  int64_t K = 0, nb = 0;
  void quantize(const float* x, int64_t M, int64_t K_) {
    K = K_;
    nb = K / w4::QK;
    qa.resize(M * K);
    da.resize(M * nb);
    sa.resize(M * nb);
    asum.resize(M * nb);
    w4::quantize_rows(x, M, K, qa.data(), da.data(), sa.data(), asum.data());
  }
  w4::Acts view(int64_t r) const { return {qa.data() + r * K, da.data() + r * nb, sa.data() + r * nb, asum.data() + r * nb, K, nb}; }
};

struct W4Part {
  const uint8_t* qs;
  const c10::Half *d, *m;
  int64_t groups, N, K, nb, blk_bytes;
};

W4Part w4_part(const at::Tensor& qs, const at::Tensor& d, const c10::optional<at::Tensor>& m, int64_t E, int64_t N,
               int64_t K, const char* name) {
  const bool q4 = m.has_value();
  const int64_t nb = K / w4::QK, groups = (N + w4::NG - 1) / w4::NG;
  const int64_t blk = q4 ? w4::QK / 2 * w4::NG : w4::QK * w4::NG;
  TORCH_CHECK(K % w4::QK == 0, "moe_w4a8: ", name, " in_features ", K, " is not a multiple of 32");
  TORCH_CHECK(qs.scalar_type() == at::kByte && qs.is_contiguous() && qs.dim() == 3 && qs.size(0) == E &&
                  qs.size(1) == groups && qs.size(2) == nb * blk,
              "moe_w4a8: ", name, " blocks must be contiguous uint8 [", E, ", ", groups, ", ", nb * blk, "], got ",
              qs.scalar_type(), " ", qs.sizes());
  TORCH_CHECK(d.scalar_type() == at::kHalf && d.is_contiguous() && d.numel() == E * groups * nb * w4::NG,
              "moe_w4a8: ", name, " scales must be contiguous float16 [", E, ", ", groups, ", ", nb * w4::NG, "]");
  if (q4)
    TORCH_CHECK(m->scalar_type() == at::kHalf && m->is_contiguous() && m->numel() == d.numel(), "moe_w4a8: ", name,
                " mins must be float16 like the scales");
  return {qs.data_ptr<uint8_t>(), d.data_ptr<c10::Half>(), q4 ? m->data_ptr<c10::Half>() : nullptr,
          groups, N, K, nb, blk};
}

// Group g of expert e's part times grouped activation rows [r0, r1): y[(m - r0) * ldy + 16 g + i]
void w4_unit(const W4Part& p, int64_t e, int64_t g, const W4Acts& a, int64_t r0, int64_t r1, float* y, int64_t ldy) {
  const int64_t eg = e * p.groups + g;  // the group's index in the stacked tensor
  const uint8_t* qs = p.qs + eg * p.nb * p.blk_bytes;
  const c10::Half* d = p.d + eg * p.nb * w4::NG;
  const c10::Half* m = p.m != nullptr ? p.m + eg * p.nb * w4::NG : nullptr;
  const int64_t valid = std::min(w4::NG, p.N - g * w4::NG);
  for (int64_t r = r0; r < r1; r += w4::ROW_TILE) {
    const int rows = static_cast<int>(std::min<int64_t>(w4::ROW_TILE, r1 - r));
    float* yr = y + (r - r0) * ldy + g * w4::NG;
    if (m != nullptr)
      w4::group_rows<true>(qs, d, m, a.view(r), rows, yr, ldy, valid);
    else
      w4::group_rows<false>(qs, d, m, a.view(r), rows, yr, ldy, valid);
  }
}

at::Tensor moe_w4a8(const at::Tensor& x, const at::Tensor& topk_weights, const at::Tensor& topk_ids,
                    const at::Tensor& qs13, const at::Tensor& d13, const c10::optional<at::Tensor>& m13,
                    const at::Tensor& qs2, const at::Tensor& d2, const c10::optional<at::Tensor>& m2, int64_t inter) {
  check_routing(x, topk_weights, topk_ids, "moe_w4a8");
  TORCH_CHECK(x.scalar_type() == at::kFloat, "moe_w4a8 takes float32 activations, got ", x.scalar_type());
  const int64_t T = x.size(0), H = x.size(1), k = topk_ids.size(1), E = qs13.size(0), I = inter;
  const W4Part w13 = w4_part(qs13, d13, m13, E, 2 * I, H, "gate|up");
  const W4Part w2 = w4_part(qs2, d2, m2, E, H, I, "down");
  at::Tensor out = at::empty({T, H}, x.options());
  if (T == 0) return out;
  const float* xp = x.data_ptr<float>();
  for (int64_t c0 = 0; c0 < T; c0 += TOKEN_CHUNK) {
    const int64_t Tc = std::min(TOKEN_CHUNK, T - c0);
    const Routing r = group_by_expert(topk_ids.data_ptr<int64_t>() + c0 * k, Tc, k, E);
    const int64_t R = Tc * k;
    W4Acts tokens, grouped;
    tokens.quantize(xp + c0 * H, Tc, H);
    grouped.K = H;
    grouped.nb = tokens.nb;
    grouped.qa.resize(R * H);
    grouped.da.resize(R * tokens.nb);
    grouped.sa.resize(R * tokens.nb);
    grouped.asum.resize(R * tokens.nb);
    const int64_t nb = tokens.nb;
    for (int64_t row = 0; row < R; ++row) {
      const int64_t t = r.token[row];
      std::memcpy(grouped.qa.data() + row * H, tokens.qa.data() + t * H, H);
      std::memcpy(grouped.da.data() + row * nb, tokens.da.data() + t * nb, nb * sizeof(float));
      std::memcpy(grouped.sa.data() + row * nb, tokens.sa.data() + t * nb, nb * sizeof(float));
      std::memcpy(grouped.asum.data() + row * nb, tokens.asum.data() + t * nb, nb * sizeof(int32_t));
    }
    at::Tensor h = at::empty({R, 2 * I}, x.options()), y = at::empty({R, H}, x.options());
    float* hp = h.data_ptr<float>();
    float* yp = y.data_ptr<float>();
    const std::vector<Unit> up_units = make_units(r, 1, w13.groups * w4::NG);
    for_units(up_units, r, [&](const Unit& un) {
      const int64_t r0 = r.start[un.hit], r1 = r.start[un.hit + 1];
      w4_unit(w13, r.hit[un.hit], un.n0 / w4::NG, grouped, r0, r1, hp + r0 * 2 * I, 2 * I);
    });
    const at::Tensor act = silu_mul(h, I);
    W4Acts acts;
    acts.quantize(act.data_ptr<float>(), R, I);
    const std::vector<Unit> down_units = make_units(r, 1, w2.groups * w4::NG);
    for_units(down_units, r, [&](const Unit& un) {
      const int64_t r0 = r.start[un.hit], r1 = r.start[un.hit + 1];
      w4_unit(w2, r.hit[un.hit], un.n0 / w4::NG, acts, r0, r1, yp + r0 * H, H);
    });
    combine(r, topk_weights.data_ptr<float>() + c0 * k, yp, H, out.data_ptr<float>() + c0 * H);
  }
  return out;
}

// ------------------------------------------------------------------------------------------------ float
// float32 / bfloat16 stacked weights: per hit expert, two ATen matmuls on its grouped rows (no Python between
// them); the weighted sum in float32, returned in x's dtype.
at::Tensor moe_float(const at::Tensor& x, const at::Tensor& topk_weights, const at::Tensor& topk_ids,
                     const at::Tensor& w13, const at::Tensor& w2) {
  check_routing(x, topk_weights, topk_ids, "moe_float");
  const int64_t T = x.size(0), H = x.size(1), k = topk_ids.size(1), E = w13.size(0), I = w13.size(1) / 2;
  TORCH_CHECK(w13.dim() == 3 && w13.size(2) == H && w13.size(1) % 2 == 0, "moe_float: w13 must be [E, 2I, ", H,
              "], got ", w13.sizes());
  TORCH_CHECK(w2.dim() == 3 && w2.size(0) == E && w2.size(1) == H && w2.size(2) == I, "moe_float: w2 must be [", E,
              ", ", H, ", ", I, "], got ", w2.sizes());
  TORCH_CHECK(w13.scalar_type() == x.scalar_type() && w2.scalar_type() == x.scalar_type(),
              "moe_float: weights and x must share a dtype, got ", w13.scalar_type(), ", ", w2.scalar_type(), ", ",
              x.scalar_type());
  at::Tensor out = at::empty({T, H}, x.options().dtype(at::kFloat));
  if (T == 0) return out.to(x.scalar_type());
  const Routing r = group_by_expert(topk_ids.data_ptr<int64_t>(), T, k, E);
  const int64_t R = T * k;
  at::Tensor tokens = at::from_blob(const_cast<int64_t*>(r.token.data()), {R}, at::kLong);
  at::Tensor xs = x.index_select(0, tokens);  // [R, H] grouped rows
  at::Tensor y = at::empty({R, H}, x.options().dtype(at::kFloat));
  for (size_t i = 0; i < r.hit.size(); ++i) {
    const int64_t e = r.hit[i], r0 = r.start[i], n = r.start[i + 1] - r0;
    at::Tensor gu = at::mm(xs.narrow(0, r0, n), w13[e].t());  // [n, 2I]
    at::Tensor a = at::silu(gu.narrow(1, 0, I)) * gu.narrow(1, I, I);
    y.narrow(0, r0, n).copy_(at::mm(a, w2[e].t()));
  }
  combine(r, topk_weights.data_ptr<float>(), y.data_ptr<float>(), H, out.data_ptr<float>());
  return out.scalar_type() == x.scalar_type() ? out : out.to(x.scalar_type());
}

}  // namespace

// Which vector path this build compiled (the GGUF kernels' name for it).
extern "C" const char* radixlm_moe_fused_isa() { return gg::radixlm_isa(); }

TORCH_LIBRARY_IMPL(radixlm, CPU, lib) {
  lib.impl("moe_gguf", &moe_gguf);
  lib.impl("moe_w4a8", &moe_w4a8);
  lib.impl("moe_float", &moe_float);
}
