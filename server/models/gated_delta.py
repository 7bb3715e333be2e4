"""The Gated DeltaNet token mixer's arithmetic (Qwen3-Next's linear-attention layers), in
static-shape PyTorch.

Each value head keeps a state ``S [Dk, Dv]``; token ``t`` with key ``k``, value ``v``, query
``q``, decay ``g <= 0`` (log space) and write strength ``beta`` in (0, 1) does::

    S = exp(g) * S                       # forget
    S = S + k (beta * (v - S^T k))^T     # the delta rule: correct what S predicts for k
    o = S^T q

A right-padded batch row leaves its state untouched on its pad positions when they carry
``g = 0`` and ``beta = 0`` (``exp(0) = 1``, nothing written): the caller zeroes them, so
every row's final state is the state after its last real token whatever the padding, and
shapes depend on the bucket only.

:func:`chunked_gated_delta_rule` (prompts) runs the same recurrence a chunk of ``C`` tokens
at a time: within a chunk the delta-rule writes form a unit lower-triangular system (the
"UT transform"), solved once per chunk, so a prompt costs ``q / C`` sequential steps of
matmuls instead of ``q`` steps of outer products. :func:`recurrent_gated_delta_rule` is the
token-by-token form (decode: one token). Both compute in float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK = 64


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _prepare(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor,
             beta: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``[bs, T, H*, D]`` / ``[bs, T, Hv]`` -> float32 ``[bs, Hv, T, D]`` / ``[bs, Hv, T]``,
    key heads repeated over their value heads, q and k L2-normalised, q scaled."""
    groups = value.shape[2] // key.shape[2]
    if groups > 1:  # consecutive value heads share a key head
        query = query.repeat_interleave(groups, dim=2)
        key = key.repeat_interleave(groups, dim=2)
    query, key, value = (t.transpose(1, 2).float() for t in (query, key, value))
    query = _l2norm(query) * query.shape[-1] ** -0.5
    key = _l2norm(key)
    return query, key, value, g.transpose(1, 2).float(), beta.transpose(1, 2).float()


