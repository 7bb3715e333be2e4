// Paged decode attention for CPU (torch.ops.hpu_serve.decode_attention): one query token
// per row against its sequence's cached keys/values, read in place from their blocks (the
// PyTorch path gathers the blocks into a copy first). Prefill uses it too, one row per
// prompt token with causal per-row lengths; consecutive rows of one sequence then run four
// at a time, so each key/value read serves four tokens (an 8,000-token prompt in 512-token
// chunks: 28.0 s -> 20.9 s end to end on SmolLM2, 2 cores).
//
// Keys are stored transposed within each block, [blocks, kv_heads, head_dim, block_size], so
// 16 tokens' scores come from one vector multiply-add per head dim, without horizontal sums;
// values keep [blocks, kv_heads, block_size, head_dim].

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <vector>

#include "kernel_utils.h"

namespace hpu_serve {
namespace {

// Attention of one (row, kv head): its query heads against the row's cached keys/values,
// block by block, with an online softmax in fp32. Each key and value is read once for all
// the query heads that share it.

// The softmax part of one block for query head g: probs p[0..n) hold the scores on entry
// and exp(score - running max) on exit; the running sum and the accumulated output (dim
// floats) are rescaled when the max grows.
inline void softmax_block(float* p, int64_t n, float& run_max, float& run_sum, float* acc,
                          int64_t dim) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  float block_max = neg_inf;
#pragma omp simd reduction(max : block_max)
  for (int64_t j = 0; j < n; ++j) block_max = std::max(block_max, p[j]);
  const float new_max = std::max(run_max, block_max);
  // 0 on the first block (run_max is -inf there), 1 while the max holds.
  const float correction = run_max == neg_inf ? 0.f : fast_exp(run_max - new_max);
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < n; ++j) {
    p[j] = fast_exp(p[j] - new_max);
    sum += p[j];
  }
  run_sum = run_sum * correction + sum;
  run_max = new_max;
  if (correction != 1.f) {
#pragma omp simd
    for (int64_t d = 0; d < dim; ++d) acc[d] *= correction;
  }
}

// Any head size, group count and block size: runtime loops (the fallback).
template <typename T>
struct GenericHead {
  int64_t dim, groups, block;
  std::vector<float> q, acc, probs, run_max, run_sum;

  GenericHead(int64_t dim_, int64_t groups_, int64_t block_)
      : dim(dim_), groups(groups_), block(block_), q(groups_ * dim_), acc(groups_ * dim_),
        probs(groups_ * block_), run_max(groups_), run_sum(groups_) {}

  void start(const T* query, int64_t head_stride, float scale) {
    for (int64_t g = 0; g < groups; ++g) {
      for (int64_t d = 0; d < dim; ++d) q[g * dim + d] = load(query + g * head_stride, d) * scale;
    }
    std::fill(acc.begin(), acc.end(), 0.f);
    std::fill(run_max.begin(), run_max.end(), -std::numeric_limits<float>::infinity());
    std::fill(run_sum.begin(), run_sum.end(), 0.f);
  }

  // n tokens of one block: keys_t [dim, block], values [block, dim].
  void block_step(const T* keys_t, const T* values, int64_t n) {
    for (int64_t g = 0; g < groups; ++g) {
      float* p = probs.data() + g * block;
      std::fill(p, p + n, 0.f);
      for (int64_t d = 0; d < dim; ++d) {
        const float qd = q[g * dim + d];
        for (int64_t j = 0; j < n; ++j) p[j] += qd * load(keys_t + d * block, j);
      }
      softmax_block(p, n, run_max[g], run_sum[g], acc.data() + g * dim, dim);
      float* a = acc.data() + g * dim;
      for (int64_t j = 0; j < n; ++j) {
        for (int64_t d = 0; d < dim; ++d) a[d] += p[j] * load(values + j * dim, d);
      }
    }
  }

