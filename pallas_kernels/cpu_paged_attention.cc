// Ragged paged attention for CPUs, as an XLA FFI custom call (the CPU serving path).
//
// Same contract as ragged_paged_attention_reference (float32 pools): sequence s owns new tokens
// cu_q_lens[s]:cu_q_lens[s+1] of the flat batch and kv_lens[s] keys (new ones included); its new
// token i sees key positions <= kv_len - q_len + i (and within the sliding window, if any); tokens
// past cu_q_lens[S] return zeros. Keys and values are read in place from the pools, a page at a
// time, with an online softmax: nothing is gathered or copied, which is what the XLA formulation
// spends most of its time on. Work units (sequence, block of query tokens, all KV heads) are shared
// between the caller and XLA's intra-op thread pool, and, for calls that read many keys, threads of
// this library's own on the cores XLA's pool leaves out (EngineArgs.cpu_reserved_cores keeps a core
// for the serving frontend: small batches leave it alone, large ones read their K/V on it too).

#include <algorithm>
#include <atomic>
#include <cmath>
#include <sched.h>
#include <unistd.h>

#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <deque>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kQueryBlock = 8;  // new tokens of one sequence per work unit (prefill chunks)
constexpr int64_t kUnitsPerGrab = 4;  // units a worker takes at once from the shared counter
constexpr int64_t kSpareMinKeys = 8192;  // keys a call reads before it takes the spare cores too
constexpr int64_t kLanes = 8;  // keys scored at once by one row (a 256-bit register of floats)
constexpr int64_t kTransposeRows = 3;  // rows per KV head from which a page's keys are transposed
constexpr int64_t kTransposeMaxDim = 32;  // head dims up to which that beats dot products

struct Unit {
  int32_t seq;
  int32_t first;  // flat index of the unit's first new token
  int32_t count;  // its new tokens
};

struct Job {
  const float* q;
  const float* k;
  const float* v;
  const int32_t* block_tables;
  const int32_t* kv_lens;
  const int32_t* cu;
  float* out;
  int64_t heads, kv_heads, group, dim, num_blocks, block_size, max_blocks;
  float scale, softcap;
  int64_t window;
  std::vector<Unit> units;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  std::mutex mu;
  std::condition_variable finished;
};

