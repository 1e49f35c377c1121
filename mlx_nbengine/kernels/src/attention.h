// Scaled-dot-product attention as an MLX primitive on the CPU device.
//
// softmax(scale * Q K^T [+ soft-cap] [+ mask]) V for queries [B, Hq, L, D] and keys and values
// [B, Hkv, S, D] (Hq a multiple of Hkv: grouped-query heads). Query i sits at absolute
// position S - L + i (the keys end with the queries; a restored or cut cache brings the
// offset). The two products run on the BLAS (cblas_sgemm), or for a tile of few rows on
// ours (SmallProducts); the softmax is ours, tiled over
// keys with a running max and sum (the "online" softmax), so memory stays bounded whatever
// the number of keys; its row kernels are chosen per instruction set (attention_x86.cpp,
// attention_portable.cpp).

#pragma once

#include <cstdint>
#include <optional>

#include "mlx/ops.h"
#include "mlx/primitives.h"

#include "qkernels.h" // Isa, cpu_has_*

namespace mnb {

namespace mx = mlx::core;

// One key tile of the online softmax, for rows [r0, r1) of the tile.
struct SoftmaxTile {
  float* s; // scores, rows x lds (the first tk columns used); becomes the probabilities
  int lds;
  int tk; // columns (keys) in this tile
  const int* lo; // per row: the visible columns are [lo, hi); outside, probabilities are 0
  const int* hi;
  const uint8_t* const* mask; // per row: mask bytes of this tile's columns, or null (all on)
  float softcap; // 0: none; else scores become softcap * tanh(score / softcap)
  float* m; // per row: running max (-inf before the first visible key)
  float* l; // per row: running sum of exp(score - m)
  float* o; // per row: the output accumulator (rows x ldo), rescaled when m grows
  int ldo;
  int dv;
};

using SoftmaxFn = void (*)(const SoftmaxTile& t, int r0, int r1);

SoftmaxFn softmax_portable();
SoftmaxFn softmax_avx2(); // nullptr where this CPU (or the build's target) lacks the set
SoftmaxFn softmax_avx512();

// The two products of a tile of few rows (a decode step's query heads of one KV group, at
// most kSmallRows), ours instead of the BLAS's: for so few rows the BLAS's packing (a copy of
// the keys or values) costs more than the product.
constexpr int kSmallRows = 8;
struct SmallProducts {
  // s[r * lds + j] = q[r * D:(r + 1) * D] . k[j * ks:j * ks + D]   (r < R, j < tk)
  void (*scores)(const float* q, int R, int D, const float* k, int64_t ks, int tk, float* s, int lds);
  // o[r * ldo + d] += sum_j p[r * lds + j] * v[j * vs + d]   (r < R, d < dv)
  void (*values)(
      const float* p, int R, int lds, const float* v, int64_t vs, int tk, float* o, int ldo, int dv);
};

SmallProducts small_products_portable();
SmallProducts small_products_avx2(); // {nullptr, nullptr} where this CPU lacks the set

// exp(x) for float32 x <= 0 by the polynomial the vectorized kernels use (x < -87.3 gives 0):
// the scalar form, exposed so a test can measure its error.
float exp_poly(float x);
// Which set a row kernel `isa` asks for runs on this CPU.
Isa attention_isa(Isa isa);

struct AttentionParams {
  float scale;
  bool causal;
  int window; // 0: none; else a key is visible when q_pos - window < k_pos <= q_pos
  float softcap; // 0: none
  Isa isa;
  int threads;
  bool operator==(const AttentionParams&) const = default;
};

// q [B, Hq, L, D], k [B, Hkv, S, D], v [B, Hkv, S, Dv], all float32; mask (optional) a bool
// array of 4 dimensions broadcastable to [B, Hq, L, S] (each of its first three 1 or full,
// the last S). Returns [B, Hq, L, Dv] float32.
mx::array attention(
    const mx::array& q,
    const mx::array& k,
    const mx::array& v,
    const std::optional<mx::array>& mask,
    const AttentionParams& params);

class Attention : public mx::UnaryPrimitive {
 public:
  Attention(mx::Stream stream, AttentionParams params, bool has_mask)
      : mx::UnaryPrimitive(stream), p_(params), has_mask_(has_mask) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;

  const char* name() const override {
    return "MnbAttention";
  }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  AttentionParams p_;
  bool has_mask_;
};

} // namespace mnb
