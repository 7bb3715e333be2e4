// The batched LoRA delta of one projection in one call (torch.ops.hpu_serve.lora_add_):
// y[t] += (x[t] A_s^T) B_s^T for each row t of adapter slot s, rows without adapter (slot -1)
// untouched. See server/models/lora/ops.py for the layout and the PyTorch op this replaces.
//
// Why it exists: the PyTorch op runs 4-5 small GEMMs, a mask and a concatenation per
// projection (17 ops a layer); at decode sizes (16 rows, 16-192 columns) each costs ~60 us
// of dispatch and ATen's unpacked bf16 GEMM setup, several times its arithmetic. Here the
// rows are grouped by slot on the host side of the kernel, each present slot's A and B^T
// are read once for all its rows, and slots no row uses are not read at all (the PyTorch op
// multiplies every slot and masks). The slot of each row is data, so one compiled graph
// serves any mix of adapters.
//
// Rounding follows the PyTorch op: the shrink accumulates in fp32 and rounds h to the model
// dtype (F.linear's output), the expand accumulates h B^T in fp32 onto y and rounds once
// (addmm's beta = 1).

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <vector>

#include "kernel_utils.h"

namespace hpu_serve {
namespace {

inline float sum16(f32x16 v) {
  float s = 0.f;
  for (int l = 0; l < 16; ++l) s += v[l];
  return s;
}

// 16 lanes rounded to T's storage (bf16 as PyTorch's cast rounds)
inline void put16(float* p, f32x16 v) { store16(p, v); }
inline void put16(BFloat16* p, f32x16 v) {
  u32x16 u;
  std::memcpy(&u, &v, sizeof(u));
  const u32x16 nearest_even = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  const u32x16 bits = (u & 0x7FFFFFFFu) > 0x7F800000u ? u32x16{} + 0x7FC0u : nearest_even;
  const u16x16 h = __builtin_convertvector(bits, u16x16);
  std::memcpy(p, &h, sizeof(h));
}

// One expand job: columns [begin, end) of part p.
struct Columns {
  int64_t part, begin, end;
};

// Rows go through in tiles of up to kTile rows of one slot: each A row and each B^T vector
// is loaded (and widened) once per tile, the tile's rows widened to fp32 once per part.
constexpr int64_t kTile = 4;

// h[b * stride + r] = dot(A row r, x_b) for the NB fp32 rows of xf ([NB, n]), rounded to T.
template <int NB, typename T>
void shrink_tile(const T* a, const float* xf, int64_t n, int64_t rank, float* h,
                 int64_t stride) {
  const int64_t whole = n / 16 * 16;
  for (int64_t r = 0; r < rank; ++r) {
    const T* ar = a + r * n;
    f32x16 acc[NB];
    for (int b = 0; b < NB; ++b) acc[b] = f32x16{};
    for (int64_t i = 0; i < whole; i += 16) {
      const f32x16 av = load16(ar + i);
      for (int b = 0; b < NB; ++b) acc[b] += av * load16(xf + b * n + i);
    }
    for (int b = 0; b < NB; ++b) {
      float sum = sum16(acc[b]);
      for (int64_t i = whole; i < n; ++i) sum += load(ar, i) * xf[b * n + i];
      h[b * stride + r] = rounded<T>(sum);
    }
  }
}

// y_b[c .. end) += h_b B^T[:, c .. end) for the NB rows of a tile (hk[b]: row b's rank
// values of this part), 16 columns at a time in fp32 registers, each B^T vector loaded once.
template <int NB, typename T>
void expand_tile(const float* const* hk, T* const* yr, const T* b, int64_t rank, int64_t out,
                 int64_t c, int64_t end) {
  for (; c + 16 <= end; c += 16) {
    f32x16 acc[NB];
    for (int t = 0; t < NB; ++t) acc[t] = load16(yr[t] + c);
    for (int64_t r = 0; r < rank; ++r) {
      const f32x16 bv = load16(b + r * out + c);
      for (int t = 0; t < NB; ++t) acc[t] += hk[t][r] * bv;
    }
    for (int t = 0; t < NB; ++t) put16(yr[t] + c, acc[t]);
  }
  for (; c < end; ++c) {
    for (int t = 0; t < NB; ++t) {
      float v = load(yr[t], c);
      for (int64_t r = 0; r < rank; ++r) v += hk[t][r] * load(b, r * out + c);
      store(yr[t], c, v);
    }
  }
}

// Calls F<NB> for the tile's row count (1 .. kTile) as a compile-time constant.
template <template <int> class F, typename... Args>
void by_count(int64_t count, Args&&... args) {
  switch (count) {
    case 4: F<4>::run(args...); break;
    case 3: F<3>::run(args...); break;
    case 2: F<2>::run(args...); break;
    default: F<1>::run(args...); break;
  }
}

template <typename T>
struct Shrink {
  template <int NB>
  struct At {
    static void run(const T* a, const float* xf, int64_t n, int64_t rank, float* h,
                    int64_t stride) {
      shrink_tile<NB, T>(a, xf, n, rank, h, stride);
    }
  };
};

template <typename T>
struct Expand {
  template <int NB>
  struct At {
    static void run(const float* const* hk, T* const* yr, const T* b, int64_t rank,
                    int64_t out, int64_t c, int64_t end) {
      expand_tile<NB, T>(hk, yr, b, rank, out, c, end);
    }
  };
};

// A tile: rows order[first .. first + count) of slot s, count <= kTile.
struct Tile {
  int64_t slot, first, count;
};

template <typename T>
void lora_add_impl(at::Tensor& y, const at::Tensor& x, const at::Tensor& a,
                   const at::Tensor& bt, const int64_t* slot, const std::vector<int64_t>& parts) {
  const int64_t tokens = x.size(0), in = x.size(1);
  const int64_t num_parts = a.size(0), num_slots = a.size(1), rank = a.size(2);
  const int64_t out = bt.size(2);
  // rows grouped by slot (a counting sort): order[start[s] .. start[s + 1]) are slot s's
  std::vector<int64_t> start(num_slots + 1, 0);
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(slot[t] >= -1 && slot[t] < num_slots, "slot index ", slot[t], " of row ", t,
                " is not in -1 .. ", num_slots - 1);
    if (slot[t] >= 0) ++start[slot[t] + 1];
  }
  for (int64_t s = 0; s < num_slots; ++s) start[s + 1] += start[s];
  const int64_t active = start[num_slots];
  if (active == 0) return;  // no row has an adapter: nothing to read or add
  std::vector<int64_t> order(active);
  {
    std::vector<int64_t> fill(start.begin(), start.end() - 1);
    for (int64_t t = 0; t < tokens; ++t) {
      if (slot[t] >= 0) order[fill[slot[t]]++] = t;
    }
  }
  std::vector<Tile> tiles;  // only the slots some row uses
  for (int64_t s = 0; s < num_slots; ++s) {
    for (int64_t k = start[s]; k < start[s + 1]; k += kTile) {
      tiles.push_back({s, k, std::min(kTile, start[s + 1] - k)});
    }
  }
  const int64_t num_tiles = static_cast<int64_t>(tiles.size());
  const T* xp = x.data_ptr<T>();
  const T* ap = a.data_ptr<T>();
  const T* bp = bt.data_ptr<T>();
  T* yp = y.data_ptr<T>();

