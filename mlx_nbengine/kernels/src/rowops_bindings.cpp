// The Python face of the row operations (rowops.h), added to module mlx_nbengine_qmv by
// bindings.cpp.

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>

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
}
