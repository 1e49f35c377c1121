#include "rowops.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <list>
#include <mutex>
#include <stdexcept>
#include <vector>

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "attention_math.h"
#include "strided.h"
#include "targets.h"
#include "workers.h"


namespace mnb {

namespace {

// Element i of a 0-D or 1-D array of T, whatever its stride (a broadcast has stride 0).
template <typename T>
T element(const mx::array& a, int64_t i) {
  return a.ndim() == 0 ? a.data<T>()[0] : a.data<T>()[i * a.strides()[0]];
}

// --- RMS norm ------------------------------------------------------------------------------

// 16 partial sums: the compiler keeps them in one or two vector registers.
MNB_INLINE float sum_squares(const float* x, int n) {
  float part[16] = {};
  int i = 0;
  for (; i + 16 <= n; i += 16) {
    for (int j = 0; j < 16; ++j) {
      part[j] += x[i + j] * x[i + j];
    }
  }
  float total = 0.0f;
  for (int j = 0; j < 16; ++j) {
    total += part[j];
  }
  for (; i < n; ++i) {
    total += x[i] * x[i];
  }
  return total;
}

MNB_INLINE void norm_row(const float* x, const float* w, float* out, int n, float eps) {
  const float r = 1.0f / std::sqrt(sum_squares(x, n) / float(n) + eps);
  if (w != nullptr) {
    for (int i = 0; i < n; ++i) {
      out[i] = (x[i] * r) * w[i];
    }
  } else {
    for (int i = 0; i < n; ++i) {
      out[i] = x[i] * r;
    }
  }
}

struct NormJob {
  const float* x;
  const int64_t* starts;
  const float* w;
  float* out;
  int64_t rows;
  int n;
  float eps;
};

MNB_INLINE void norm_rows(const NormJob& j) {
  for (int64_t r = 0; r < j.rows; ++r) {
    norm_row(j.x + j.starts[r], j.w, j.out + r * j.n, j.n, j.eps);
  }
}

void norm_portable(const NormJob& j) {
  norm_rows(j);
}
#if defined(__x86_64__)
MNB_AVX2 void norm_avx2(const NormJob& j) {
  norm_rows(j);
}
MNB_AVX512 void norm_avx512(const NormJob& j) {
  norm_rows(j);
}
#endif

// --- gelu_tanh(gate) * up ------------------------------------------------------------------

constexpr float kGeluA = 0.7978845608028654f, kGeluB = 0.044715f; // sqrt(2 / pi); the cubic's

// One element, as the vector forms compute each lane (FMA where they use it), so an
// element's bits do not depend on whether it falls in a vector or the tail.
template <bool FMA>
MNB_INLINE float gelu_mul_one(float x, float u) {
  auto madd = [](float a, float b, float c) { return FMA ? std::fma(a, b, c) : a * b + c; };
  float z = madd(kGeluB, (x * x) * x, x) * kGeluA;
  z = std::min(attn::kTanhLimit, std::max(-attn::kTanhLimit, z));
  const float t = z * z;
  float p = attn::kTanhP[4], q = attn::kTanhQ[4];
  for (int k = 3; k >= 0; --k) {
    p = madd(p, t, attn::kTanhP[k]);
    q = madd(q, t, attn::kTanhQ[k]);
  }
  const float y = std::min(1.0f, std::max(-1.0f, (z * p) / q));
  return ((0.5f * x) * (1.0f + y)) * u;
}

void gelu_mul_portable(const float* g, const float* u, float* o, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    o[i] = gelu_mul_one<false>(g[i], u[i]);
  }
}

#if defined(__x86_64__)
// The vector forms, one per width: the same operations lane by lane as gelu_mul_one<true>.
#define MNB_GELU_BODY(W, V, P)                                                          \
  int64_t i = 0;                                                                        \
  for (; i + W <= n; i += W) {                                                          \
    const V x = P##_loadu_ps(g + i);                                                    \
    V z = P##_mul_ps(P##_fmadd_ps(P##_set1_ps(kGeluB), P##_mul_ps(P##_mul_ps(x, x), x), x), \
                     P##_set1_ps(kGeluA));                                              \
    z = P##_min_ps(P##_set1_ps(attn::kTanhLimit), P##_max_ps(P##_set1_ps(-attn::kTanhLimit), z)); \
    const V t = P##_mul_ps(z, z);                                                       \
    V p = P##_set1_ps(attn::kTanhP[4]), q = P##_set1_ps(attn::kTanhQ[4]);               \
    for (int k = 3; k >= 0; --k) {                                                      \
      p = P##_fmadd_ps(p, t, P##_set1_ps(attn::kTanhP[k]));                             \
      q = P##_fmadd_ps(q, t, P##_set1_ps(attn::kTanhQ[k]));                             \
    }                                                                                   \
    const V y = P##_min_ps(P##_set1_ps(1.0f),                                           \
                           P##_max_ps(P##_set1_ps(-1.0f), P##_div_ps(P##_mul_ps(z, p), q))); \
    const V r = P##_mul_ps(P##_mul_ps(P##_set1_ps(0.5f), x), P##_add_ps(P##_set1_ps(1.0f), y)); \
    P##_storeu_ps(o + i, P##_mul_ps(r, P##_loadu_ps(u + i)));                           \
  }                                                                                     \
  for (; i < n; ++i) {                                                                  \
    o[i] = gelu_mul_one<true>(g[i], u[i]);                                              \
  }

MNB_AVX2 void gelu_mul_avx2(const float* g, const float* u, float* o, int64_t n) {
  MNB_GELU_BODY(8, __m256, _mm256)
}
MNB_AVX512 void gelu_mul_avx512(const float* g, const float* u, float* o, int64_t n) {
  MNB_GELU_BODY(16, __m512, _mm512)
}
#undef MNB_GELU_BODY
#endif

// --- silu(gate) * up ----------------------------------------------------------------------

constexpr float kSiluExpMax = 88.0f; // exp(88) < FLT_MAX: 2^127 still fits the exponent

// One element, as the vector forms compute each lane (FMA where they use it): silu(x) * u with
// silu(x) = x / (1 + exp(-x)), exp by attention_math.h's polynomial on -x clamped to
// [kExpMin, kSiluExpMax] (past them silu is 0 or x to float rounding).
template <bool FMA>
MNB_INLINE float silu_mul_one(float x, float u) {
  auto madd = [](float a, float b, float c) { return FMA ? std::fma(a, b, c) : a * b + c; };
  const float t = std::min(kSiluExpMax, std::max(attn::kExpMin, -x));
  const float n = __builtin_rintf(t * attn::kLog2e);
  const float r = (t - n * attn::kLn2Hi) - n * attn::kLn2Lo;
  float p = attn::kExpC[0];
  for (int i = 1; i < 8; ++i) {
    p = madd(p, r, attn::kExpC[i]);
  }
  const uint32_t bits = uint32_t(int32_t(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return (x / (1.0f + p * scale)) * u;
}

void silu_mul_portable(const float* g, const float* u, float* o, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    o[i] = silu_mul_one<false>(g[i], u[i]);
  }
}

#if defined(__x86_64__)
// The vector forms, one per width: the same operations lane by lane as silu_mul_one<true>.
#define MNB_SILU_BODY(W, V, P, ROUND, CAST)                                             \
  int64_t i = 0;                                                                        \
  for (; i + W <= n; i += W) {                                                          \
    const V x = P##_loadu_ps(g + i);                                                    \
    const V t = P##_min_ps(P##_set1_ps(kSiluExpMax),                                    \
                           P##_max_ps(P##_set1_ps(attn::kExpMin),                       \
                                      P##_sub_ps(P##_setzero_ps(), x)));                \
    const V k = ROUND(P##_mul_ps(t, P##_set1_ps(attn::kLog2e)));                        \
    const V r = P##_sub_ps(P##_sub_ps(t, P##_mul_ps(k, P##_set1_ps(attn::kLn2Hi))),     \
                           P##_mul_ps(k, P##_set1_ps(attn::kLn2Lo)));                   \
    V p = P##_set1_ps(attn::kExpC[0]);                                                  \
    for (int c = 1; c < 8; ++c) {                                                       \
      p = P##_fmadd_ps(p, r, P##_set1_ps(attn::kExpC[c]));                              \
    }                                                                                   \
    const V scale = CAST(P##_slli_epi32(                                                \
        P##_add_epi32(P##_cvtps_epi32(k), P##_set1_epi32(127)), 23));                   \
    const V e = P##_add_ps(P##_set1_ps(1.0f), P##_mul_ps(p, scale));                    \
    P##_storeu_ps(o + i, P##_mul_ps(P##_div_ps(x, e), P##_loadu_ps(u + i)));           \
  }                                                                                     \
  for (; i < n; ++i) {                                                                  \
    o[i] = silu_mul_one<true>(g[i], u[i]);                                              \
  }

#define MNB_ROUND256(v) _mm256_round_ps((v), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define MNB_ROUND512(v) _mm512_roundscale_ps((v), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
MNB_AVX2 void silu_mul_avx2(const float* g, const float* u, float* o, int64_t n) {
  MNB_SILU_BODY(8, __m256, _mm256, MNB_ROUND256, _mm256_castsi256_ps)
}
MNB_AVX512 void silu_mul_avx512(const float* g, const float* u, float* o, int64_t n) {
  MNB_SILU_BODY(16, __m512, _mm512, MNB_ROUND512, _mm512_castsi512_ps)
}
#undef MNB_ROUND256
#undef MNB_ROUND512
#undef MNB_SILU_BODY
#endif

// --- RoPE ----------------------------------------------------------------------------------

struct RopeJob {
  const float* x;
  const int64_t* starts;
  const int* table_row; // per row of x: its row of the cos/sin table
  const float* cos; // table rows x half
  const float* sin;
  float* out;
  int64_t rows;
  int n; // features per row
  int dims; // rotated features
  bool traditional;
};

MNB_INLINE void rope_rows(const RopeJob& j) {
  const int half = j.dims / 2;
  for (int64_t r = 0; r < j.rows; ++r) {
    const float* x = j.x + j.starts[r];
    float* o = j.out + r * j.n;
    const float* c = j.cos + int64_t(j.table_row[r]) * half;
    const float* s = j.sin + int64_t(j.table_row[r]) * half;
    if (j.traditional) {
      for (int i = 0; i < half; ++i) {
        const float x1 = x[2 * i], x2 = x[2 * i + 1];
        o[2 * i] = x1 * c[i] - x2 * s[i];
        o[2 * i + 1] = x1 * s[i] + x2 * c[i];
      }
    } else {
      for (int i = 0; i < half; ++i) {
        const float x1 = x[i], x2 = x[i + half];
        o[i] = x1 * c[i] - x2 * s[i];
        o[i + half] = x1 * s[i] + x2 * c[i];
      }
    }
    for (int i = j.dims; i < j.n; ++i) {
      o[i] = x[i];
    }
  }
}

void rope_portable(const RopeJob& j) {
  rope_rows(j);
}
#if defined(__x86_64__)
MNB_AVX2 void rope_avx2(const RopeJob& j) {
  rope_rows(j);
}
MNB_AVX512 void rope_avx512(const RopeJob& j) {
  rope_rows(j);
}
#endif

// The cos and sin of every position a call needs: the same positions come back for the
// queries and keys of a layer and for every layer of a step, so the last few tables are kept.
struct RopeTable {
  std::vector<float> inv_freq; // the key, with positions
  std::vector<int64_t> positions;
  float scale;
  std::vector<float> cos, sin; // positions x half
};

class RopeTables {
 public:
  const RopeTable& get(const std::vector<float>& inv_freq,
                       const std::vector<int64_t>& positions,
                       float scale) {
    for (auto it = tables_.begin(); it != tables_.end(); ++it) {
      if (it->scale == scale && it->positions == positions && it->inv_freq == inv_freq) {
        tables_.splice(tables_.begin(), tables_, it);
        return tables_.front();
      }
    }
    RopeTable t{inv_freq, positions, scale, {}, {}};
    const size_t half = inv_freq.size();
    t.cos.resize(positions.size() * half);
    t.sin.resize(positions.size() * half);
    for (size_t p = 0; p < positions.size(); ++p) {
      // The angle in double: float32 products lose whole ulps of the angle at long positions.
      const double pos = double(positions[p]) * double(scale);
      for (size_t i = 0; i < half; ++i) {
        const double theta = pos * double(inv_freq[i]);
        t.cos[p * half + i] = float(std::cos(theta));
        t.sin[p * half + i] = float(std::sin(theta));
      }
    }
    tables_.push_front(std::move(t));
    if (tables_.size() > kKept) {
      tables_.pop_back();
    }
    return tables_.front();
  }

 private:
  static constexpr size_t kKept = 4;
  std::list<RopeTable> tables_;
};

std::mutex tables_lock;
RopeTables& tables() {
  static RopeTables* t = new RopeTables(); // never destroyed: eval threads may outlive statics
  return *t;
}

} // namespace

// --- the row passes, shared with the fused decode step (qkv_step.cpp) ----------------------

void norm_rows_for(Isa isa, const float* x, const int64_t* starts, const float* w, float* out,
                   int64_t rows, int n, float eps) {
  NormJob job{x, starts, w, out, rows, n, eps};
#if defined(__x86_64__)
  if (isa == Isa::avx512) {
    return norm_avx512(job);
  }
  if (isa == Isa::avx2) {
    return norm_avx2(job);
  }
#endif
  norm_portable(job);
}

void norm_dense_rows(Isa isa, const float* x, const float* w, float* out, int64_t rows, int n,
                     float eps) {
  std::vector<int64_t> starts(rows);
  for (int64_t r = 0; r < rows; ++r) {
    starts[r] = r * n;
  }
  norm_rows_for(isa, x, starts.data(), w, out, rows, n, eps);
}

std::vector<float> rope_inv_freq(float base, int half) {
  std::vector<float> inv_freq(half);
  for (int i = 0; i < half; ++i) {
    inv_freq[i] = float(std::exp(-double(i) * std::log(double(base)) / double(half)));
  }
  return inv_freq;
}

void rope_rows_for(Isa isa, const float* x, const int64_t* starts, const int* table_row,
                   const std::vector<float>& inv_freq, const std::vector<int64_t>& positions,
                   float scale, float* out, int64_t rows, int n, int dims, bool traditional) {
  std::lock_guard<std::mutex> lock(tables_lock);
  const RopeTable& table = tables().get(inv_freq, positions, scale);
  RopeJob job{x, starts, table_row, table.cos.data(), table.sin.data(),
              out, rows, n, dims, traditional};
#if defined(__x86_64__)
  if (isa == Isa::avx512) {
    return rope_avx512(job);
  }
  if (isa == Isa::avx2) {
    return rope_avx2(job);
  }
#endif
  rope_portable(job);
}

void silu_mul_for(Isa isa, const float* gate, const float* up, float* out, int64_t n) {
#if defined(__x86_64__)
  if (isa == Isa::avx512) {
    return silu_mul_avx512(gate, up, out, n);
  }
  if (isa == Isa::avx2) {
    return silu_mul_avx2(gate, up, out, n);
  }
#endif
  silu_mul_portable(gate, up, out, n);
}

void gelu_tanh_mul_for(Isa isa, const float* gate, const float* up, float* out, int64_t n) {
#if defined(__x86_64__)
  if (isa == Isa::avx512) {
    return gelu_mul_avx512(gate, up, out, n);
  }
  if (isa == Isa::avx2) {
    return gelu_mul_avx2(gate, up, out, n);
  }
#endif
  gelu_mul_portable(gate, up, out, n);
}

// --- the operations ------------------------------------------------------------------------

mx::array gated_activation(const mx::array& gate, const mx::array& up, bool silu, Isa isa,
                           int threads) {
  if (gate.dtype() != mx::float32 || up.dtype() != mx::float32 || gate.shape() != up.shape()) {
    throw std::invalid_argument(std::string(silu ? "silu_mul" : "gelu_tanh_mul") +
                                ": gate and up must be float32 of one shape");
  }
  auto s = mx::default_stream(mx::Device::cpu);
  return mx::array(
      gate.shape(),
      mx::float32,
      std::make_shared<GatedActivation>(s, silu, usable(isa), std::max(1, threads)),
      {contiguous_input(gate, s), contiguous_input(up, s)});
}

mx::array gelu_tanh_mul(const mx::array& gate, const mx::array& up, Isa isa, int threads) {
  return gated_activation(gate, up, false, isa, threads);
}

mx::array silu_mul(const mx::array& gate, const mx::array& up, Isa isa, int threads) {
  return gated_activation(gate, up, true, isa, threads);
}

void GatedActivation::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (const auto& a : inputs) {
    encoder.set_input_array(a);
  }
  encoder.set_output_array(out);
  const mx::array g = inputs[0], u = inputs[1];
  float* op = out.data<float>();
  const Isa isa = isa_;
  const bool silu = silu_;
  const int64_t n = int64_t(out.size());
  // Small arrays (a decode step's) on one thread: waking the others costs more.
  const int threads = n < (int64_t(1) << 16) ? 1 : threads_;
  encoder.dispatch([g, u, op, isa, silu, n, threads]() {
    auto fn = silu ? silu_mul_portable : gelu_mul_portable;
#if defined(__x86_64__)
    if (isa == Isa::avx512) {
      fn = silu ? silu_mul_avx512 : gelu_mul_avx512;
    } else if (isa == Isa::avx2) {
      fn = silu ? silu_mul_avx2 : gelu_mul_avx2;
    }
#endif
    const float* gp = g.data<float>();
    const float* up = u.data<float>();
    // Chunks of 4,096 elements: each the same function of its elements wherever it falls.
    constexpr int kChunk = 4096;
    const int chunks = int((n + kChunk - 1) / kChunk);
    workers().run(threads, chunks, std::max(1, chunks / (threads * 4)), [&](int c0, int c1) {
      const int64_t a = int64_t(c0) * kChunk, b = std::min(n, int64_t(c1) * kChunk);
      fn(gp + a, up + a, op + a, b - a);
    });
  });
}

void GatedActivation::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("gated activations run on the CPU only");
}

bool GatedActivation::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const GatedActivation&>(other);
  return silu_ == o.silu_ && isa_ == o.isa_ && threads_ == o.threads_;
}

