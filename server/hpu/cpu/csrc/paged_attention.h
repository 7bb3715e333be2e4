// Paged attention for CPU (torch.ops.hpu_serve.decode_attention): one query token per row
// against its sequence's cached keys/values, read in place from their blocks (the PyTorch
// path gathers the blocks into a copy first). Prefill chunks of the plain case (no window,
// chunk, cap or sinks, the model's dtype in the cache) go to the tiled kernel of
// prefill_attention.cpp; every other prefill uses this one, one row per prompt token with
// causal per-row lengths: bf16 caches on AVX-512 BF16 one row at a time on the decode head
// (decode_head_bf16.h), others consecutive rows of one sequence four at a time, so each
// key/value read serves four tokens.
//
// Keys are stored transposed within each block, [blocks, kv_heads, head_dim, block_size], so
// 16 tokens' scores come from one vector multiply-add per head dim, without horizontal sums;
// values keep [blocks, kv_heads, block_size, head_dim].
//
// Variants, all runtime arguments except the dtypes:
// - a sliding window (per layer): a row whose sequence holds len tokens sees positions
//   [len - window, len), transformers' rule; blocks wholly before it are not read at all,
//   so a windowed layer costs O(window), not O(len);
// - an attention chunk (per layer, Llama 4): the row at position len - 1 sees only its own
//   chunk, positions [(len - 1) / chunk * chunk, len); blocks before it are not read either;
// - soft-capped scores (Gemma 2): cap * tanh(s / cap) before the softmax;
// - attention sinks (gpt-oss): a learned logit per query head that joins the softmax's
//   denominator and adds no value; it enters once, when a row's output is normalised;
// - the cache dtype C: the query's dtype T, or fp8 e4m3 widened to fp32 as it is loaded.
//
// The templates live here; paged_attention.cpp instantiates the caches in the model's
// dtype and registers the op, paged_attention_fp8.cpp the fp8 caches (two translation
// units that compile in parallel).
#pragma once

#include <ATen/Parallel.h>

#include <vector>

#include "attention_common.h"
#include "decode_head_bf16.h"

namespace hpu_serve {

// Any head size, group count and block size: runtime loops (the fallback).
template <typename T, typename C>
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

  // slots [lo, n) of one block: keys_t [dim, block], values [block, dim].
  void block_step(const C* keys_t, const C* values, int64_t lo, int64_t n, float softcap,
                  Drip next_k = {}, Drip next_v = {}) {
    next_k.rest();
    next_v.rest();
    for (int64_t g = 0; g < groups; ++g) {
      float* p = probs.data() + g * block;
      std::fill(p + lo, p + n, 0.f);
      for (int64_t d = 0; d < dim; ++d) {
        const float qd = q[g * dim + d];
        for (int64_t j = lo; j < n; ++j) p[j] += qd * load(keys_t + d * block, j);
      }
      cap_scores(p + lo, n - lo, softcap);
      softmax_block(p + lo, n - lo, run_max[g], run_sum[g], acc.data() + g * dim, dim);
      float* a = acc.data() + g * dim;
      for (int64_t j = lo; j < n; ++j) {
        for (int64_t d = 0; d < dim; ++d) a[d] += p[j] * load(values + j * dim, d);
      }
    }
  }

  void finish(T* out, const float* sinks) {
    for (int64_t g = 0; g < groups; ++g) {
      // An empty sequence (never scheduled, but cheap to guard) yields zeros, not NaN.
      const float inv = softmax_inv(run_sum[g], run_max[g], sinks, g);
      for (int64_t d = 0; d < dim; ++d) store(out + g * dim, d, acc[g * dim + d] * inv);
    }
  }
};