// exp(x) for x <= 0 (a score minus the running maximum) as plain arithmetic, so the loop over a page's
// keys vectorizes (std::exp is a scalar call): x = n ln2 + r with |r| <= ln2 / 2, exp(r) by its Taylor
// series to r^6 (relative error ~2e-7), 2^n in the exponent bits. Below -87 it returns exp(-87) ~ 1.6e-38.
inline float ExpNonPositive(float x) {
  x = std::max(x, -87.f);
  const float n = std::floor(x * 1.44269504f + 0.5f);
  const float r = (x - n * 0.693145752f) - n * 1.42860677e-6f;
  const float p =
      1.f + r * (1.f + r * (0.5f + r * (1.f / 6 + r * (1.f / 24 + r * (1.f / 120 + r * (1.f / 720))))));
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// What a worker reuses between units: per-row floats (scaled queries, accumulators, softmax state, one
// page's scores), one page's keys of one head transposed, and per-row positions, set once a unit.
inline float Dot(const float* a, const float* b, int64_t n) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

struct Scratch {
  std::vector<float> f, kt;
  std::vector<int64_t> q_off, k_off, pos;
};

// One unit: rows (KV head, new token, query head of its group) attend over their sequence's pages.
// With several rows per KV head (prefill chunks, large query groups), each page's keys of a head are
// transposed to [dim, keys] once, and a row's scores for 8 keys are dim vector FMAs into one register
// (a dot product per key and row, with its horizontal sum, cost ~50 cycles a query-key pair at head
// dim 8); with one or two rows (decode) the transpose would cost more than it saves, so they take dot
// products. Values are then added row by row, a key at a time.
void RunUnit(const Job& job, const Unit& u, Scratch& scratch) {
  const int64_t g = job.group, d = job.dim, bs = job.block_size;
  const int64_t per_head = u.count * g;  // rows of one KV head
  const int64_t rows = job.kv_heads * per_head;
  const int32_t q_len = job.cu[u.seq + 1] - job.cu[u.seq];
  const int32_t kv_len = job.kv_lens[u.seq];
  const int64_t first_pos = int64_t{kv_len} - q_len + (u.first - job.cu[u.seq]);
  const int64_t max_pos = first_pos + u.count - 1;
  const int64_t last_pos = std::min<int64_t>(max_pos, job.max_blocks * bs - 1);
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  const bool transpose = per_head >= kTransposeRows && d <= kTransposeMaxDim;
  const int64_t padded = (bs + kLanes - 1) / kLanes * kLanes;  // a page's keys, padded to whole registers
  scratch.f.resize(rows * (2 * d + 2 + padded));
  if (transpose) scratch.kt.assign(d * padded, 0.f);
  float* acc = scratch.f.data();
  float* m = acc + rows * d;
  float* l = m + rows;
  float* s = l + rows;  // [rows, padded] scores of one page, then their weights
  float* qs = s + rows * padded;  // [rows, d] queries times the scale (transposed keys only)
  float* kt = scratch.kt.data();  // [d, padded] one page's keys of one head
  std::fill(acc, acc + rows * d, 0.f);
  std::fill(m, m + rows, kNegInf);
  std::fill(l, l + rows, 0.f);
  if (last_pos < 0) return;
  // Row r: KV head r / per_head, new token (r % per_head) / g, query head r % g of the group.
  scratch.q_off.resize(rows);
  scratch.k_off.resize(rows);
  scratch.pos.resize(rows);
  int64_t* q_off = scratch.q_off.data();
  int64_t* k_off = scratch.k_off.data();
  int64_t* pos = scratch.pos.data();
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t t = (r % per_head) / g;
    q_off[r] = ((u.first + t) * job.heads + (r / per_head) * g + r % g) * d;
    k_off[r] = (r / per_head) * d;
    pos[r] = first_pos + t;
    if (transpose) {
      for (int64_t i = 0; i < d; ++i) qs[r * d + i] = job.q[q_off[r] + i] * job.scale;
    }
  }
  int64_t lo = 0;
  if (job.window > 0) lo = std::max<int64_t>(0, first_pos - job.window + 1);
  const int32_t* table = job.block_tables + int64_t{u.seq} * job.max_blocks;
  const int64_t stride = job.kv_heads * d;  // between consecutive keys of one head
  for (int64_t page = lo / bs; page <= last_pos / bs; ++page) {
    const int64_t block = std::clamp<int64_t>(table[page], 0, job.num_blocks - 1);
    const int64_t keys = std::min<int64_t>(bs, last_pos - page * bs + 1);
    const int64_t start = page * bs;
    const float* kp = job.k + block * bs * job.kv_heads * d;
    const float* vp = job.v + block * bs * job.kv_heads * d;
    if (transpose) {
      for (int64_t h = 0; h < job.kv_heads; ++h) {
        for (int64_t j = 0; j < keys; ++j) {
          const float* key = kp + j * stride + h * d;
          for (int64_t i = 0; i < d; ++i) kt[i * padded + j] = key[i];
        }
        for (int64_t r = h * per_head; r < (h + 1) * per_head; ++r) {
          const float* qr = qs + r * d;
          for (int64_t j0 = 0; j0 < keys; j0 += kLanes) {
            float a[kLanes] = {};
            for (int64_t i = 0; i < d; ++i) {
              const float qi = qr[i];
              const float* ki = kt + i * padded + j0;
#pragma omp simd
              for (int64_t jj = 0; jj < kLanes; ++jj) a[jj] += qi * ki[jj];
            }
            std::copy(a, a + kLanes, s + r * padded + j0);
          }
        }
      }
    } else {
      for (int64_t j = 0; j < keys; ++j) {
        const float* key = kp + j * stride;
        for (int64_t r = 0; r < rows; ++r) s[r * padded + j] = Dot(job.q + q_off[r], key + k_off[r], d) * job.scale;
      }
    }
    if (job.softcap > 0.f) {
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t j = 0; j < keys; ++j) s[r * padded + j] = job.softcap * std::tanh(s[r * padded + j] / job.softcap);
      }
    }
    // every row sees every key of the page unless the page passes a row's position or leaves its window
    const bool masked = start + keys - 1 > first_pos || (job.window > 0 && max_pos - start >= job.window);
    if (masked) {
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t j = 0; j < keys; ++j) {
          if (start + j > pos[r] || (job.window > 0 && pos[r] - (start + j) >= job.window)) s[r * padded + j] = kNegInf;
        }
      }
    }
    for (int64_t r = 0; r < rows; ++r) {
      float* sr = s + r * padded;
      const float page_max = *std::max_element(sr, sr + keys);
      const float m_new = std::max(m[r], page_max);
      if (m_new == kNegInf) {  // nothing visible yet
        std::fill(sr, sr + keys, 0.f);
        continue;
      }
      const float corr = m[r] == kNegInf ? 0.f : ExpNonPositive(m[r] - m_new);
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t j = 0; j < keys; ++j) {
        const float w = sr[j] == kNegInf ? 0.f : ExpNonPositive(sr[j] - m_new);
        sr[j] = w;
        sum += w;
      }
      float* ar = acc + r * d;
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) ar[i] *= corr;
      m[r] = m_new;
      l[r] = l[r] * corr + sum;
    }
    if (transpose && d % kLanes == 0) {  // 8 of a row's sums in one register across the page's keys
      for (int64_t r = 0; r < rows; ++r) {
        const float* sr = s + r * padded;
        float* ar = acc + r * d;
        for (int64_t i0 = 0; i0 < d; i0 += kLanes) {
          float a[kLanes];
          std::copy(ar + i0, ar + i0 + kLanes, a);
          for (int64_t j = 0; j < keys; ++j) {
            const float w = sr[j];
            if (masked && w == 0.f) continue;  // a key it does not see (its value may be another step's, or unset)
            const float* vr = vp + j * stride + k_off[r] + i0;
#pragma omp simd
            for (int64_t ii = 0; ii < kLanes; ++ii) a[ii] += w * vr[ii];
          }
          std::copy(a, a + kLanes, ar + i0);
        }
      }
    } else {  // a page's values stream through once, each key's row added to every row that sees it
      for (int64_t j = 0; j < keys; ++j) {
        const float* value = vp + j * stride;
        for (int64_t r = 0; r < rows; ++r) {
          const float w = s[r * padded + j];
          if (masked && w == 0.f) continue;
          const float* vr = value + k_off[r];
          float* ar = acc + r * d;
#pragma omp simd
          for (int64_t i = 0; i < d; ++i) ar[i] += w * vr[i];
        }
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    float* o = job.out + q_off[r];
    const float inv = l[r] > 0.f ? 1.f / l[r] : 0.f;
#pragma omp simd
    for (int64_t i = 0; i < d; ++i) o[i] = acc[r * d + i] * inv;
  }
}

