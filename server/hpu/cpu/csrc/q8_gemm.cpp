// y = x W^T for a weight held as GGUF Q8_0 codes (torch.ops.hpu_serve.q8_linear): int8 codes,
// one scale per 32 inputs, for the few rows of a decode or speculative-verify step.
//
// Why it exists: a GGUF's LM head is often Q8_0 (SmolLM2's 49152 x 576, tied to the
// embeddings). Served from its dequantized bf16 copy it was the largest read of a batch-1
// step, 57 MB and ~2.4 ms of ~6; its codes and scales are 32 MB.
//
// Numerics, as int4_gemm.cpp: each row is accumulated on its own, in fp32, in one fixed
// order, so a row's output is the same bits whatever the number of rows in the call and the
// thread count (an exact speculative verify). A code c is split as c = 16 h + l, with h its
// signed high nibble (-8..7) and l its low nibble (0..15), both exact in bf16; per group of
// 32 inputs and output column
//   hi = sum_k x[k] h[k],  lo = sum_k x[k] l[k]      (exact products, fp32 adds, in order)
//   acc = fma(fma(hi, 16, lo), scale, acc)            (groups ascending)
// which is sum_k x[k] c[k] scale, the dequantized weight times x, up to fp32 rounding
// (tests/hpu/cpu/test_q8_gemm.py checks it against float64). Products use vdpbf16ps where the
// CPU has AVX512-BF16, fmas otherwise.
//
// Packed layout (server/hpu/cpu/q8_pack.py): output columns in tiles of 16 (N padded to a
// multiple of 16), and per tile and group of 32 inputs one block of 576 bytes, one stream:
//   codes   512 bytes: for inputs 2j, 2j + 1 (j = 0..15), 32 bytes; byte 2c + e holds column
//           c's code for input 2j + e, so its nibbles widen to the bf16 pairs vdpbf16ps takes;
//   scales  float32 [16]: the 16 columns' scales (GGUF's fp16 d, every bit kept).

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>

#include "kernel_utils.h"

#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace hpu_serve {
namespace {

constexpr int64_t kTile = 16;     // output columns per vector
constexpr int64_t kGroup = 32;    // inputs per scale (GGUF's Q8_0 block)
constexpr int64_t kCodes = kGroup * kTile;         // code bytes per block
constexpr int64_t kBlock = kCodes + kTile * 4;     // + 16 float32 scales
constexpr int64_t kMaxRows = 8;   // rows per pass over the weight (register budget)

// bf16 bits of the nibbles: low (0..15) and signed high (-8..7), each table 32 entries long
// (vpermw reads an index's low 5 bits: repeated, the low nibble needs no mask).
struct NibbleTables {
  alignas(64) uint16_t low[32];
  alignas(64) uint16_t high[32];
  NibbleTables() {
    for (int i = 0; i < 32; ++i) {
      low[i] = float_to_bf16_bits(static_cast<float>(i & 15));
      high[i] = float_to_bf16_bits(static_cast<float>((i & 15) < 8 ? (i & 15) : (i & 15) - 16));
    }
  }
};

const NibbleTables& tables() {
  static const NibbleTables t;
  return t;
}

struct Problem {
  const uint32_t* x;      // [rows, K / 2]: bf16 input pairs
  const uint8_t* weight;  // [tiles, groups, kBlock]
  int64_t half, groups, n;
};

// Rows [row0, row0 + M) against output tile t: each code decoded once for the M rows.
template <int M, typename O>
void tile_rows(const Problem& p, int64_t row0, int64_t t, O* out) {
  const NibbleTables& nib = tables();
#if defined(__AVX512BW__)
  const __m512i low_table = _mm512_load_si512(nib.low);
  const __m512i high_table = _mm512_load_si512(nib.high);
#endif
  f32x16 acc[M];
  for (int m = 0; m < M; ++m) acc[m] = f32x16{};
  const uint32_t* x = p.x + row0 * p.half;
  const uint8_t* tile = p.weight + t * p.groups * kBlock;
  for (int64_t g = 0; g < p.groups; ++g) {
    const uint8_t* block = tile + g * kBlock;
    for (int64_t c = 0; c < kBlock; c += 64) __builtin_prefetch(block + 2 * kBlock + c);
    f32x16 hi[M], lo[M];
    for (int m = 0; m < M; ++m) hi[m] = lo[m] = f32x16{};
    for (int64_t j = 0; j < kGroup / 2; ++j) {
      const uint8_t* bytes = block + j * 2 * kTile;
      u16x32 wl, wh;
#if defined(__AVX512BW__)
      const __m512i wide =
          _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes)));
      wl = reinterpret_cast<u16x32>(_mm512_permutexvar_epi16(wide, low_table));
      wh = reinterpret_cast<u16x32>(
          _mm512_permutexvar_epi16(_mm512_srli_epi16(wide, 4), high_table));
#else
      for (int i = 0; i < 32; ++i) {
        wl[i] = nib.low[bytes[i] & 15];
        wh[i] = nib.high[bytes[i] >> 4];
      }
#endif
      const int64_t pair = g * (kGroup / 2) + j;
      for (int m = 0; m < M; ++m) {
        const uint32_t xp = x[m * p.half + pair];
        lo[m] = dot_pair(lo[m], wl, xp);
        hi[m] = dot_pair(hi[m], wh, xp);
      }
    }
    const f32x16 scale = load16(reinterpret_cast<const float*>(block + kCodes));
    for (int m = 0; m < M; ++m) acc[m] = fma16(fma16(hi[m], splat(16.f), lo[m]), scale, acc[m]);
  }
  const int64_t col = t * kTile;
  for (int m = 0; m < M; ++m) {
    O* row = out + (row0 + m) * p.n;
    for (int64_t l = 0; l < kTile && col + l < p.n; ++l) store(row, col + l, acc[m][l]);
  }
}

