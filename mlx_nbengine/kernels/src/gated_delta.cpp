#include "gated_delta.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "rowops.h"
#include "targets.h"
#include "workers.h"


namespace mnb {

namespace {

struct DeltaJob {
  const float* q;
  const float* k;
  const float* v;
  const float* g;
  const float* beta;
  const float* state;
  const bool* mask; // null: every token counts
  float* y;
  float* state_out;
  int64_t B, T, Hk, Hv, Dk, Dv;
  const int* taps; // token counts at which the state is also written out, ascending
  int n_taps;
  float* tapped; // [n_taps, B, Hv, Dv, Dk]
};

// The state is worked on transposed, St [Dk][Dvp] (Dvp: Dv rounded up to kLanes, the pad rows
// zero and never changed), so kLanes rows of the state are a few vectors: a row's products with
// k and q accumulate lane-wise over Dk, with no sums across lanes.
constexpr int kLanes = 32;

// One token's pass over kLanes rows [r0, r0 + kLanes): the update St = g St + delta k^T
// (skipped for a masked token), then, where a next token exists, the rows' products with
// its k and q (a, b), from the updated rows while they are in registers.
template <bool UPDATE, bool NEXT>
MNB_INLINE void block_pass(float* __restrict st, int64_t dk_n, int64_t stride, float g,
                           const float* __restrict delta, const float* __restrict k,
                           const float* __restrict k_next,
                           const float* __restrict q_next, float* __restrict a,
                           float* __restrict b) {
  float a0[kLanes] = {}, a1[kLanes] = {}, b0[kLanes] = {}, b1[kLanes] = {};
  int64_t i = 0;
  for (; i + 2 <= dk_n; i += 2) {
    float* s0 = st + i * stride;
    float* s1 = s0 + stride;
    for (int j = 0; j < kLanes; ++j) {
      float x0 = s0[j], x1 = s1[j];
      if constexpr (UPDATE) {
        x0 = x0 * g + delta[j] * k[i];
        x1 = x1 * g + delta[j] * k[i + 1];
        s0[j] = x0;
        s1[j] = x1;
      }
      if constexpr (NEXT) {
        a0[j] += x0 * k_next[i];
        a1[j] += x1 * k_next[i + 1];
        b0[j] += x0 * q_next[i];
        b1[j] += x1 * q_next[i + 1];
      }
    }
  }
  for (; i < dk_n; ++i) {
    float* s0 = st + i * stride;
    for (int j = 0; j < kLanes; ++j) {
      float x0 = s0[j];
      if constexpr (UPDATE) {
        x0 = x0 * g + delta[j] * k[i];
        s0[j] = x0;
      }
      if constexpr (NEXT) {
        a0[j] += x0 * k_next[i];
        b0[j] += x0 * q_next[i];
      }
    }
  }
  if constexpr (NEXT) {
    for (int j = 0; j < kLanes; ++j) {
      a[j] = a0[j] + a1[j];
      b[j] = b0[j] + b1[j];
    }
  }
}

#if defined(__x86_64__)
// block_pass with the vector sets' intrinsics (compilers vectorize the loops above poorly):
// kLanes rows as two AVX-512 registers, or four AVX2 registers, two dk accumulators each.
#define MNB_BLOCK_PASS(NAME, TARGET, V, P, H)                                              \
  template <bool UPDATE, bool NEXT>                                                         \
  TARGET inline void NAME(float* __restrict st, int64_t dk_n, int64_t stride, float g,      \
                          const float* __restrict delta, const float* __restrict k,         \
                          const float* __restrict k_next, const float* __restrict q_next,   \
                          float* __restrict a, float* __restrict b) {                       \
    constexpr int W = kLanes / H;                                                           \
    const V vg = P##_set1_ps(g);                                                            \
    V vd[H], a0[H], a1[H], b0[H], b1[H];                                                    \
    for (int h = 0; h < H; ++h) {                                                           \
      vd[h] = P##_loadu_ps(delta + h * W);                                                  \
      a0[h] = a1[h] = b0[h] = b1[h] = P##_setzero_ps();                                     \
    }                                                                                       \
    int64_t i = 0;                                                                          \
    for (; i + 2 <= dk_n; i += 2) {                                                         \
      float* s0 = st + i * stride;                                                          \
      float* s1 = s0 + stride;                                                              \
      for (int h = 0; h < H; ++h) {                                                         \
        V x0 = P##_loadu_ps(s0 + h * W), x1 = P##_loadu_ps(s1 + h * W);                     \
        if constexpr (UPDATE) {                                                             \
          x0 = P##_fmadd_ps(vd[h], P##_set1_ps(k[i]), P##_mul_ps(x0, vg));                  \
          x1 = P##_fmadd_ps(vd[h], P##_set1_ps(k[i + 1]), P##_mul_ps(x1, vg));              \
          P##_storeu_ps(s0 + h * W, x0);                                                    \
          P##_storeu_ps(s1 + h * W, x1);                                                    \
        }                                                                                   \
        if constexpr (NEXT) {                                                               \
          a0[h] = P##_fmadd_ps(x0, P##_set1_ps(k_next[i]), a0[h]);                          \
          a1[h] = P##_fmadd_ps(x1, P##_set1_ps(k_next[i + 1]), a1[h]);                      \
          b0[h] = P##_fmadd_ps(x0, P##_set1_ps(q_next[i]), b0[h]);                          \
          b1[h] = P##_fmadd_ps(x1, P##_set1_ps(q_next[i + 1]), b1[h]);                      \
        }                                                                                   \
      }                                                                                     \
    }                                                                                       \
    for (; i < dk_n; ++i) {                                                                 \
      float* s0 = st + i * stride;                                                          \
      for (int h = 0; h < H; ++h) {                                                         \
        V x0 = P##_loadu_ps(s0 + h * W);                                                    \
        if constexpr (UPDATE) {                                                             \
          x0 = P##_fmadd_ps(vd[h], P##_set1_ps(k[i]), P##_mul_ps(x0, vg));                  \
          P##_storeu_ps(s0 + h * W, x0);                                                    \
        }                                                                                   \
        if constexpr (NEXT) {                                                               \
          a0[h] = P##_fmadd_ps(x0, P##_set1_ps(k_next[i]), a0[h]);                          \
          b0[h] = P##_fmadd_ps(x0, P##_set1_ps(q_next[i]), b0[h]);                          \
        }                                                                                   \
      }                                                                                     \
    }                                                                                       \
    if constexpr (NEXT) {                                                                   \
      for (int h = 0; h < H; ++h) {                                                         \
        P##_storeu_ps(a + h * W, P##_add_ps(a0[h], a1[h]));                                 \
        P##_storeu_ps(b + h * W, P##_add_ps(b0[h], b1[h]));                                 \
      }                                                                                     \
    }                                                                                       \
  }

MNB_BLOCK_PASS(block_pass_avx2, MNB_AVX2, __m256, _mm256, 4)
MNB_BLOCK_PASS(block_pass_avx512, MNB_AVX512, __m512, _mm512, 2)
#undef MNB_BLOCK_PASS
#endif

// The block pass of kernel set `S` (0 portable, 1 avx2, 2 avx512).
template <int S, bool UPDATE, bool NEXT>
MNB_INLINE void pass_of(float* st, int64_t dk_n, int64_t stride, float g, const float* delta,
                        const float* k, const float* k_next, const float* q_next, float* a,
                        float* b) {
#if defined(__x86_64__)
  if constexpr (S == 2) {
    return block_pass_avx512<UPDATE, NEXT>(st, dk_n, stride, g, delta, k, k_next, q_next, a, b);
  } else if constexpr (S == 1) {
    return block_pass_avx2<UPDATE, NEXT>(st, dk_n, stride, g, delta, k, k_next, q_next, a, b);
  }
#endif
  block_pass<UPDATE, NEXT>(st, dk_n, stride, g, delta, k, k_next, q_next, a, b);
}

// Every token of heads [u0, u1) (a unit is one batch row's value head). Per token, with
// a = S k and b = S q read from the state before it (S decays by g, then gains delta k^T):
//   kv = g a;  delta = (v - kv) beta;  y = g b + delta (k . q)
// which is gated_delta_ops' y = (g S + delta k^T) q, rearranged so one pass over the state
// per token both updates it and reads the next token's a and b. Rows evolve independently,
// so each block of kLanes rows (16 KB for Dk 128) runs through every token while it stays in
// the core's first-level cache.
// A step of few tokens (a decode step) works on the state as it is laid out, [Dv][Dk]: a
// transposed copy in and out would cost more than the token itself. R rows at a time, in
// place (their sums are independent, so their latencies overlap):
//   row *= g;  kv = row . k;  delta = (v - kv) beta;  row += delta k;  y = row . q
constexpr int64_t kRowMajorTokens = 4;
constexpr int kRowLanes = 16;

MNB_INLINE float lanes_total(const float* part) {
  float s[8];
  for (int j = 0; j < 8; ++j) {
    s[j] = part[j] + part[j + 8];
  }
  for (int j = 0; j < 4; ++j) {
    s[j] += s[j + 4];
  }
  return (s[0] + s[2]) + (s[1] + s[3]);
}

template <int R>
MNB_INLINE void rows_step(float* __restrict row, int64_t n, const float* __restrict q,
                          const float* __restrict k, const float* __restrict v, float g,
                          float beta, float* __restrict y) {
  float acc[R][kRowLanes] = {};
  int64_t i = 0;
  for (; i + kRowLanes <= n; i += kRowLanes) {
    for (int r = 0; r < R; ++r) {
      for (int j = 0; j < kRowLanes; ++j) {
        const float x = row[r * n + i + j] * g;
        row[r * n + i + j] = x;
        acc[r][j] += x * k[i + j];
      }
    }
  }
  float delta[R];
  for (int r = 0; r < R; ++r) {
    float kv = lanes_total(acc[r]);
    for (int64_t t = i; t < n; ++t) {
      const float x = row[r * n + t] * g;
      row[r * n + t] = x;
      kv += x * k[t];
    }
    delta[r] = (v[r] - kv) * beta;
    for (int j = 0; j < kRowLanes; ++j) {
      acc[r][j] = 0.0f;
    }
  }
  for (i = 0; i + kRowLanes <= n; i += kRowLanes) {
    for (int r = 0; r < R; ++r) {
      for (int j = 0; j < kRowLanes; ++j) {
        const float x = row[r * n + i + j] + k[i + j] * delta[r];
        row[r * n + i + j] = x;
        acc[r][j] += x * q[i + j];
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    float out = lanes_total(acc[r]);
    for (int64_t t = i; t < n; ++t) {
      const float x = row[r * n + t] + k[t] * delta[r];
      row[r * n + t] = x;
      out += x * q[t];
    }
    y[r] = out;
  }
}

// One token over all `rows` rows of one head's state, in place, four at a time.
MNB_INLINE void state_rows(float* state, int64_t rows, int64_t n, const float* q, const float* k,
                           const float* v, float g, float beta, float* y) {
  int64_t r = 0;
  for (; r + 4 <= rows; r += 4) {
    rows_step<4>(state + r * n, n, q, k, v + r, g, beta, y + r);
  }
  for (; r < rows; ++r) {
    rows_step<1>(state + r * n, n, q, k, v + r, g, beta, y + r);
  }
}

// Every token of heads [u0, u1) of a short step, the state in its own layout.
MNB_INLINE void heads_rows(const DeltaJob& j, int64_t u0, int64_t u1) {
  const int64_t n = j.Dk, rows = j.Dv, per = rows * n, group = j.Hv / j.Hk;
  std::vector<float> scratch(j.mask != nullptr ? size_t(per) : 0);
  for (int64_t u = u0; u < u1; ++u) {
    const int64_t b = u / j.Hv, hv = u % j.Hv, hk = hv / group;
    float* state = j.state_out + u * per;
    std::memcpy(state, j.state + u * per, size_t(per) * sizeof(float));
    int tap = 0;
    for (int64_t t = 0; t < j.T; ++t) {
      const int64_t bt = b * j.T + t;
      const float* q = j.q + (bt * j.Hk + hk) * n;
      const float* k = j.k + (bt * j.Hk + hk) * n;
      const float* v = j.v + (bt * j.Hv + hv) * rows;
      const float g = j.g[bt * j.Hv + hv], beta = j.beta[bt * j.Hv + hv];
      float* y = j.y + (bt * j.Hv + hv) * rows;
      // A masked token (a pad) computes its y on a copy and leaves the state as it was.
      float* s = state;
      if (j.mask != nullptr && !j.mask[bt]) {
        s = scratch.data();
        std::memcpy(s, state, size_t(per) * sizeof(float));
      }
      state_rows(s, rows, n, q, k, v, g, beta, y);
      while (tap < j.n_taps && j.taps[tap] == t + 1) {
        float* out = j.tapped + (int64_t(tap) * j.B * j.Hv + u) * per;
        std::memcpy(out, state, size_t(per) * sizeof(float));
        ++tap;
      }
    }
  }
}

template <int S>
MNB_INLINE void heads_run(const DeltaJob& j, int64_t u0, int64_t u1) {
  const int64_t dk_n = j.Dk, dv_n = j.Dv, group = j.Hv / j.Hk;
  const int64_t dvp = (dv_n + kLanes - 1) / kLanes * kLanes;
  std::vector<float> st(static_cast<size_t>(dk_n * dvp)), kq(static_cast<size_t>(j.T));
  alignas(64) float a[kLanes], b[kLanes], delta[kLanes], v[kLanes] = {}, yb[kLanes];
  for (int64_t u = u0; u < u1; ++u) {
    const int64_t bi = u / j.Hv, hv = u % j.Hv, hk = hv / group;
    const float* s_in = j.state + u * dv_n * dk_n;
    std::fill(st.begin(), st.end(), 0.0f);
    for (int64_t r = 0; r < dv_n; ++r) {
      for (int64_t i = 0; i < dk_n; ++i) {
        st[size_t(i * dvp + r)] = s_in[r * dk_n + i];
      }
    }
    auto key = [&](int64_t t) { return j.k + ((bi * j.T + t) * j.Hk + hk) * dk_n; };
    auto query = [&](int64_t t) { return j.q + ((bi * j.T + t) * j.Hk + hk) * dk_n; };
    for (int64_t t = 0; t < j.T; ++t) {
      const float *k = key(t), *q = query(t);
      float dot = 0.0f;
      for (int64_t i = 0; i < dk_n; ++i) {
        dot += k[i] * q[i];
      }
      kq[size_t(t)] = dot;
    }
    for (int64_t r0 = 0; r0 < dvp; r0 += kLanes) {
      float* rows = st.data() + r0;
      const int64_t live = std::min<int64_t>(kLanes, dv_n - r0); // the rest are pad rows
      int tap = 0;
      if (j.T > 0) { // the first token's a and b: a pass that reads only
        pass_of<S, false, true>(rows, dk_n, dvp, 1.0f, delta, key(0), key(0), query(0), a, b);
      }
      for (int64_t t = 0; t < j.T; ++t) {
        const int64_t bt = bi * j.T + t;
        const float g = j.g[bt * j.Hv + hv], beta = j.beta[bt * j.Hv + hv];
        const float* vt = j.v + (bt * j.Hv + hv) * dv_n + r0;
        float* y = j.y + (bt * j.Hv + hv) * dv_n + r0;
        for (int64_t r = 0; r < live; ++r) {
          v[r] = vt[r];
        }
        const float kqt = kq[size_t(t)];
        for (int r = 0; r < kLanes; ++r) {
          delta[r] = (v[r] - g * a[r]) * beta;
          yb[r] = g * b[r] + delta[r] * kqt;
        }
        for (int64_t r = 0; r < live; ++r) {
          y[r] = yb[r];
        }
        // A masked token (a pad) gives its y and leaves the state as it was.
        const bool update = j.mask == nullptr || j.mask[bt];
        const bool last = t + 1 == j.T;
        const float* k = key(t);
        if (update && !last) {
          pass_of<S, true, true>(rows, dk_n, dvp, g, delta, k, key(t + 1), query(t + 1), a, b);
        } else if (update) {
          pass_of<S, true, false>(rows, dk_n, dvp, g, delta, k, nullptr, nullptr, a, b);
        } else if (!last) {
          pass_of<S, false, true>(rows, dk_n, dvp, g, delta, k, key(t + 1), query(t + 1), a, b);
        }
        while (tap < j.n_taps && j.taps[tap] == t + 1) { // the state after t + 1 tokens
          float* out = j.tapped + (int64_t(tap) * j.B * j.Hv + u) * dv_n * dk_n;
          for (int64_t r = r0; r < r0 + live; ++r) {
            for (int64_t i = 0; i < dk_n; ++i) {
              out[r * dk_n + i] = st[size_t(i * dvp + r)];
            }
          }
          ++tap;
        }
      }
    }
    float* s_out = j.state_out + u * dv_n * dk_n;
    for (int64_t r = 0; r < dv_n; ++r) {
      for (int64_t i = 0; i < dk_n; ++i) {
        s_out[r * dk_n + i] = st[size_t(i * dvp + r)];
      }
    }
  }
}

void heads_portable(const DeltaJob& j, int64_t u0, int64_t u1) {
  j.T <= kRowMajorTokens ? heads_rows(j, u0, u1) : heads_run<0>(j, u0, u1);
}
#if defined(__x86_64__)
MNB_AVX2 void heads_avx2(const DeltaJob& j, int64_t u0, int64_t u1) {
  j.T <= kRowMajorTokens ? heads_rows(j, u0, u1) : heads_run<1>(j, u0, u1);
}
MNB_AVX512 void heads_avx512(const DeltaJob& j, int64_t u0, int64_t u1) {
  j.T <= kRowMajorTokens ? heads_rows(j, u0, u1) : heads_run<2>(j, u0, u1);
}
#endif

// Rows [t0, t1) of one batch row's convolution: out row t = sum_j wt[j] * x row (t + j),
// each over C contiguous channels (wt: the weights transposed, [K, C]).
MNB_INLINE void conv_rows(const float* __restrict x, const float* __restrict wt,
                          float* __restrict out, int64_t t0, int64_t t1, int K, int64_t C) {
  for (int64_t t = t0; t < t1; ++t) {
    float* o = out + t * C;
    const float* w0 = wt;
    const float* x0 = x + t * C;
    for (int64_t c = 0; c < C; ++c) {
      o[c] = w0[c] * x0[c];
    }
    for (int j = 1; j < K; ++j) {
      const float* wj = wt + j * C;
      const float* xj = x + (t + j) * C;
      for (int64_t c = 0; c < C; ++c) {
        o[c] += wj[c] * xj[c];
      }
    }
  }
}

void conv_portable(const float* x, const float* wt, float* out, int64_t t0, int64_t t1, int K,
                   int64_t C) {
  conv_rows(x, wt, out, t0, t1, K, C);
}
#if defined(__x86_64__)
MNB_AVX2 void conv_avx2(const float* x, const float* wt, float* out, int64_t t0, int64_t t1,
                        int K, int64_t C) {
  conv_rows(x, wt, out, t0, t1, K, C);
}
MNB_AVX512 void conv_avx512(const float* x, const float* wt, float* out, int64_t t0, int64_t t1,
                            int K, int64_t C) {
  conv_rows(x, wt, out, t0, t1, K, C);
}
#endif

// The outputs allocated and the CPU encoder told of every array a primitive reads and writes.
mx::cpu::CommandEncoder& prepared_encoder(mx::Stream stream, const std::vector<mx::array>& inputs,
                                          std::vector<mx::array>& outputs) {
  for (auto& out : outputs) {
    out.set_data(mx::allocator::malloc(out.nbytes()));
  }
  auto& encoder = mx::cpu::get_command_encoder(stream);
  for (const auto& a : inputs) {
    encoder.set_input_array(a);
  }
  for (auto& a : outputs) {
    encoder.set_output_array(a);
  }
  return encoder;
}

mx::array float32_input(const mx::array& a, const char* what, mx::Stream s) {
  if (a.dtype() != mx::float32) {
    throw std::invalid_argument(std::string("gated_delta: ") + what + " must be float32");
  }
  return contiguous_input(a, s);
}

} // namespace

mx::array conv_silu(const mx::array& x, const mx::array& w, Isa isa, int threads) {
  if (x.dtype() != mx::float32 || w.dtype() != mx::float32 || x.ndim() != 3 ||
      w.ndim() != 3 || w.shape(2) != 1 || w.shape(0) != x.shape(2) || x.shape(1) < w.shape(1)) {
    throw std::invalid_argument(
        "conv_silu: x must be float32 [B, S + K - 1, C] and w float32 [C, K, 1]");
  }
  auto s = mx::default_stream(mx::Device::cpu);
  const int K = w.shape(1);
  return mx::array(
      {x.shape(0), x.shape(1) - K + 1, x.shape(2)},
      mx::float32,
      std::make_shared<ConvSilu>(s, usable(isa), std::max(1, threads)),
      {contiguous_input(x, s), contiguous_input(w, s)});
}

void ConvSilu::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (const auto& a : inputs) {
    encoder.set_input_array(a);
  }
  encoder.set_output_array(out);
  const mx::array x = inputs[0], w = inputs[1];
  float* op = out.data<float>();
  const Isa isa = isa_;
  const int64_t B = out.shape(0), S = out.shape(1), C = out.shape(2);
  const int K = w.shape(1);
  const int threads = B * S * C < (int64_t(1) << 16) ? 1 : threads_;
  encoder.dispatch([x, w, op, isa, B, S, C, K, threads]() {
    auto conv = conv_portable;
#if defined(__x86_64__)
    if (isa == Isa::avx512) {
      conv = conv_avx512;
    } else if (isa == Isa::avx2) {
      conv = conv_avx2;
    }
#endif
    std::vector<float> wt(size_t(K) * C), ones(size_t(C), 1.0f);
    const float* wp = w.data<float>();
    for (int64_t c = 0; c < C; ++c) {
      for (int j = 0; j < K; ++j) {
        wt[size_t(j) * C + c] = wp[c * K + j];
      }
    }
    const float* xp = x.data<float>();
    // Chunks of 16 rows of one batch row: each row the same function wherever it falls.
    constexpr int64_t kRows = 16;
    const int64_t per = (S + kRows - 1) / kRows;
    workers().run(threads, int(B * per), 1, [&](int c0, int c1) {
      for (int ci = c0; ci < c1; ++ci) {
        const int64_t b = ci / per, t0 = (ci % per) * kRows, t1 = std::min(S, t0 + kRows);
        const float* xb = xp + b * (S + K - 1) * C;
        float* ob = op + b * S * C;
        conv(xb, wt.data(), ob, t0, t1, K, C);
        for (int64_t t = t0; t < t1; ++t) {
          silu_mul_for(isa, ob + t * C, ones.data(), ob + t * C, C);
        }
      }
    });
  });
}

void ConvSilu::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("conv_silu runs on the CPU only");
}

bool ConvSilu::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const ConvSilu&>(other);
  return isa_ == o.isa_ && threads_ == o.threads_;
}

