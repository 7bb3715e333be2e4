// y = x W^T (+ b) for a bfloat16 weight, for the few rows of a decode or speculative-verify
// step (torch.ops.hpu_serve.bf16_linear).
//
// Why it exists: oneDNN picks its GEMM blocking by row count, so a row's result depends on
// how many rows share the call. A speculative verify step (k + 1 rows) then rounds a token's
// logits differently from a plain one-row decode step, and near-ties flip: greedy text with
// speculation was not plain decoding's on bf16 weights. Here every row is accumulated on its
// own in one fixed order, so its output is the same bits at 1 row or 16 and whatever the
// thread count (the int4 kernel's rule, csrc/int4_gemm.cpp). It also streams the weight once
// per call for all rows, as a memory-bound skinny GEMM should.
//
// Numerics: per output column, fp32 accumulation of exact bf16 products (vdpbf16ps adds a
// pair's two products, the odd input first, then the accumulator), over input pairs in
// ascending order in one chain, then the bias in fp32, then one rounding to the output
// dtype. The portable path does the same arithmetic with fmas.
//
// Packed layout (server/hpu/cpu/bf16_pack.py prepacks it once at load time): output columns
// in tiles of 16 (N padded to a multiple of 16 with zeros), inputs in pairs (K padded to
// even): [tiles, K / 2, 16, 2] bf16, so each tile is one sequential stream of 64-byte vectors,
// vector p holding the 16 columns' weights for inputs 2p and 2p + 1.

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>
#include <vector>

#include "kernel_utils.h"

