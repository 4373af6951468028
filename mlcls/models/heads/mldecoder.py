"""ML-Decoder (Ridnik et al., WACV 2023): class queries cross-attend to the backbone's spatial features.

The structure and parameter names are those of the authors' released ``MLDecoder``, so that its state dict
loads both ways (``decoder.embed_standart.*``, ``decoder.query_embed.weight``, ``decoder.layers.0.*``,
``decoder.duplicate_pooling``, ``decoder.duplicate_pooling_bias``)::

    features (B, D, H, W) or tokens (B, N, D)
      -> embed_standart: Linear(D, E) + ReLU                       memory (N, B, E), N = H W
    queries q = query_embed.weight (G, E), fixed (not learnt), broadcast over the batch
      -> one decoder layer without self-attention (the released residual):
         t = norm1(q + dropout1(q)); t = norm2(t + dropout2(CrossAttention(t, memory)))
         t = norm3(t + dropout3(linear2(dropout(relu(linear1(t))))))                            (G, B, E)
      -> group fully-connected: out[b, g, :] = t[g, b, :] @ duplicate_pooling[g]                 (B, G, K)
      -> logits = out.flatten(1)[:, :C] + duplicate_pooling_bias                                    (B, C)

with G = min(num_groups, C) queries and duplicate factor K = ceil(C / G). The layer is called directly:
``nn.TransformerDecoder.forward`` reads ``layers[0].self_attn``, which this layer does not have.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def check_sizes(num_attention_heads: int, **sizes: object) -> None:
    """One ``ValueError`` line for a size of ``sizes`` that is not an integer >= 1, or an ``embed_dim`` that
    is not a multiple of ``num_attention_heads``."""
    for name, value in sizes.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"ML-Decoder {name}={value!r}; expected an integer >= 1")
    if sizes["embed_dim"] % num_attention_heads:
        raise ValueError(
            f"ML-Decoder embed_dim={sizes['embed_dim']}; expected a multiple of its {num_attention_heads} "
            "attention heads"
        )


def decoder_memory(embed_standart: nn.Linear, features: torch.Tensor) -> torch.Tensor:
    """``ReLU(embed_standart(tokens))`` (N, B, E) of features (B, D, H, W) or tokens (B, N, D)."""
    tokens = features.flatten(2).transpose(1, 2) if features.ndim == 4 else features  # (B, N, D)
    return F.relu(embed_standart(tokens)).transpose(0, 1)


class DecoderLayerWithoutSelfAttention(nn.Module):
    """A transformer decoder layer (post-norm) whose self-attention is replaced by ``t + dropout1(t)``.

    ``forward(queries (G, B, E), memory (N, B, E)) -> (G, B, E)``, sequence-first like torch's layers.
    """

    def __init__(
        self, embed_dim: int, num_attention_heads: int, feedforward_dim: int, dropout: float
    ) -> None:
        super().__init__()
        self.multihead_attn = nn.MultiheadAttention(embed_dim, num_attention_heads, dropout=dropout)
        self.linear1 = nn.Linear(embed_dim, feedforward_dim)
        self.linear2 = nn.Linear(feedforward_dim, embed_dim)
        self.norm1 = nn.LayerNorm(embed_dim)
        self.norm2 = nn.LayerNorm(embed_dim)
        self.norm3 = nn.LayerNorm(embed_dim)
        self.dropout = nn.Dropout(dropout)
        self.dropout1 = nn.Dropout(dropout)
        self.dropout2 = nn.Dropout(dropout)
        self.dropout3 = nn.Dropout(dropout)

    def forward(self, queries: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        target = self.norm1(queries + self.dropout1(queries))
        attended = self.multihead_attn(target, memory, memory, need_weights=False)[0]
        target = self.norm2(target + self.dropout2(attended))
        fed = self.linear2(self.dropout(F.relu(self.linear1(target))))
        return self.norm3(target + self.dropout3(fed))


class MLDecoder(nn.Module):
    """ML-Decoder head: ``forward(features (B, D, H, W) or tokens (B, N, D)) -> logits (B, C)``, as the
    module docstring, on ``in_features`` = D channels; G = ``num_groups`` capped at C. The defaults are the
    released ones."""

    def __init__(
        self,
        in_features: int,
        num_classes: int,
        num_groups: int = 100,
        embed_dim: int = 768,
        num_attention_heads: int = 8,
        feedforward_dim: int = 2048,
        dropout: float = 0.1,
    ) -> None:
        super().__init__()
        check_sizes(num_attention_heads, num_groups=num_groups, embed_dim=embed_dim, num_classes=num_classes)
        num_groups = min(num_groups, num_classes)
        self.num_classes = num_classes
        # the parameters under the released names, in the released order (the released module's ``decoder``)
        decoder = self.decoder = nn.Module()
        decoder.layers = nn.ModuleList(
            [DecoderLayerWithoutSelfAttention(embed_dim, num_attention_heads, feedforward_dim, dropout)]
        )
        decoder.embed_standart = nn.Linear(in_features, embed_dim)
        decoder.query_embed = nn.Embedding(num_groups, embed_dim)
        decoder.query_embed.requires_grad_(False)  # non-learnable queries, as released
        duplicate_factor = math.ceil(num_classes / num_groups)
        decoder.duplicate_pooling = nn.Parameter(torch.empty(num_groups, embed_dim, duplicate_factor))
        decoder.duplicate_pooling_bias = nn.Parameter(torch.zeros(num_classes))
        nn.init.xavier_normal_(decoder.duplicate_pooling)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        decoder = self.decoder
        memory = decoder_memory(decoder.embed_standart, features)  # (N, B, E)
        queries = decoder.query_embed.weight.unsqueeze(1).expand(-1, memory.shape[1], -1)  # (G, B, E)
        decoded = decoder.layers[0](queries.to(memory.dtype), memory)  # (G, B, E)
        grouped = torch.einsum("gbe,gek->bgk", decoded, decoder.duplicate_pooling.to(decoded.dtype))
        return grouped.flatten(1)[:, : self.num_classes] + decoder.duplicate_pooling_bias