std::vector<mx::array> gated_delta(
    const mx::array& q,
    const mx::array& k,
    const mx::array& v,
    const mx::array& g,
    const mx::array& beta,
    const mx::array& state,
    const std::optional<mx::array>& mask,
    const std::vector<int>& taps,
    Isa isa,
    int threads) {
  if (q.ndim() != 4 || k.shape() != q.shape() || v.ndim() != 4) {
    throw std::invalid_argument("gated_delta: q and k must be [B, T, Hk, Dk], v [B, T, Hv, Dv]");
  }
  const int B = q.shape(0), T = q.shape(1), Hk = q.shape(2), Dk = q.shape(3);
  const int Hv = v.shape(2), Dv = v.shape(3);
  if (v.shape(0) != B || v.shape(1) != T || Hk == 0 || Hv % Hk != 0) {
    throw std::invalid_argument("gated_delta: v must be [B, T, Hv, Dv] with Hv a multiple of Hk");
  }
  const mx::Shape gates{B, T, Hv};
  if (g.shape() != gates || beta.shape() != gates) {
    throw std::invalid_argument("gated_delta: g and beta must be [B, T, Hv] (a scalar gate per head)");
  }
  if (state.shape() != mx::Shape{B, Hv, Dv, Dk}) {
    throw std::invalid_argument("gated_delta: state must be [B, Hv, Dv, Dk]");
  }
  if (mask && (mask->dtype() != mx::bool_ || mask->shape() != mx::Shape{B, T})) {
    throw std::invalid_argument("gated_delta: mask must be bool [B, T]");
  }
  for (size_t i = 0; i < taps.size(); ++i) {
    if (taps[i] < 1 || taps[i] > T || (i > 0 && taps[i] <= taps[i - 1])) {
      throw std::invalid_argument("gated_delta: taps must ascend within 1..T");
    }
  }
  auto s = mx::default_stream(mx::Device::cpu);
  std::vector<mx::array> inputs{
      float32_input(q, "q", s),
      float32_input(k, "k", s),
      float32_input(v, "v", s),
      float32_input(g, "g", s),
      float32_input(beta, "beta", s),
      float32_input(state, "state", s)};
  if (mask) {
    inputs.push_back(contiguous_input(*mask, s));
  }
  std::vector<mx::Shape> shapes{{B, T, Hv, Dv}, state.shape()};
  std::vector<mx::Dtype> dtypes{mx::float32, mx::float32};
  if (!taps.empty()) {
    shapes.push_back({int(taps.size()), B, Hv, Dv, Dk});
    dtypes.push_back(mx::float32);
  }
  return mx::array::make_arrays(
      std::move(shapes),
      std::move(dtypes),
      std::make_shared<GatedDelta>(s, bool(mask), taps, usable(isa), std::max(1, threads)),
      std::move(inputs));
}

