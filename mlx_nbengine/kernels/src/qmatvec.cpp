#include "qmatvec.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <vector>

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"

#include "qgemm.h"
#include "strided.h"
#include "workers.h"

namespace mnb {

ScaleType scale_type(mx::Dtype t) {
  if (t == mx::float32) {
    return ScaleType::f32;
  }
  if (t == mx::float16) {
    return ScaleType::f16;
  }
  if (t == mx::bfloat16) {
    return ScaleType::bf16;
  }
  throw std::invalid_argument("quantized_matvec: scales must be float32, float16 or bfloat16");
}

RowsFn rows_for(Isa isa, const QJob& job) {
  RowsFn fn = nullptr;
  if (isa == Isa::avx512) {
    fn = avx512_rows(job);
  }
  if (fn == nullptr && isa != Isa::portable) {
    fn = avx2_rows(job);
  }
  return fn != nullptr ? fn : portable_rows(job);
}

mx::array contiguous_input(const mx::array& a, mx::Stream s) {
  if (a.is_available() && a.flags().row_contiguous) {
    return a;
  }
  return mx::contiguous(a, false, s);
}

int product_threads(const QJob& job, int threads) {
  // Weights of a small matrix are read faster than threads wake.
  const int64_t bytes = int64_t(job.N) * job.K * job.bits / 8;
  return bytes < (int64_t(1) << 18) ? 1 : threads;
}

int product_chunk(int N, int threads) {
  // Chunks several times more than threads: a thread slowed by other load takes fewer.
  return std::max(16, (N + threads * 8 - 1) / (threads * 8));
}

void rows_product(QJob job, Isa isa, int threads) {
  const RowsFn fn = rows_for(isa, job);
  QActivations xq;
  if (fn != portable_rows(job)) {
    xq.prepare(job);
  }
  const int t = product_threads(job, threads);
  workers().run(t, job.N, product_chunk(job.N, t), [&](int n0, int n1) { fn(job, n0, n1); });
}

void QActivations::prepare(QJob& job) {
  const int M = job.M, K = job.K, group = job.group, G = K / group;
  const int P = (G + 15) / 16 * 16;
  xq.assign(size_t(M) * K, 0);
  xscale.assign(size_t(M) * P, 0.0f);
  xsum.assign(size_t(M) * P, 0.0f);
  std::vector<int16_t> rounded(static_cast<size_t>(group));
  for (int m = 0; m < M; ++m) {
    for (int g = 0; g < G; ++g) {
      const float* x = job.x + int64_t(m) * K + int64_t(g) * group;
      round_group(x, group, rounded.data(), xscale[size_t(m) * P + g], xsum[size_t(m) * P + g]);
      int16_t* q = xq.data() + int64_t(m) * K + int64_t(g) * group;
      for (int i = 0; i < group; ++i) {
        // 4-bit rows unpack each 32 values even elements first, then odd ones.
        const int at = job.bits == 4 ? (i & ~31) + ((i & 31) % 2) * 16 + (i & 31) / 2 : i;
        q[at] = rounded[i];
      }
    }
  }
  job.xq = xq.data();
  job.xscale = xscale.data();
  job.xsum = xsum.data();
  job.padded_groups = P;
}

Isa usable(Isa isa) {
  if (isa == Isa::avx512 && !cpu_has_avx512()) {
    isa = Isa::avx2;
  }
  if (isa == Isa::avx2 && !cpu_has_avx2()) {
    isa = Isa::portable;
  }
  return isa;
}

mx::array quantized_matvec(
    const mx::array& x,
    const mx::array& w,
    const mx::array& scales,
    const mx::array& biases,
    int group_size,
    int bits,
    Isa isa,
    int threads,
    LongProducts long_products) {
  if (bits != 4 && bits != 8) {
    throw std::invalid_argument("quantized_matvec: bits must be 4 or 8");
  }
  if (x.ndim() < 1 || w.ndim() != 2 || w.dtype() != mx::uint32) {
    throw std::invalid_argument("quantized_matvec: w must be a 2-D uint32 array");
  }
  const int K = x.shape(-1);
  const int N = w.shape(0);
  if (int64_t(w.shape(1)) * 32 / bits != K || K % group_size != 0 ||
      scales.shape() != mx::Shape{N, K / group_size} || biases.shape() != scales.shape()) {
    throw std::invalid_argument("quantized_matvec: x, w, scales and biases do not fit together");
  }
  scale_type(scales.dtype());
  const int M = int(x.size() / K);
  if (M < 1 ||
      (M > kMaxRows && !qgemm_available(usable(isa)) && !int8_products(long_products))) {
    throw std::invalid_argument("quantized_matvec: x must have 1 to 64 rows");
  }
  auto s = mx::default_stream(mx::Device::cpu);
  auto shape = x.shape();
  shape.back() = N;
  std::vector<mx::array> inputs{
      x, contiguous_input(w, s), contiguous_input(scales, s), contiguous_input(biases, s)};
  auto primitive = std::make_shared<QuantizedMatVec>(
      s, group_size, bits, usable(isa), std::max(1, threads), long_products);
  if (x.dtype() == mx::float32) {
    // No reshape, copy or cast around it: eval_cpu reads x as M x K (copying only a view
    // whose rows are not contiguous), so a decode step's product is one graph node.
    return mx::array(shape, mx::float32, primitive, std::move(inputs));
  }
  inputs[0] = mx::astype(x, mx::float32, s);
  return mx::astype(mx::array(shape, mx::float32, primitive, std::move(inputs)), x.dtype(), s);
}

void QuantizedMatVec::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  const auto& w = inputs[1];
  const auto& scales = inputs[2];
  const auto& biases = inputs[3];
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (const auto& a : inputs) {
    encoder.set_input_array(a);
  }
  encoder.set_output_array(out);
  const auto& x = inputs[0];
  const int K = x.shape(-1);
  QJob job{
      x.data<float>(),
      w.data<uint8_t>(),
      scales.data<void>(),
      biases.data<void>(),
      out.data<float>(),
      int(x.size() / K),
      K,
      w.shape(0),
      group_size_,
      bits_,
      scale_type(scales.dtype())};
  const int threads = product_threads(job, threads_);
  const bool gather = !x.flags().row_contiguous;
  const Isa isa = isa_;
  const int all_threads = threads_;
  const LongProducts long_products = long_products_;
  encoder.dispatch([job, isa, threads, all_threads, long_products, gather, x]() mutable {
    std::vector<float> dense;
    if (gather) { // a view whose rows are not contiguous: read it as M x K row-major
      std::vector<int64_t> starts;
      const float* rows = rows_of(x, dense, starts);
      if (rows != dense.data()) { // rows apart, each contiguous: copy them together
        dense.resize(x.size());
        for (size_t r = 0; r < starts.size(); ++r) {
          std::copy_n(rows + starts[r], job.K, dense.data() + r * job.K);
        }
      }
      job.x = dense.data();
    }
    if ((job.M > kBlockRows && qgemm_available(isa)) ||
        (job.M > kMaxRows && int8_products(long_products))) { // a prefill step: a GEMM
      qgemm(job, isa, all_threads, long_products);
      return;
    }
    // Blocks of at most kBlockRows rows, each with its kernel and its int16 x.
    const int blocks = (job.M + kBlockRows - 1) / kBlockRows;
    std::vector<QJob> jobs(blocks, job);
    std::vector<RowsFn> fns(blocks);
    std::vector<QActivations> xq(blocks);
    for (int i = 0; i < blocks; ++i) {
      QJob& b = jobs[i];
      b.M = std::min(kBlockRows, job.M - i * kBlockRows);
      b.x = job.x + int64_t(i) * kBlockRows * job.K;
      b.out = job.out + int64_t(i) * kBlockRows * job.N;
      fns[i] = rows_for(isa, b);
      if (fns[i] == nullptr) {
        throw std::runtime_error("quantized_matvec: no kernel for this shape");
      }
      if (fns[i] != portable_rows(b)) {
        xq[i].prepare(b);
      }
    }
    const int chunk = product_chunk(job.N, threads);
    workers().run(threads, job.N, chunk, [&](int n0, int n1) {
      for (int i = 0; i < blocks; ++i) {
        fns[i](jobs[i], n0, n1);
      }
    });
  });
}

void QuantizedMatVec::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("quantized_matvec runs on the CPU only");
}

bool QuantizedMatVec::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const QuantizedMatVec&>(other);
  return group_size_ == o.group_size_ && bits_ == o.bits_ && isa_ == o.isa_ &&
      threads_ == o.threads_ && long_products_ == o.long_products_;
}

} // namespace mnb
