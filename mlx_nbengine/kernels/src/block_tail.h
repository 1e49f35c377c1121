// BlockTail: what follows attention in a decode step of a decoder layer with sandwich norms
// (Gemma 3), as one MLX primitive on the CPU device:
//
//   h   = x + norm(o_proj(attn heads as rows), post_attn)
//   out = h + norm(mlp(norm(h, pre_ffn)), post_ffn)       mlp: down(act(gate) * up)
//
// and where a `PerLayer` tail is given (Gemma 4's per-layer inputs and layer scalar):
//
//   out = out + norm(proj(act(in_gate(out)) * per_layer_input), post)   (with the matrices)
//   out = out * scalar                                                   (with the scalar)
//
// Where the model's graph has a transpose, a reshape, the output product, three norms, two
// adds and the MLP (9 nodes), this is one: the products run on the row kernels (the output
// product as QuantizedMatVec runs it, the MLP as GatedMlp does), the norms on rowops' pass,
// in the unfused graph's order, so its results are that graph's bits.

#pragma once

#include <optional>

#include "gated_mlp.h"
#include "qmatvec.h"

namespace mnb {

// Gemma 4's end of a layer: the per-layer input's gate and projection (where `input` is
// given: [B, L, P] float32, in_gate [P, K] and proj [K, P] quantized as the layer's other
// matrices, post [K]), then the layer's scalar (where given: float32 [1]).
struct PerLayer {
  std::optional<mx::array> input;
  std::optional<Quantized> in_gate, proj;
  std::optional<mx::array> post;
  std::optional<mx::array> scalar;
};

struct TailParams {
  float eps; // every norm's
  int group_size, bits; // every matrix's
  Activation activation;
  Isa isa;
  int threads;
};

// attn [B, H, L, D] (attention's output, float32) and x [B, L, K] (the layer's input, float32;
// B * L at most kBlockRows rows), o [K, H * D], gate and up [F, K], down [K, F], the norms'
// weights [K] (as the norms scale by them: Gemma's 1 + weight): out [B, L, K].
mx::array block_tail(
    const mx::array& attn,
    const mx::array& x,
    const Quantized& o,
    const mx::array& post_attn_norm,
    const mx::array& pre_ffn_norm,
    const Quantized& gate,
    const Quantized& up,
    const Quantized& down,
    const mx::array& post_ffn_norm,
    const PerLayer& per_layer,
    const TailParams& params);

class BlockTail : public mx::UnaryPrimitive {
 public:
  BlockTail(mx::Stream stream, const TailParams& params, bool per_layer, bool scalar)
      : mx::UnaryPrimitive(stream), p_(params), per_layer_(per_layer), scalar_(scalar) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;

  const char* name() const override {
    return "MnbBlockTail";
  }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  TailParams p_;
  bool per_layer_, scalar_; // whether the inputs hold a PerLayer's matrices, its scalar
};

} // namespace mnb