mx::array rms_norm(const mx::array& x, const std::optional<mx::array>& w, float eps, Isa isa) {
  if (x.dtype() != mx::float32 || x.ndim() < 1) {
    throw std::invalid_argument("rms_norm: x must be a float32 array");
  }
  const int n = x.shape(-1);
  if (w && (w->dtype() != mx::float32 || w->ndim() != 1 || w->shape(0) != n)) {
    throw std::invalid_argument("rms_norm: weight must be float32 of x's last dimension");
  }
  auto s = mx::default_stream(mx::Device::cpu);
  std::vector<mx::array> inputs{x};
  if (w) {
    inputs.push_back(*w);
  }
  return mx::array(
      x.shape(), mx::float32, std::make_shared<RmsNorm>(s, eps, bool(w), usable(isa)), inputs);
}

void RmsNorm::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  const auto& x = inputs[0];
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (const auto& a : inputs) {
    encoder.set_input_array(a);
  }
  encoder.set_output_array(out);
  const bool has_weight = has_weight_;
  const int n = x.ndim() ? x.shape(-1) : 1;
  const Isa isa = isa_;
  const float eps = eps_;
  float* op = out.data<float>();
  std::optional<mx::array> weight;
  if (has_weight) {
    weight = inputs[1];
  }
  encoder.dispatch([x, weight, n, isa, eps, op]() {
    if (x.size() == 0) {
      return;
    }
    std::vector<float> scratch, dense_w;
    std::vector<int64_t> starts;
    const float* xp = rows_of(x, scratch, starts);
    const float* w = nullptr;
    if (weight) {
      dense_w.resize(n);
      for (int i = 0; i < n; ++i) {
        dense_w[i] = element<float>(*weight, i);
      }
      w = dense_w.data();
    }
    norm_rows_for(isa, xp, starts.data(), w, op, int64_t(starts.size()), n, eps);
  });
}

