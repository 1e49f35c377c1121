// The worker threads our CPU kernels split their work over (see Workers).

#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace mnb {

// The kernels' one set of worker threads (the quantized products split their output
// columns, attention its softmax rows). A call announces itself, does its share and returns
// as soon as every chunk is done and no worker is still inside it: a worker the OS has not
// scheduled yet (a busy machine) never holds a call up, since the caller takes the chunks
// nobody claimed. Between calls workers spin for up to kSpin (a decode step's products
// come a few tens of microseconds apart, and waking a sleeping thread costs about as much),
// then sleep. Calls come one at a time (the CPU stream's thread); a lock keeps them so.
class Workers {
 public:
  static constexpr std::chrono::microseconds kSpin{300};

  using Task = std::function<void(int n0, int n1)>;

  // The workers stop spinning now and sleep until the next call: say so before handing the
  // cores to another pool of threads (the BLAS's), which a spinning worker would slow.
  void rest() {
    nap_.store(true, std::memory_order_relaxed);
  }

  // task(n0, n1) for every `chunk`-sized part of [0, N), on up to `threads` threads.
  void run(int threads, int N, int chunk, const Task& task) {
    nap_.store(false, std::memory_order_relaxed);
    chunk = std::max(1, chunk);
    if (threads <= 1 || N <= chunk) {
      task(0, N);
      return;
    }
    std::lock_guard<std::mutex> one_call(call_);
    ensure(threads - 1);
    {
      // Workers read the call's fields under this lock, with the epoch that announces them.
      std::lock_guard<std::mutex> lock(m_);
      task_ = &task;
      n_ = N;
      chunk_ = chunk;
      helpers_ = threads - 1;
      next_.store(0, std::memory_order_relaxed);
      closed_.store(false, std::memory_order_seq_cst);
      epoch_.fetch_add(1, std::memory_order_release);
    }
    wake_.notify_all();
    work();
    // No worker joins from here on; wait for those inside (each finishes its chunk).
    closed_.store(true, std::memory_order_seq_cst);
    while (inside_.load(std::memory_order_seq_cst) != 0) {
      std::this_thread::yield();
    }
  }

 private:
  void ensure(int helpers) {
    while (int(workers_.size()) < helpers) {
      const int index = int(workers_.size());
      const uint64_t seen = epoch_.load(std::memory_order_acquire);
      workers_.emplace_back([this, index, seen] { loop(index, seen); });
      workers_.back().detach(); // lives as long as the process
    }
  }

  void work() {
    for (;;) {
      const int n0 = next_.fetch_add(chunk_, std::memory_order_relaxed);
      if (n0 >= n_) {
        return;
      }
      (*task_)(n0, std::min(n_, n0 + chunk_));
    }
  }

  void loop(int index, uint64_t seen) {
    for (;;) {
      const auto give_up = std::chrono::steady_clock::now() + kSpin;
      while (epoch_.load(std::memory_order_acquire) == seen &&
             !nap_.load(std::memory_order_relaxed) &&
             std::chrono::steady_clock::now() < give_up) {
        for (int i = 0; i < 32; ++i) {
#if defined(__x86_64__)
          __builtin_ia32_pause();
#endif
        }
      }
      bool mine;
      {
        std::unique_lock<std::mutex> lock(m_);
        wake_.wait(lock, [&] { return epoch_.load(std::memory_order_acquire) != seen; });
        seen = epoch_.load(std::memory_order_acquire);
        mine = index < helpers_;
      }
      if (!mine) {
        continue;
      }
      // Enter the call unless its caller has already closed it (then it did our share).
      inside_.fetch_add(1, std::memory_order_seq_cst);
      if (!closed_.load(std::memory_order_seq_cst) &&
          epoch_.load(std::memory_order_acquire) == seen) {
        work();
      }
      inside_.fetch_sub(1, std::memory_order_seq_cst);
    }
  }

  std::mutex call_;
  std::mutex m_;
  std::condition_variable wake_;
  std::vector<std::thread> workers_;
  std::atomic<uint64_t> epoch_{0};
  std::atomic<int> next_{0};
  std::atomic<int> inside_{0};
  std::atomic<bool> closed_{true};
  std::atomic<bool> nap_{false};
  const Task* task_ = nullptr;
  int n_ = 0;
  int chunk_ = 16;
  int helpers_ = 0;
};

// The process's workers (never destroyed: their threads outlive static destructors).
inline Workers& workers() {
  static Workers* w = new Workers();
  return *w;
}

} // namespace mnb
