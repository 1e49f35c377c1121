#include "gated_mlp.h"

#include <cmath>
#include <stdexcept>
#include <vector>

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"

#include "attention_math.h"
#include "strided.h"
#include "workers.h"

namespace mnb {

namespace {

// sqrt(2 / pi) and the cubic's coefficient of GELU's tanh approximation.
constexpr float kGeluA = 0.7978845608028654f;
constexpr float kGeluB = 0.044715f;

inline float activate(Activation a, float g) {
  if (a == Activation::gelu_tanh) {
    return 0.5f * g * (1.0f + attn::tanh_scalar(kGeluA * (g + kGeluB * (g * g * g))));
  }
  // x * sigmoid(x), exp of a non-positive argument either way.
  if (g >= 0.0f) {
    return g / (1.0f + attn::exp_scalar(-g));
  }
  const float e = attn::exp_scalar(g);
  return g * e / (1.0f + e);
}

} // namespace

void check_quantized(const Quantized& m, int rows, int cols, int group_size, int bits,
                     const char* op, const char* what) {
  if (m.w.ndim() != 2 || m.w.dtype() != mx::uint32 || m.w.shape(0) != rows ||
      int64_t(m.w.shape(1)) * 32 / bits != cols ||
      m.scales.shape() != mx::Shape{rows, cols / group_size} ||
      m.biases.shape() != m.scales.shape()) {
    throw std::invalid_argument(std::string(op) + ": the " + what + " matrix does not fit");
  }
  scale_type(m.scales.dtype());
}

QJob quantized_job(const std::vector<mx::array>& inputs, int first, const float* x, float* out,
                   int M, int K, int group, int bits) {
  const auto& w = inputs[first];
  return QJob{
      x,
      w.data<uint8_t>(),
      inputs[first + 1].data<void>(),
      inputs[first + 2].data<void>(),
      out,
      M,
      K,
      w.shape(0),
      group,
      bits,
      scale_type(inputs[first + 1].dtype())};
}

void gated_mlp_rows(QJob gate, QJob up, QJob down, Activation act, Isa isa, int threads) {
  const int M = gate.M, H = gate.N;
  std::vector<float> g(size_t(M) * H), u(size_t(M) * H);
  gate.out = g.data();
  up.out = u.data();
  down.x = g.data(); // the activations, act(gate) * up, replace the gate's values
  const RowsFn fg = rows_for(isa, gate), fu = rows_for(isa, up), fd = rows_for(isa, down);
  QActivations xq, hq;
  if (fg != portable_rows(gate)) {
    xq.prepare(gate);
    up.xq = gate.xq;
    up.xscale = gate.xscale;
    up.xsum = gate.xsum;
    up.padded_groups = gate.padded_groups;
  }
  const int t1 = product_threads(gate, threads);
  workers().run(t1, H, product_chunk(H, t1), [&](int n0, int n1) {
    fg(gate, n0, n1);
    fu(up, n0, n1);
    for (int m = 0; m < M; ++m) {
      float* gm = g.data() + size_t(m) * H;
      const float* um = u.data() + size_t(m) * H;
      for (int n = n0; n < n1; ++n) {
        gm[n] = activate(act, gm[n]) * um[n];
      }
    }
  });
  if (fd != portable_rows(down)) {
    hq.prepare(down);
  }
  const int t2 = product_threads(down, threads);
  workers().run(t2, down.N, product_chunk(down.N, t2), [&](int n0, int n1) {
    fd(down, n0, n1);
  });
}

mx::array gated_mlp(
    const mx::array& x,
    const Quantized& gate,
    const Quantized& up,
    const Quantized& down,
    int group_size,
    int bits,
    Activation activation,
    Isa isa,
    int threads) {
  if (bits != 4 && bits != 8) {
    throw std::invalid_argument("gated_mlp: bits must be 4 or 8");
  }
  if (x.ndim() < 1 || x.dtype() != mx::float32) {
    throw std::invalid_argument("gated_mlp: x must be float32");
  }
  const int K = x.shape(-1), H = gate.w.shape(0);
  if (K % group_size != 0 || H % group_size != 0) {
    throw std::invalid_argument("gated_mlp: sizes must be whole groups");
  }
  check_quantized(gate, H, K, group_size, bits, "gated_mlp", "gate");
  check_quantized(up, H, K, group_size, bits, "gated_mlp", "up");
  check_quantized(down, K, H, group_size, bits, "gated_mlp", "down");
  const int M = int(x.size() / K);
  if (M < 1 || M > kBlockRows) {
    throw std::invalid_argument("gated_mlp: x must have 1 to 8 rows");
  }
  auto s = mx::default_stream(mx::Device::cpu);
  // x as it comes (eval_cpu reads a view whose rows are not contiguous through a copy), so
  // the MLP is one graph node.
  std::vector<mx::array> inputs{x};
  for (const Quantized* m : {&gate, &up, &down}) {
    inputs.push_back(contiguous_input(m->w, s));
    inputs.push_back(contiguous_input(m->scales, s));
    inputs.push_back(contiguous_input(m->biases, s));
  }
  auto primitive = std::make_shared<GatedMlp>(
      s, group_size, bits, activation, usable(isa), std::max(1, threads));
  return mx::array(x.shape(), mx::float32, primitive, std::move(inputs));
}

void GatedMlp::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (const auto& a : inputs) {
    encoder.set_input_array(a);
  }
  encoder.set_output_array(out);
  const int K = inputs[0].shape(-1), H = inputs[1].shape(0), M = int(inputs[0].size() / K);
  QJob gate = quantized_job(inputs, 1, nullptr, nullptr, M, K, group_size_, bits_);
  QJob up = quantized_job(inputs, 4, nullptr, nullptr, M, K, group_size_, bits_);
  QJob down = quantized_job(inputs, 7, nullptr, out.data<float>(), M, H, group_size_, bits_);
  const Isa isa = isa_;
  const Activation act = activation_;
  const int threads = threads_;
  const mx::array x = inputs[0];
  encoder.dispatch([gate, up, down, isa, act, threads, x]() mutable {
    std::vector<float> dense;
    gate.x = up.x = dense_rows(x, dense);
    gated_mlp_rows(gate, up, down, act, isa, threads);
  });
}

void GatedMlp::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("gated_mlp runs on the CPU only");
}

bool GatedMlp::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const GatedMlp&>(other);
  return group_size_ == o.group_size_ && bits_ == o.bits_ && activation_ == o.activation_ &&
      isa_ == o.isa_ && threads_ == o.threads_;
}

} // namespace mnb
