// GatedMlp: a gated MLP of MLX affine-quantized weights, down(act(gate(x)) * up(x)), as one
// MLX primitive on the CPU device, for the few rows of a decode step (at most kBlockRows).
//
// One primitive where the model's graph has three products, the activation and a multiply:
// x is rounded to int16 once for the gate and the up product, which run chunk by chunk on
// the same workers with the activation fused after them, then the down product; no graph
// nodes, allocations or worker hand-offs between them.

#pragma once

#include "qmatvec.h"

namespace mnb {

enum class Activation : int {
  gelu_tanh = 0, // GELU's tanh approximation (Gemma), tanh by attention_math.h's fit
  silu = 1, // x * sigmoid(x) (SwiGLU: Llama, Qwen, ...)
};

struct Quantized {
  mx::array w, scales, biases;
};

// Throws std::invalid_argument ("<op>: the <what> matrix does not fit") unless `m` is a
// rows x cols matrix quantized with `group_size` and `bits`, scales of a dtype we read.
void check_quantized(const Quantized& m, int rows, int cols, int group_size, int bits,
                     const char* op, const char* what);

// A product's job over the matrix inputs[first..first+2] (weights, scales, biases, evaluated),
// for M rows of x (K features) into out.
QJob quantized_job(const std::vector<mx::array>& inputs, int first, const float* x, float* out,
                   int M, int K, int group, int bits);

// down(act(x @ gate.T) * (x @ up.T)) for x of at most kBlockRows rows (float32, any leading
// shape); every matrix quantized with the same group size and bits.
mx::array gated_mlp(
    const mx::array& x,
    const Quantized& gate,
    const Quantized& up,
    const Quantized& down,
    int group_size,
    int bits,
    Activation activation,
    Isa isa,
    int threads);

// The body of the primitive, for the fused decode steps that contain an MLP
// (decode_block.h): gate.x (= up.x) holds M <= kBlockRows rows, down.out receives M rows;
// the out fields of gate and up and down.x are set here.
void gated_mlp_rows(QJob gate, QJob up, QJob down, Activation act, Isa isa, int threads);

class GatedMlp : public mx::UnaryPrimitive {
 public:
  GatedMlp(mx::Stream stream, int group_size, int bits, Activation activation, Isa isa, int threads)
      : mx::UnaryPrimitive(stream),
        group_size_(group_size),
        bits_(bits),
        activation_(activation),
        isa_(isa),
        threads_(threads) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;

  const char* name() const override {
    return "MnbGatedMlp";
  }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  int group_size_;
  int bits_;
  Activation activation_;
  Isa isa_;
  int threads_;
};

} // namespace mnb
