// The Python face of the kernels: module mlx_nbengine_qmv (built into the cache home): the
// quantized matrix-vector products and attention.

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>

#include "attention.h"
#include "gated_mlp.h"
#include "qgemm.h"
#include "qmatvec.h"

namespace nb = nanobind;
using namespace nb::literals;

void bind_rowops(nb::module_& m, mnb::Isa (*parse_isa)(const std::string&)); // rowops_bindings

namespace {

mnb::Isa parse_isa(const std::string& name) {
  if (name == "avx512") {
    return mnb::Isa::avx512;
  }
  if (name == "avx2") {
    return mnb::Isa::avx2;
  }
  if (name == "portable") {
    return mnb::Isa::portable;
  }
  throw std::invalid_argument("isa must be avx512, avx2 or portable, not " + name);
}

const char* isa_name(mnb::Isa isa) {
  switch (isa) {
    case mnb::Isa::avx512:
      return "avx512";
    case mnb::Isa::avx2:
      return "avx2";
    default:
      return "portable";
  }
}

} // namespace

NB_MODULE(mlx_nbengine_qmv, m) {
  m.doc() = "mlx_nbengine's quantized matrix-vector kernels for MLX's affine layout";
  m.def(
      "quantized_matvec",
      [](const mnb::mx::array& x,
         const mnb::mx::array& w,
         const mnb::mx::array& scales,
         const mnb::mx::array& biases,
         int group_size,
         int bits,
         const std::string& isa,
         int threads) {
        return mnb::quantized_matvec(
            x, w, scales, biases, group_size, bits, parse_isa(isa), threads);
      },
      "x"_a,
      "w"_a,
      "scales"_a,
      "biases"_a,
      "group_size"_a,
      "bits"_a,
      "isa"_a,
      "threads"_a);
  m.def(
      "gated_mlp",
      [](const mnb::mx::array& x,
         const mnb::mx::array& gw,
         const mnb::mx::array& gs,
         const mnb::mx::array& gb,
         const mnb::mx::array& uw,
         const mnb::mx::array& us,
         const mnb::mx::array& ub,
         const mnb::mx::array& dw,
         const mnb::mx::array& ds,
         const mnb::mx::array& db,
         int group_size,
         int bits,
         const std::string& activation,
         const std::string& isa,
         int threads) {
        mnb::Activation act;
        if (activation == "gelu_tanh") {
          act = mnb::Activation::gelu_tanh;
        } else if (activation == "silu") {
          act = mnb::Activation::silu;
        } else {
          throw std::invalid_argument("activation must be gelu_tanh or silu, not " + activation);
        }
        return mnb::gated_mlp(
            x, {gw, gs, gb}, {uw, us, ub}, {dw, ds, db}, group_size, bits, act, parse_isa(isa),
            threads);
      },
      "x"_a,
      "gate_w"_a,
      "gate_scales"_a,
      "gate_biases"_a,
      "up_w"_a,
      "up_scales"_a,
      "up_biases"_a,
      "down_w"_a,
      "down_scales"_a,
      "down_biases"_a,
      "group_size"_a,
      "bits"_a,
      "activation"_a,
      "isa"_a,
      "threads"_a,
      "down(act(x gate^T) * (x up^T)) on the quantized kernels (see gated_mlp.h).");
  m.def(
      "usable_isa",
      [](const std::string& isa) { return std::string(isa_name(mnb::usable(parse_isa(isa)))); },
      "isa"_a,
      "The kernel set that runs for `isa` on this CPU (a lesser one where it lacks `isa`).");
  m.def("max_rows", [] { return mnb::kMaxRows; });
  m.def("gemm_available", [](const std::string& isa) { return mnb::qgemm_available(mnb::usable(parse_isa(isa))); }, "isa"_a);
  m.def(
      "attention",
      [](const mnb::mx::array& q,
         const mnb::mx::array& k,
         const mnb::mx::array& v,
         const std::optional<mnb::mx::array>& mask,
         float scale,
         bool causal,
         int window,
         float softcap,
         const std::string& isa,
         int threads) {
        return mnb::attention(
            q, k, v, mask, mnb::AttentionParams{scale, causal, window, softcap, parse_isa(isa), threads});
      },
      "q"_a,
      "k"_a,
      "v"_a,
      "mask"_a.none(),
      "scale"_a,
      "causal"_a,
      "window"_a,
      "softcap"_a,
      "isa"_a,
      "threads"_a,
      "softmax(scale q k^T [soft-capped] [masked]) v on the CPU (see attention.h).");
  m.def(
      "attention_isa",
      [](const std::string& isa) {
        return std::string(isa_name(mnb::attention_isa(parse_isa(isa))));
      },
      "isa"_a,
      "The attention kernel set that runs for `isa` on this CPU.");
  bind_rowops(m, parse_isa);
  m.def("exp_poly", &mnb::exp_poly, "x"_a, "The softmax's exp (x <= 0), scalar form.");
}
