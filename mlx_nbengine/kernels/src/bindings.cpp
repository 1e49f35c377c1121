// The Python face of the kernels: module mlx_nbengine_qmv (built into the cache home): the
// quantized matrix-vector products and attention.

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include "attention.h"
#include "block_tail.h"
#include "gated_mlp.h"
#include "qgemm.h"
#include "qmatvec.h"
#include "qkv_step.h"
#include "tokens.h"

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

mnb::Activation parse_activation(const std::string& name) {
  if (name == "gelu_tanh") {
    return mnb::Activation::gelu_tanh;
  }
  if (name == "silu") {
    return mnb::Activation::silu;
  }
  throw std::invalid_argument("activation must be gelu_tanh or silu, not " + name);
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
         int threads,
         const std::string& long_products) {
        if (long_products != "int16" && long_products != "blas" && long_products != "int8" &&
            long_products != "int8-pairs") {
          throw std::invalid_argument(
              "long_products must be 'int16', 'blas', 'int8' or 'int8-pairs'");
        }
        return mnb::quantized_matvec(
            x, w, scales, biases, group_size, bits, parse_isa(isa), threads,
            long_products == "int8"           ? mnb::LongProducts::int8
                : long_products == "int8-pairs" ? mnb::LongProducts::int8_pairs
                : long_products == "blas"       ? mnb::LongProducts::blas
                                                : mnb::LongProducts::int16);
      },
      "x"_a,
      "w"_a,
      "scales"_a,
      "biases"_a,
      "group_size"_a,
      "bits"_a,
      "isa"_a,
      "threads"_a,
      "long_products"_a = "int16");
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
        return mnb::gated_mlp(
            x, {gw, gs, gb}, {uw, us, ub}, {dw, ds, db}, group_size, bits,
            parse_activation(activation), parse_isa(isa), threads);
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
      "qkv_step",
      [](const mnb::mx::array& x,
         const mnb::mx::array& qw,
         const mnb::mx::array& qs,
         const mnb::mx::array& qb,
         const std::optional<mnb::mx::array>& kw,
         const std::optional<mnb::mx::array>& ks,
         const std::optional<mnb::mx::array>& kb,
         const std::optional<mnb::mx::array>& vw,
         const std::optional<mnb::mx::array>& vs,
         const std::optional<mnb::mx::array>& vb,
         const mnb::mx::array& q_norm,
         const std::optional<mnb::mx::array>& k_norm,
         const mnb::mx::array& offset,
         const std::optional<mnb::mx::array>& x_norm,
         float x_eps,
         int heads,
         int kv_heads,
         float eps,
         int rope_dims,
         bool traditional,
         float base,
         float scale,
         const std::optional<mnb::mx::array>& freqs,
         bool v_norm,
         int group_size,
         int bits,
         const std::string& isa,
         int threads) {
        std::optional<mnb::Quantized> k, v;
        if (kw) {
          if (!ks || !kb || !vw || !vs || !vb) {
            throw std::invalid_argument("qkv_step: k and v each need weights, scales and biases");
          }
          k = mnb::Quantized{*kw, *ks, *kb};
          v = mnb::Quantized{*vw, *vs, *vb};
        }
        mnb::QkvParams params{heads, kv_heads, eps, rope_dims, traditional, base, scale,
                              group_size, bits, parse_isa(isa), threads, x_eps};
        params.v_norm = v_norm;
        auto out = mnb::qkv_step(x, {qw, qs, qb}, k, v, q_norm, k_norm, offset, x_norm, freqs,
                                 params);
        if (out.size() == 1) {
          return nb::make_tuple(out[0]);
        }
        return nb::make_tuple(out[0], out[1], out[2]);
      },
      "x"_a, "q_w"_a, "q_scales"_a, "q_biases"_a, "k_w"_a.none(), "k_scales"_a.none(),
      "k_biases"_a.none(), "v_w"_a.none(), "v_scales"_a.none(), "v_biases"_a.none(),
      "q_norm"_a, "k_norm"_a.none(), "offset"_a, "x_norm"_a.none(), "x_eps"_a, "heads"_a,
      "kv_heads"_a, "eps"_a, "rope_dims"_a, "traditional"_a, "base"_a, "scale"_a,
      "freqs"_a.none(), "v_norm"_a, "group_size"_a, "bits"_a, "isa"_a, "threads"_a,
      "(rope(norm(q)), rope(norm(k)), v) of a decode step (x first normed by x_norm where given),"
      " each [B, H, L, D]; (rope(norm(q)),) without k and v (qkv_step.h).");
  m.def(
      "block_tail",
      [](const mnb::mx::array& attn,
         const mnb::mx::array& x,
         const mnb::mx::array& ow,
         const mnb::mx::array& os,
         const mnb::mx::array& ob,
         const mnb::mx::array& post_attn_norm,
         const mnb::mx::array& pre_ffn_norm,
         const mnb::mx::array& gw,
         const mnb::mx::array& gs,
         const mnb::mx::array& gb,
         const mnb::mx::array& uw,
         const mnb::mx::array& us,
         const mnb::mx::array& ub,
         const mnb::mx::array& dw,
         const mnb::mx::array& ds,
         const mnb::mx::array& db,
         const mnb::mx::array& post_ffn_norm,
         const std::optional<mnb::mx::array>& per_layer_input,
         const std::optional<mnb::mx::array>& in_gate_w,
         const std::optional<mnb::mx::array>& in_gate_s,
         const std::optional<mnb::mx::array>& in_gate_b,
         const std::optional<mnb::mx::array>& proj_w,
         const std::optional<mnb::mx::array>& proj_s,
         const std::optional<mnb::mx::array>& proj_b,
         const std::optional<mnb::mx::array>& post_per_layer_norm,
         const std::optional<mnb::mx::array>& scalar,
         float eps,
         int group_size,
         int bits,
         const std::string& activation,
         const std::string& isa,
         int threads) {
        mnb::PerLayer per_layer{per_layer_input, std::nullopt, std::nullopt,
                                post_per_layer_norm, scalar};
        if (in_gate_w) {
          if (!in_gate_s || !in_gate_b || !proj_w || !proj_s || !proj_b) {
            throw std::invalid_argument(
                "block_tail: the per-layer gate and projection each need weights, scales and "
                "biases");
          }
          per_layer.in_gate = mnb::Quantized{*in_gate_w, *in_gate_s, *in_gate_b};
          per_layer.proj = mnb::Quantized{*proj_w, *proj_s, *proj_b};
        }
        return mnb::block_tail(
            attn, x, {ow, os, ob}, post_attn_norm, pre_ffn_norm, {gw, gs, gb}, {uw, us, ub},
            {dw, ds, db}, post_ffn_norm, per_layer,
            mnb::TailParams{eps, group_size, bits, parse_activation(activation),
                            parse_isa(isa), threads});
      },
      "attn"_a, "x"_a, "o_w"_a, "o_scales"_a, "o_biases"_a, "post_attn_norm"_a,
      "pre_ffn_norm"_a, "gate_w"_a, "gate_scales"_a, "gate_biases"_a, "up_w"_a, "up_scales"_a,
      "up_biases"_a, "down_w"_a, "down_scales"_a, "down_biases"_a, "post_ffn_norm"_a,
      "per_layer_input"_a.none(), "in_gate_w"_a.none(), "in_gate_scales"_a.none(),
      "in_gate_biases"_a.none(), "proj_w"_a.none(), "proj_scales"_a.none(),
      "proj_biases"_a.none(), "post_per_layer_norm"_a.none(), "scalar"_a.none(), "eps"_a,
      "group_size"_a, "bits"_a, "activation"_a, "isa"_a, "threads"_a,
      "x + norm(o(attn)) then + norm(mlp(norm(.))), then Gemma 4's per-layer tail and scalar "
      "where given: a decode step's layer after attention (block_tail.h).");
  m.def(
      "usable_isa",
      [](const std::string& isa) { return std::string(isa_name(mnb::usable(parse_isa(isa)))); },
      "isa"_a,
      "The kernel set that runs for `isa` on this CPU (a lesser one where it lacks `isa`).");
  m.def("max_rows", [] { return mnb::kMaxRows; });
  m.def("gemm_available", [](const std::string& isa) { return mnb::qgemm_available(mnb::usable(parse_isa(isa))); }, "isa"_a);
  m.def(
      "gemm_pack",
      [](nb::bytes x, int M, int K, int group, int per_word, bool int8, const std::string& isa,
         bool vector) {
        if (M < 1 || K < 1 || group < 1 || K % group != 0 || group > 128 || group % 4 != 0 ||
            (per_word != 2 && per_word != 4) || x.size() != size_t(M) * K * 4) {
          throw std::invalid_argument("gemm_pack: x must be M x K float32, K a multiple of group");
        }
        mnb::QJob job{};
        job.x = reinterpret_cast<const float*>(x.c_str());
        job.M = M;
        job.K = K;
        job.group = group;
        std::vector<int32_t> words;
        std::vector<float> scale, sum;
        const int lanes = mnb::qgemm_pack(job, mnb::usable(parse_isa(isa)), per_word, int8,
                                          vector, words, scale, sum);
        auto as_bytes = [](const auto& v) {
          return nb::bytes(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(v[0]));
        };
        return nb::make_tuple(lanes, as_bytes(words), as_bytes(scale), as_bytes(sum));
      },
      "x"_a, "M"_a, "K"_a, "group"_a, "per_word"_a, "int8"_a, "isa"_a, "vector"_a,
      "x rounded and laid out as the GEMM's tiles read it (qgemm.h's qgemm_pack): (lanes, "
      "words, scale, sum) as bytes; `vector`: the set's packing, else the scalar loop.");
  m.def(
      "gemm_tile_rows",
      [](const std::string& isa) { return mnb::qgemm_tile_rows(mnb::usable(parse_isa(isa))); },
      "isa"_a);
  m.def("gemm_int8_fast", [](const std::string& isa) { return mnb::qgemm_int8_fast(mnb::usable(parse_isa(isa))); }, "isa"_a);
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
  m.def(
      "join_tokens",
      [](const std::vector<std::tuple<std::uintptr_t, int64_t, int64_t, int64_t, int>>& slices,
         int B, int H, int T, int D, mnb::mx::Dtype dtype) {
        std::vector<mnb::TokenSlice> parts;
        parts.reserve(slices.size());
        for (const auto& [data, s0, s1, s2, n] : slices) {
          parts.push_back(mnb::TokenSlice{data, s0, s1, s2, n});
        }
        return mnb::join_tokens(parts, B, H, T, D, dtype);
      },
      "slices"_a,
      "B"_a,
      "H"_a,
      "T"_a,
      "D"_a,
      "dtype"_a,
      "Token slices (address, byte strides of axes 0-2, tokens) joined along axis 2 into a new "
      "[B, H, T, D] array, zeros after them (see tokens.h).");
  bind_rowops(m, parse_isa);
  m.def("exp_poly", &mnb::exp_poly, "x"_a, "The softmax's exp (x <= 0), scalar form.");
}
