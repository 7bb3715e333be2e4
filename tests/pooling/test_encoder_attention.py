"""The fused encoder attention kernel (``torch.ops.hpu_serve.encoder_attention``) against a
float64 reference over right-padded batches of mixed lengths, and the eager CPU engine
serving BERT through it with sentence-transformers' embeddings."""

from __future__ import annotations

import pytest
import torch

from server.cache_dir import writable_cache_dir
from server.hpu.cpu.kernels import load_cpu_kernels


@pytest.fixture(scope="module")
def kernels() -> None:
    assert load_cpu_kernels(writable_cache_dir() / "kernels"), \
        "the fused CPU kernels did not build (see the log)"


def reference(qkv: torch.Tensor, lengths: torch.Tensor, heads: int) -> torch.Tensor:
    """Row by row in float64: each valid token attends to its row's valid tokens; padding
    positions (and rows of length 0) are zeros."""
    bs, n, width = qkv.shape
    dim = width // 3 // heads
    out = torch.zeros(bs, n, heads * dim, dtype=torch.float64)
    for b in range(bs):
        m = int(lengths[b])
        if m == 0:
            continue
        q, k, v = (t.reshape(m, heads, dim).transpose(0, 1)
                   for t in qkv[b, :m].double().split(heads * dim, dim=-1))
        p = torch.softmax(q @ k.transpose(1, 2) * dim ** -0.5, dim=-1)
        out[b, :m] = (p @ v).transpose(0, 1).reshape(m, heads * dim)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "dim", "n"), [(4, 16, 37), (12, 32, 128), (2, 64, 70),
                                                 (3, 96, 33), (2, 128, 9)])
def test_matches_reference(kernels, dtype: torch.dtype, heads: int, dim: int, n: int) -> None:
    torch.manual_seed(heads * dim + n)
    lengths = torch.tensor([n, 0, 1, n // 2 + 1, n - 1])
    qkv = torch.randn(len(lengths), n, 3 * heads * dim).to(dtype)
    # padding positions hold garbage: the kernel must never read them
    for b, m in enumerate(lengths.tolist()):
        qkv[b, m:] = float("nan")
    got = torch.ops.hpu_serve.encoder_attention(qkv, lengths, heads, dim ** -0.5)
    assert got.dtype == dtype and got.shape == (len(lengths), n, heads * dim)
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: the output's own rounding
    torch.testing.assert_close(got.double(), reference(qkv, lengths, heads), atol=tol, rtol=tol)


def test_refuses_bad_arguments(kernels) -> None:
    qkv = torch.randn(2, 8, 3 * 4 * 32)
    with pytest.raises(RuntimeError, match="head size"):
        torch.ops.hpu_serve.encoder_attention(torch.randn(2, 8, 3 * 4 * 8), torch.tensor([8, 8]),
                                              4, 1.0)
    with pytest.raises(RuntimeError, match="lengths"):
        torch.ops.hpu_serve.encoder_attention(qkv, torch.tensor([8, 8], dtype=torch.int32),
                                              4, 1.0)
    with pytest.raises(RuntimeError, match="3 \\* heads"):
        torch.ops.hpu_serve.encoder_attention(qkv, torch.tensor([8, 8]), 5, 1.0)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_serves_bert_through_kernel(kernels, st_folder, dtype: str) -> None:
    from sentence_transformers import SentenceTransformer

    from server.engine.llm import LLM
    from tests.pooling.test_parity import TEXTS

    folder = st_folder("bert", "mean", True)
    ref = SentenceTransformer(folder, device="cpu").encode(TEXTS, convert_to_tensor=True)
    llm = LLM(folder, dtype=dtype, max_num_seqs=4, execution_mode="eager")
    attention = llm.engine.loaded.model.encoder.layer[0].attention.self
    assert attention.kernel and attention.qkv is not None  # what ran: the fused path
    got = torch.tensor([o.outputs.embedding for o in llm.embed(TEXTS)])
    cosines = torch.cosine_similarity(got, ref.float(), dim=-1)
    assert cosines.min() >= (0.9999 if dtype == "float32" else 0.999)
