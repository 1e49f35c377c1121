#include "qkv_step.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"

#include "rowops.h"
#include "strided.h"
#include "workers.h"

namespace mnb {

namespace {

// The heads of `lin` (B * L rows of H * D) normed and rotated into out [B, H, L, D], as the
// unfused graph does: the norm reads the transposed view's rows, RoPE the norm's output.
void heads(const float* lin, const float* w, float* out, int B, int L, int H, int D,
           const std::vector<int64_t>& positions, bool each, const std::vector<float>& inv_freq,
           const QkvParams& p) {
  const int64_t rows = int64_t(B) * H * L;
  std::vector<int64_t> starts(rows), dense(rows);
  std::vector<int> table_row(rows);
  for (int b = 0; b < B; ++b) {
    for (int h = 0; h < H; ++h) {
      for (int t = 0; t < L; ++t) {
        const int64_t r = (int64_t(b) * H + h) * L + t;
        starts[r] = (int64_t(b) * L + t) * H * D + int64_t(h) * D;
        dense[r] = r * D;
        table_row[r] = (each ? b : 0) * L + t;
      }
    }
  }
  std::vector<float> normed(size_t(rows) * D);
  norm_rows_for(p.isa, lin, starts.data(), w, normed.data(), rows, D, p.eps);
  rope_rows_for(p.isa, normed.data(), dense.data(), table_row.data(), inv_freq, positions,
                p.scale, out, rows, D, p.rope_dims, p.traditional);
}

} // namespace

std::vector<mx::array> qkv_step(
    const mx::array& x,
    const Quantized& q,
    const std::optional<Quantized>& k,
    const std::optional<Quantized>& v,
    const mx::array& q_norm,
    const std::optional<mx::array>& k_norm,
    const mx::array& offset,
    const std::optional<mx::array>& x_norm,
    const std::optional<mx::array>& freqs,
    const QkvParams& params) {
  const QkvParams& p = params;
  if (p.bits != 4 && p.bits != 8) {
    throw std::invalid_argument("qkv_step: bits must be 4 or 8");
  }
  if (x.ndim() != 3 || x.dtype() != mx::float32) {
    throw std::invalid_argument("qkv_step: x must be float32 [B, L, K]");
  }
  const int B = x.shape(0), L = x.shape(1), K = x.shape(2);
  if (B * L < 1 || B * L > kBlockRows) {
    throw std::invalid_argument("qkv_step: x must have 1 to 8 rows");
  }
  if (p.heads < 1 || p.kv_heads < 1 || q.w.ndim() != 2 || q.w.shape(0) % p.heads != 0) {
    throw std::invalid_argument("qkv_step: the query heads do not divide q");
  }
  const bool has_kv = bool(k);
  if (bool(v) != has_kv || bool(k_norm) != has_kv) {
    throw std::invalid_argument("qkv_step: k, v and k_norm come together or not at all");
  }
  const int D = q.w.shape(0) / p.heads;
  if (K % p.group_size != 0) {
    throw std::invalid_argument("qkv_step: x's features must be whole groups");
  }
  check_quantized(q, p.heads * D, K, p.group_size, p.bits, "qkv_step", "query");
  if (has_kv) {
    check_quantized(*k, p.kv_heads * D, K, p.group_size, p.bits, "qkv_step", "key");
    check_quantized(*v, p.kv_heads * D, K, p.group_size, p.bits, "qkv_step", "value");
  }
  for (const mx::array* w : {&q_norm, has_kv ? &*k_norm : nullptr}) {
    if (w != nullptr && (w->dtype() != mx::float32 || w->ndim() != 1 || w->shape(0) != D)) {
      throw std::invalid_argument("qkv_step: the norms' weights must be float32 [head dim]");
    }
  }
  if (x_norm && (x_norm->dtype() != mx::float32 || x_norm->ndim() != 1 || x_norm->shape(0) != K)) {
    throw std::invalid_argument("qkv_step: the input norm's weight must be float32 [features]");
  }
  if (p.rope_dims <= 0 || p.rope_dims % 2 != 0 || p.rope_dims > D) {
    throw std::invalid_argument("qkv_step: RoPE's dims must be even and at most the head dim");
  }
  if (freqs && (freqs->ndim() != 1 || freqs->shape(0) != p.rope_dims / 2)) {
    throw std::invalid_argument("qkv_step: freqs must have rope_dims / 2 values");
  }
  if (offset.ndim() > 1 || (offset.ndim() == 1 && offset.size() != 1 && int(offset.size()) != B)) {
    throw std::invalid_argument("qkv_step: offset must be a scalar or one per batch row");
  }
  auto s = mx::default_stream(mx::Device::cpu);
  std::vector<mx::array> inputs{x};
  auto add = [&](const Quantized& m) {
    inputs.push_back(contiguous_input(m.w, s));
    inputs.push_back(contiguous_input(m.scales, s));
    inputs.push_back(contiguous_input(m.biases, s));
  };
  add(q);
  inputs.push_back(q_norm);
  inputs.push_back(mx::astype(offset, mx::int32, s));
  QkvStep::Slots slots;
  if (has_kv) {
    slots.k = int(inputs.size());
    add(*k);
    slots.v = int(inputs.size());
    add(*v);
    slots.k_norm = int(inputs.size());
    inputs.push_back(*k_norm);
  }
  if (x_norm) {
    slots.x_norm = int(inputs.size());
    inputs.push_back(*x_norm);
  }
  if (freqs) {
    slots.freqs = int(inputs.size());
    inputs.push_back(mx::astype(*freqs, mx::float32, s));
  }
  QkvParams held = p;
  held.isa = usable(p.isa);
  held.threads = std::max(1, p.threads);
  auto primitive = std::make_shared<QkvStep>(s, held, slots);
  if (!has_kv) {
    return {mx::array({B, p.heads, L, D}, mx::float32, primitive, std::move(inputs))};
  }
  return mx::array::make_arrays(
      {{B, p.heads, L, D}, {B, p.kv_heads, L, D}, {B, p.kv_heads, L, D}},
      {mx::float32, mx::float32, mx::float32},
      primitive,
      std::move(inputs));
}

void QkvStep::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  for (auto& out : outputs) {
    out.set_data(mx::allocator::malloc(out.nbytes()));
  }
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (const auto& a : inputs) {
    encoder.set_input_array(a);
  }
  for (auto& out : outputs) {
    encoder.set_output_array(out);
  }
  const auto& x = inputs[0];
  const int B = x.shape(0), L = x.shape(1), K = x.shape(2), M = B * L;
  const Slots slots = slots_;
  const bool has_kv = slots.k >= 0;
  QJob jq = quantized_job(inputs, 1, nullptr, nullptr, M, K, p_.group_size, p_.bits);
  QJob jk = has_kv ? quantized_job(inputs, slots.k, nullptr, nullptr, M, K, p_.group_size, p_.bits)
                   : jq;
  QJob jv = has_kv ? quantized_job(inputs, slots.v, nullptr, nullptr, M, K, p_.group_size, p_.bits)
                   : jq;
  if (!has_kv) {
    jk.N = jv.N = 0;
  }
  float* qo = outputs[0].data<float>();
  float* ko = has_kv ? outputs[1].data<float>() : nullptr;
  float* vo = has_kv ? outputs[2].data<float>() : nullptr;
  const QkvParams p = p_;
  const mx::array qn = inputs[4], offset = inputs[5];
  const std::optional<mx::array> kn =
      has_kv ? std::optional<mx::array>(inputs[slots.k_norm]) : std::nullopt;
  const std::optional<mx::array> xn =
      slots.x_norm >= 0 ? std::optional<mx::array>(inputs[slots.x_norm]) : std::nullopt;
  const std::optional<mx::array> freqs =
      slots.freqs >= 0 ? std::optional<mx::array>(inputs[slots.freqs]) : std::nullopt;
  encoder.dispatch([=]() mutable {
    const int D = jq.N / p.heads;
    std::vector<float> dense, normed;
    const float* xd = dense_rows(x, dense);
    if (xn) { // the input norm, as the layer's RmsNorm primitive runs it
      std::vector<float> w;
      normed.resize(size_t(M) * K);
      norm_dense_rows(p.isa, xd, dense_rows(*xn, w), normed.data(), M, K, p.x_eps);
      xd = normed.data();
    }
    jq.x = jk.x = jv.x = xd;
    std::vector<float> lin(size_t(M) * (jq.N + jk.N + jv.N));
    jq.out = lin.data();
    jk.out = jq.out + size_t(M) * jq.N;
    jv.out = jk.out + size_t(M) * jk.N;
    const RowsFn fq = rows_for(p.isa, jq), fk = rows_for(p.isa, jk), fv = rows_for(p.isa, jv);
    QActivations xq;
    if (fq != portable_rows(jq)) {
      xq.prepare(jq);
      for (QJob* j : {&jk, &jv}) {
        j->xq = jq.xq;
        j->xscale = jq.xscale;
        j->xsum = jq.xsum;
        j->padded_groups = jq.padded_groups;
      }
    }
    // The matrices as one of jq.N + jk.N + jv.N output rows, split over the workers.
    QJob all = jq;
    all.N = jq.N + jk.N + jv.N;
    const int threads = product_threads(all, p.threads);
    workers().run(threads, all.N, product_chunk(all.N, threads), [&](int n0, int n1) {
      int first = 0;
      for (auto [job, fn] : {std::pair{&jq, fq}, std::pair{&jk, fk}, std::pair{&jv, fv}}) {
        const int lo = std::max(n0, first), hi = std::min(n1, first + job->N);
        if (lo < hi) {
          fn(*job, lo - first, hi - first);
        }
        first += job->N;
      }
    });
    // RoPE's positions as the rope primitive takes them: one row of T per distinct offset.
    const bool each = offset.size() > 1;
    const int distinct = each ? B : 1;
    std::vector<int64_t> positions(int64_t(distinct) * L);
    const int32_t* off = offset.data<int32_t>();
    for (int b = 0; b < distinct; ++b) {
      const int32_t o = offset.ndim() == 0 ? off[0] : off[int64_t(b) * offset.strides()[0]];
      for (int t = 0; t < L; ++t) {
        positions[int64_t(b) * L + t] = int64_t(o) + t;
      }
    }
    std::vector<float> inv_freq;
    if (freqs) { // as the rope primitive reads them
      std::vector<float> held;
      const float* f = dense_rows(*freqs, held);
      inv_freq.resize(p.rope_dims / 2);
      for (int i = 0; i < p.rope_dims / 2; ++i) {
        inv_freq[i] = 1.0f / f[i];
      }
    } else {
      inv_freq = rope_inv_freq(p.base, p.rope_dims / 2);
    }
    std::vector<float> wq, wk;
    heads(jq.out, dense_rows(qn, wq), qo, B, L, p.heads, D, positions, each, inv_freq, p);
    if (!has_kv) {
      return;
    }
    heads(jk.out, dense_rows(*kn, wk), ko, B, L, p.kv_heads, D, positions, each, inv_freq, p);
    if (p.v_norm) { // each value head normed over D, no weight, as the norm primitive runs it
      const int64_t rows = int64_t(B) * p.kv_heads * L;
      std::vector<int64_t> starts(rows);
      for (int b = 0; b < B; ++b) {
        for (int h = 0; h < p.kv_heads; ++h) {
          for (int t = 0; t < L; ++t) {
            starts[(int64_t(b) * p.kv_heads + h) * L + t] =
                (int64_t(b) * L + t) * jv.N + int64_t(h) * D;
          }
        }
      }
      norm_rows_for(p.isa, jv.out, starts.data(), nullptr, vo, rows, D, p.eps);
      return;
    }
    for (int b = 0; b < B; ++b) {
      for (int h = 0; h < p.kv_heads; ++h) {
        for (int t = 0; t < L; ++t) {
          std::memcpy(vo + ((int64_t(b) * p.kv_heads + h) * L + t) * D,
                      jv.out + (int64_t(b) * L + t) * jv.N + int64_t(h) * D, sizeof(float) * D);
        }
      }
    }
  });
}

void QkvStep::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("qkv_step runs on the CPU only");
}

bool QkvStep::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const QkvStep&>(other).p_;
  const Slots& os = static_cast<const QkvStep&>(other).slots_;
  return p_.heads == o.heads && p_.kv_heads == o.kv_heads && p_.eps == o.eps &&
      p_.x_eps == o.x_eps &&
      p_.rope_dims == o.rope_dims && p_.traditional == o.traditional && p_.base == o.base &&
      p_.scale == o.scale && p_.group_size == o.group_size && p_.bits == o.bits &&
      p_.isa == o.isa && p_.threads == o.threads && p_.v_norm == o.v_norm &&
      slots_.k == os.k && slots_.x_norm == os.x_norm && slots_.freqs == os.freqs;
}

} // namespace mnb
