// Paged attention over KV caches stored in fp8 e4m3 (--kv-cache-dtype fp8): each key and
// value is widened to fp32 as it is loaded (load16 in kernel_utils.h), so the cache is read
// at half the bytes of bf16 and never copied. Unscaled, as the caches are written (see
// rotary_write_kv): the PyTorch path's `.to(query.dtype)` upcast, exactly.

#include "paged_attention.h"

namespace hpu_serve {

void attention_fp8_cache(const AttentionArgs& a) {
  if (a.query.scalar_type() == at::kBFloat16) {
    attention_dispatch<BFloat16, Float8_e4m3fn, true>(a);
  } else {
    attention_dispatch<float, Float8_e4m3fn, false>(a);
  }
}

}  // namespace hpu_serve