  void finish(T* out) {
    for (int64_t g = 0; g < groups; ++g) {
      // An empty sequence (never scheduled, but cheap to guard) yields zeros, not NaN.
      const float inv = run_sum[g] > 0.f ? 1.f / run_sum[g] : 0.f;
      for (int64_t d = 0; d < dim; ++d) store(out + g * dim, d, acc[g * dim + d] * inv);
    }
  }
};

// The common shapes (G query heads per kv head, head size DIM, blocks of a multiple of 16
// tokens) with G and DIM known at compile time: scores for 16 tokens accumulate in G
// registers from the transposed key block, one widening load per (head dim, 16 tokens);
// outputs accumulate 16 dims at a time in G registers, one widening load per (token, 16
// dims). Each key/value element is loaded and widened once.
template <typename T, int G, int DIM>
struct FastHead {
  int64_t block;
  alignas(64) float q[G][DIM];
  alignas(64) float acc[G][DIM];
  float run_max[G], run_sum[G];
  std::vector<float> probs;

  FastHead(int64_t, int64_t, int64_t block_) : block(block_), probs(G * block_) {}

  void start(const T* query, int64_t head_stride, float scale) {
    for (int g = 0; g < G; ++g) {
#pragma omp simd
      for (int d = 0; d < DIM; ++d) q[g][d] = load(query + g * head_stride, d) * scale;
      std::fill(acc[g], acc[g] + DIM, 0.f);
      run_max[g] = -std::numeric_limits<float>::infinity();
      run_sum[g] = 0.f;
    }
  }

  void block_step(const T* keys_t, const T* values, int64_t n) {
    for (int64_t j0 = 0; j0 < n; j0 += 16) {
      f32x16 s[G] = {};
      for (int d = 0; d < DIM; ++d) {
        const f32x16 k = load16(keys_t + d * block + j0);
        for (int g = 0; g < G; ++g) s[g] += q[g][d] * k;
      }
      for (int g = 0; g < G; ++g) store16(probs.data() + g * block + j0, s[g]);
    }
    for (int g = 0; g < G; ++g) {
      softmax_block(probs.data() + g * block, n, run_max[g], run_sum[g], acc[g], DIM);
    }
    for (int d0 = 0; d0 < DIM; d0 += 16) {
      f32x16 a[G];
      for (int g = 0; g < G; ++g) a[g] = load16(acc[g] + d0);
      for (int64_t j = 0; j < n; ++j) {
        const f32x16 v = load16(values + j * DIM + d0);
        for (int g = 0; g < G; ++g) a[g] += probs[g * block + j] * v;
      }
      for (int g = 0; g < G; ++g) store16(acc[g] + d0, a[g]);
    }
  }

  void finish(T* out) {
    for (int g = 0; g < G; ++g) {
      const float inv = run_sum[g] > 0.f ? 1.f / run_sum[g] : 0.f;
#pragma omp simd
      for (int d = 0; d < DIM; ++d) store(out + g * DIM, d, acc[g][d] * inv);
    }
  }
};

// QT consecutive query tokens of one sequence (the rows of a prompt chunk) against the same
// blocks: each key/value vector loaded serves QT x G query heads, where one row at a time
// reads the whole context once per token. Row t sees n[t] tokens of a block (the tokens
// differ by one position each, so only the last block differs); rows past `rows` have
// zero queries and are never written out.
template <typename T, int G, int DIM, int QT>
struct FastTokens {
  int64_t block;
  int rows = 0;
  alignas(64) float q[QT][G][DIM];
  alignas(64) float acc[QT][G][DIM];
  float run_max[QT][G], run_sum[QT][G];
  std::vector<float> probs;  // [QT][G][block]

  FastTokens(int64_t block_) : block(block_), probs(QT * G * block_) {}

  void start(const T* const* queries, int rows_, int64_t head_stride, float scale) {
    rows = rows_;
    for (int t = 0; t < QT; ++t) {
      for (int g = 0; g < G; ++g) {
        for (int d = 0; d < DIM; ++d) {
          q[t][g][d] = t < rows ? load(queries[t] + g * head_stride, d) * scale : 0.f;
        }
        std::fill(acc[t][g], acc[t][g] + DIM, 0.f);
        run_max[t][g] = -std::numeric_limits<float>::infinity();
        run_sum[t][g] = 0.f;
      }
    }
  }