// Take units from the shared counter until none are left.
void Work(Job& job) {
  Scratch scratch;
  const int64_t n = static_cast<int64_t>(job.units.size());
  for (;;) {
    const int64_t start = job.next.fetch_add(kUnitsPerGrab);
    if (start >= n) return;
    const int64_t stop = std::min(n, start + kUnitsPerGrab);
    for (int64_t i = start; i < stop; ++i) RunUnit(job, job.units[i], scratch);
    if (job.done.fetch_add(stop - start) + (stop - start) == n) {
      std::lock_guard<std::mutex> lock(job.mu);
      job.finished.notify_all();
    }
  }
}

// Threads of this library's own, one per core the process may run on beyond XLA's pool; started on
// first use and kept for the life of the process (never destroyed: exiting does not wait on them).
// The cores are the main thread's (the engine core starts XLA's threads bound to the cores it does
// not reserve, and the threads XLA runs this kernel on inherit that binding; these may run anywhere
// the process may).
class SpareThreads {
 public:
  static SpareThreads& Get() {
    static SpareThreads* threads = new SpareThreads();
    return *threads;
  }

  // The main thread's cores, minus XLA's pool size.
  static int64_t Spare(int64_t pool_threads) {
    cpu_set_t set;
    const int64_t cpus = MainCores(&set) ? CPU_COUNT(&set) : std::thread::hardware_concurrency();
    return std::max<int64_t>(0, cpus - pool_threads);
  }

  void Run(int64_t n, const std::function<void()>& task) {
    std::lock_guard<std::mutex> lock(mu_);
    for (; started_ < n; ++started_) std::thread([this] { Loop(); }).detach();
    for (int64_t i = 0; i < n; ++i) tasks_.push_back(task);
    ready_.notify_all();
  }