// The common shapes (G query heads per kv head, head size DIM, blocks of a multiple of 16
// tokens) with G and DIM known at compile time: scores for 16 tokens accumulate in G
// registers from the transposed key block, one widening load per (head dim, 16 tokens);
// outputs accumulate 16 dims at a time in G registers, one widening load per (token, 16
// dims). Each key/value element is loaded and widened once.
//
// Each multiply-add chain waits ~4 cycles for the previous one, so G chains alone (3 for
// SmolLM2) leave most of the FMA units idle: the scores of JT 16-token chunks and the
// output of DT 16-dim chunks are accumulated at once (up to ~12 registers), which keeps
// every lane's own summation order, hence the same bits (SmolLM2's decode attention at
// batch 32: 0.33 -> 0.15 ms a layer from cache, 1 thread).
constexpr int fit_chunks(int g, int most) {
  int n = 12 / g;
  n = n < 1 ? 1 : (n > most ? most : n);
  while (most % n != 0) --n;  // DT must divide DIM / 16
  return n;
}

template <typename T, typename C, int G, int DIM>
struct FastHead {
  static constexpr int JT = fit_chunks(G, 4);         // 16-token chunks per score pass
  static constexpr int DT = fit_chunks(G, DIM / 16);  // 16-dim chunks per output pass
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

  // Scores of the 16-token chunks at j0, j0 + 16, ... (NJ of them) into probs.
  template <int NJ>
  void scores(const C* keys_t, int64_t j0, Drip& next_k) {
    f32x16 s[NJ][G] = {};
    for (int d = 0; d < DIM; ++d) {
      next_k.next();
      const C* row = keys_t + d * block + j0;
      f32x16 k[NJ];
      for (int t = 0; t < NJ; ++t) k[t] = load16(row + 16 * t);
      for (int g = 0; g < G; ++g) {
        const float qd = q[g][d];
        for (int t = 0; t < NJ; ++t) s[t][g] += qd * k[t];
      }
    }
    for (int t = 0; t < NJ; ++t) {
      for (int g = 0; g < G; ++g) store16(probs.data() + g * block + j0 + 16 * t, s[t][g]);
    }
  }

  void block_step(const C* keys_t, const C* values, int64_t lo, int64_t n, float softcap,
                  Drip next_k = {}, Drip next_v = {}) {
    int64_t j0 = lo / 16 * 16;
    const int64_t chunks = (n - j0 + 15) / 16;
    next_k.pace(DIM * (chunks / JT + chunks % JT));
    next_v.pace(DIM / (16 * DT) * (n - lo));
    for (; j0 + 16 * JT <= n; j0 += 16 * JT) scores<JT>(keys_t, j0, next_k);
    for (; j0 < n; j0 += 16) scores<1>(keys_t, j0, next_k);
    next_k.rest();
    for (int g = 0; g < G; ++g) {
      float* p = probs.data() + g * block;
      cap_scores(p + lo, n - lo, softcap);
      softmax_block(p + lo, n - lo, run_max[g], run_sum[g], acc[g], DIM);
    }
    for (int d0 = 0; d0 < DIM; d0 += 16 * DT) {
      f32x16 a[DT][G];
      for (int t = 0; t < DT; ++t) {
        for (int g = 0; g < G; ++g) a[t][g] = load16(acc[g] + d0 + 16 * t);
      }
      for (int64_t j = lo; j < n; ++j) {
        next_v.next();
        f32x16 v[DT];
        for (int t = 0; t < DT; ++t) v[t] = load16(values + j * DIM + d0 + 16 * t);
        for (int g = 0; g < G; ++g) {
          const float pj = probs[g * block + j];
          for (int t = 0; t < DT; ++t) a[t][g] += pj * v[t];
        }
      }
      for (int t = 0; t < DT; ++t) {
        for (int g = 0; g < G; ++g) store16(acc[g] + d0 + 16 * t, a[t][g]);
      }
    }
    next_v.rest();
  }

  void finish(T* out, const float* sinks) {
    for (int g = 0; g < G; ++g) {
      const float inv = softmax_inv(run_sum[g], run_max[g], sinks, g);
#pragma omp simd
      for (int d = 0; d < DIM; ++d) store(out + g * DIM, d, acc[g][d] * inv);
    }
  }
};

