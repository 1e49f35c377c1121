#include "block_tail.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"

#include "rowops.h"
#include "strided.h"

namespace mnb {

namespace {

// Inputs: attn, x, o (3), post_attn, pre_ffn, gate (3), up (3), down (3), post_ffn; then a
// PerLayer's input, in_gate (3), proj (3) and post where given, and its scalar where given.
constexpr int kO = 2, kPostAttn = 5, kPreFfn = 6, kGate = 7, kUp = 10, kDown = 13, kPostFfn = 16;
constexpr int kPerLayer = 17, kInGate = 18, kProj = 21, kPost = 24;

// out[m] = base[m] + norm(r[m], w) for M rows of K.
void add_norm(Isa isa, const float* base, const float* r, const float* w, float* out, int M,
              int K, float eps) {
  std::vector<float> normed(size_t(M) * K);
  norm_dense_rows(isa, r, w, normed.data(), M, K, eps);
  for (size_t i = 0; i < normed.size(); ++i) {
    out[i] = base[i] + normed[i];
  }
}

void check_norm(const mx::array& w, int K) {
  if (w.dtype() != mx::float32 || w.ndim() != 1 || w.shape(0) != K) {
    throw std::invalid_argument("block_tail: the norms' weights must be float32 [features]");
  }
}

} // namespace

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
    const TailParams& params) {
  const TailParams& p = params;
  if (p.bits != 4 && p.bits != 8) {
    throw std::invalid_argument("block_tail: bits must be 4 or 8");
  }
  if (x.ndim() != 3 || x.dtype() != mx::float32 || attn.ndim() != 4 ||
      attn.dtype() != mx::float32) {
    throw std::invalid_argument("block_tail: x must be float32 [B, L, K], attn [B, H, L, D]");
  }
  const int B = x.shape(0), L = x.shape(1), K = x.shape(2);
  if (B * L < 1 || B * L > kBlockRows) {
    throw std::invalid_argument("block_tail: x must have 1 to 8 rows");
  }
  if (attn.shape(0) != B || attn.shape(2) != L) {
    throw std::invalid_argument("block_tail: attn's batch and length must be x's");
  }
  const int HD = attn.shape(1) * attn.shape(3);
  if (K % p.group_size != 0 || HD % p.group_size != 0 || gate.w.ndim() != 2) {
    throw std::invalid_argument("block_tail: sizes must be whole groups");
  }
  const int F = gate.w.shape(0);
  check_quantized(o, K, HD, p.group_size, p.bits, "block_tail", "output");
  check_quantized(gate, F, K, p.group_size, p.bits, "block_tail", "gate");
  check_quantized(up, F, K, p.group_size, p.bits, "block_tail", "up");
  check_quantized(down, K, F, p.group_size, p.bits, "block_tail", "down");
  for (const mx::array* w : {&post_attn_norm, &pre_ffn_norm, &post_ffn_norm}) {
    check_norm(*w, K);
  }
  const PerLayer& pl = per_layer;
  const bool has_per_layer = bool(pl.input);
  if (bool(pl.in_gate) != has_per_layer || bool(pl.proj) != has_per_layer ||
      bool(pl.post) != has_per_layer) {
    throw std::invalid_argument(
        "block_tail: the per-layer input, its gate, projection and norm come together");
  }
  if (has_per_layer) {
    const auto& in = *pl.input;
    if (in.ndim() != 3 || in.dtype() != mx::float32 || in.shape(0) != B || in.shape(1) != L ||
        in.shape(2) % p.group_size != 0) {
      throw std::invalid_argument(
          "block_tail: the per-layer input must be float32 [B, L, P], P whole groups");
    }
    const int P = in.shape(2);
    check_quantized(*pl.in_gate, P, K, p.group_size, p.bits, "block_tail", "per-layer gate");
    check_quantized(*pl.proj, K, P, p.group_size, p.bits, "block_tail", "per-layer projection");
    check_norm(*pl.post, K);
  }
  if (pl.scalar && (pl.scalar->dtype() != mx::float32 || pl.scalar->size() != 1)) {
    throw std::invalid_argument("block_tail: the layer scalar must be one float32");
  }
  auto s = mx::default_stream(mx::Device::cpu);
  std::vector<mx::array> inputs{attn, x};
  auto add = [&](const Quantized& m) {
    inputs.push_back(contiguous_input(m.w, s));
    inputs.push_back(contiguous_input(m.scales, s));
    inputs.push_back(contiguous_input(m.biases, s));
  };
  add(o);
  inputs.push_back(post_attn_norm);
  inputs.push_back(pre_ffn_norm);
  add(gate);
  add(up);
  add(down);
  inputs.push_back(post_ffn_norm);
  if (has_per_layer) {
    inputs.push_back(*pl.input);
    add(*pl.in_gate);
    add(*pl.proj);
    inputs.push_back(*pl.post);
  }
  if (pl.scalar) {
    inputs.push_back(mx::reshape(*pl.scalar, {1}, s));
  }
  TailParams held = p;
  held.isa = usable(p.isa);
  held.threads = std::max(1, p.threads);
  return mx::array(x.shape(), mx::float32,
                   std::make_shared<BlockTail>(s, held, has_per_layer, bool(pl.scalar)),
                   std::move(inputs));
}