def recurrent_gated_delta_rule(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                               g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k ``[bs, T, Hk, Dk]``, v ``[bs, T, Hv, Dv]``, g, beta ``[bs, T, Hv]``, state
    ``[bs, Hv, Dk, Dv]`` -> (output ``[bs, T, Hv, Dv]`` in v's dtype, final state float32),
    one token at a time."""
    dtype = value.dtype
    q, k, v, g, beta = _prepare(query, key, value, g, beta)
    state = state.float()
    outputs = []
    for t in range(q.shape[2]):
        state = state * g[:, :, t].exp()[..., None, None]
        k_t = k[:, :, t]
        predicted = (state * k_t.unsqueeze(-1)).sum(dim=-2)  # S^T k: [bs, Hv, Dv]
        delta = (v[:, :, t] - predicted) * beta[:, :, t].unsqueeze(-1)
        state = state + k_t.unsqueeze(-1) * delta.unsqueeze(-2)
        outputs.append((state * q[:, :, t].unsqueeze(-1)).sum(dim=-2))
    out = torch.stack(outputs, dim=2)  # [bs, Hv, T, Dv]
    return out.transpose(1, 2).to(dtype), state


def chunked_gated_delta_rule(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor,
                             chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """As :func:`recurrent_gated_delta_rule` (same arguments and results), ``chunk`` tokens
    per sequential step."""
    dtype = value.dtype
    q, k, v, g, beta = _prepare(query, key, value, g, beta)
    bs, heads, length, dk = k.shape
    dv = v.shape[-1]
    chunk = min(chunk, 1 << (length - 1).bit_length())  # a power of two (the inverse's)
    pad = -length % chunk
    if pad:  # zero g and beta: the padding leaves the state as it is
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        g, beta = (F.pad(t, (0, pad)) for t in (g, beta))
    n = (length + pad) // chunk
    q, k, v = (t.reshape(bs, heads, n, chunk, -1) for t in (q, k, v))
    g, beta = g.reshape(bs, heads, n, chunk), beta.reshape(bs, heads, n, chunk)
    k_beta = k * beta.unsqueeze(-1)
    v_beta = v * beta.unsqueeze(-1)
    decay = g.cumsum(dim=-1)  # log of the decay from the chunk's start to each position
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    # exp(decay_i - decay_j) for j <= i, 0 above the diagonal (masked before exp: no inf)
    pair = torch.where(causal, decay.unsqueeze(-1) - decay.unsqueeze(-2), -torch.inf).exp()
    # The writes of a chunk depend on each other through S^T k: with A = strictly lower
    # (beta_i k_i . k_j decayed), the corrected values U solve (I + A) U = beta V, and the
    # keys reading the chunk's initial state W solve (I + A) W = beta K exp(decay).
    inverse = unit_lower_inverse((k_beta @ k.transpose(-1, -2)) * pair)
    values = inverse @ v_beta
    keys = inverse @ (k_beta * decay.exp().unsqueeze(-1))
    intra = (q @ k.transpose(-1, -2)) * pair  # within-chunk attention, causal and decayed
    q_decayed = q * decay.exp().unsqueeze(-1)
    k_to_end = k * (decay[..., -1:] - decay).exp().unsqueeze(-1)
    chunk_decay = decay[..., -1].exp()[..., None, None]
    state = state.float()
    outputs = []
    for i in range(n):
        fresh = values[:, :, i] - keys[:, :, i] @ state  # what the writes add beyond S
        outputs.append(q_decayed[:, :, i] @ state + intra[:, :, i] @ fresh)
        state = state * chunk_decay[:, :, i] + k_to_end[:, :, i].transpose(-1, -2) @ fresh
    out = torch.cat(outputs, dim=2)[:, :, :length]  # [bs, Hv, T, Dv]
    return out.transpose(1, 2).to(dtype), state.reshape(bs, heads, dk, dv)


def unit_lower_inverse(system: torch.Tensor) -> torch.Tensor:
    """``(I + A)^-1`` for ``A`` the strict lower triangle of ``system`` ``[..., n, n]`` (``n``
    a power of two; the diagonal and above are not read), by doubling the inverted diagonal
    blocks: ``[[X, 0], [B, Y]]^-1 = [[X^-1, 0], [-Y^-1 B X^-1, Y^-1]]``, ``log2(n)`` rounds
    of batched matmuls. Measured on CPU it is far faster than ``torch.linalg.
    solve_triangular`` on these many small systems (which took 83% of a prompt's time), and
    it is plain matmuls for every device and compiler."""
    n = system.shape[-1]
    batch = system.shape[:-2]
    inverse = torch.ones(*batch, n, 1, 1, dtype=system.dtype, device=system.device)
    size = 1
    while size < n:
        blocks = n // size
        # each pair's lower-left block: rows of its odd block, columns of its even one
        grid = system.reshape(*batch, blocks, size, blocks, size)
        lower = torch.diagonal(grid[..., 1::2, :, 0::2, :], dim1=-4, dim2=-2)
        lower = lower.permute(*range(len(batch)), -1, -3, -2)  # [..., blocks / 2, s, s]
        top, bottom = inverse[..., 0::2, :, :], inverse[..., 1::2, :, :]
        corner = -(bottom @ lower @ top)
        zeros = torch.zeros_like(top)
        inverse = torch.cat([torch.cat([top, zeros], dim=-1),
                             torch.cat([corner, bottom], dim=-1)], dim=-2)
        size *= 2
    return inverse.reshape(*batch, n, n)


def causal_conv(x: torch.Tensor, previous: torch.Tensor, weight: torch.Tensor,
                lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal convolution then SiLU: x ``[bs, C, T]`` after ``previous``
    ``[bs, C, K - 1]`` (the inputs before it; zeros at a sequence's start), weight
    ``[C, K]`` -> (output ``[bs, C, T]``, the new ``previous``: the ``K - 1`` inputs ending at
    each row's last real position ``lens - 1``)."""
    window = weight.shape[1] - 1
    full = torch.cat([previous.to(x.dtype), x], dim=-1)  # [bs, C, K - 1 + T]
    out = F.silu(F.conv1d(full, weight.unsqueeze(1), groups=weight.shape[0]))
    # input t sits at index t + K - 1 of ``full``: the window ending at lens - 1 starts at lens
    index = lens.view(-1, 1) + torch.arange(window, device=x.device)
    tail = full.gather(2, index.unsqueeze(1).expand(-1, full.shape[1], -1))
    return out, tail