namespace hpu_serve {
namespace {

constexpr int64_t kTile = 16;    // output columns per vector
constexpr int64_t kMaxRows = 16;  // rows per pass over the weight: one accumulator a row
constexpr int64_t kPrefetch = 16;  // input pairs (64-byte vectors) ahead

struct Problem {
  const uint32_t* x;      // [passes, half, per]: bf16 input pairs, a pass's rows adjacent
  const uint16_t* w;      // [tiles, half, 16, 2]
  const float* bias;      // [n] or null
  int64_t half, n;
  int64_t rows, per, passes;  // per: rows per pass (the last pass may have fewer)
};

// The next tile's lines a pass fetches while it computes from cache (none: the pass streams
// its own tile from memory, a few lines ahead).
struct Fetch {
  const uint16_t* next = nullptr;
  int64_t lo = 0, hi = 0;  // the next tile's 64-byte lines [lo, hi), spread over the pass
};

// Pass `pass` (rows [pass * per, pass * per + M)) against output tile t.
template <int M, typename O>
void tile_rows(const Problem& p, int64_t pass, int64_t t, O* out, const Fetch& f) {
  f32x16 acc[M];
#pragma GCC unroll 16
  for (int m = 0; m < M; ++m) acc[m] = f32x16{};
  const uint16_t* w = p.w + t * p.half * 2 * kTile;
  const uint32_t* x = p.x + pass * p.half * p.per;
  // the next tile's lines [lo, hi) spread evenly over the pass's input pairs, counted
  // without a division per pair (a 64-bit divide each pair slowed 8-row passes by ~25%)
  const int64_t share = f.hi - f.lo;
  int64_t q = f.lo, owed = 0;
  for (int64_t i = 0; i < p.half; ++i) {
    if (f.next == nullptr) {
      // the tile's stream, 1 KiB ahead: without it a pass of 6 or more rows fell from ~20
      // to ~15 GB/s (measured on SmolLM2's linear stack, 2 threads)
      __builtin_prefetch(w + (i + kPrefetch) * 2 * kTile);
    } else {
      for (owed += share; owed >= p.half; owed -= p.half) {
        __builtin_prefetch(f.next + q++ * 2 * kTile, 0, 2);
      }
    }
    const u16x32 wi = load_u16x32(w + i * 2 * kTile);
    const uint32_t* xi = x + i * p.per;
#pragma GCC unroll 16
    for (int m = 0; m < M; ++m) acc[m] = dot_pair(acc[m], wi, xi[m]);
  }
  const int64_t col = t * kTile;
  f32x16 bias{};
  if (p.bias != nullptr) {
    for (int64_t l = 0; l < kTile && col + l < p.n; ++l) bias[l] = p.bias[col + l];
  }
  for (int m = 0; m < M; ++m) {
    const f32x16 sum = acc[m] + bias;
    O* row = out + (pass * p.per + m) * p.n;
    if (col + kTile <= p.n) {
      store16(row + col, sum);  // at K = 576 the scalar stores were ~8% of a pass
    } else {
      for (int64_t l = 0; col + l < p.n; ++l) store(row, col + l, sum[l]);
    }
  }
}

// Tile t for every row, one pass per p.per rows. Past the first pass the tile comes from
// cache (K x 64 bytes), so those passes fetch the tile after it, a share each: its first
// pass then streams from cache instead of waiting on memory.
template <typename O>
void tile_all_rows(const Problem& p, int64_t t, int64_t end, O* out) {
  for (int64_t pass = 0; pass < p.passes; ++pass) {
    Fetch f;
    if (pass > 0 && t + 1 < end) {
      f = {p.w + (t + 1) * p.half * 2 * kTile, (pass - 1) * p.half / (p.passes - 1),
           pass * p.half / (p.passes - 1)};
    }
    dispatch_rows<kMaxRows>(std::min(p.per, p.rows - pass * p.per),
                             [&](auto m) { tile_rows<decltype(m)::value>(p, pass, t, out, f); });
  }
}

// Rows per pass for a call of `rows` rows (a row's bits do not depend on it). A pass that
// streams its tile from memory computes at ~2/3 of the cache passes' rate; 13-16 rows go in
// two passes of 8, the second from cache while it fetches the next tile (16 rows, 2 threads:
// SmolLM2's stack 11.5 ms in one pass against 9.9 in two, the 1B's sizes 23.4 against 19.5).
inline int64_t rows_per_pass(int64_t rows) {
  if (rows <= 12) return rows;
  if (rows <= 16) return (rows + 1) / 2;
  const int64_t passes = (rows + kMaxRows - 1) / kMaxRows;
  return (rows + passes - 1) / passes;
}

// out_dtype float32 returns the fp32 accumulators unrounded (tests and logits).
at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& weight,
                       const std::optional<at::Tensor>& bias, int64_t out_features,
                       std::optional<at::ScalarType> out_dtype) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kBFloat16,
              "x must be a bfloat16 CPU tensor");
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) > 0, "x must have a non-empty last dim");
  const int64_t k = x.size(-1);
  const int64_t half = (k + 1) / 2;
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == at::kBFloat16 &&
                  weight.dim() == 4 && weight.size(1) == half && weight.size(2) == kTile &&
                  weight.size(3) == 2 && weight.is_contiguous(),
              "weight must be a contiguous bfloat16 CPU tensor [tiles, in_features / 2, 16, 2]");
  TORCH_CHECK(out_features > (weight.size(0) - 1) * kTile &&
                  out_features <= weight.size(0) * kTile,
              "out_features must end in the last 16-column tile");
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() &&
                    bias->numel() == out_features,
                "bias must be a contiguous float32 tensor of out_features values");
  }
  const at::ScalarType dtype = out_dtype.value_or(at::kBFloat16);
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kFloat,
              "out_dtype must be bfloat16 or float32");
  at::Tensor out = at::empty(out_shape(x, out_features), x.options().dtype(dtype));
  if (x.numel() == 0) return out;
  // rows as pairs of bf16: an odd K is padded with one zero input (its weights are 0 too)
  at::Tensor xs = x.reshape({-1, k});
  if (k % 2 != 0) xs = at::constant_pad_nd(xs, {0, 1}, 0);
  xs = xs.contiguous();
  const int64_t rows = xs.size(0);
  // each pass's rows side by side per input pair, so a pass reads its rows' pairs at fixed
  // offsets from one pointer (strided row pointers spilled the accumulators past 8 rows)
  const int64_t per = rows_per_pass(rows);
  const int64_t passes = (rows + per - 1) / per;
  at::Tensor xt = at::empty({passes * half * per}, xs.options().dtype(at::kInt));
  {
    const uint32_t* src = reinterpret_cast<const uint32_t*>(xs.data_ptr<BFloat16>());
    uint32_t* dst = reinterpret_cast<uint32_t*>(xt.data_ptr<int32_t>());
    for (int64_t r = 0; r < rows; ++r) {
      uint32_t* d = dst + (r / per) * half * per + r % per;
      const uint32_t* s = src + r * half;
      for (int64_t i = 0; i < half; ++i) d[i * per] = s[i];
    }
  }
  const Problem p{reinterpret_cast<const uint32_t*>(xt.data_ptr<int32_t>()),
                  reinterpret_cast<const uint16_t*>(weight.data_ptr<BFloat16>()),
                  bias.has_value() ? bias->data_ptr<float>() : nullptr, half, out_features,
                  rows, per, passes};
  const auto run = [&](auto* op) {
    at::parallel_for(0, weight.size(0), 4, [&](int64_t begin, int64_t end) {
      // past one pass (13 rows and more), a tile's later passes read its weights from cache
      // (a tile is K x 64 bytes), not from memory again
      for (int64_t t = begin; t < end; ++t) tile_all_rows(p, t, end, op);
    });
  };
  if (dtype == at::kFloat) {
    run(out.data_ptr<float>());
  } else {
    run(out.data_ptr<BFloat16>());
  }
  return out;
}

// Shapes only (fake tensors, torch.compile tracing): the op stays one opaque call.
at::Tensor bf16_linear_meta(const at::Tensor& x, const at::Tensor& weight,
                            const std::optional<at::Tensor>& bias, int64_t out_features,
                            std::optional<at::ScalarType> out_dtype) {
  return at::empty(out_shape(x, out_features),
                   x.options().dtype(out_dtype.value_or(at::kBFloat16)));
}

}  // namespace
}  // namespace hpu_serve

TORCH_LIBRARY_FRAGMENT(hpu_serve, m) {
  m.def(
      "bf16_linear(Tensor x, Tensor weight, Tensor? bias, int out_features, "
      "ScalarType? out_dtype=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(hpu_serve, CPU, m) { m.impl("bf16_linear", &hpu_serve::bf16_linear); }

TORCH_LIBRARY_IMPL(hpu_serve, Meta, m) { m.impl("bf16_linear", &hpu_serve::bf16_linear_meta); }