  // shrink: h[k, p, :] = A[p, s] x[order[k]] (k: the row's place in order), rounded to T;
  // one job per (tile, part)
  const int64_t stride = num_parts * rank;
  std::vector<float> h(active * stride);
  at::parallel_for(0, num_tiles * num_parts, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> xf(kTile * in);
    for (int64_t j = begin; j < end; ++j) {
      const Tile tile = tiles[j / num_parts];
      const int64_t p = j % num_parts;
      for (int64_t b = 0; b < tile.count; ++b) {
        const T* row = xp + order[tile.first + b] * in;
        for (int64_t i = 0; i < in; ++i) xf[b * in + i] = load(row, i);
      }
      by_count<Shrink<T>::template At>(tile.count, ap + (p * num_slots + tile.slot) * rank * in,
                                       xf.data(), in, rank, h.data() + tile.first * stride +
                                       p * rank, stride);
    }
  });

  // expand: y[t, cols of p] += h[k, p, :] B^T[s, :, cols]; one job per 64-column range of
  // a part, walking every tile
  std::vector<Columns> jobs;
  constexpr int64_t kWidth = 64;
  for (int64_t p = 0, col = 0; p < num_parts; col += parts[p], ++p) {
    for (int64_t c = col; c < col + parts[p]; c += kWidth) {
      jobs.push_back({p, c, std::min(c + kWidth, col + parts[p])});
    }
  }
  at::parallel_for(0, static_cast<int64_t>(jobs.size()), 4, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
      const Columns cols = jobs[j];
      for (const Tile& tile : tiles) {
        const float* hk[kTile];
        T* yr[kTile];
        for (int64_t b = 0; b < tile.count; ++b) {
          hk[b] = h.data() + (tile.first + b) * stride + cols.part * rank;
          yr[b] = yp + order[tile.first + b] * out;
        }
        by_count<Expand<T>::template At>(tile.count, hk, yr, bp + tile.slot * rank * out, rank,
                                         out, cols.begin, cols.end);
      }
    }
  });
}