  void block_step(const T* keys_t, const T* values, const int64_t* n) {
    int64_t nmax = 0;
    for (int t = 0; t < rows; ++t) nmax = std::max(nmax, n[t]);
    for (int64_t j0 = 0; j0 < nmax; j0 += 16) {
      f32x16 s[QT][G] = {};
      for (int d = 0; d < DIM; ++d) {
        const f32x16 k = load16(keys_t + d * block + j0);
        for (int t = 0; t < QT; ++t) {
          for (int g = 0; g < G; ++g) s[t][g] += q[t][g][d] * k;
        }
      }
      for (int t = 0; t < QT; ++t) {
        for (int g = 0; g < G; ++g) store16(probs.data() + (t * G + g) * block + j0, s[t][g]);
      }
    }
    for (int t = 0; t < QT; ++t) {
      const int64_t seen = t < rows ? std::max<int64_t>(n[t], 0) : 0;
      for (int g = 0; g < G; ++g) {
        float* p = probs.data() + (t * G + g) * block;
        if (seen > 0) softmax_block(p, seen, run_max[t][g], run_sum[t][g], acc[t][g], DIM);
        std::fill(p + seen, p + nmax, 0.f);  // past the row's own end: no weight
      }
    }
    for (int d0 = 0; d0 < DIM; d0 += 16) {
      f32x16 a[QT][G];
      for (int t = 0; t < QT; ++t) {
        for (int g = 0; g < G; ++g) a[t][g] = load16(acc[t][g] + d0);
      }
      for (int64_t j = 0; j < nmax; ++j) {
        const f32x16 v = load16(values + j * DIM + d0);
        for (int t = 0; t < QT; ++t) {
          for (int g = 0; g < G; ++g) a[t][g] += probs[(t * G + g) * block + j] * v;
        }
      }
      for (int t = 0; t < QT; ++t) {
        for (int g = 0; g < G; ++g) store16(acc[t][g] + d0, a[t][g]);
      }
    }
  }

  void finish(T* const* outs) {
    for (int t = 0; t < rows; ++t) {
      for (int g = 0; g < G; ++g) {
        const float inv = run_sum[t][g] > 0.f ? 1.f / run_sum[t][g] : 0.f;
#pragma omp simd
        for (int d = 0; d < DIM; ++d) store(outs[t] + g * DIM, d, acc[t][g][d] * inv);
      }
    }
  }
};

// Rows r-1 and r are consecutive tokens of one sequence: the same block table, and one
// more token each.
inline bool same_sequence(const int32_t* tables, const int32_t* lens, int64_t width,
                          int64_t r) {
  return lens[r] == lens[r - 1] + 1 &&
         std::memcmp(tables + r * width, tables + (r - 1) * width, width * sizeof(int32_t)) == 0;
}

