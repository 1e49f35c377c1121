// BlockTail: what follows attention in a decode step of a decoder layer with sandwich norms
// (Gemma 3), as one MLX primitive on the CPU device:
//
//   h   = x + norm(o_proj(attn heads as rows), post_attn)
//   out = h + norm(mlp(norm(h, pre_ffn)), post_ffn)       mlp: down(act(gate) * up)
//
// Where the model's graph has a transpose, a reshape, the output product, three norms, two
// adds and the MLP (9 nodes), this is one: the products run on the row kernels (the output
// product as QuantizedMatVec runs it, the MLP as GatedMlp does), the norms on rowops' pass,
// in the unfused graph's order, so its results are that graph's bits.

#pragma once

#include "gated_mlp.h"
#include "qmatvec.h"

namespace mnb {

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
    const TailParams& params);

class BlockTail : public mx::UnaryPrimitive {
 public:
  BlockTail(mx::Stream stream, const TailParams& params)
      : mx::UnaryPrimitive(stream), p_(params) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;

  const char* name() const override {
    return "MnbBlockTail";
  }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  TailParams p_;
};

} // namespace mnb
