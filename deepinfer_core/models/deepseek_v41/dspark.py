"""DeepSeek-V4.1's DSpark block drafter (``mtp.{j}.*``, ``j < num_nextn_predict_layers``).

See ``docs/design/v41_dspark_drafter.md``.  The drafter has ``M`` window-only V4.1 blocks (no
compressor, indexer or Engram; ``dspark_n_routed_experts`` experts, top
``dspark_num_experts_per_tok``), each with its own sliding window of *context* keys:

* **Context write** (:meth:`DSparkHead.write_context`, called by the target's forward for
  every row it computes): the mean over the ``hc_mult`` streams entering each target layer of
  ``dspark_target_layer_ids`` (id ``L`` = the last layer's output), concatenated, through
  ``main_proj`` and ``main_norm`` gives ``m``; each draft layer writes
  ``rope(RMSNorm(wkv m))`` into its ring with the target ring's own rows (``W + S`` rows per
  slot), so rejected drafts leave nothing behind, as in the target's window.
* **Block** (:meth:`DSparkHead.block`, side-effect free): ``γ = dspark_block_size`` rows per
  request anchored at position ``P`` (token ``x_0`` then the noise token), at positions
  ``P .. P+γ-1``; every row attends to the context keys of ``[max(0, P-W), P-1]`` and to all
  ``γ`` block keys (non-causal inside the block).  The last ``pre`` collapses the streams
  (``y``); the drafter's own final norm and the target's head give the base logits ``U``.
* **Heads**: the Markov head adds ``W2 W1[x_{k-1}]`` to ``U_{k-1}`` for draft ``k``, on the
  token drafted before it (:meth:`DSparkHead.markov`); the confidence head estimates
  ``P(x_k accepted | x_{<k} accepted) = sigmoid(w . [y_{k-1}; W1[x_{k-1}]])``
  (:meth:`DSparkHead.confidence`).  Drawing the drafts is the drafter's
  (:mod:`deepinfer_core.speculative.dspark`).
"""

from __future__ import annotations

import logging

import torch

from deepinfer_core.models.cache_spec import CacheSpec, HybridCache
from deepinfer_core.ops import OpTable
from deepinfer_core.weights.quant import Weight

from .config import DeepseekV41Config
from .layer import DecoderLayer
from .metadata import V41StepMetadata
from .ops import op
from .params import CONFIDENCE_HEAD

logger = logging.getLogger("deepinfer.model")


class DSparkHead:
    """The DSpark drafter's layers and heads over the target's embedding and output head.

    Args:
        cfg: the architecture (its ``dspark_*`` fields checked by ``check_dspark``).
        w: the weights, with the drafter's (:func:`~.params.dspark_parameter_specs`); the draft
            layers' fused projections are popped, as the backbone's.
        dtype: the model dtype.
    """

    def __init__(self, cfg: DeepseekV41Config, w: dict[str, Weight], dtype: torch.dtype):
        self.cfg = cfg
        n, m = cfg.num_hidden_layers, cfg.num_nextn_predict_layers
        top_k = cfg.dspark_num_experts_per_tok
        self.layers = [DecoderLayer(cfg, n + j, w, dtype, prefix=f"mtp.{j}.", top_k=top_k) for j in range(m)]
        self.target_layer_ids = list(cfg.dspark_target_layer_ids or [])
        self.block_size = cfg.dspark_block_size
        self.noise_token_id = cfg.dspark_noise_token_id
        self.main_proj, self.main_norm = w["mtp.0.main_proj.weight"], w["mtp.0.main_norm.weight"]
        last = f"mtp.{m - 1}."
        self.norm = w[last + "norm.weight"]
        self.markov_embed = w[last + "markov_head.embed.weight"]
        self.markov_head = w[last + "markov_head.head.weight"].float()
        conf = w.get(last + CONFIDENCE_HEAD)
        self.confidence_weight = None if conf is None else conf.float()
        self.embed, self.head = w["embed.weight"], w["head.weight"]
        self.eps = cfg.rms_norm_eps

    def cache_specs(self, num_spec_tokens: int) -> list[list[CacheSpec]]:
        """One window ring per draft layer (cache layers ``L .. L+M-1``), the target ring's
        geometry (``W + num_spec_tokens`` rows per slot)."""
        return [layer.attn.cache_specs(num_spec_tokens) for layer in self.layers]

    def write_context(
        self, features: list[torch.Tensor], md: V41StepMetadata, cache: HybridCache, ops: OpTable, rope: dict
    ) -> None:
        """The context keys of the step's rows: ``features`` are the stream means at the target
        layers (``[T, D]`` each, in ``dspark_target_layer_ids`` order) of ``md``'s rows, written
        where the target writes its own window keys (``md.v4.ring_rows``)."""
        f = torch.cat(features, dim=-1)
        m = ops.rms_norm(ops.linear(f, self.main_proj), self.main_norm, self.eps)
        for layer in self.layers:
            layer.attn.write_context(m, md.v4.ring_rows, cache, ops, rope)

    def block(
        self, md: V41StepMetadata, cache: HybridCache, ops: OpTable, rope: dict
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The block forward over ``md``'s rows (:func:`~.metadata.build_dspark_metadata`):
        ``(U, y)``, float32 base logits ``[T, V]`` and the collapsed pre-norm hidden ``[T, D]``
        of every row.  Reads the draft rings, writes no request's cache."""
        x = ops.embedding(md.input_ids, self.embed)
        t, n = x.shape[0], self.cfg.hc_mult
        h = x.unsqueeze(1).expand(-1, n, -1).contiguous()
        pre = torch.zeros(t, n, dtype=torch.float32, device=x.device)
        pre[:, 0] = 1.0  # the first site collapses stream 0, as the backbone's
        for layer in self.layers:
            h, pre = layer(h, pre, md, cache, ops, rope, {})
        y = op(ops, "hc_collapse")(h, pre)
        u = ops.linear(ops.rms_norm(y, self.norm, self.eps), self.head).float()
        return u, y

    def markov(self, prev: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The Markov head on the previous tokens ``prev`` ``[B]``: ``(e [B, r], bias [B, V])``,
        ``e = W1[prev]`` and the float32 logit correction ``W2 e``."""
        e = self.markov_embed.index_select(0, prev)
        return e, e.float() @ self.markov_head.T

    def confidence(self, y: torch.Tensor, e: torch.Tensor) -> torch.Tensor | None:
        """``sigmoid(w . [y; e])`` per row, float32 ``[B]`` (``None`` without the head)."""
        if self.confidence_weight is None:
            return None
        z = torch.cat([y.float(), e.float()], dim=-1) @ self.confidence_weight.T
        return torch.sigmoid(z[:, 0])
