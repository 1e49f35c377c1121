#include "attention.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <vector>

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"

#include "blas.h"
#include "workers.h"

namespace mnb {

namespace {

constexpr int kRowMajor = 101, kNoTrans = 111, kTrans = 112;
constexpr float kNinf = -std::numeric_limits<float>::infinity();
// Rows of one tile (query heads of a group x query positions) and keys per tile: the
// scores tile stays within 2 MiB whatever the number of keys.
constexpr int kTileRows = 512;
constexpr int kTileFloats = 1 << 19;
// A few-row tile's products are split over the threads from this many multiply-adds on
// (about 30 microseconds on one core): below it, the split costs more than it saves.
constexpr int64_t kSplitMacs = 1 << 17;

SoftmaxFn softmax_for(Isa isa) {
  SoftmaxFn fn = nullptr;
  if (isa == Isa::avx512) {
    fn = softmax_avx512();
  }
  if (fn == nullptr && isa != Isa::portable) {
    fn = softmax_avx2();
  }
  return fn != nullptr ? fn : softmax_portable();
}

// Our products for tiles of few rows: AVX2 for both vectorized sets (they read as fast as
// the memory gives), the portable loops otherwise.
SmallProducts small_for(Isa isa) {
  SmallProducts f{};
  if (isa != Isa::portable) {
    f = small_products_avx2();
  }
  return f.scores != nullptr ? f : small_products_portable();
}

// A 4-D array's data with unit stride on its last axis: the array itself, or a dense copy.
template <typename T>
struct View {
  const T* p;
  int64_t s0, s1, s2;
  std::vector<T> copy;
};

template <typename T>
void view_of(const mx::array& a, View<T>& v) {
  const auto& st = a.strides();
  if (a.shape(3) <= 1 || st[3] == 1) {
    v.p = a.data<T>();
    v.s0 = a.shape(0) > 1 ? st[0] : 0;
    v.s1 = a.shape(1) > 1 ? st[1] : 0;
    v.s2 = a.shape(2) > 1 ? st[2] : 0;
    return;
  }
  const int64_t n0 = a.shape(0), n1 = a.shape(1), n2 = a.shape(2), n3 = a.shape(3);
  v.copy.resize(size_t(n0 * n1 * n2 * n3));
  const T* src = a.data<T>();
  T* dst = v.copy.data();
  for (int64_t i = 0; i < n0; ++i) {
    for (int64_t j = 0; j < n1; ++j) {
      for (int64_t k = 0; k < n2; ++k) {
        const T* row = src + i * st[0] + j * st[1] + k * st[2];
        for (int64_t l = 0; l < n3; ++l) {
          *dst++ = row[l * st[3]];
        }
      }
    }
  }
  v.p = v.copy.data();
  v.s0 = n0 > 1 ? n1 * n2 * n3 : 0;
  v.s1 = n1 > 1 ? n2 * n3 : 0;
  v.s2 = n2 > 1 ? n3 : 0;
}

// The first index in [a, z) whose mask byte is set (z if none), and the last (a - 1 if
// none), eight bytes at a time.
bool clear8(const uint8_t* p) {
  uint64_t word;
  std::memcpy(&word, p, 8);
  return word == 0;
}

int first_set(const uint8_t* row, int a, int z) {
  while (a + 8 <= z && clear8(row + a)) {
    a += 8;
  }
  while (a < z && row[a] == 0) {
    ++a;
  }
  return a;
}

int last_set(const uint8_t* row, int a, int z) {
  while (z - 8 >= a && clear8(row + z - 8)) {
    z -= 8;
  }
  while (z > a && row[z - 1] == 0) {
    --z;
  }
  return z - 1;
}

struct Shape4 {
  int B, Hq, Hkv, L, S, D, Dv;
};

void run(
    const Shape4& sh,
    const View<float>& q,
    const View<float>& k,
    const View<float>& v,
    const View<uint8_t>* mask,
    float* out,
    const AttentionParams& p) {
  const int G = sh.Hq / sh.Hkv, L = sh.L, S = sh.S, D = sh.D, Dv = sh.Dv;
  const int Lq = std::max(1, std::min(L, kTileRows / G));
  const int rows_max = G * Lq;
  const int Tk = std::max(64, std::min(4096, kTileFloats / rows_max));
  SoftmaxFn fn = softmax_for(p.isa);
  const SmallProducts small = small_for(p.isa);
  std::vector<float> qs(size_t(rows_max) * D), sc(size_t(rows_max) * Tk), o(size_t(rows_max) * Dv);
  std::vector<float> m(rows_max), l(rows_max);
  std::vector<int> lo(rows_max), hi(rows_max);
  std::vector<const uint8_t*> mrow(rows_max);
  for (int b = 0; b < sh.B; ++b) {
    for (int h = 0; h < sh.Hkv; ++h) {
      const float* kp = k.p + b * k.s0 + h * k.s1;
      const float* vp = v.p + b * v.s0 + h * v.s1;
      std::vector<float> vmean; // filled when a row sees no key
      for (int l0 = 0; l0 < L; l0 += Lq) {
        const int lq = std::min(Lq, L - l0), R = G * lq;
        for (int g = 0; g < G; ++g) {
          for (int i = 0; i < lq; ++i) {
            const float* src = q.p + b * q.s0 + (h * G + g) * q.s1 + (l0 + i) * q.s2;
            float* dst = qs.data() + size_t(g * lq + i) * D;
            for (int d = 0; d < D; ++d) {
              dst[d] = src[d] * p.scale;
            }
          }
        }
        std::fill(o.begin(), o.begin() + size_t(R) * Dv, 0.0f);
        std::fill(m.begin(), m.begin() + R, kNinf);
        std::fill(l.begin(), l.begin() + R, 0.0f);
        const int first = S - L + l0; // the absolute position of the tile's first query
        int kend = p.causal ? std::min(S, first + lq) : S;
        int kbeg = p.window > 0 ? std::max(0, first - p.window + 1) : 0;
        if (mask != nullptr) {
          // The keys of the tile: from the first one any of its rows sees to the last. A
          // sliding window comes as a mask (mlx-lm's rotating caches), and most keys of a
          // long step lie outside it.
          int lo_all = kend, hi_all = kbeg;
          for (int g = 0; g < (mask->s1 == 0 ? 1 : G); ++g) {
            for (int i = 0; i < lq; ++i) {
              const uint8_t* row =
                  mask->p + b * mask->s0 + (h * G + g) * mask->s1 + (l0 + i) * mask->s2;
              const int a = first_set(row, kbeg, kend);
              if (a < kend) {
                lo_all = std::min(lo_all, a);
                hi_all = std::max(hi_all, last_set(row, a, kend) + 1);
              }
            }
          }
          kbeg = lo_all;
          kend = std::max(lo_all, hi_all);
        }
        for (int k0 = kbeg; k0 < kend; k0 += Tk) {
          const int tk = std::min(Tk, kend - k0);
          const int64_t ks = std::max<int64_t>(k.s2, D), vs = std::max<int64_t>(v.s2, Dv);
          // A decode step's tile (few rows, one KV group) is split over the threads too:
          // its scores by keys, its values by columns. Each score and each output column
          // is summed in the same order whatever the split, so the bits do not depend on it.
          const int small_threads = int64_t(R) * tk * D < kSplitMacs ? 1 : p.threads;
          if (R <= kSmallRows) {
            const float* kt = kp + k0 * k.s2;
            workers().run(small_threads, tk, (tk + small_threads - 1) / small_threads,
                          [&](int j0, int j1) {
                            small.scores(qs.data(), R, D, kt + j0 * ks, ks, j1 - j0,
                                         sc.data() + j0, Tk);
                          });
          } else {
            workers().rest(); // the BLAS's threads take the cores next
            cblas_sgemm(
                kRowMajor, kNoTrans, kTrans, R, tk, D, 1.0f, qs.data(), D, kp + k0 * k.s2,
                int(ks), 0.0f, sc.data(), Tk);
          }
          for (int g = 0; g < G; ++g) {
            for (int i = 0; i < lq; ++i) {
              const int r = g * lq + i, pos = first + i;
              int a = p.window > 0 ? pos - p.window + 1 - k0 : 0;
              int z = p.causal ? pos + 1 - k0 : tk;
              a = std::clamp(a, 0, tk);
              z = std::clamp(z, a, tk);
              if (mask != nullptr) {
                mrow[r] = mask->p + b * mask->s0 + (h * G + g) * mask->s1 + (l0 + i) * mask->s2 + k0;
                // The row's visible span from its first visible key: the softmax's vectors
                // then group the same keys wherever the span sits in the tile (a restored
                // window's keys sit elsewhere than a cold run's), so the sums agree bit for bit.
                a = first_set(mrow[r], a, z);
                z = last_set(mrow[r], a, z) + 1;
              }
              lo[r] = a;
              hi[r] = z;
            }
          }
          SoftmaxTile tile{
              sc.data(), Tk, tk, lo.data(), hi.data(), mask != nullptr ? mrow.data() : nullptr,
              p.softcap, m.data(), l.data(), o.data(), Dv, Dv};
          // A small tile is done before helpers wake.
          const int threads = int64_t(R) * tk < 16384 ? 1 : p.threads;
          const int chunk = (R + threads * 4 - 1) / (threads * 4);
          workers().run(std::min(threads, R), R, chunk, [&](int r0, int r1) { fn(tile, r0, r1); });
          if (R <= kSmallRows) {
            const float* vt = vp + k0 * v.s2;
            // Columns in multiples of 16: every column then takes the kernel's vector path.
            const int per = (Dv / small_threads + 15) / 16 * 16;
            workers().run(small_threads, Dv, std::max(16, per), [&](int d0, int d1) {
              small.values(sc.data(), R, Tk, vt + d0, vs, tk, o.data() + d0, Dv, d1 - d0);
            });
          } else {
            workers().rest(); // the BLAS's threads take the cores next
            cblas_sgemm(
                kRowMajor, kNoTrans, kNoTrans, R, Dv, tk, 1.0f, sc.data(), Tk, vp + k0 * v.s2,
                int(vs), 1.0f, o.data(), Dv);
          }
        }
        for (int g = 0; g < G; ++g) {
          for (int i = 0; i < lq; ++i) {
            const int r = g * lq + i;
            float* dst = out + ((int64_t(b) * sh.Hq + h * G + g) * L + l0 + i) * Dv;
            if (l[r] > 0.0f) {
              const float inv = 1.0f / l[r];
              const float* src = o.data() + size_t(r) * Dv;
              for (int d = 0; d < Dv; ++d) {
                dst[d] = src[d] * inv;
              }
              continue;
            }
            // A row that sees no key (only an explicit mask can do that) gets what MLX gives
            // it: every score the lowest float, so the plain mean of all the values.
            if (vmean.empty()) {
              vmean.assign(size_t(Dv), 0.0f);
              for (int j = 0; j < S; ++j) {
                for (int d = 0; d < Dv; ++d) {
                  vmean[d] += vp[j * v.s2 + d];
                }
              }
              for (int d = 0; d < Dv; ++d) {
                vmean[d] /= float(S);
              }
            }
            std::copy(vmean.begin(), vmean.end(), dst);
          }
        }
      }
    }
  }
}

} // namespace

Isa attention_isa(Isa isa) {
  if (isa == Isa::avx512 && softmax_avx512() == nullptr) {
    isa = Isa::avx2;
  }
  if (isa == Isa::avx2 && softmax_avx2() == nullptr) {
    isa = Isa::portable;
  }
  return isa;
}

mx::array attention(
    const mx::array& q,
    const mx::array& k,
    const mx::array& v,
    const std::optional<mx::array>& mask,
    const AttentionParams& params) {
  if (q.ndim() != 4 || k.ndim() != 4 || v.ndim() != 4) {
    throw std::invalid_argument("attention: queries, keys and values must be 4-D");
  }
  if (q.dtype() != mx::float32 || k.dtype() != mx::float32 || v.dtype() != mx::float32) {
    throw std::invalid_argument("attention: queries, keys and values must be float32");
  }
  const int B = q.shape(0), Hq = q.shape(1), L = q.shape(2), D = q.shape(3);
  const int Hkv = k.shape(1), S = k.shape(2), Dv = v.shape(3);
  if (k.shape(0) != B || v.shape(0) != B || v.shape(1) != Hkv || v.shape(2) != S ||
      k.shape(3) != D || Hkv < 1 || Hq % Hkv != 0) {
    throw std::invalid_argument("attention: queries, keys and values do not fit together");
  }
  if (params.causal && S < L) {
    throw std::invalid_argument("attention: a causal step needs at least as many keys as queries");
  }
  if (params.window < 0 || params.scale != params.scale) {
    throw std::invalid_argument("attention: the window must be >= 0 and the scale a number");
  }
  auto s = mx::default_stream(mx::Device::cpu);
  if (L == 0 || B == 0 || Hq == 0) {
    return mx::zeros({B, Hq, L, Dv}, mx::float32, s);
  }
  std::vector<mx::array> inputs{q, k, v};
  if (mask.has_value()) {
    auto mk = *mask;
    if (mk.dtype() != mx::bool_ || mk.ndim() > 4) {
      throw std::invalid_argument("attention: the mask must be a bool array of up to 4 dimensions");
    }
    auto shape = mk.shape();
    while (shape.size() < 4) {
      shape.insert(shape.begin(), 1);
    }
    if ((shape[0] != 1 && shape[0] != B) || (shape[1] != 1 && shape[1] != Hq) ||
        (shape[2] != 1 && shape[2] != L) || shape[3] != S) {
      throw std::invalid_argument("attention: the mask does not broadcast to [B, Hq, L, S]");
    }
    inputs.push_back(mx::reshape(mk, shape, s));
  }
  AttentionParams p = params;
  p.isa = attention_isa(p.isa);
  p.threads = std::max(1, p.threads);
  return mx::array(
      {B, Hq, L, Dv},
      mx::float32,
      std::make_shared<Attention>(s, p, mask.has_value()),
      std::move(inputs));
}

void Attention::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (const auto& a : inputs) {
    encoder.set_input_array(a);
  }
  encoder.set_output_array(out);
  const auto& q = inputs[0];
  const Shape4 sh{
      q.shape(0), q.shape(1), inputs[1].shape(1), q.shape(2), inputs[1].shape(2), q.shape(3),
      inputs[2].shape(3)};
  std::optional<mx::array> mask;
  if (has_mask_) {
    mask = inputs[3];
  }
  encoder.dispatch([q, k = inputs[1], v = inputs[2], mask, sh, o = out.data<float>(), p = p_]() {
    View<float> qv, kv, vv;
    view_of(q, qv);
    view_of(k, kv);
    view_of(v, vv);
    View<uint8_t> mv;
    if (mask.has_value()) {
      view_of(*mask, mv);
    }
    run(sh, qv, kv, vv, mask.has_value() ? &mv : nullptr, o, p);
  });
}

void Attention::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("attention runs on the CPU only");
}

bool Attention::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const Attention&>(other);
  return p_ == o.p_ && has_mask_ == o.has_mask_;
}

} // namespace mnb