void BlockTail::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (const auto& a : inputs) {
    encoder.set_input_array(a);
  }
  encoder.set_output_array(out);
  const mx::array attn = inputs[0], x = inputs[1];
  const mx::array w1 = inputs[kPostAttn], w2 = inputs[kPreFfn], w3 = inputs[kPostFfn];
  const int B = x.shape(0), L = x.shape(1), K = x.shape(2), M = B * L;
  const int H = attn.shape(1), D = attn.shape(3), HD = H * D;
  const TailParams p = p_;
  QJob o = quantized_job(inputs, kO, nullptr, nullptr, M, HD, p.group_size, p.bits);
  QJob gate = quantized_job(inputs, kGate, nullptr, nullptr, M, K, p.group_size, p.bits);
  QJob up = quantized_job(inputs, kUp, nullptr, nullptr, M, K, p.group_size, p.bits);
  QJob down = quantized_job(inputs, kDown, nullptr, nullptr, M, gate.N, p.group_size, p.bits);
  const bool per_layer = per_layer_;
  const int P = per_layer ? inputs[kPerLayer].shape(2) : 0;
  QJob in_gate = per_layer ? quantized_job(inputs, kInGate, nullptr, nullptr, M, K, p.group_size, p.bits)
                           : gate;
  QJob proj = per_layer ? quantized_job(inputs, kProj, nullptr, nullptr, M, P, p.group_size, p.bits)
                        : gate;
  const std::optional<mx::array> pli =
      per_layer ? std::optional<mx::array>(inputs[kPerLayer]) : std::nullopt;
  const std::optional<mx::array> w4 =
      per_layer ? std::optional<mx::array>(inputs[kPost]) : std::nullopt;
  const std::optional<mx::array> scalar =
      scalar_ ? std::optional<mx::array>(inputs.back()) : std::nullopt;
  float* op = out.data<float>();
  encoder.dispatch([=]() mutable {
    // The heads as rows of the output product: row (b, t) is head after head of attn[b, :, t].
    std::vector<float> scratch;
    std::vector<int64_t> starts;
    const float* heads = rows_of(attn, scratch, starts);
    std::vector<float> a(size_t(M) * HD);
    for (int b = 0; b < B; ++b) {
      for (int h = 0; h < H; ++h) {
        for (int t = 0; t < L; ++t) {
          std::memcpy(a.data() + (int64_t(b) * L + t) * HD + int64_t(h) * D,
                      heads + starts[(int64_t(b) * H + h) * L + t], sizeof(float) * D);
        }
      }
    }
    std::vector<float> r(size_t(M) * K), hbuf(size_t(M) * K), n(size_t(M) * K);
    o.x = a.data();
    o.out = r.data();
    rows_product(o, p.isa, p.threads);
    std::vector<float> dense, wd1, wd2, wd3;
    const float* xd = dense_rows(x, dense);
    add_norm(p.isa, xd, r.data(), dense_rows(w1, wd1), hbuf.data(), M, K, p.eps);
    norm_dense_rows(p.isa, hbuf.data(), dense_rows(w2, wd2), n.data(), M, K, p.eps);
    gate.x = up.x = n.data();
    down.out = r.data();
    gated_mlp_rows(gate, up, down, p.activation, p.isa, p.threads);
    add_norm(p.isa, hbuf.data(), r.data(), dense_rows(w3, wd3), op, M, K, p.eps);
    if (pli) { // out + norm(proj(gelu_tanh(in_gate(out)) * per-layer input), post)
      std::vector<float> g(size_t(M) * P), held, wd4;
      in_gate.x = op;
      in_gate.out = g.data();
      rows_product(in_gate, p.isa, p.threads);
      const float* in = dense_rows(*pli, held);
      gelu_tanh_mul_for(p.isa, g.data(), in, g.data(), int64_t(g.size()));
      proj.x = g.data();
      proj.out = r.data();
      rows_product(proj, p.isa, p.threads);
      add_norm(p.isa, op, r.data(), dense_rows(*w4, wd4), op, M, K, p.eps);
    }
    if (scalar) {
      const float f = scalar->data<float>()[0];
      for (int64_t i = 0; i < int64_t(M) * K; ++i) {
        op[i] *= f;
      }
    }
  });
}

void BlockTail::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("block_tail runs on the CPU only");
}

bool BlockTail::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const BlockTail&>(other).p_;
  const auto& other_tail = static_cast<const BlockTail&>(other);
  if (per_layer_ != other_tail.per_layer_ || scalar_ != other_tail.scalar_) {
    return false;
  }
  return p_.eps == o.eps && p_.group_size == o.group_size && p_.bits == o.bits &&
      p_.activation == o.activation && p_.isa == o.isa && p_.threads == o.threads;
}

} // namespace mnb
