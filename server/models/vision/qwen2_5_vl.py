"""Qwen2.5-VL's vision transformer: patches of ``T x p x p`` pixels embedded by one linear
map (the checkpoint's Conv3d, whose stride equals its kernel), 2-D rotary embeddings (height
and width halves of each head), window attention in most blocks and full attention in
``fullatt_block_indexes``, RMSNorm and SwiGLU MLPs, then a merger of each
``merge x merge`` patch group into one row of the language model's embeddings.

Static shapes: every image of an encoder call is packed into one sequence of a planned
number of patches (a bucket), padded at the end. Which patches attend to which is data, not
shape: a window id and an image id per patch, compared into masks inside the graph, so one
compiled graph serves every mix of image sizes that fits its bucket. The packing
(:func:`pack_images`) runs on the host; parameter names follow Hugging Face's ``visual.*``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from server.models.errors import ModelFileError
from server.models.vision.qwen2_5_vl_config import QwenVisionConfig

# the window / image id of padding patches: they see each other only
_PAD = -1


class _RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class _PatchEmbed(nn.Module):
    def __init__(self, cfg: QwenVisionConfig) -> None:
        super().__init__()
        kernel = (cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
        self.proj = nn.Conv3d(cfg.num_channels, cfg.hidden_size, kernel, stride=kernel,
                              bias=False)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        # a kernel-sized stride over one kernel-sized input is a matmul with the weight
        # flattened in the processor's (channel, time, row, column) order
        weight = self.proj.weight
        return F.linear(patches.to(weight.dtype), weight.reshape(weight.shape[0], -1))


class _Attention(nn.Module):
    def __init__(self, cfg: QwenVisionConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size)
        self.proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, -1).unbind(1)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1),
                                             v.transpose(0, 1), attn_mask=mask)
        return self.proj(out.transpose(0, 1).reshape(n, -1))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE in float32 (as the reference), back in x's dtype."""
    h = x.float()
    half = h.shape[-1] // 2
    rotated = torch.cat((-h[..., half:], h[..., :half]), dim=-1)
    return (h * cos + rotated * sin).to(x.dtype)


class _MLP(nn.Module):
    def __init__(self, cfg: QwenVisionConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _Block(nn.Module):
    def __init__(self, cfg: QwenVisionConfig) -> None:
        super().__init__()
        self.norm1 = _RMSNorm(cfg.hidden_size)
        self.norm2 = _RMSNorm(cfg.hidden_size)
        self.attn = _Attention(cfg)
        self.mlp = _MLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, mask)
        return x + self.mlp(self.norm2(x))


class _Merger(nn.Module):
    def __init__(self, cfg: QwenVisionConfig) -> None:
        super().__init__()
        self.width = cfg.hidden_size * cfg.merge_unit
        self.ln_q = _RMSNorm(cfg.hidden_size)
        self.mlp = nn.Sequential(nn.Linear(self.width, self.width), nn.GELU(),
                                 nn.Linear(self.width, cfg.text_hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.width))


class QwenVision(nn.Module):
    """Packed patches -> language-model rows, a pure function of tensors (one compiled
    graph per patch bucket). Inputs (all ``[P]`` long, ``P`` a multiple of the merge
    unit, in window order, from :func:`pack_images`): the patches ``[P, patch_dim]``, their
    (row, column) ``[P, 2]``, window and image ids; ``order`` ``[P / unit]`` puts the
    merged rows back in each image's reading order."""

    def __init__(self, cfg: QwenVisionConfig) -> None:
        super().__init__()
        self.config = cfg
        self.patch_embed = _PatchEmbed(cfg)
        self.blocks = nn.ModuleList(_Block(cfg) for _ in range(cfg.num_layers))
        self.merger = _Merger(cfg)
        # a quarter of each head's frequencies per axis: rows, then columns
        quarter = cfg.head_dim // 2
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, quarter, 2, dtype=torch.float)
                                             / quarter))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.full = frozenset(cfg.fullatt_block_indexes)

    def forward(self, patches: torch.Tensor, coords: torch.Tensor, windows: torch.Tensor,
                images: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(patches)
        freqs = (coords.unsqueeze(-1).float() * self.inv_freq).flatten(1)  # [P, head/2]
        angles = torch.cat((freqs, freqs), dim=-1).unsqueeze(1)  # [P, 1, head]
        cos, sin = angles.cos(), angles.sin()
        window_mask = windows.unsqueeze(1) == windows.unsqueeze(0)
        image_mask = images.unsqueeze(1) == images.unsqueeze(0)
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, image_mask if i in self.full else window_mask)
        return self.merger(x).index_select(0, order)


