// y = x W^T for a weight held as 4-bit codes (torch.ops.hpu_serve.int4_linear), for the few
// rows of a decode or speculative-verify step.
//
// Why it exists: aten's _weight_int4pack_mm_for_cpu unpacks the weight again for every
// small block of rows, so a 4-row verify step cost ~1.8 one-row steps. Here each group of
// codes is unpacked once, into registers, and applied to every row of the call: the weight
// is read and decoded once whatever the row count.
//
// Numerics, the point of the kernel: a row's output is the same bits whatever the number of
// rows in the call (and whatever the thread count), so a speculative verify step of k + 1
// rows scores every draft exactly as a plain one-row decode step would, and greedy text with
// speculation is plain decoding's. Each row is accumulated on its own, in fp32, in one fixed
// order: per group of `group` inputs and per output column,
//   part = sum_k x[k] * (q[k] - 8)            (exact products added one by one, in order)
//   acc  = fma(part, scale, acc); acc = fma(zero, sum_k x[k], acc)   (groups ascending)
// which is sum_k x[k] * ((q[k] - 8) * scale + zero), the dequantized weight times x, up to
// fp32 rounding (tests/hpu/cpu/test_int4_gemm.py checks it against float64).
//
// Products: x is bf16 and (q - 8) is exact in bf16, so the kernel multiplies with
// vdpbf16ps (AVX512-BF16: 32 products per instruction into fp32, each product exact); the
// portable path does the same arithmetic with fmas.
//
// Packed layout (server/hpu/cpu/int4_pack.py prepacks it once at load time): output
// columns in tiles of 16 (one 16-lane fp32 vector; N padded to a multiple of 16), and per
// tile and input group one block of bytes, read as one sequential stream:
//   codes       group / 2 bytes: for inputs 4r .. 4r + 3, 32 bytes; byte 2j + e holds
//               column j's codes for input 4r + e (low nibble) and 4r + 2 + e (high), so
//               the low nibbles widen to the bf16 pairs vdpbf16ps takes, and so do the high;
//   scale_zero  float32 [Z, 16]: Z = 2 (scale, zero), or Z = 1 (scale only: every zero is
//               0, as in GGUF Q4_0; saves its bytes and fma).

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>
#include <vector>

#include "kernel_utils.h"

#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace hpu_serve {
namespace {

constexpr int64_t kTile = 16;    // output columns per vector
constexpr int64_t kMaxRows = 8;  // rows per pass over the weight (register budget)

// 32 code bytes -> two vectors of bf16 (q - 8): the low nibbles (inputs 4r, 4r + 1) and the
// high ones (4r + 2, 4r + 3), exact on every path.
inline void decode_quad(const uint8_t* bytes, u16x32& lo, u16x32& hi) {
#if defined(__AVX512BW__)
  // vpermw reads an index's low 5 bits: with the table repeated in its upper half, the low
  // nibble needs no mask.
  const __m512i table = _mm512_set_epi16(
      0x40E0, 0x40C0, 0x40A0, 0x4080, 0x4040, 0x4000, 0x3F80, 0x0000, 0xBF80, 0xC000, 0xC040,
      0xC080, 0xC0A0, 0xC0C0, 0xC0E0, 0xC100, 0x40E0, 0x40C0, 0x40A0, 0x4080, 0x4040, 0x4000,
      0x3F80, 0x0000, 0xBF80, 0xC000, 0xC040, 0xC080, 0xC0A0, 0xC0C0, 0xC0E0, 0xC100);
  const __m512i wide =
      _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes)));
  lo = reinterpret_cast<u16x32>(_mm512_permutexvar_epi16(wide, table));
  hi = reinterpret_cast<u16x32>(_mm512_permutexvar_epi16(_mm512_srli_epi16(wide, 4), table));
#else
  for (int i = 0; i < 32; ++i) {
    lo[i] = float_to_bf16_bits(static_cast<float>((bytes[i] & 15) - 8));
    hi[i] = float_to_bf16_bits(static_cast<float>((bytes[i] >> 4) - 8));
  }
#endif
}

struct Problem {
  const uint32_t* x;      // [rows, K / 2]: bf16 input pairs
  const float* xsum;      // [rows, groups]: sum of x over each group (zero term)
  const uint8_t* weight;  // [tiles, groups, block]: see the header
  int64_t k, group, groups, z, block, n;
};

// Rows [row0, row0 + M) against output tile t: one pass over the tile's blocks, each code
// decoded once for the M rows.
template <int M, typename O>
void tile_rows(const Problem& p, int64_t row0, int64_t t, O* out) {
  f32x16 acc[M];
  for (int m = 0; m < M; ++m) acc[m] = f32x16{};
  const int64_t quads = p.group / 4;
  const int64_t half = p.k / 2;
  const uint32_t* x = p.x + row0 * half;
  for (int64_t g = 0; g < p.groups; ++g) {
    f32x16 part[M];
    for (int m = 0; m < M; ++m) part[m] = f32x16{};
    const uint8_t* block = p.weight + (t * p.groups + g) * p.block;
    for (int64_t q = 0; q < quads; ++q) {
      const int64_t r = g * quads + q;  // inputs 4r .. 4r + 3
      u16x32 lo, hi;
      decode_quad(block + q * 2 * kTile, lo, hi);
      for (int m = 0; m < M; ++m) {
        part[m] = dot_pair(part[m], lo, x[m * half + 2 * r]);
        part[m] = dot_pair(part[m], hi, x[m * half + 2 * r + 1]);
      }
    }
    const float* sz = reinterpret_cast<const float*>(block + quads * 2 * kTile);
    const f32x16 scale = load16(sz);
    for (int m = 0; m < M; ++m) acc[m] = fma16(part[m], scale, acc[m]);
    if (p.z == 2) {
      const f32x16 zero = load16(sz + kTile);
      for (int m = 0; m < M; ++m) {
        acc[m] = fma16(zero, splat(p.xsum[(row0 + m) * p.groups + g]), acc[m]);
      }
    }
  }
  const int64_t col = t * kTile;
  for (int m = 0; m < M; ++m) {
    O* row = out + (row0 + m) * p.n;
    for (int64_t l = 0; l < kTile && col + l < p.n; ++l) store(row, col + l, acc[m][l]);
  }
}

