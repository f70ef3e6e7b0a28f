"""An independent full-recompute oracle of DeepSeek-V4.1's DSpark block drafter, in plain torch.

Written for the tests from ``docs/design/v41_dspark_drafter.md`` §2 (no engine code): it
subclasses the backbone oracle (:class:`~oracle.OracleV41`, which reads the checkpoint itself)
to capture the mean over the hc streams entering each target layer, then for a sequence
``ids[0..P]`` (anchor ``ids[P]``) recomputes everything from scratch:

* the context ``m_t = RMSNorm(main_proj . concat_l mean(H^l_t))`` of every ``t < P`` and each
  draft layer's context key ``fp8(rope(RMSNorm(wkv_j m_t)))``;
* the block: ``γ`` rows (anchor, then the noise token) at positions ``P ..``, every draft layer
  with dense masks -- row ``i`` sees the context keys of ``[max(0, P-W), P-1]`` and every block
  key (``window="official"``), or only the context keys a causal window ending at its own
  position would hold (``window="causal"``, the other reading of §5 Q1);
* the collapse with the last FFN ``pre``, the drafter's own final norm and the target's head
  (``U``), then the greedy Markov walk and the confidence head.

The checkpoint's spellings are resolved here, independently of the engine's loader: head and
combiner tensors under any ``mtp.{j}.`` stage, the confidence weight as
``confidence_head.weight`` or ``confidence_head.proj.weight``.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tests.models.v41.oracle import OracleV41, fp8_qdq


class DSparkOracle(OracleV41):
    """``DSparkOracle(model_dir).draft(ids)``: the drafts of the block anchored at ``ids[-1]``."""

    def __init__(self, model_dir: str | Path, window: str = "official"):
        super().__init__(model_dir)
        c = self.c
        self.window = window
        self.m = c["num_nextn_predict_layers"]
        self.gamma = c["dspark_block_size"]
        self.noise = c["dspark_noise_token_id"]
        ids = c.get("dspark_target_layer_ids")
        if ids is None:  # the last three layers that are not kv sources
            ids = [i for i in range(self.n) if i not in self.kv_src][-3:]
        self.target_ids = list(ids)
        self._captured: dict[int, torch.Tensor] = {}

    def _leaf(self, *leaves: str) -> torch.Tensor | None:
        """The one tensor ``mtp.{j}.<leaf>`` of any stage ``j`` and any of ``leaves``."""
        found = [
            t
            for name, t in self.w.items()
            for leaf in leaves
            if name.startswith("mtp.") and name.split(".", 2)[-1] == leaf
        ]
        assert len(found) <= 1, leaves
        return found[0] if found else None

    def _before_layer(self, i: int, h: torch.Tensor) -> None:
        if i in self.target_ids:
            self._captured[i] = h.mean(1)

    @torch.no_grad()
    def context(self, ids: list[int]) -> torch.Tensor:
        """``m_t`` ``[len(ids), D]`` of every position of ``ids``."""
        self._captured = {}
        self.logits(ids)
        f = torch.cat([self._captured[i] for i in self.target_ids], dim=-1)
        return self._rms(f @ self._leaf("main_proj.weight").T, self._leaf("main_norm.weight"))

    def _draft_attention(self, j: int, x: torch.Tensor, m: torch.Tensor, p: int) -> torch.Tensor:
        c, w, a = self.c, self.w, f"mtp.{j}.attn."
        g, H, hd, W = x.shape[0], c["num_attention_heads"], c["head_dim"], c["sliding_window"]
        pos = torch.arange(p, p + g)
        cos, sin = self._cos_sin(pos, comp=False)
        q_res = self._rms(x @ w[a + "wq_a.weight"].T, w[a + "q_norm.weight"])
        q = self._rope((q_res @ w[a + "wq_b.weight"].T).view(g, H, hd), cos, sin)

        def key(v: torch.Tensor, c_: torch.Tensor, s_: torch.Tensor) -> torch.Tensor:
            return fp8_qdq(self._rope(self._rms(v @ w[a + "wkv.weight"].T, w[a + "kv_norm.weight"]), c_, s_))

        lo = max(0, p - W)
        ctx_pos = torch.arange(lo, p)
        ctx = key(m[lo:p], *self._cos_sin(ctx_pos, comp=False))
        block = key(x, cos, sin)
        if self.window == "official":
            ctx_mask = torch.ones(g, p - lo, dtype=torch.bool)
        else:  # a causal window ending at the row's own position
            ctx_mask = ctx_pos[None, :] > (pos[:, None] - W)
        mask = torch.cat([ctx_mask, torch.ones(g, g, dtype=torch.bool)], dim=1)
        return self._attend(a, q, torch.cat([ctx, block]), mask, cos, sin)

    @torch.no_grad()
    def block(self, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(U [γ, V], y [γ, D])`` of the block anchored at ``ids[-1]`` (position ``len(ids)-1``)."""
        c, w = self.c, self.w
        p = len(ids) - 1
        m = self.context(ids[:-1]) if p else torch.zeros(0, c["hidden_size"])
        tokens = torch.tensor([ids[-1]] + [self.noise] * (self.gamma - 1))
        x = w["embed.weight"][tokens]
        h = x[:, None].expand(-1, c["hc_mult"], -1).clone()
        pre = torch.zeros(self.gamma, c["hc_mult"])
        pre[:, 0] = 1.0
        counts = (c["dspark_n_routed_experts"], c["dspark_num_experts_per_tok"])
        for j in range(self.m):
            h, pre = self._block(
                f"mtp.{j}.",
                h,
                pre,
                lambda v, j=j: self._draft_attention(j, v, m, p),
                lambda v, j=j: self._moe(0, v, prefix=f"mtp.{j}.", counts=counts),
            )
        y = (pre[..., None] * h).sum(1)
        u = self._rms(y, self._leaf("norm.weight")) @ w["head.weight"].T
        return u, y

    @torch.no_grad()
    def draft(self, ids: list[int], n: int | None = None) -> dict[str, torch.Tensor]:
        """Greedy drafts ``tokens`` ``[n]`` (default ``γ``), their conditional confidences
        ``confidence`` ``[n]`` (absent without the head), ``U`` and ``y`` of the block."""
        u, y = self.block(ids)
        w1 = self._leaf("markov_head.embed.weight")
        w2 = self._leaf("markov_head.head.weight")
        wc = self._leaf("confidence_head.weight", "confidence_head.proj.weight")
        prev, tokens, conf = ids[-1], [], []
        for k in range(1, (n or self.gamma) + 1):
            e = w1[prev]
            prev = int((u[k - 1] + w2 @ e).argmax())
            tokens.append(prev)
            if wc is not None:
                conf.append(torch.sigmoid(wc[0] @ torch.cat([y[k - 1], e])))
        out = {"tokens": torch.tensor(tokens), "U": u, "y": y}
        if conf:
            out["confidence"] = torch.stack(conf)
        return out