template <int M, typename O>
void rows_pass(const Problem& p, int64_t row0, int64_t begin, int64_t end, O* out) {
  for (int64_t t = begin; t < end; ++t) tile_rows<M>(p, row0, t, out);
}

template <typename O>
void q8_linear_impl(const at::Tensor& x, const at::Tensor& weight, at::Tensor& out) {
  const int64_t k = x.size(-1);
  const int64_t rows = x.numel() / k;
  const Problem p{reinterpret_cast<const uint32_t*>(x.data_ptr<BFloat16>()),
                  weight.data_ptr<uint8_t>(), k / 2, k / kGroup, out.size(-1)};
  O* op = out.data_ptr<O>();
  at::parallel_for(0, weight.size(0), 4, [&](int64_t begin, int64_t end) {
    for (int64_t r = 0; r < rows; r += kMaxRows) {
      dispatch_rows(std::min(kMaxRows, rows - r),
                    [&](auto m) { rows_pass<decltype(m)::value>(p, r, begin, end, op); });
    }
  });
}

// out_dtype float32 returns the fp32 accumulators unrounded (tests: a row's bits).
at::Tensor q8_linear(const at::Tensor& x, const at::Tensor& weight, int64_t out_features,
                     std::optional<at::ScalarType> out_dtype) {
  TORCH_CHECK(x.device().is_cpu() && x.is_contiguous() && x.scalar_type() == at::kBFloat16,
              "x must be a contiguous bfloat16 CPU tensor");
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) > 0 && x.size(-1) % kGroup == 0,
              "x's last dim must be a positive multiple of 32");
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == at::kByte &&
                  weight.dim() == 3 && weight.size(1) == x.size(-1) / kGroup &&
                  weight.size(2) == kBlock && weight.is_contiguous(),
              "weight must be a contiguous uint8 CPU tensor [tiles, in_features / 32, 576]");
  TORCH_CHECK(out_features > (weight.size(0) - 1) * kTile &&
                  out_features <= weight.size(0) * kTile,
              "out_features must end in the last 16-column tile");
  const at::ScalarType dtype = out_dtype.value_or(at::kBFloat16);
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kFloat,
              "out_dtype must be bfloat16 or float32");
  at::Tensor out = at::empty(out_shape(x, out_features), x.options().dtype(dtype));
  if (x.numel() == 0) return out;
  if (dtype == at::kFloat) {
    q8_linear_impl<float>(x, weight, out);
  } else {
    q8_linear_impl<BFloat16>(x, weight, out);
  }
  return out;
}

at::Tensor q8_linear_meta(const at::Tensor& x, const at::Tensor& weight, int64_t out_features,
                          std::optional<at::ScalarType> out_dtype) {
  return at::empty(out_shape(x, out_features),
                   x.options().dtype(out_dtype.value_or(at::kBFloat16)));
}

}  // namespace
}  // namespace hpu_serve

TORCH_LIBRARY_FRAGMENT(hpu_serve, m) {
  m.def("q8_linear(Tensor x, Tensor weight, int out_features, ScalarType? out_dtype=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(hpu_serve, CPU, m) { m.impl("q8_linear", &hpu_serve::q8_linear); }

TORCH_LIBRARY_IMPL(hpu_serve, Meta, m) { m.impl("q8_linear", &hpu_serve::q8_linear_meta); }
