"""Heads whose classes are text: each class is its embedding (:func:`mlcls.text.class_embeddings`), held as
the buffer ``class_embeddings`` (C, T) of unit rows, and no weight belongs to one class. The class list can
therefore change after training (:meth:`TextQueryHead.set_class_embeddings`): a class never trained on
needs only its embedding, and the logit count follows the rows.

``mldecoder_zsl`` -- ML-Decoder's zero-shot variant (Ridnik et al., WACV 2023, section 3.3; the released
``MLDecoder(zsl=1)``), on the backbone's unpooled features, its parameters named as there (without the
released ``decoder.`` prefix)::

    memory  = ReLU(embed_standart(tokens))                                   (N, B, E)
    queries = ReLU(wordvec_proj(class_embeddings))                           (C, E), one query per class
    t       = decoder layer without self-attention (mlcls.models.heads.mldecoder)(queries, memory)  (C, B, E)
    logits[b, c] = t[c, b, :] @ duplicate_pooling + duplicate_pooling_bias                           (B, C)

  with ``wordvec_proj`` one Linear(T, E) shared by all classes and the group fully-connected layer one
  (E, 1) map and one bias shared by all classes (the released ZSL model: num_groups = C, duplicate factor 1).

``cosine`` -- a projection of the pooled image feature compared with each class embedding::

    f = mean of the features over positions                                  (B, D)
    logits[b, c] = tau * cos(W f_b, e_c),  tau = exp(log_scale), at most 100 (CLIP's clamp)

  ``W`` a Linear(D, T) without bias; ``log_scale`` learnt, initialised at log(``init_scale``) (10 by
  default: logits in [-10, 10], sigmoid probabilities from 4.5e-5 to 0.99995).

A zero-shot evaluation scores classes the head was never trained on: :func:`scoring_classes` swaps the
head's class embeddings for theirs during the evaluation and restores its own after it.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from mlcls.models.heads.mldecoder import DecoderLayerWithoutSelfAttention, check_sizes, decoder_memory

# The largest temperature of the cosine head (CLIP clamps its logit scale at 100 likewise).
MAX_SCALE = 100.0


class TextQueryHead(nn.Module):
    """A head scoring the classes of its ``class_embeddings`` buffer, (C, T) float32 with unit rows."""

    def __init__(self, class_embeddings: torch.Tensor) -> None:
        super().__init__()
        embeddings = self._checked(class_embeddings, None).float()
        self.text_dim = embeddings.shape[1]
        self.register_buffer("class_embeddings", embeddings)

    @property
    def num_classes(self) -> int:
        return self.class_embeddings.shape[0]

    def _checked(self, embeddings: torch.Tensor, text_dim: int | None) -> torch.Tensor:
        if not isinstance(embeddings, torch.Tensor) or embeddings.ndim != 2 or embeddings.shape[0] < 1:
            shape = tuple(embeddings.shape) if isinstance(embeddings, torch.Tensor) else type(embeddings)
            raise ValueError(f"class embeddings of shape {shape}; expected (classes, dim) with classes >= 1")
        if text_dim is not None and embeddings.shape[1] != text_dim:
            raise ValueError(
                f"class embeddings of width {embeddings.shape[1]}; this {type(self).__name__} head was built "
                f"for width {text_dim} (the text source it was trained with)"
            )
        if not torch.isfinite(embeddings).all():
            raise ValueError("class embeddings hold a non-finite value; expected finite unit rows")
        return embeddings.detach()

    def set_class_embeddings(self, embeddings: torch.Tensor) -> None:
        """Score the classes of ``embeddings`` (C', T) from now on: C' logits, in their order (held in the
        buffer's dtype and device)."""
        self.class_embeddings = self._checked(embeddings, self.text_dim).to(self.class_embeddings)


def text_query_head(model: nn.Module) -> TextQueryHead | None:
    """The text-query head of ``model`` (a :class:`~mlcls.models.heads.HeadedModel`, or the head itself),
    ``None`` when its classes are weights of their own."""
    head = model.get_classifier() if hasattr(model, "get_classifier") else model
    return head if isinstance(head, TextQueryHead) else None


@contextlib.contextmanager
def scoring_classes(model: nn.Module, embeddings: torch.Tensor) -> Iterator[TextQueryHead]:
    """``model``'s text-query head scores the classes of ``embeddings`` (C', T) within the block (C' logits,
    in their order), its own class embeddings restored after it, also when the block raises; a
    ``ValueError`` for a model without a text-query head (its classes are weights: it scores only those)."""
    head = text_query_head(model)
    if head is None:
        raise ValueError("zero-shot evaluation needs a text-query head (model/head=mldecoder_zsl | cosine)")
    own = head.class_embeddings
    head.set_class_embeddings(embeddings)
    try:
        yield head
    finally:
        head.set_class_embeddings(own)


class MLDecoderZSL(TextQueryHead):
    """ML-Decoder with text queries: ``forward(features (B, D, H, W) or tokens (B, N, D)) -> logits (B, C)``.

    ``class_embeddings`` (C, T) unit rows, one query per class; the other arguments as
    :class:`~mlcls.models.heads.mldecoder.MLDecoder`'s.
    """

    def __init__(
        self,
        in_features: int,
        class_embeddings: torch.Tensor,
        embed_dim: int = 768,
        num_attention_heads: int = 8,
        feedforward_dim: int = 2048,
        dropout: float = 0.1,
    ) -> None:
        super().__init__(class_embeddings)
        check_sizes(num_attention_heads, embed_dim=embed_dim)
        self.embed_standart = nn.Linear(in_features, embed_dim)
        self.wordvec_proj = nn.Linear(self.text_dim, embed_dim)
        self.layers = nn.ModuleList(
            [DecoderLayerWithoutSelfAttention(embed_dim, num_attention_heads, feedforward_dim, dropout)]
        )
        self.duplicate_pooling = nn.Parameter(torch.empty(embed_dim, 1))
        self.duplicate_pooling_bias = nn.Parameter(torch.zeros(1))
        nn.init.xavier_normal_(self.duplicate_pooling)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        memory = decoder_memory(self.embed_standart, features)  # (N, B, E)
        queries = F.relu(self.wordvec_proj(self.class_embeddings.to(memory.dtype)))  # (C, E)
        queries = queries.unsqueeze(1).expand(-1, memory.shape[1], -1)  # (C, B, E)
        decoded = self.layers[0](queries.to(memory.dtype), memory)  # (C, B, E)
        logits = decoded.transpose(0, 1) @ self.duplicate_pooling.to(decoded.dtype)  # (B, C, 1)
        return logits.squeeze(2) + self.duplicate_pooling_bias


class CosineHead(TextQueryHead):
    """``forward(features (B, D, H, W) or tokens (B, N, D)) -> logits (B, C)``, the ``cosine`` head of the
    module docstring; ``init_scale``, tau at initialisation, is in (0, 100]."""

    def __init__(self, in_features: int, class_embeddings: torch.Tensor, init_scale: float = 10.0) -> None:
        super().__init__(class_embeddings)
        if not isinstance(init_scale, int | float) or not 0 < init_scale <= MAX_SCALE:
            raise ValueError(
                f"cosine head init_scale={init_scale!r}; expected a number in (0, {MAX_SCALE:g}]"
            )
        self.proj = nn.Linear(in_features, self.text_dim, bias=False)
        self.log_scale = nn.Parameter(torch.tensor(math.log(init_scale)))

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        pooled = features.mean(dim=(2, 3)) if features.ndim == 4 else features.mean(dim=1)  # (B, D)
        image = F.normalize(self.proj(pooled), dim=1)  # (B, T)
        text = F.normalize(self.class_embeddings.to(image.dtype), dim=1)  # (C, T)
        scale = self.log_scale.clamp(max=math.log(MAX_SCALE)).exp()
        return scale * image @ text.t()