void GatedDelta::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& encoder = prepared_encoder(stream(), inputs, outputs);
  const auto& q = inputs[0];
  const auto& v = inputs[2];
  DeltaJob job{
      nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr,
      outputs[0].data<float>(), outputs[1].data<float>(),
      q.shape(0), q.shape(1), q.shape(2), v.shape(2), q.shape(3), v.shape(3),
      taps_.data(), int(taps_.size()), outputs.size() > 2 ? outputs[2].data<float>() : nullptr};
  const Isa isa = isa_;
  const int64_t units = job.B * job.Hv;
  // A small step (a tiny model's) on one thread: waking the others costs more.
  const int64_t work = units * std::max<int64_t>(job.T, 1) * job.Dv * job.Dk;
  const int threads = work < (int64_t(1) << 15) ? 1 : int(std::min<int64_t>(threads_, units));
  // The primitive may be gone when the task runs (its graph detached): the task keeps its
  // own copy of the tap counts.
  encoder.dispatch([inputs, job, taps = taps_, isa, units, threads]() mutable {
    job.taps = taps.data();
    job.q = inputs[0].data<float>();
    job.k = inputs[1].data<float>();
    job.v = inputs[2].data<float>();
    job.g = inputs[3].data<float>();
    job.beta = inputs[4].data<float>();
    job.state = inputs[5].data<float>();
    job.mask = inputs.size() > 6 ? inputs[6].data<bool>() : nullptr;
    auto fn = heads_portable;
#if defined(__x86_64__)
    if (isa == Isa::avx512) {
      fn = heads_avx512;
    } else if (isa == Isa::avx2) {
      fn = heads_avx2;
    }
#endif
    if (units == 0) {
      return;
    }
    workers().run(threads, int(units), 1, [&](int u0, int u1) { fn(job, u0, u1); });
  });
}

