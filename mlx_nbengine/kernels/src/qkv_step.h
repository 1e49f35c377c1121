// QkvStep: a decode step's queries, keys and values of one attention layer as one MLX
// primitive on the CPU device: the three quantized products, the heads' RMS norms and RoPE.
//
// Where the model's graph has the input norm, three products, three reshapes, three transposes, two norms
// and two RoPEs (14 nodes; Gemma 3's attention), this is one node: x is normed, then rounded to
// int16 once for the three products, which run as one split over the workers; then each query
// and key head is normed and rotated. Its results are the unfused graph's bits: the same row
// kernels, norm and RoPE passes (rowops.h), in the same order.

#pragma once

#include <optional>

#include "gated_mlp.h" // Quantized
#include "qmatvec.h"

namespace mnb {

struct QkvParams {
  int heads, kv_heads; // query heads; key and value heads
  float eps; // the norms'
  int rope_dims; // features rotated per head (the first ones)
  bool traditional;
  float base, scale; // RoPE's frequencies base^(-2i/dims), positions times scale
  int group_size, bits;
  Isa isa;
  int threads;
  float x_eps = 0.0f; // the input norm's, where there is one
  bool v_norm = false; // the value heads normed too, without a weight (Gemma 4)
};

// x [B, L, K] (float32, B * L at most kBlockRows rows; first normed by x_norm [K] where
// given: the layer's input norm) against q [heads * D, K], k and v
// [kv_heads * D, K]: {rope(norm(q, q_norm)), rope(norm(k, k_norm)), v}, each [B, H, L, D]
// (the layout of x @ W.T reshaped to [B, L, H, D] and transposed), norms over D with weights
// [D], position of (b, t) offset[b] + t (offset: an int32 scalar or one per batch row).
// Without k and v (a layer that reads an earlier layer's keys and values): {rope(norm(q))}.
// With params.v_norm, v's heads are normed without a weight. RoPE's frequencies are
// base^(-2i/rope_dims), or 1 / freqs[i] where freqs [rope_dims / 2] is given (as
// mx.fast.rope takes them; an infinite one leaves its pair unrotated).
std::vector<mx::array> qkv_step(
    const mx::array& x,
    const Quantized& q,
    const std::optional<Quantized>& k,
    const std::optional<Quantized>& v,
    const mx::array& q_norm,
    const std::optional<mx::array>& k_norm,
    const mx::array& offset,
    const std::optional<mx::array>& x_norm,
    const std::optional<mx::array>& freqs,
    const QkvParams& params);

class QkvStep : public mx::Primitive {
 public:
  // Where each optional input sits among the inputs (-1: absent).
  struct Slots {
    int k = -1, v = -1, k_norm = -1, x_norm = -1, freqs = -1;
  };

  QkvStep(mx::Stream stream, const QkvParams& params, Slots slots)
      : mx::Primitive(stream), p_(params), slots_(slots) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;

  const char* name() const override {
    return "MnbQkvStep";
  }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  QkvParams p_;
  Slots slots_;
};

} // namespace mnb
