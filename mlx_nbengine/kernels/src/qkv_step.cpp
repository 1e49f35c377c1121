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
    const Quantized& k,
    const Quantized& v,
    const mx::array& q_norm,
    const mx::array& k_norm,
    const mx::array& offset,
    const std::optional<mx::array>& x_norm,
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
  const int D = q.w.shape(0) / p.heads;
  if (K % p.group_size != 0) {
    throw std::invalid_argument("qkv_step: x's features must be whole groups");
  }
  check_quantized(q, p.heads * D, K, p.group_size, p.bits, "qkv_step", "query");
  check_quantized(k, p.kv_heads * D, K, p.group_size, p.bits, "qkv_step", "key");
  check_quantized(v, p.kv_heads * D, K, p.group_size, p.bits, "qkv_step", "value");
  for (const mx::array* w : {&q_norm, &k_norm}) {
    if (w->dtype() != mx::float32 || w->ndim() != 1 || w->shape(0) != D) {
      throw std::invalid_argument("qkv_step: the norms' weights must be float32 [head dim]");
    }
  }
  if (x_norm && (x_norm->dtype() != mx::float32 || x_norm->ndim() != 1 || x_norm->shape(0) != K)) {
    throw std::invalid_argument("qkv_step: the input norm's weight must be float32 [features]");
  }
  if (p.rope_dims <= 0 || p.rope_dims % 2 != 0 || p.rope_dims > D) {
    throw std::invalid_argument("qkv_step: RoPE's dims must be even and at most the head dim");
  }
  if (offset.ndim() > 1 || (offset.ndim() == 1 && offset.size() != 1 && int(offset.size()) != B)) {
    throw std::invalid_argument("qkv_step: offset must be a scalar or one per batch row");
  }
  auto s = mx::default_stream(mx::Device::cpu);
  std::vector<mx::array> inputs{x};
  for (const Quantized* m : {&q, &k, &v}) {
    inputs.push_back(contiguous_input(m->w, s));
    inputs.push_back(contiguous_input(m->scales, s));
    inputs.push_back(contiguous_input(m->biases, s));
  }
  inputs.push_back(q_norm);
  inputs.push_back(k_norm);
  inputs.push_back(mx::astype(offset, mx::int32, s));
  if (x_norm) {
    inputs.push_back(*x_norm);
  }
  QkvParams held = p;
  held.isa = usable(p.isa);
  held.threads = std::max(1, p.threads);
  return mx::array::make_arrays(
      {{B, p.heads, L, D}, {B, p.kv_heads, L, D}, {B, p.kv_heads, L, D}},
      {mx::float32, mx::float32, mx::float32},
      std::make_shared<QkvStep>(s, held),
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
  QJob jq = quantized_job(inputs, 1, nullptr, nullptr, M, K, p_.group_size, p_.bits);
  QJob jk = quantized_job(inputs, 4, nullptr, nullptr, M, K, p_.group_size, p_.bits);
  QJob jv = quantized_job(inputs, 7, nullptr, nullptr, M, K, p_.group_size, p_.bits);
  float* qo = outputs[0].data<float>();
  float* ko = outputs[1].data<float>();
  float* vo = outputs[2].data<float>();
  const QkvParams p = p_;
  const mx::array qn = inputs[10], kn = inputs[11], offset = inputs[12];
  const std::optional<mx::array> xn =
      inputs.size() > 13 ? std::optional<mx::array>(inputs[13]) : std::nullopt;
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
    // The three matrices as one of jq.N + jk.N + jv.N output rows, split over the workers.
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
    const std::vector<float> inv_freq = rope_inv_freq(p.base, p.rope_dims / 2);
    std::vector<float> wq, wk;
    heads(jq.out, dense_rows(qn, wq), qo, B, L, p.heads, D, positions, each, inv_freq, p);
    heads(jk.out, dense_rows(kn, wk), ko, B, L, p.kv_heads, D, positions, each, inv_freq, p);
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
  return p_.heads == o.heads && p_.kv_heads == o.kv_heads && p_.eps == o.eps &&
      p_.x_eps == o.x_eps &&
      p_.rope_dims == o.rope_dims && p_.traditional == o.traditional && p_.base == o.base &&
      p_.scale == o.scale && p_.group_size == o.group_size && p_.bits == o.bits &&
      p_.isa == o.isa && p_.threads == o.threads;
}

} // namespace mnb
