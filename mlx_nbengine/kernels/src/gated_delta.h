// The gated delta rule (the linear attention of Qwen 3.5's hybrid layers) as an MLX primitive
// on the CPU device.
//
// mlx-lm computes it with Metal kernels only; everywhere else gated_delta_ops runs a Python
// loop that calls a compiled step once per token and layer (about 2 ms a token on x86). Here
// one primitive runs every token of a step: each (batch row, value head) owns its state
// [Dv, Dk] (float32, 64 KB for heads of 128, kept in the core's cache over the tokens), and
// each token is one pass over the state that updates it and reads the next token's products
// (gated_delta.cpp). Heads are split over the step's threads.
//
// Per token t and value head h (key head h / (Hv / Hk)), as gated_delta_ops computes it:
//   S = S * g[t, h];  kv = S k;  delta = (v - kv) * beta[t, h];  S = S + delta k^T;  y = S q
// A row whose mask is false computes y from the updated state but keeps the old state.
//
// Shapes: q, k [B, T, Hk, Dk]; v [B, T, Hv, Dv]; g, beta [B, T, Hv]; state [B, Hv, Dv, Dk];
// mask [B, T] (bool) or none. All float32. Outputs: y [B, T, Hv, Dv] and the new state; where
// `taps` (ascending token counts in 1..T) are given, also the state after each of them,
// [len(taps), B, Hv, Dv, Dk] (a block boundary inside a long prefill step).

#pragma once

#include <optional>
#include <vector>

#include "mlx/ops.h"
#include "mlx/primitives.h"

#include "qmatvec.h" // Isa, usable

namespace mnb {

namespace mx = mlx::core;

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
    int threads);

// The layer's short convolution and its activation: silu(conv1d(x)) with MLX's Conv1d of
// groups = channels and no padding, x [B, S + K - 1, C] (the K - 1 kept inputs, then the
// step's), w [C, K, 1] (MLX's layout). Returns [B, S, C]: out[t, c] = silu(sum_j w[c, j]
// x[t + j, c]). MLX runs a grouped convolution and silu on the CPU as slow scalar loops.
mx::array conv_silu(const mx::array& x, const mx::array& w, Isa isa, int threads);

class ConvSilu : public mx::UnaryPrimitive {
 public:
  ConvSilu(mx::Stream stream, Isa isa, int threads)
      : mx::UnaryPrimitive(stream), isa_(isa), threads_(threads) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  const char* name() const override {
    return "MnbConvSilu";
  }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  Isa isa_;
  int threads_;
};

// A decode step of the whole linear-attention layer between its projections, one token per
// batch row: the short convolution (its state updated), silu, the heads' q/k L2 norms
// (mlx-lm's normalize_qk), the gate g = exp(-exp(A_log) softplus(a + dt_bias)) and
// beta = sigmoid(b), the recurrence, and the output norm rms_norm(y) * w * silu(z).
// qkv [B, 1, C], conv_state [B, K - 1, C], conv_w [C, K, 1], a and b [B, 1, Hv], A_log and
// dt_bias [Hv], state [B, Hv, Dv, Dk], z [B, 1, Hv, Dv], norm_w [Dv]; float32. Returns the
// normed output [B, 1, Hv * Dv], the new conv state and the new state. With `mask` (bool
// [B, 1], a batched cache's left padding) a masked row is the library's masked token: its
// input zeroed before the convolution (whose state still shifts) and its state kept.
struct DeltaStepParams {
  int heads_k, key_dim, value_dim; // Hk, Dk, Dv
  float norm_eps; // the output norm's
  Isa isa;
  int threads;
};

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
    const DeltaStepParams& params);

class DeltaStep : public mx::Primitive {
 public:
  DeltaStep(mx::Stream stream, const DeltaStepParams& params)
      : mx::Primitive(stream), p_(params) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override {
    return "MnbDeltaStep";
  }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  DeltaStepParams p_;
};

class GatedDelta : public mx::Primitive {
 public:
  GatedDelta(mx::Stream stream, bool has_mask, std::vector<int> taps, Isa isa, int threads)
      : mx::Primitive(stream),
        has_mask_(has_mask),
        taps_(std::move(taps)),
        isa_(isa),
        threads_(threads) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;

  const char* name() const override {
    return "MnbGatedDelta";
  }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  bool has_mask_;
  std::vector<int> taps_;
  Isa isa_;
  int threads_;
};

} // namespace mnb