// The head a decode row runs: vdpbf16ps where the query and cache are bf16 and the CPU has
// it, FastHead's fp32 FMAs otherwise.
#ifdef HPU_SERVE_DECODE_BF16_DOT
template <typename T, typename C, int G, int DIM>
using DecodeHead = std::conditional_t<std::is_same_v<T, BFloat16> && std::is_same_v<C, BFloat16>,
                                      Bf16Head<G, DIM>, FastHead<T, C, G, DIM>>;
#else
template <typename T, typename C, int G, int DIM>
using DecodeHead = FastHead<T, C, G, DIM>;
#endif

// QT consecutive query tokens of one sequence (the rows of a prompt chunk) against the same
// blocks: each key/value vector loaded serves QT x G query heads, where one row at a time
// reads the whole context once per token. Row t sees slots [lo[t], n[t]) of a block (the
// rows differ by one position each, so only the window's first block and the last block
// differ); rows past `rows` have zero queries and are never written out.
template <typename T, typename C, int G, int DIM, int QT>
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

  void block_step(const C* keys_t, const C* values, const int64_t* lo, const int64_t* n,
                  float softcap) {
    int64_t begin = block, end = 0;  // the slots some row sees
    for (int t = 0; t < rows; ++t) {
      if (n[t] > lo[t]) {
        begin = std::min(begin, lo[t]);
        end = std::max(end, n[t]);
      }
    }
    if (end <= begin) return;
    for (int64_t j0 = begin / 16 * 16; j0 < end; j0 += 16) {
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
      const bool seen = t < rows && n[t] > lo[t];
      const int64_t first = seen ? lo[t] : begin;
      const int64_t last = seen ? n[t] : begin;
      for (int g = 0; g < G; ++g) {
        float* p = probs.data() + (t * G + g) * block;
        if (seen) {
          cap_scores(p + first, last - first, softcap);
          softmax_block(p + first, last - first, run_max[t][g], run_sum[t][g], acc[t][g], DIM);
        }
        // slots this row does not see (out of its window, past its end): no weight
        std::fill(p + begin, p + first, 0.f);
        std::fill(p + last, p + end, 0.f);
      }
    }
    for (int d0 = 0; d0 < DIM; d0 += 16) {
      f32x16 a[QT][G];
      for (int t = 0; t < QT; ++t) {
        for (int g = 0; g < G; ++g) a[t][g] = load16(acc[t][g] + d0);
      }
      for (int64_t j = begin; j < end; ++j) {
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

  void finish(T* const* outs, const float* sinks) {
    for (int t = 0; t < rows; ++t) {
      for (int g = 0; g < G; ++g) {
        const float inv = softmax_inv(run_sum[t][g], run_max[t][g], sinks, g);
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

inline void check_lens(const AttentionArgs& a) {
  const int64_t width = a.block_tables.size(1);
  const int64_t block = a.v_cache.size(2);
  const int32_t* lens = a.seq_lens.data_ptr<int32_t>();
  for (int64_t r = 0; r < a.query.size(0); ++r) {
    TORCH_CHECK(lens[r] >= 0 && lens[r] <= width * block, "seq_len ", lens[r], " of row ", r,
                " exceeds its block table");
  }
}

// One row's walk over its visible blocks: step(offset, lo, n) per block, in order.
template <typename Step>
inline void for_each_block(const int32_t* table, int64_t len, int64_t window, int64_t chunk,
                           int64_t block, int64_t num_blocks, int64_t head_offset,
                           int64_t block_elems,
                           Step&& step) {
  const int64_t from = first_visible(len, window, chunk);
  for (int64_t b = from / block; b * block < len; ++b) {
    const int64_t blk = table[b];
    TORCH_CHECK(blk >= 0 && blk < num_blocks, "block ", blk, " out of the cache");
    const int64_t start = b * block;
    step(blk * block_elems + head_offset, std::max<int64_t>(from - start, 0),
         std::min(block, len - start));
  }
}

// Prompt rows grouped QT consecutive tokens at a time; work items are (group, kv head).
// Returns false (nothing done) when no two rows belong together (decode batches).
template <typename T, typename C, int G, int DIM>
bool prompt_attention_impl(const AttentionArgs& a) {
  if constexpr (!std::is_same_v<DecodeHead<T, C, G, DIM>, FastHead<T, C, G, DIM>>) {
    // Rows one at a time, on the decode head: a speculative verify step's rows then get a
    // plain decode's bits (greedy text with speculation equals greedy text without it), and
    // vdpbf16ps halves the arithmetic that grouping four rows shared (the re-reads of a block
    // come from cache).
    return false;
  }
  constexpr int QT = 4;
  const int64_t rows = a.query.size(0);
  const int64_t width = a.block_tables.size(1);
  const int32_t* tables = a.block_tables.data_ptr<int32_t>();
  const int32_t* lens = a.seq_lens.data_ptr<int32_t>();
  std::vector<int64_t> starts;  // first row of each group, then `rows`
  for (int64_t r = 0; r < rows; ++r) {
    if (r == 0 || r - starts.back() == QT || !same_sequence(tables, lens, width, r)) {
      starts.push_back(r);
    }
  }
  if (static_cast<int64_t>(starts.size()) * 2 > rows) return false;  // mostly lone rows
  starts.push_back(rows);
  const int64_t num_heads = a.query.size(1);
  const int64_t num_kv_heads = a.k_cache.size(1);
  const int64_t block = a.v_cache.size(2);
  const int64_t q_row = a.query.stride(0);
  const int64_t q_head = a.query.stride(1);
  const int64_t num_blocks = a.k_cache.size(0);
  const int64_t window = a.window;
  const int64_t chunk = a.chunk;
  const float softcap = a.softcap;
  const T* qp = a.query.data_ptr<T>();
  const C* kc = a.k_cache.data_ptr<C>();
  const C* vc = a.v_cache.data_ptr<C>();
  T* op = a.out.data_ptr<T>();
  const float fscale = a.scale;
  const int64_t num_groups = static_cast<int64_t>(starts.size()) - 1;
  check_lens(a);
  at::parallel_for(0, num_groups * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    FastTokens<T, C, G, DIM, QT> heads(block);
    DecodeHead<T, C, G, DIM> lone(DIM, G, block);  // a row alone (a decode riding in the batch)
    const T* queries[QT];
    T* outs[QT];
    int64_t lo[QT], n[QT];
    for (int64_t item = begin; item < end; ++item) {
      const int64_t first = starts[item / num_kv_heads];
      const int64_t h = item % num_kv_heads;
      const int count = static_cast<int>(starts[item / num_kv_heads + 1] - first);
      const int64_t head_offset = h * block * DIM;
      const int64_t block_elems = num_kv_heads * block * DIM;
      if (count == 1) {  // QT lanes for one row would do QT times the arithmetic
        lone.start(qp + first * q_row + h * G * q_head, q_head, fscale);
        for_each_block(tables + first * width, lens[first], window, chunk, block, num_blocks,
                       head_offset, block_elems, [&](int64_t offset, int64_t l, int64_t m) {
                         lone.block_step(kc + offset, vc + offset, l, m, softcap);
                       });
        lone.finish(op + (first * num_heads + h * G) * DIM, head_sinks(a.sinks, h, G));
        continue;
      }
      for (int t = 0; t < count; ++t) {
        queries[t] = qp + (first + t) * q_row + h * G * q_head;
        outs[t] = op + ((first + t) * num_heads + h * G) * DIM;
      }
      heads.start(queries, count, q_head, fscale);
      // rows ascend by one token: the first sees the earliest key, the last the latest
      const int64_t from = first_visible(lens[first], window, chunk);
      const int64_t longest = lens[first + count - 1];
      for (int64_t b = from / block; b * block < longest; ++b) {
        const int64_t blk = tables[first * width + b];
        TORCH_CHECK(blk >= 0 && blk < num_blocks, "block ", blk, " out of the cache");
        const int64_t start = b * block;
        for (int t = 0; t < count; ++t) {
          const int64_t len = lens[first + t];
          lo[t] = std::min(std::max<int64_t>(first_visible(len, window, chunk) - start, 0),
                           block);
          n[t] = std::min(std::max<int64_t>(len - start, 0), block);
        }
        const int64_t offset = blk * block_elems + head_offset;
        heads.block_step(kc + offset, vc + offset, lo, n, softcap);
      }
      heads.finish(outs, head_sinks(a.sinks, h, G));
    }
  });
  return true;
}

// One decode token per row against its sequence's blocks; work items are (row, kv head).
template <typename T, typename C, typename Head>
void decode_attention_impl(const AttentionArgs& a) {
  const int64_t rows = a.query.size(0);
  const int64_t num_heads = a.query.size(1);
  const int64_t dim = a.query.size(2);
  const int64_t num_kv_heads = a.k_cache.size(1);
  const int64_t block = a.v_cache.size(2);
  const int64_t groups = num_heads / num_kv_heads;
  const int64_t q_row = a.query.stride(0);
  const int64_t q_head = a.query.stride(1);
  const int64_t table_width = a.block_tables.size(1);
  const int64_t num_blocks = a.k_cache.size(0);
  const int64_t window = a.window;
  const int64_t chunk = a.chunk;
  const float softcap = a.softcap;
  const T* qp = a.query.data_ptr<T>();
  const C* kc = a.k_cache.data_ptr<C>();
  const C* vc = a.v_cache.data_ptr<C>();
  const int32_t* tables = a.block_tables.data_ptr<int32_t>();
  const int32_t* lens = a.seq_lens.data_ptr<int32_t>();
  T* op = a.out.data_ptr<T>();
  const float fscale = a.scale;
  const int64_t block_elems = num_kv_heads * block * dim;
  check_lens(a);

  // Element offset of block b of row r, kv head h, in either cache (-1: past the row's end).
  auto block_offset = [&](int64_t r, int64_t h, int64_t b) -> int64_t {
    if (b * block >= lens[r]) return -1;
    const int64_t blk = tables[r * table_width + b];
    TORCH_CHECK(blk >= 0 && blk < num_blocks, "block ", blk, " out of the cache");
    return blk * block_elems + h * block * dim;
  };
  auto first_block = [&](int64_t r) { return first_visible(lens[r], window, chunk) / block; };
  // Blocks are short scattered streams (block x dim elements per head): the hardware
  // prefetcher ramps up too late on them (measured: ~10 GB/s from DRAM against 36 GB/s
  // from cache), so the next block is requested while this one is computed.
  const int64_t block_bytes = block * dim * static_cast<int64_t>(sizeof(C));
  auto next_k = [&](int64_t at) { return at < 0 ? Drip{} : Drip(kc + at, block_bytes); };
  auto next_v = [&](int64_t at) { return at < 0 ? Drip{} : Drip(vc + at, block_bytes); };

  if (rows >= 2 * at::get_num_threads()) {
    // Enough rows to keep every thread busy: a thread takes whole rows and walks each
    // block's kv heads in memory order (one block's heads are contiguous), which streams
    // better than visiting the same block once per head.
    at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
      std::vector<Head> heads;
      for (int64_t h = 0; h < num_kv_heads; ++h) heads.emplace_back(dim, groups, block);
      for (int64_t r = begin; r < end; ++r) {
        for (int64_t h = 0; h < num_kv_heads; ++h) {
          heads[h].start(qp + r * q_row + h * groups * q_head, q_head, fscale);
        }
        const int64_t len = lens[r];
        const int64_t from = first_visible(len, window, chunk);
        for (int64_t b = from / block; b * block < len; ++b) {
          const int64_t start = b * block;
          const int64_t lo = std::max<int64_t>(from - start, 0);
          const int64_t n = std::min(block, len - start);
          for (int64_t h = 0; h < num_kv_heads; ++h) {
            const int64_t next = h + 1 < num_kv_heads ? block_offset(r, h + 1, b)
                                                      : block_offset(r, 0, b + 1);
            const int64_t ahead =
                next >= 0 ? next
                          : (r + 1 < end ? block_offset(r + 1, 0, first_block(r + 1)) : -1);
            const int64_t offset = block_offset(r, h, b);
            heads[h].block_step(kc + offset, vc + offset, lo, n, softcap, next_k(ahead),
                                next_v(ahead));
          }
        }
        for (int64_t h = 0; h < num_kv_heads; ++h) {
          heads[h].finish(op + (r * num_heads + h * groups) * dim,
                          head_sinks(a.sinks, h, groups));
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
      head.start(qp + r * q_row + h * groups * q_head, q_head, fscale);
      const int64_t len = lens[r];
      const int64_t from = first_visible(len, window, chunk);
      for (int64_t b = from / block; b * block < len; ++b) {
        const int64_t next = block_offset(r, h, b + 1);
        const int64_t r2 = (item + 1) / num_kv_heads;
        const int64_t ahead =
            next >= 0 ? next
                      : (item + 1 < end ? block_offset(r2, (item + 1) % num_kv_heads,
                                                       first_block(r2))
                                        : -1);
        const int64_t start = b * block;
        const int64_t offset = block_offset(r, h, b);
        head.block_step(kc + offset, vc + offset, std::max<int64_t>(from - start, 0),
                        std::min(block, len - start), softcap, next_k(ahead), next_v(ahead));
      }
      head.finish(op + (r * num_heads + h * groups) * dim, head_sinks(a.sinks, h, groups));
    }
  });
}

// G query heads per kv head up to MAX_G get a compiled fast path (MAX_G 8 for the head
// sizes most models use, 4 for the rarer ones: each instantiation costs build time).
template <typename T, typename C, int DIM, int MAX_G>
bool dispatch_groups(int64_t groups, const AttentionArgs& a) {
#define HPU_SERVE_GROUPS(G)                                                                 \
  case G:                                                                                  \
    if constexpr (G <= MAX_G) {                                                            \
      if constexpr (G <= 4) { /* G x 4 lanes fit the vector registers */                  \
        if (prompt_attention_impl<T, C, G, DIM>(a)) return true;                           \
      }                                                                                    \
      decode_attention_impl<T, C, DecodeHead<T, C, G, DIM>>(a);                            \
      return true;                                                                         \
    }                                                                                      \
    return false;
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

// Head sizes with fast paths: 64 and 128 (Llama, Qwen, Mistral, SmolLM2), 96 (Phi-3/4),
// 256 (Gemma 2/3). Others run the generic loops. FAST false: generic loops only (fp32
// models over fp8 caches, a rare pairing not worth its build time).
template <typename T, typename C, bool FAST>
void attention_dispatch(const AttentionArgs& a) {
  if constexpr (FAST) {
    const int64_t groups = a.query.size(1) / a.k_cache.size(1);
    const int64_t dim = a.query.size(2);
    if (a.v_cache.size(2) % 16 == 0) {
      if (dim == 64 && dispatch_groups<T, C, 64, 8>(groups, a)) return;
      if (dim == 128 && dispatch_groups<T, C, 128, 8>(groups, a)) return;
      if (dim == 96 && dispatch_groups<T, C, 96, 4>(groups, a)) return;
      if (dim == 256 && dispatch_groups<T, C, 256, 4>(groups, a)) return;
    }
  }
  decode_attention_impl<T, C, GenericHead<T, C>>(a);
}

// paged_attention_fp8.cpp: caches stored in fp8 e4m3.
void attention_fp8_cache(const AttentionArgs& a);

}  // namespace hpu_serve
