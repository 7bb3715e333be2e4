"""Engine core: scheduling, paged KV bookkeeping, model running, sampling, outputs."""