void GatedDelta::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("gated_delta runs on the CPU only");
}

bool GatedDelta::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const GatedDelta&>(other);
  return has_mask_ == o.has_mask_ && taps_ == o.taps_ && isa_ == o.isa_ &&
         threads_ == o.threads_;
}

// --- the layer's decode step ----------------------------------------------------------------

namespace {

MNB_INLINE float sum_squares_of(const float* x, int64_t n) {
  float part[kRowLanes] = {};
  int64_t i = 0;
  for (; i + kRowLanes <= n; i += kRowLanes) {
    for (int j = 0; j < kRowLanes; ++j) {
      part[j] += x[i + j] * x[i + j];
    }
  }
  float total = lanes_total(part);
  for (; i < n; ++i) {
    total += x[i] * x[i];
  }
  return total;
}

MNB_INLINE float silu_of(float x) {
  return x / (1.0f + std::exp(-x));
}

struct StepJob {
  const float *qkv, *conv_state, *conv_w, *a, *b, *a_log, *dt_bias, *state, *z, *norm_w;
  float *out, *conv_out, *state_out;
  const bool* mask; // null: every row counts; else a masked row keeps its state
  int64_t C, K, Hk, Hv, Dk, Dv;
  float norm_eps;
};

// A decode step's work is (row, block of value heads) units: one sequence's 16 heads split
// over the step's threads, whose states (a megabyte a layer) one core alone reads at half
// the machine's bandwidth. Each unit convolves its row (every unit of a row the same bits);
// the first block of a row writes its convolution state.
struct StepUnits {
  int64_t splits; // blocks of heads a row
  int64_t heads;  // value heads
  int64_t row(int64_t u) const { return u / splits; }
  int64_t h0(int64_t u) const { return (u % splits) * heads / splits; }
  int64_t h1(int64_t u) const { return (u % splits + 1) * heads / splits; }
};

// A row's convolution and its silu into `mixed`, its queries and keys normalized there, and
// (`write_state`) its new conv state.
MNB_INLINE void step_conv(const StepJob& j, int64_t row, float* mixed, bool write_state) {
  const int64_t C = j.C, K = j.K, keep = K - 1;
  const float* kept = j.conv_state + row * keep * C;
  const bool masked = j.mask != nullptr && !j.mask[row];
  const float* x = j.qkv + row * C;
  for (int64_t c = 0; c < C; ++c) {
    float acc = j.conv_w[c * K + keep] * (masked ? 0.0f : x[c]);
    for (int64_t t = 0; t < keep; ++t) {
      acc += j.conv_w[c * K + t] * kept[t * C + c];
    }
    mixed[c] = silu_of(acc);
  }
  // normalize_qk: q * Dk^-1 / rms, k * Dk^-0.5 / rms, rms with eps 1e-6 / Dk.
  const float inv2 = 1.0f / float(j.Dk), eps = 1e-6f * inv2;
  float* q = mixed;
  float* k = mixed + j.Hk * j.Dk;
  for (int64_t h = 0; h < j.Hk; ++h) {
    float* qh = q + h * j.Dk;
    float* kh = k + h * j.Dk;
    const float rq = 1.0f / std::sqrt(sum_squares_of(qh, j.Dk) / float(j.Dk) + eps);
    const float rk = 1.0f / std::sqrt(sum_squares_of(kh, j.Dk) / float(j.Dk) + eps);
    const float sk = std::sqrt(inv2);
    for (int64_t i = 0; i < j.Dk; ++i) {
      qh[i] = inv2 * (qh[i] * rq);
      kh[i] = sk * (kh[i] * rk);
    }
  }
  if (!write_state) {
    return;
  }
  float* new_kept = j.conv_out + row * keep * C;
  for (int64_t t = 0; t + 1 < keep; ++t) {
    std::memcpy(new_kept + t * C, kept + (t + 1) * C, size_t(C) * sizeof(float));
  }
  if (keep > 0 && masked) {
    std::fill(new_kept + (keep - 1) * C, new_kept + keep * C, 0.0f);
  } else if (keep > 0) {
    std::memcpy(new_kept + (keep - 1) * C, x, size_t(C) * sizeof(float));
  }
}

// One batch row's value heads h0 .. h1 after step_conv: their gate and beta, the recurrence
// (rows_step, in place on the new state) and the output norm.
MNB_INLINE void step_heads(const StepJob& j, int64_t row, int64_t h0, int64_t h1, float* mixed) {
  const float* q = mixed;
  const float* k = mixed + j.Hk * j.Dk;
  const float* v = mixed + 2 * j.Hk * j.Dk;
  const int64_t group = j.Hv / j.Hk, per = j.Dv * j.Dk;
  for (int64_t h = h0; h < h1; ++h) {
    const float av = j.a[row * j.Hv + h] + j.dt_bias[h];
    const float softplus = av > 20.0f ? av : std::log1p(std::exp(av));
    const float g = std::exp(-std::exp(j.a_log[h]) * softplus);
    const float beta = 1.0f / (1.0f + std::exp(-j.b[row * j.Hv + h]));
    float* s = j.state_out + (row * j.Hv + h) * per;
    std::memcpy(s, j.state + (row * j.Hv + h) * per, size_t(per) * sizeof(float));
    const float* qh = q + (h / group) * j.Dk;
    const float* kh = k + (h / group) * j.Dk;
    float* y = j.out + (row * j.Hv + h) * j.Dv;
    state_rows(s, j.Dv, j.Dk, qh, kh, v + h * j.Dv, g, beta, y);
    if (j.mask != nullptr && !j.mask[row]) { // a masked row gives its y and keeps its state
      std::memcpy(s, j.state + (row * j.Hv + h) * per, size_t(per) * sizeof(float));
    }
    // rms_norm(y) * w * silu(z)
    const float ry = 1.0f / std::sqrt(sum_squares_of(y, j.Dv) / float(j.Dv) + j.norm_eps);
    const float* zh = j.z + (row * j.Hv + h) * j.Dv;
    for (int64_t i = 0; i < j.Dv; ++i) {
      y[i] = silu_of(zh[i]) * ((y[i] * ry) * j.norm_w[i]);
    }
  }
}

// Units u0 .. u1 (StepUnits), a row convolved once for its consecutive units.
MNB_INLINE void step_units(const StepJob& j, const StepUnits& units, int64_t u0, int64_t u1,
                           float* mixed) {
  int64_t convolved = -1;
  for (int64_t u = u0; u < u1; ++u) {
    const int64_t row = units.row(u);
    if (row != convolved) {
      step_conv(j, row, mixed, units.h0(u) == 0);
      convolved = row;
    }
    step_heads(j, row, units.h0(u), units.h1(u), mixed);
  }
}

void step_portable(const StepJob& j, const StepUnits& s, int64_t u0, int64_t u1, float* m) {
  step_units(j, s, u0, u1, m);
}
#if defined(__x86_64__)
MNB_AVX2 void step_avx2(const StepJob& j, const StepUnits& s, int64_t u0, int64_t u1, float* m) {
  step_units(j, s, u0, u1, m);
}
MNB_AVX512 void step_avx512(const StepJob& j, const StepUnits& s, int64_t u0, int64_t u1,
                            float* m) {
  step_units(j, s, u0, u1, m);
}
#endif

} // namespace