@dataclass(frozen=True, slots=True)
class PackedImages:
    """One encoder call's inputs (see :class:`QwenVision`) and each image's row count."""

    patches: torch.Tensor
    coords: torch.Tensor
    windows: torch.Tensor
    images: torch.Tensor
    order: torch.Tensor
    rows: tuple[int, ...]

    @property
    def inputs(self) -> tuple[torch.Tensor, ...]:
        return self.patches, self.coords, self.windows, self.images, self.order

    def to(self, device: torch.device, dtype: torch.dtype) -> PackedImages:
        return PackedImages(self.patches.to(device, dtype), self.coords.to(device),
                            self.windows.to(device), self.images.to(device),
                            self.order.to(device), self.rows)


def _windows(t: int, h: int, w: int, side: int) -> list[torch.Tensor]:
    """An image's merged units (``t x h x w``, reading order) grouped into windows of
    ``side x side`` units: per frame, window rows then columns, each read row by row."""
    units = torch.arange(t * h * w).view(t, h, w)
    return [units[f, y:y + side, x:x + side].reshape(-1)
            for f in range(t) for y in range(0, h, side) for x in range(0, w, side)]


def pack_images(cfg: QwenVisionConfig, pixels: Sequence[torch.Tensor],
                grids: Sequence[tuple[int, int, int]], size: int | None = None
                ) -> PackedImages:
    """Images (each ``[patches, patch_dim]`` in the processor's order, its grid of merged
    units ``(t, h, w)``) packed into one call of ``size`` patches (None: no padding)."""
    m, unit = cfg.spatial_merge_size, cfg.merge_unit
    # (row, column) of each patch in the processor's order: merged unit after merged unit,
    # each unit's m x m patches row by row
    dy, dx = torch.meshgrid(torch.arange(m), torch.arange(m), indexing="ij")
    unit_order: list[torch.Tensor] = []
    coords: list[torch.Tensor] = []
    window_ids: list[torch.Tensor] = []
    image_ids: list[torch.Tensor] = []
    first_unit = 0
    window = 0
    for image, (t, h, w) in enumerate(grids):
        uy, ux = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        rc = torch.stack([(uy.reshape(-1, 1) * m + dy.reshape(1, -1)),
                          (ux.reshape(-1, 1) * m + dx.reshape(1, -1))], dim=-1)
        rc = rc.reshape(-1, 2).repeat(t, 1)  # [t * h * w * unit, 2], reading order
        for units in _windows(t, h, w, cfg.window_units):
            unit_order.append(units + first_unit)
            patch = (units.unsqueeze(1) * unit + torch.arange(unit)).reshape(-1)
            coords.append(rc[patch])
            window_ids.append(torch.full((len(patch),), window))
            image_ids.append(torch.full((len(patch),), image))
            window += 1
        first_unit += t * h * w
    total = first_unit * unit
    size = total if size is None else size
    if size < total or size % unit:
        raise ValueError(f"{total} patches do not fit an encoder call of {size}")
    units_in_order = torch.cat(unit_order)
    gather = (units_in_order.unsqueeze(1) * unit + torch.arange(unit)).reshape(-1)
    flat = torch.cat([p.reshape(-1, cfg.patch_dim) for p in pixels])
    pad = size - total
    patches = torch.zeros(size, cfg.patch_dim, dtype=flat.dtype)
    patches[:total] = flat[gather]
    order = torch.cat([torch.argsort(units_in_order),
                       torch.arange(first_unit, size // unit)])
    fill = torch.full((pad,), _PAD, dtype=torch.long)
    rows = tuple(t * h * w for t, h, w in grids)
    return PackedImages(patches, torch.cat(coords + [torch.zeros(pad, 2, dtype=torch.long)]),
                        torch.cat(window_ids + [fill]), torch.cat(image_ids + [fill]),
                        order, rows)


def vision_tensor_name(name: str) -> str | None:
    """A checkpoint tensor's name in :class:`QwenVision` (``model.visual.*`` in transformers
    5's files, ``visual.*`` in older ones), or None for a language-model tensor."""
    name = name.removeprefix("model.")
    if name.startswith("visual."):
        return name.removeprefix("visual.")
    return None


def load_vision(module: QwenVision, tensors: dict[str, torch.Tensor], where: str,
                dry_run: bool = False) -> None:
    """Copies the tower's tensors in; a stray, missing or misshapen one is a
    ModelFileError naming it."""
    params = dict(module.named_parameters())
    for name, tensor in tensors.items():
        target = params.get(name)
        if target is None:
            raise ModelFileError(f"model file {where}: tensor 'visual.{name}' has no place "
                                 "in the Qwen2.5-VL vision tower")
        if tuple(target.shape) != tuple(tensor.shape):
            raise ModelFileError(f"model file {where}: tensor 'visual.{name}' has shape "
                                 f"{list(tensor.shape)}, the config calls for "
                                 f"{list(target.shape)}")
        if not dry_run:
            with torch.no_grad():
                target.copy_(tensor)
    missing = sorted(set(params) - set(tensors))
    if missing:
        raise ModelFileError(f"model file {where}: the checkpoint lacks vision weights "
                             f"{', '.join('visual.' + m for m in missing[:6])}")