// Prompt rows grouped QT consecutive tokens at a time; work items are (group, kv head).
// Returns false (nothing done) when no two rows belong together (decode batches).
template <typename T, int G, int DIM>
bool prompt_attention_impl(const at::Tensor& query, const at::Tensor& k_cache,
                           const at::Tensor& v_cache, const at::Tensor& block_tables,
                           const at::Tensor& seq_lens, double scale, at::Tensor& out) {
  constexpr int QT = 4;
  const int64_t rows = query.size(0);
  const int64_t width = block_tables.size(1);
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  std::vector<int64_t> starts;  // first row of each group, then `rows`
  for (int64_t r = 0; r < rows; ++r) {
    if (r == 0 || r - starts.back() == QT || !same_sequence(tables, lens, width, r)) {
      starts.push_back(r);
    }
  }
  if (static_cast<int64_t>(starts.size()) * 2 > rows) return false;  // mostly lone rows
  starts.push_back(rows);
  const int64_t num_heads = query.size(1);
  const int64_t num_kv_heads = k_cache.size(1);
  const int64_t block = v_cache.size(2);
  const int64_t q_row = query.stride(0);
  const int64_t q_head = query.stride(1);
  const int64_t num_blocks = k_cache.size(0);
  const T* qp = query.data_ptr<T>();
  const T* kc = k_cache.data_ptr<T>();
  const T* vc = v_cache.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const float fscale = static_cast<float>(scale);
  const int64_t num_groups = static_cast<int64_t>(starts.size()) - 1;
  for (int64_t r = 0; r < rows; ++r) {
    TORCH_CHECK(lens[r] >= 0 && lens[r] <= width * block, "seq_len ", lens[r], " of row ", r,
                " exceeds its block table");
  }
  at::parallel_for(0, num_groups * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    FastTokens<T, G, DIM, QT> heads(block);
    FastHead<T, G, DIM> lone(DIM, G, block);  // a row alone (a decode riding in the batch)
    const T* queries[QT];
    T* outs[QT];
    int64_t n[QT];
    for (int64_t item = begin; item < end; ++item) {
      const int64_t first = starts[item / num_kv_heads];
      const int64_t h = item % num_kv_heads;
      const int count = static_cast<int>(starts[item / num_kv_heads + 1] - first);
      if (count == 1) {  // QT lanes for one row would do QT times the arithmetic
        lone.start(qp + first * q_row + h * G * q_head, q_head, fscale);
        const int64_t len = lens[first];
        for (int64_t start = 0, b = 0; start < len; start += block, ++b) {
          const int64_t blk = tables[first * width + b];
          TORCH_CHECK(blk >= 0 && blk < num_blocks, "block ", blk, " out of the cache");
          const int64_t offset = (blk * num_kv_heads + h) * block * DIM;
          lone.block_step(kc + offset, vc + offset, std::min(block, len - start));
        }
        lone.finish(op + (first * num_heads + h * G) * DIM);
        continue;
      }
      for (int t = 0; t < count; ++t) {
        queries[t] = qp + (first + t) * q_row + h * G * q_head;
        outs[t] = op + ((first + t) * num_heads + h * G) * DIM;
      }
      heads.start(queries, count, q_head, fscale);
      const int64_t longest = lens[first + count - 1];
      for (int64_t start = 0, b = 0; start < longest; start += block, ++b) {
        const int64_t blk = tables[first * width + b];
        TORCH_CHECK(blk >= 0 && blk < num_blocks, "block ", blk, " out of the cache");
        for (int t = 0; t < count; ++t) n[t] = std::min(block, lens[first + t] - start);
        const int64_t offset = (blk * num_kv_heads + h) * block * DIM;
        heads.block_step(kc + offset, vc + offset, n);
      }
      heads.finish(outs);
    }
  });
  return true;
}

