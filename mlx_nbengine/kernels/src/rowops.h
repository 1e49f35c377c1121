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

// The row passes of rms_norm and rope, for primitives that fuse them (qkv_step.h): row r of
// x starts at x + starts[r]; out is row-major. RoPE's position of row r is
// positions[table_row[r]]; rope_inv_freq is the frequencies rope takes for `base`.
void norm_rows_for(Isa isa, const float* x, const int64_t* starts, const float* w, float* out,
                   int64_t rows, int n, float eps);
// norm_rows_for over M contiguous rows of n (x and out row-major).
void norm_dense_rows(Isa isa, const float* x, const float* w, float* out, int64_t rows, int n,
                     float eps);
std::vector<float> rope_inv_freq(float base, int half);
void rope_rows_for(Isa isa, const float* x, const int64_t* starts, const int* table_row,
                   const std::vector<float>& inv_freq, const std::vector<int64_t>& positions,
                   float scale, float* out, int64_t rows, int n, int dims, bool traditional);

class GeluTanhMul : public mx::UnaryPrimitive {
 public:
  GeluTanhMul(mx::Stream stream, Isa isa, int threads)
      : mx::UnaryPrimitive(stream), isa_(isa), threads_(threads) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  const char* name() const override {
    return "MnbGeluTanhMul";
  }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
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