// y [T, out] += each row's LoRA delta, in place. x [T, in]; a [P, S, R, in] (part p's
// shrink rows of each slot); bt [S, R, out] (part p writes only its own columns,
// sum(parts[:p]) ..); slot [T] int64, each row's slot 0 .. S-1 or -1 (no adapter); parts:
// the P output widths.
void lora_add_(at::Tensor& y, const at::Tensor& x, const at::Tensor& a, const at::Tensor& bt,
               const at::Tensor& slot, at::IntArrayRef parts) {
  check_rows(y, "y");
  check_rows(x, "x");
  check_rows(a, "a");
  check_rows(bt, "bt");
  const auto dtype = y.scalar_type();
  TORCH_CHECK(x.scalar_type() == dtype && a.scalar_type() == dtype && bt.scalar_type() == dtype,
              "y, x, a and bt must share a dtype");
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && x.size(0) == y.size(0),
              "x must be [tokens, in] and y [tokens, out]");
  TORCH_CHECK(a.dim() == 4 && a.size(3) == x.size(1) && bt.dim() == 3 &&
                  bt.size(0) == a.size(1) && bt.size(1) == a.size(2) && bt.size(2) == y.size(1),
              "a must be [parts, slots, rank, in] and bt [slots, rank, out]");
  TORCH_CHECK(static_cast<int64_t>(parts.size()) == a.size(0), "parts must give ", a.size(0),
              " widths");
  int64_t total = 0;
  for (const int64_t w : parts) {
    TORCH_CHECK(w > 0, "part widths must be positive");
    total += w;
  }
  TORCH_CHECK(total == y.size(1), "part widths must add up to y's width");
  TORCH_CHECK(slot.scalar_type() == at::kLong && slot.is_contiguous() &&
                  slot.numel() == x.size(0) && slot.device().is_cpu(),
              "slot must be a CPU int64 [tokens]");
  const std::vector<int64_t> widths(parts.begin(), parts.end());
  if (dtype == at::kBFloat16) {
    lora_add_impl<BFloat16>(y, x, a, bt, slot.data_ptr<int64_t>(), widths);
  } else {
    lora_add_impl<float>(y, x, a, bt, slot.data_ptr<int64_t>(), widths);
  }
}

}  // namespace
}  // namespace hpu_serve

TORCH_LIBRARY_FRAGMENT(hpu_serve, m) {
  m.def(
      "lora_add_(Tensor(a!) y, Tensor x, Tensor a, Tensor bt, Tensor slot, int[] parts) "
      "-> ()");
}

TORCH_LIBRARY_IMPL(hpu_serve, CPU, m) { m.impl("lora_add_", &hpu_serve::lora_add_); }