// Tiles [begin, end) one at a time: a tile's blocks are one sequential stream (measured
// faster than interleaving 2 or 4 tiles' accumulator chains, from 1 row on).
template <int M, typename O>
void rows_pass(const Problem& p, int64_t row0, int64_t begin, int64_t end, O* out) {
  for (int64_t t = begin; t < end; ++t) tile_rows<M>(p, row0, t, out);
}

// Bytes of one (tile, group) block: the codes, then Z vectors of 16 floats.
int64_t block_bytes(int64_t group, int64_t z) { return group / 4 * 2 * kTile + z * kTile * 4; }

template <typename O>
void int4_linear_impl(const at::Tensor& x, const at::Tensor& weight, int64_t group, int64_t z,
                      at::Tensor& out) {
  const int64_t k = x.size(-1);
  const int64_t rows = x.numel() / k;
  const int64_t groups = k / group;
  // Each group's sum of x for the zero term: per row, one fixed sequential order, so a
  // row's values do not depend on the others.
  std::vector<float> xsum(z == 2 ? rows * groups : 0);
  const BFloat16* xp = x.data_ptr<BFloat16>();
  for (int64_t r = 0; r < rows && z == 2; ++r) {
    for (int64_t g = 0; g < groups; ++g) {
      float s = 0.f;
      for (int64_t i = 0; i < group; ++i) s += load(xp, r * k + g * group + i);
      xsum[r * groups + g] = s;
    }
  }
  const Problem p{reinterpret_cast<const uint32_t*>(xp), xsum.data(),
                  weight.data_ptr<uint8_t>(), k, group, groups, z, block_bytes(group, z),
                  out.size(-1)};
  O* op = out.data_ptr<O>();
  at::parallel_for(0, weight.size(0), 4, [&](int64_t begin, int64_t end) {
    for (int64_t r = 0; r < rows; r += kMaxRows) {
      dispatch_rows(std::min(kMaxRows, rows - r),
                    [&](auto m) { rows_pass<decltype(m)::value>(p, r, begin, end, op); });
    }
  });
}

// The number of (scale, zero) vectors per block (1 or 2) that `weight` was packed with.
int64_t check_packed(const at::Tensor& x, const at::Tensor& weight, int64_t group,
                     int64_t out_features) {
  const int64_t k = x.size(-1);
  TORCH_CHECK(group > 0 && group % 4 == 0 && k % group == 0,
              "group_size must be a multiple of 4 that divides in_features (", k, "), got ",
              group);
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == at::kByte &&
                  weight.dim() == 3 && weight.size(1) == k / group && weight.is_contiguous(),
              "weight must be a contiguous uint8 CPU tensor [tiles, in_features / group_size, "
              "block]");
  const int64_t z = weight.size(2) == block_bytes(group, 1) ? 1 : 2;
  TORCH_CHECK(weight.size(2) == block_bytes(group, z),
              "weight's blocks must hold group_size / 2 code bytes and 1 or 2 x 16 floats");
  TORCH_CHECK(out_features > (weight.size(0) - 1) * kTile &&
                  out_features <= weight.size(0) * kTile,
              "out_features must end in the last 16-column tile");
  return z;
}

// out_dtype float32 returns the fp32 accumulators unrounded (tests: a row's bits can then be
// compared before bf16 rounding hides most differences).
at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& weight, int64_t group_size,
                       int64_t out_features, std::optional<at::ScalarType> out_dtype) {
  TORCH_CHECK(x.device().is_cpu() && x.is_contiguous() && x.scalar_type() == at::kBFloat16,
              "x must be a contiguous bfloat16 CPU tensor");
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) > 0, "x must have a non-empty last dim");
  const int64_t z = check_packed(x, weight, group_size, out_features);
  const at::ScalarType dtype = out_dtype.value_or(at::kBFloat16);
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kFloat,
              "out_dtype must be bfloat16 or float32");
  at::Tensor out = at::empty(out_shape(x, out_features), x.options().dtype(dtype));
  if (x.numel() == 0) return out;
  if (dtype == at::kFloat) {
    int4_linear_impl<float>(x, weight, group_size, z, out);
  } else {
    int4_linear_impl<BFloat16>(x, weight, group_size, z, out);
  }
  return out;
}

// Shapes only (fake tensors, torch.compile tracing): the op stays one opaque call.
at::Tensor int4_linear_meta(const at::Tensor& x, const at::Tensor& weight, int64_t group_size,
                            int64_t out_features, std::optional<at::ScalarType> out_dtype) {
  return at::empty(out_shape(x, out_features),
                   x.options().dtype(out_dtype.value_or(at::kBFloat16)));
}

}  // namespace
}  // namespace hpu_serve

TORCH_LIBRARY_FRAGMENT(hpu_serve, m) {
  m.def(
      "int4_linear(Tensor x, Tensor weight, int group_size, int out_features, "
      "ScalarType? out_dtype=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(hpu_serve, CPU, m) { m.impl("int4_linear", &hpu_serve::int4_linear); }

TORCH_LIBRARY_IMPL(hpu_serve, Meta, m) { m.impl("int4_linear", &hpu_serve::int4_linear_meta); }
