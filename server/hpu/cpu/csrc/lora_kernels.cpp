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

// out[b] = dot(a, x_b) for NB rows x_b = x + rows[b] * n, 16 lanes at a time: the A row is
// loaded once for every row of the block.
template <int NB, typename T>
void dot_block(const T* a, const T* x, const int64_t* rows, int64_t n, float* out) {
  const T* xr[NB];
  f32x16 acc[NB];
  for (int b = 0; b < NB; ++b) {
    xr[b] = x + rows[b] * n;
    acc[b] = f32x16{};
  }
  const int64_t whole = n / 16 * 16;
  for (int64_t i = 0; i < whole; i += 16) {
    const f32x16 av = load16(a + i);
    for (int b = 0; b < NB; ++b) acc[b] += av * load16(xr[b] + i);
  }
  for (int b = 0; b < NB; ++b) {
    float s = sum16(acc[b]);
    for (int64_t i = whole; i < n; ++i) s += load(a, i) * load(xr[b], i);
    out[b] = s;
  }
}

template <typename T>
void dot_rows(const T* a, const T* x, const int64_t* rows, int64_t count, int64_t n,
              float* out) {
  int64_t b = 0;
  for (; b + 4 <= count; b += 4) dot_block<4>(a, x, rows + b, n, out + b);
  switch (count - b) {
    case 3: dot_block<3>(a, x, rows + b, n, out + b); break;
    case 2: dot_block<2>(a, x, rows + b, n, out + b); break;
    case 1: dot_block<1>(a, x, rows + b, n, out + b); break;
    default: break;
  }
}

// One expand job: columns [begin, end) of part p (begin a multiple of 16 from the part's
// start, or the tail).
struct Columns {
  int64_t part, begin, end;
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
  std::vector<int64_t> present;  // the slots some row uses
  for (int64_t s = 0; s < num_slots; ++s) {
    if (start[s + 1] > start[s]) present.push_back(s);
  }
  const T* xp = x.data_ptr<T>();
  const T* ap = a.data_ptr<T>();
  const T* bp = bt.data_ptr<T>();
  T* yp = y.data_ptr<T>();

  // shrink: h[k, p, r] = x[order[k]] . A[p, s, r] (k: the row's place in order), rounded
  // to T; one job per (present slot, part, rank row) reads its A row once
  std::vector<float> h(active * num_parts * rank);
  const int64_t shrink_jobs = static_cast<int64_t>(present.size()) * num_parts * rank;
  at::parallel_for(0, shrink_jobs, 8, [&](int64_t begin, int64_t end) {
    std::vector<float> dots(tokens);
    for (int64_t j = begin; j < end; ++j) {
      const int64_t s = present[j / (num_parts * rank)];
      const int64_t p = j / rank % num_parts, r = j % rank;
      const int64_t first = start[s], count = start[s + 1] - first;
      dot_rows(ap + ((p * num_slots + s) * rank + r) * in, xp, order.data() + first, count, in,
               dots.data());
      for (int64_t k = 0; k < count; ++k) {
        h[((first + k) * num_parts + p) * rank + r] = rounded<T>(dots[k]);
      }
    }
  });

  // expand: y[t, cols of p] += h[k, p, :] B^T[s, :, cols], 16 columns at a time in fp32
  // registers; one job per column range, each walking every present slot's rows
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
      for (const int64_t s : present) {
        const T* b = bp + s * rank * out;
        for (int64_t k = start[s]; k < start[s + 1]; ++k) {
          const float* hk = h.data() + (k * num_parts + cols.part) * rank;
          T* yr = yp + order[k] * out;
          int64_t c = cols.begin;
          for (; c + 16 <= cols.end; c += 16) {
            f32x16 acc = load16(yr + c);
            for (int64_t r = 0; r < rank; ++r) acc += hk[r] * load16(b + r * out + c);
            put16(yr + c, acc);
          }
          for (; c < cols.end; ++c) {
            float v = load(yr, c);
            for (int64_t r = 0; r < rank; ++r) v += hk[r] * load(b, r * out + c);
            store(yr, c, v);
          }
        }
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