std::vector<mx::array> delta_step(
    const mx::array& qkv,
    const mx::array& conv_state,
    const mx::array& conv_w,
    const mx::array& a,
    const mx::array& b,
    const mx::array& a_log,
    const mx::array& dt_bias,
    const mx::array& state,
    const mx::array& z,
    const mx::array& norm_w,
    const std::optional<mx::array>& mask,
    const DeltaStepParams& params) {
  const int B = qkv.shape(0), C = qkv.shape(-1), K = conv_w.ndim() == 3 ? conv_w.shape(1) : 0;
  const int Hv = state.ndim() == 4 ? state.shape(1) : 0, Dv = params.value_dim;
  const int Hk = params.heads_k, Dk = params.key_dim;
  const bool fits = qkv.ndim() == 3 && qkv.shape(1) == 1 && K > 0 &&
                    conv_w.shape() == mx::Shape{C, K, 1} &&
                    conv_state.shape() == mx::Shape{B, K - 1, C} && Hk > 0 && Hv % Hk == 0 &&
                    C == 2 * Hk * Dk + Hv * Dv && a.shape() == mx::Shape{B, 1, Hv} &&
                    b.shape() == a.shape() && a_log.shape() == mx::Shape{Hv} &&
                    dt_bias.shape() == a_log.shape() &&
                    state.shape() == mx::Shape{B, Hv, Dv, Dk} &&
                    z.shape() == mx::Shape{B, 1, Hv, Dv} && norm_w.shape() == mx::Shape{Dv};
  if (!fits) {
    throw std::invalid_argument("delta_step: the layer's arrays do not fit one decode step");
  }
  if (mask && (mask->dtype() != mx::bool_ || mask->shape() != mx::Shape{B, 1})) {
    throw std::invalid_argument("delta_step: mask must be bool [B, 1]");
  }
  auto s = mx::default_stream(mx::Device::cpu);
  std::vector<mx::array> inputs;
  const char* names[] = {"qkv", "conv_state", "conv_w", "a", "b", "A_log", "dt_bias",
                         "state", "z", "norm_w"};
  int i = 0;
  for (const mx::array* x : {&qkv, &conv_state, &conv_w, &a, &b, &a_log, &dt_bias, &state, &z,
                             &norm_w}) {
    inputs.push_back(float32_input(*x, names[i++], s));
  }
  if (mask) {
    inputs.push_back(contiguous_input(*mask, s));
  }
  DeltaStepParams held = params;
  held.isa = usable(params.isa);
  held.threads = std::max(1, params.threads);
  return mx::array::make_arrays(
      {{B, 1, Hv * Dv}, conv_state.shape(), state.shape()},
      {mx::float32, mx::float32, mx::float32},
      std::make_shared<DeltaStep>(s, held),
      std::move(inputs));
}