// One decode token per row against its sequence's blocks; work items are (row, kv head).
template <typename T, typename Head>
void decode_attention_impl(const at::Tensor& query, const at::Tensor& k_cache,
                           const at::Tensor& v_cache, const at::Tensor& block_tables,
                           const at::Tensor& seq_lens, double scale, at::Tensor& out) {
  const int64_t rows = query.size(0);
  const int64_t num_heads = query.size(1);
  const int64_t dim = query.size(2);
  const int64_t num_kv_heads = k_cache.size(1);
  const int64_t block = v_cache.size(2);
  const int64_t groups = num_heads / num_kv_heads;
  const int64_t q_row = query.stride(0);
  const int64_t q_head = query.stride(1);
  const int64_t table_width = block_tables.size(1);
  const int64_t num_blocks = k_cache.size(0);
  const T* qp = query.data_ptr<T>();
  const T* kc = k_cache.data_ptr<T>();
  const T* vc = v_cache.data_ptr<T>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  T* op = out.data_ptr<T>();
  const float fscale = static_cast<float>(scale);

  // Element offset of block b of row r, kv head h, in either cache (-1: past the row's end).
  auto block_offset = [&](int64_t r, int64_t h, int64_t b) -> int64_t {
    if (b * block >= lens[r]) return -1;
    const int64_t blk = tables[r * table_width + b];
    TORCH_CHECK(blk >= 0 && blk < num_blocks, "block ", blk, " out of the cache");
    return (blk * num_kv_heads + h) * block * dim;
  };
  // Blocks are short scattered streams (block x dim elements per head): the hardware
  // prefetcher ramps up too late on them (measured: ~10 GB/s from DRAM against 36 GB/s
  // from cache), so the next block is requested while this one is computed.
  const int64_t block_bytes = block * dim * static_cast<int64_t>(sizeof(T));
  auto prefetch = [&](int64_t offset) {
    if (offset < 0) return;
    const char* k = reinterpret_cast<const char*>(kc + offset);
    const char* v = reinterpret_cast<const char*>(vc + offset);
    for (int64_t i = 0; i < block_bytes; i += 64) {
      __builtin_prefetch(k + i);
      __builtin_prefetch(v + i);
    }
  };
  auto check_len = [&](int64_t r) {
    TORCH_CHECK(lens[r] >= 0 && lens[r] <= table_width * block, "seq_len ", lens[r],
                " of row ", r, " exceeds its block table");
  };

  if (rows >= 2 * at::get_num_threads()) {
    // Enough rows to keep every thread busy: a thread takes whole rows and walks each
    // block's kv heads in memory order (one block's heads are contiguous), which streams
    // better than visiting the same block once per head.
    at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
      std::vector<Head> heads;
      for (int64_t h = 0; h < num_kv_heads; ++h) heads.emplace_back(dim, groups, block);
      for (int64_t r = begin; r < end; ++r) {
        check_len(r);
        for (int64_t h = 0; h < num_kv_heads; ++h) {
          heads[h].start(qp + r * q_row + h * groups * q_head, q_head, fscale);
        }
        const int64_t len = lens[r];
        for (int64_t start = 0, b = 0; start < len; start += block, ++b) {
          for (int64_t h = 0; h < num_kv_heads; ++h) {
            const int64_t next = h + 1 < num_kv_heads ? block_offset(r, h + 1, b)
                                                      : block_offset(r, 0, b + 1);
            prefetch(next >= 0 ? next : (r + 1 < end ? block_offset(r + 1, 0, 0) : -1));
            const int64_t offset = block_offset(r, h, b);
            heads[h].block_step(kc + offset, vc + offset, std::min(block, len - start));
          }
        }
        for (int64_t h = 0; h < num_kv_heads; ++h) {
          heads[h].finish(op + (r * num_heads + h * groups) * dim);
        }
      }
    });
    return;
  }
  // Few rows (latency-bound small batches): split each row's kv heads across threads.
  at::parallel_for(0, rows * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    Head head(dim, groups, block);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t r = item / num_kv_heads;
      const int64_t h = item % num_kv_heads;
      check_len(r);
      head.start(qp + r * q_row + h * groups * q_head, q_head, fscale);
      const int64_t len = lens[r];
      for (int64_t start = 0, b = 0; start < len; start += block, ++b) {
        const int64_t next = block_offset(r, h, b + 1);
        prefetch(next >= 0 ? next
                           : (item + 1 < end ? block_offset((item + 1) / num_kv_heads,
                                                            (item + 1) % num_kv_heads, 0)
                                             : -1));
        const int64_t offset = block_offset(r, h, b);
        head.block_step(kc + offset, vc + offset, std::min(block, len - start));
      }
      head.finish(op + (r * num_heads + h * groups) * dim);
    }
  });
}