void RmsNorm::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("rms_norm runs on the CPU only");
}

bool RmsNorm::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const RmsNorm&>(other);
  return eps_ == o.eps_ && has_weight_ == o.has_weight_ && isa_ == o.isa_;
}

mx::array rope(
    const mx::array& x,
    int dims,
    bool traditional,
    std::optional<float> base,
    float scale,
    const mx::array& offset,
    const std::optional<mx::array>& freqs,
    Isa isa) {
  if (x.dtype() != mx::float32 || x.ndim() < 3) {
    throw std::invalid_argument("rope: x must be a float32 array of at least 3 dimensions");
  }
  if (dims <= 0 || dims % 2 != 0 || dims > x.shape(-1)) {
    throw std::invalid_argument("rope: dims must be even and at most x's last dimension");
  }
  if (bool(base) == bool(freqs)) {
    throw std::invalid_argument("rope: exactly one of base and freqs must be given");
  }
  if (freqs && (freqs->ndim() != 1 || freqs->shape(0) != dims / 2)) {
    throw std::invalid_argument("rope: freqs must have dims / 2 values");
  }
  if (offset.ndim() > 1 || (offset.ndim() == 1 && offset.size() != 1 &&
                            int(offset.size()) != x.shape(0))) {
    throw std::invalid_argument("rope: offset must be a scalar or one per batch row");
  }
  auto s = mx::default_stream(mx::Device::cpu);
  std::vector<mx::array> inputs{x, mx::astype(offset, mx::int32, s)};
  if (freqs) {
    inputs.push_back(mx::astype(*freqs, mx::float32, s));
  }
  return mx::array(
      x.shape(),
      mx::float32,
      std::make_shared<Rope>(
          s, dims, traditional, base.value_or(0.0f), scale, bool(freqs), usable(isa)),
      inputs);
}

