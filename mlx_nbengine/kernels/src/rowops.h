// Row operations of a transformer step as MLX primitives on the CPU device: RMS norm and
// rotary position embedding (RoPE).
//
// MLX 0.32 has no CPU kernel for mx.fast.rms_norm or mx.fast.rope: on the CPU each is a
// graph of a dozen or more small operations (RoPE recomputes its cos and sin every call),
// and a decode step of a small model runs a hundred norms and dozens of RoPEs. Each of these
// is one primitive: one pass over the rows, vectorized by the compiler for the instruction
// set chosen at run time (Isa), float32 only.
//
// Rows: an input [..., D] is a sequence of rows of D contiguous floats; the leading
// dimensions may have any strides (a transposed view is read in place). Outputs are
// row-major.

#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "mlx/ops.h"
#include "mlx/primitives.h"

#include "qmatvec.h" // Isa, usable

namespace mnb {

namespace mx = mlx::core;

// x * rsqrt(mean(x^2) + eps) [* w] over the last axis, as mx.fast.rms_norm computes it.
mx::array rms_norm(
    const mx::array& x, const std::optional<mx::array>& w, float eps, Isa isa);

// mx.fast.rope: x [B, *, T, D]; the first `dims` features of position p (offset + t, the
// offset a scalar or one per batch row, int32) rotate by p * scale * inv_freq[i], with
// inv_freq[i] = base^(-2i/dims), or 1 / freqs[i] where freqs is given. `traditional`
// rotates pairs (2i, 2i+1), else (i, i + dims/2). Features past `dims` are copied.
mx::array rope(
    const mx::array& x,
    int dims,
    bool traditional,
    std::optional<float> base,
    float scale,
    const mx::array& offset,
    const std::optional<mx::array>& freqs,
    Isa isa);

// gelu_tanh(gate) * up, elementwise, for float32 arrays of one shape: the activation of a
// GELU-gated MLP (Gemma's) in a prefill step, one pass instead of MLX's compiled graph
// (scalar on x86). tanh by the rational fit of attention_math.h.
mx::array gelu_tanh_mul(const mx::array& gate, const mx::array& up, Isa isa, int threads);

// silu(gate) * up, elementwise, for float32 arrays of one shape: SwiGLU's activation (Llama's,
// Qwen's MLP; Qwen 3.5's gated output norm), one pass instead of MLX's sigmoid, which is
// scalar on x86. silu(x) = x / (1 + exp(-x)), exp by attention_math.h's polynomial.
mx::array silu_mul(const mx::array& gate, const mx::array& up, Isa isa, int threads);

// The row passes of rms_norm and rope, for primitives that fuse them (qkv_step.h): row r of
// x starts at x + starts[r]; out is row-major. RoPE's position of row r is
// positions[table_row[r]]; rope_inv_freq is the frequencies rope takes for `base`.
void norm_rows_for(Isa isa, const float* x, const int64_t* starts, const float* w, float* out,
                   int64_t rows, int n, float eps);
// norm_rows_for over M contiguous rows of n (x and out row-major).
void norm_dense_rows(Isa isa, const float* x, const float* w, float* out, int64_t rows, int n,
                     float eps);
std::vector<float> rope_inv_freq(float base, int half);
// silu(gate) * up over n contiguous floats (silu_mul's pass, for primitives that fuse it).
void silu_mul_for(Isa isa, const float* gate, const float* up, float* out, int64_t n);
// gelu_tanh(gate) * up likewise (gelu_tanh_mul's pass); out may be gate.
void gelu_tanh_mul_for(Isa isa, const float* gate, const float* up, float* out, int64_t n);
void rope_rows_for(Isa isa, const float* x, const int64_t* starts, const int* table_row,
                   const std::vector<float>& inv_freq, const std::vector<int64_t>& positions,
                   float scale, float* out, int64_t rows, int n, int dims, bool traditional);

// gelu_tanh_mul (silu false) and silu_mul (silu true).
class GatedActivation : public mx::UnaryPrimitive {
 public:
  GatedActivation(mx::Stream stream, bool silu, Isa isa, int threads)
      : mx::UnaryPrimitive(stream), silu_(silu), isa_(isa), threads_(threads) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  const char* name() const override {
    return silu_ ? "MnbSiluMul" : "MnbGeluTanhMul";
  }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  bool silu_;
  Isa isa_;
  int threads_;
};

class RmsNorm : public mx::UnaryPrimitive {
 public:
  RmsNorm(mx::Stream stream, float eps, bool has_weight, Isa isa)
      : mx::UnaryPrimitive(stream), eps_(eps), has_weight_(has_weight), isa_(isa) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  const char* name() const override {
    return "MnbRmsNorm";
  }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  float eps_;
  bool has_weight_;
  Isa isa_;
};

class Rope : public mx::UnaryPrimitive {
 public:
  Rope(mx::Stream stream, int dims, bool traditional, float base, float scale, bool has_freqs,
       Isa isa)
      : mx::UnaryPrimitive(stream),
        dims_(dims),
        traditional_(traditional),
        base_(base),
        scale_(scale),
        has_freqs_(has_freqs),
        isa_(isa) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  const char* name() const override {
    return "MnbRope";
  }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  int dims_;
  bool traditional_;
  float base_;
  float scale_;
  bool has_freqs_;
  Isa isa_;
};

} // namespace mnb