template <typename T, int DIM>
bool dispatch_groups(int64_t groups, const at::Tensor& query, const at::Tensor& k_cache,
                     const at::Tensor& v_cache, const at::Tensor& block_tables,
                     const at::Tensor& seq_lens, double scale, at::Tensor& out) {
#define HPU_SERVE_GROUPS(G)                                                                 \
  case G:                                                                                  \
    if constexpr (G <= 4) { /* G x 4 lanes fit the vector registers */                    \
      if (prompt_attention_impl<T, G, DIM>(query, k_cache, v_cache, block_tables, seq_lens, \
                                           scale, out)) {                                  \
        return true;                                                                       \
      }                                                                                    \
    }                                                                                      \
    decode_attention_impl<T, FastHead<T, G, DIM>>(query, k_cache, v_cache, block_tables,    \
                                                  seq_lens, scale, out);                   \
    return true;
  switch (groups) {
    HPU_SERVE_GROUPS(1)
    HPU_SERVE_GROUPS(2)
    HPU_SERVE_GROUPS(3)
    HPU_SERVE_GROUPS(4)
    HPU_SERVE_GROUPS(5)
    HPU_SERVE_GROUPS(6)
    HPU_SERVE_GROUPS(7)
    HPU_SERVE_GROUPS(8)
    default:
      return false;
  }
#undef HPU_SERVE_GROUPS
}

template <typename T>
void decode_attention_dispatch(const at::Tensor& query, const at::Tensor& k_cache,
                               const at::Tensor& v_cache, const at::Tensor& block_tables,
                               const at::Tensor& seq_lens, double scale, at::Tensor& out) {
  const int64_t groups = query.size(1) / k_cache.size(1);
  const int64_t dim = query.size(2);
  if (v_cache.size(2) % 16 == 0) {
    if (dim == 64 && dispatch_groups<T, 64>(groups, query, k_cache, v_cache, block_tables,
                                             seq_lens, scale, out)) {
      return;
    }
    if (dim == 128 && dispatch_groups<T, 128>(groups, query, k_cache, v_cache, block_tables,
                                               seq_lens, scale, out)) {
      return;
    }
  }
  decode_attention_impl<T, GenericHead<T>>(query, k_cache, v_cache, block_tables, seq_lens,
                                           scale, out);
}

// query [rows, Hq, D] (rows and heads may be strided, e.g. a view into qkv), caches as in
// check_cache_layout, block_tables int32 [rows, width], seq_lens int32 [rows] (tokens of
// each row, including the one being decoded) -> [rows, Hq, D].
at::Tensor decode_attention(const at::Tensor& query, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& block_tables,
                            const at::Tensor& seq_lens, double scale) {
  TORCH_CHECK(query.device().is_cpu() && query.dim() == 3 && query.stride(2) == 1,
              "query must be a CPU [rows, heads, head_dim] tensor, unit stride in head_dim");
  check_rows(k_cache, "k_cache");
  check_rows(v_cache, "v_cache");
  const auto dtype = query.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "query must be fp32 or bf16");
  TORCH_CHECK(k_cache.scalar_type() == dtype && v_cache.scalar_type() == dtype,
              "caches must have query's dtype");
  check_cache_layout(k_cache, v_cache, k_cache.size(1), query.size(2));
  TORCH_CHECK(query.size(1) % k_cache.size(1) == 0, "query heads must be a multiple of kv heads");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.is_contiguous() &&
                  block_tables.dim() == 2 && block_tables.size(0) == query.size(0),
              "block_tables must be int32 [rows, width]");
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.is_contiguous() &&
                  seq_lens.numel() == query.size(0),
              "seq_lens must be int32 [rows]");
  at::Tensor out = at::empty({query.size(0), query.size(1), query.size(2)}, query.options());
  if (dtype == at::kBFloat16) {
    decode_attention_dispatch<BFloat16>(query, k_cache, v_cache, block_tables, seq_lens, scale,
                                        out);
  } else {
    decode_attention_dispatch<float>(query, k_cache, v_cache, block_tables, seq_lens, scale, out);
  }
  return out;
}

}  // namespace
}  // namespace hpu_serve

TORCH_LIBRARY_FRAGMENT(hpu_serve, m) {
  m.def(
      "decode_attention(Tensor query, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
      "Tensor seq_lens, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(hpu_serve, CPU, m) {
  m.impl("decode_attention", &hpu_serve::decode_attention);
}