void Rope::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  const auto& x = inputs[0];
  const auto& offset = inputs[1];
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (const auto& a : inputs) {
    encoder.set_input_array(a);
  }
  encoder.set_output_array(out);
  const int half = dims_ / 2;
  std::vector<float> inv_freq(half);
  std::optional<mx::array> freqs;
  if (has_freqs_) {
    freqs = inputs[2];
  }
  const float base = base_;
  const int dims = dims_;
  const bool traditional = traditional_;
  const float scale = scale_;
  const Isa isa = isa_;
  float* op = out.data<float>();
  encoder.dispatch([=, inv_freq = std::move(inv_freq)]() mutable {
    if (x.size() == 0) {
      return;
    }
    if (freqs) {
      for (int i = 0; i < half; ++i) {
        inv_freq[i] = 1.0f / element<float>(*freqs, i);
      }
    } else {
      inv_freq = rope_inv_freq(base, half);
    }
    const int nd = x.ndim();
    const int B = x.shape(0), T = x.shape(nd - 2);
    const int64_t rows = int64_t(x.size() / x.shape(-1));
    const int64_t per_batch = rows / B; // rows of one batch element: (*, T)
    const bool each = offset.size() > 1;
    // Table rows: one per (batch offset, t); a shared offset needs T rows only.
    const int distinct = each ? B : 1;
    std::vector<int64_t> positions(int64_t(distinct) * T);
    for (int b = 0; b < distinct; ++b) {
      for (int t = 0; t < T; ++t) {
        positions[int64_t(b) * T + t] = int64_t(element<int>(offset, b)) + t;
      }
    }
    std::vector<int> table_row(rows);
    for (int64_t r = 0; r < rows; ++r) {
      const int b = each ? int(r / per_batch) : 0;
      table_row[r] = b * T + int(r % T);
    }
    std::vector<float> scratch;
    std::vector<int64_t> starts;
    const float* xp = rows_of(x, scratch, starts);
    rope_rows_for(isa, xp, starts.data(), table_row.data(), inv_freq, positions, scale, op,
                  rows, int(x.shape(-1)), dims, traditional);
  });
}

void Rope::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("rope runs on the CPU only");
}

bool Rope::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const Rope&>(other);
  return dims_ == o.dims_ && traditional_ == o.traditional_ && base_ == o.base_ &&
      scale_ == o.scale_ && has_freqs_ == o.has_freqs_ && isa_ == o.isa_;
}

} // namespace mnb