 private:
  static bool MainCores(cpu_set_t* set) { return sched_getaffinity(getpid(), sizeof(*set), set) == 0; }

  void Loop() {
    cpu_set_t set;
    if (MainCores(&set)) sched_setaffinity(0, sizeof(set), &set);
    for (;;) {
      std::function<void()> task;
      {
        std::unique_lock<std::mutex> lock(mu_);
        ready_.wait(lock, [this] { return !tasks_.empty(); });
        task = std::move(tasks_.front());
        tasks_.pop_front();
      }
      task();
    }
  }

  std::mutex mu_;
  std::condition_variable ready_;
  std::deque<std::function<void()>> tasks_;
  int64_t started_ = 0;
};

ffi::Error RaggedPagedAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k_pool,
                                ffi::Buffer<ffi::F32> v_pool, ffi::Buffer<ffi::S32> block_tables,
                                ffi::Buffer<ffi::S32> cu_q_lens, ffi::Buffer<ffi::S32> kv_lens, float scale,
                                int64_t window, float softcap, ffi::ResultBuffer<ffi::F32> out) {
  auto qd = q.dimensions();
  auto kd = k_pool.dimensions();
  auto td = block_tables.dimensions();
  auto vd = v_pool.dimensions();
  if (qd.size() != 3 || kd.size() != 4 || vd.size() != 4 || td.size() != 2 ||
      cu_q_lens.element_count() != td[0] + 1 || kv_lens.element_count() != td[0] || kd[3] != qd[2] ||
      !std::equal(kd.begin(), kd.end(), vd.begin()) || kd[0] <= 0 || kd[1] <= 0) {
    return ffi::Error::InvalidArgument("ragged paged attention: inconsistent operand shapes");
  }
  auto job = std::make_shared<Job>();
  job->q = q.typed_data();
  job->k = k_pool.typed_data();
  job->v = v_pool.typed_data();
  job->block_tables = block_tables.typed_data();
  job->kv_lens = kv_lens.typed_data();
  job->cu = cu_q_lens.typed_data();
  job->out = out->typed_data();
  const int64_t n = qd[0];
  job->heads = qd[1];
  job->dim = qd[2];
  job->num_blocks = kd[0];
  job->block_size = kd[1];
  job->kv_heads = kd[2];
  if (job->kv_heads <= 0 || job->heads % job->kv_heads) {
    return ffi::Error::InvalidArgument("ragged paged attention: query heads must be a multiple of KV heads");
  }
  job->group = job->heads / job->kv_heads;
  job->max_blocks = td[1];
  job->scale = scale;
  job->window = window;
  job->softcap = softcap;
  std::memset(job->out, 0, sizeof(float) * out->element_count());
  const int64_t seqs = td[0];
  for (int64_t s = 0; s < seqs; ++s) {
    if (job->cu[s + 1] < job->cu[s] || job->cu[s] < 0) {
      return ffi::Error::InvalidArgument("ragged paged attention: cu_q_lens must be non-decreasing from 0");
    }
    const int64_t a = std::min<int64_t>(job->cu[s], n), b = std::min<int64_t>(job->cu[s + 1], n);
    for (int64_t t = a; t < b; t += kQueryBlock) {
      job->units.push_back(
          {static_cast<int32_t>(s), static_cast<int32_t>(t), static_cast<int32_t>(std::min(kQueryBlock, b - t))});
    }
  }
  const int64_t units = static_cast<int64_t>(job->units.size());
  if (units == 0) return ffi::Error::Success();
  const int64_t grabs = (units + kUnitsPerGrab - 1) / kUnitsPerGrab;
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), grabs) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([job] { Work(*job); });
  int64_t keys = 0;
  for (int64_t s = 0; s < seqs; ++s) keys += job->kv_lens[s];
  if (keys >= kSpareMinKeys) {
    const int64_t spare = std::min(SpareThreads::Spare(pool.num_threads()), grabs - 1 - helpers);
    if (spare > 0) SpareThreads::Get().Run(spare, [job] { Work(*job); });
  }
  Work(*job);
  std::unique_lock<std::mutex> lock(job->mu);
  job->finished.wait(lock, [&] { return job->done.load() == units; });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxinfraRaggedPagedAttention, RaggedPagedAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("window")
                                  .Attr<float>("softcap")
                                  .Ret<ffi::Buffer<ffi::F32>>());
