// The Python face of the row operations (rowops.h) and the gated delta rule (gated_delta.h), added to module mlx_nbengine_qmv by
// bindings.cpp.

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "gated_delta.h"
#include "rowops.h"

namespace nb = nanobind;
using namespace nb::literals;

void bind_rowops(nb::module_& m, mnb::Isa (*parse_isa)(const std::string&)) {
  m.def(
      "gelu_tanh_mul",
      [parse_isa](const mnb::mx::array& gate, const mnb::mx::array& up, const std::string& isa,
                  int threads) { return mnb::gelu_tanh_mul(gate, up, parse_isa(isa), threads); },
      "gate"_a,
      "up"_a,
      "isa"_a,
      "threads"_a,
      "gelu_tanh(gate) * up of float32 arrays on the CPU.");
  m.def(
      "silu_mul",
      [parse_isa](const mnb::mx::array& gate, const mnb::mx::array& up, const std::string& isa,
                  int threads) { return mnb::silu_mul(gate, up, parse_isa(isa), threads); },
      "gate"_a,
      "up"_a,
      "isa"_a,
      "threads"_a,
      "silu(gate) * up of float32 arrays on the CPU.");
  m.def(
      "rms_norm",
      [parse_isa](const mnb::mx::array& x,
                  const std::optional<mnb::mx::array>& w,
                  float eps,
                  const std::string& isa) { return mnb::rms_norm(x, w, eps, parse_isa(isa)); },
      "x"_a,
      "w"_a.none(),
      "eps"_a,
      "isa"_a,
      "mx.fast.rms_norm of a float32 array on the CPU.");
  m.def(
      "rope",
      [parse_isa](const mnb::mx::array& x,
                  int dims,
                  bool traditional,
                  std::optional<float> base,
                  float scale,
                  const mnb::mx::array& offset,
                  const std::optional<mnb::mx::array>& freqs,
                  const std::string& isa) {
        return mnb::rope(x, dims, traditional, base, scale, offset, freqs, parse_isa(isa));
      },
      "x"_a,
      "dims"_a,
      "traditional"_a,
      "base"_a.none(),
      "scale"_a,
      "offset"_a,
      "freqs"_a.none(),
      "isa"_a,
      "mx.fast.rope of a float32 array on the CPU (offset: an int32 array).");
  m.def(
      "delta_step",
      [parse_isa](const mnb::mx::array& qkv, const mnb::mx::array& conv_state,
                  const mnb::mx::array& conv_w, const mnb::mx::array& a, const mnb::mx::array& b,
                  const mnb::mx::array& a_log, const mnb::mx::array& dt_bias,
                  const mnb::mx::array& state, const mnb::mx::array& z,
                  const mnb::mx::array& norm_w, const std::optional<mnb::mx::array>& mask,
                  int heads_k, int key_dim, int value_dim, float norm_eps,
                  const std::string& isa, int threads) {
        auto out = mnb::delta_step(
            qkv, conv_state, conv_w, a, b, a_log, dt_bias, state, z, norm_w, mask,
            mnb::DeltaStepParams{heads_k, key_dim, value_dim, norm_eps, parse_isa(isa), threads});
        return nb::make_tuple(out[0], out[1], out[2]);
      },
      "qkv"_a, "conv_state"_a, "conv_w"_a, "a"_a, "b"_a, "a_log"_a, "dt_bias"_a, "state"_a,
      "z"_a, "norm_w"_a, "mask"_a.none(), "heads_k"_a, "key_dim"_a, "value_dim"_a,
      "norm_eps"_a, "isa"_a, "threads"_a,
      "A decode step of Qwen 3.5's linear-attention layer between its projections: "
      "(out, conv_state, state) (see gated_delta.h).");
  m.def(
      "conv_silu",
      [parse_isa](const mnb::mx::array& x, const mnb::mx::array& w, const std::string& isa,
                  int threads) { return mnb::conv_silu(x, w, parse_isa(isa), threads); },
      "x"_a,
      "w"_a,
      "isa"_a,
      "threads"_a,
      "silu(depthwise conv1d(x, w)) of float32 arrays on the CPU (see gated_delta.h).");
  m.def(
      "gated_delta",
      [parse_isa](const mnb::mx::array& q,
                  const mnb::mx::array& k,
                  const mnb::mx::array& v,
                  const mnb::mx::array& g,
                  const mnb::mx::array& beta,
                  const mnb::mx::array& state,
                  const std::optional<mnb::mx::array>& mask,
                  const std::vector<int>& taps,
                  const std::string& isa,
                  int threads) {
        auto out = mnb::gated_delta(q, k, v, g, beta, state, mask, taps, parse_isa(isa), threads);
        if (out.size() > 2) {
          return nb::make_tuple(out[0], out[1], out[2]);
        }
        return nb::make_tuple(out[0], out[1]);
      },
      "q"_a,
      "k"_a,
      "v"_a,
      "g"_a,
      "beta"_a,
      "state"_a,
      "mask"_a.none(),
      "taps"_a,
      "isa"_a,
      "threads"_a,
      "The gated delta rule of float32 arrays on the CPU: (y, state) (see gated_delta.h).");
}