void DeltaStep::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& encoder = prepared_encoder(stream(), inputs, outputs);
  const auto& st = inputs[7];
  StepJob job{};
  job.out = outputs[0].data<float>();
  job.conv_out = outputs[1].data<float>();
  job.state_out = outputs[2].data<float>();
  job.C = inputs[0].shape(-1);
  job.K = inputs[2].shape(1);
  job.Hk = p_.heads_k;
  job.Hv = st.shape(1);
  job.Dk = p_.key_dim;
  job.Dv = p_.value_dim;
  job.norm_eps = p_.norm_eps;
  const Isa isa = p_.isa;
  const int64_t rows = inputs[0].shape(0);
  // Rows first; where threads are left, each row's heads split over them.
  const int64_t splits =
      std::clamp<int64_t>((p_.threads + rows - 1) / rows, 1, std::max<int64_t>(1, job.Hv));
  const StepUnits units{splits, job.Hv};
  const int threads = int(std::min<int64_t>(p_.threads, rows * splits));
  encoder.dispatch([inputs, job, isa, rows, units, threads]() mutable {
    const float** fields[] = {&job.qkv, &job.conv_state, &job.conv_w, &job.a, &job.b,
                              &job.a_log, &job.dt_bias, &job.state, &job.z, &job.norm_w};
    for (int i = 0; i < 10; ++i) {
      *fields[i] = inputs[i].data<float>();
    }
    job.mask = inputs.size() > 10 ? inputs[10].data<bool>() : nullptr;
    auto fn = step_portable;
#if defined(__x86_64__)
    if (isa == Isa::avx512) {
      fn = step_avx512;
    } else if (isa == Isa::avx2) {
      fn = step_avx2;
    }
#endif
    workers().run(threads, int(rows * units.splits), 1, [&](int u0, int u1) {
      std::vector<float> mixed(size_t(job.C));
      fn(job, units, u0, u1, mixed.data());
    });
  });
}

void DeltaStep::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("delta_step runs on the CPU only");
}

bool DeltaStep::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const DeltaStep&>(other).p_;
  return p_.heads_k == o.heads_k && p_.key_dim == o.key_dim && p_.value_dim == o.value_dim &&
         p_.norm_eps == o.norm_eps && p_.isa == o.isa && p_.threads == o.threads;
}

} // namespace mnb
