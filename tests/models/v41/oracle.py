"""An independent full-recompute oracle of DeepSeek-V4.1's text backbone, in plain torch.

Written for the tests from transformers-main's ``modeling_deepseek_v41.py`` (read, not
copied; transformers main cannot be installed here): no cache, the whole sequence every call,
dense masks instead of index lists, per-token expert loops.  It shares no code with the engine
(its own config reading, rope/YaRN, quantise-dequantise, top-k), reads the checkpoint's
native-named safetensors itself and dequantises MXFP8/MXFP4 tensors itself.

Where this oracle fixes a detail transformers leaves open, the engine does the same (see
``docs/deepseek_v41.md``): top-k ties (indexer entries, candidate blocks, experts) go to the
lower index (``torch.topk`` leaves them unspecified).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors import safe_open

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


# ---- numerics of the release (quantise-dequantise) ---------------------------------------------
def _pow2_ceil(x: torch.Tensor) -> torch.Tensor:
    # the smallest power of two >= x (x > 0): frexp gives x = m * 2**e with m in [0.5, 1)
    m, e = torch.frexp(x)
    return torch.where(m == 0.5, torch.ldexp(torch.ones_like(x), e - 1), torch.ldexp(torch.ones_like(x), e))


def _to_e2m1(v: torch.Tensor) -> torch.Tensor:
    """Round to the nearest e2m1 value, ties to the even code (v already within +-6)."""
    dist = (v.abs().unsqueeze(-1) - E2M1).abs()
    code = dist.argmin(dim=-1)  # the lower code of a tie
    upper = (code + 1).clamp(max=7)
    d_upper, d_code = dist.gather(-1, upper[..., None])[..., 0], dist.gather(-1, code[..., None])[..., 0]
    tie = (d_upper == d_code) & (upper > code)
    code = torch.where(tie & (code % 2 == 1), upper, code)
    return torch.copysign(E2M1[code], v)


def fp8_qdq(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    n = x.shape[-1]
    if n % block:
        return x
    b = x.float().unflatten(-1, (n // block, block))
    s = _pow2_ceil(b.abs().amax(-1, keepdim=True).clamp_min(1e-4) / 448.0)
    return ((b / s).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s).flatten(-2).to(x.dtype)


def fp4_qdq(x: torch.Tensor, block: int, e4m3_scale: bool) -> torch.Tensor:
    n = x.shape[-1]
    if n % block:
        return x
    b = x.float().unflatten(-1, (n // block, block))
    amax = b.abs().amax(-1, keepdim=True)
    if e4m3_scale:
        s = (amax.clamp_min(6 * 2.0**-9) / 6).to(torch.float8_e4m3fn).float()
    else:
        s = _pow2_ceil(amax.clamp_min(6 * 2.0**-126) / 6)
    return (_to_e2m1((b / s).clamp(-6, 6)) * s).flatten(-2).to(x.dtype)


# ---- checkpoint ----------------------------------------------------------------------------------
def _dequant(t: torch.Tensor, scale: torch.Tensor, block: list[int]) -> torch.Tensor:
    s = scale.float()
    if t.dtype == torch.float8_e4m3fn and s.shape[0] == t.shape[0]:  # Engram rows: a scale per group
        return t.float() * s.repeat_interleave(t.shape[1] // s.shape[1], dim=1)
    if t.dtype == torch.float8_e4m3fn:  # block scales: repeat each over its tile (edge tiles partial)
        br, bc = block
        full = s.repeat_interleave(br, 0)[: t.shape[0]].repeat_interleave(bc, 1)[:, : t.shape[1]]
        return t.float() * full
    u = t.view(torch.uint8)  # packed e2m1, low nibble first
    codes = torch.stack([u & 15, u >> 4], -1).flatten(-2).long()
    vals = torch.copysign(E2M1[codes & 7], torch.where(codes >= 8, -1.0, 1.0))
    group = vals.shape[-1] // s.shape[-1]
    return vals * s.repeat_interleave(group, -1)


def _native(name: str) -> str:
    """A transformers ``save_pretrained`` name (``model.`` + native, the head ``lm_head``) as native."""
    name = name.removeprefix("model.")
    return "head.weight" if name == "lm_head.weight" else name


def read_checkpoint(model_dir: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """``(text config dict, {native name: float32 tensor})`` with scales applied to quantised
    tensors (e4m3 or packed e2m1; transformers' float Engram tables carry a scale it never
    applies) and experts kept per expert; native or transformers names."""
    model_dir = Path(model_dir)
    cfg = json.loads((model_dir / "config.json").read_text())
    text = cfg.get("text_config", cfg)
    block = (cfg.get("quantization_config") or {}).get("weight_block_size", [128, 128])
    raw: dict[str, torch.Tensor] = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for k in st.keys():  # noqa: SIM118 (safe_open is not a dict)
                raw[_native(k)] = st.get_tensor(k)
    out = {}
    for k, t in raw.items():
        if k.endswith(".scale") and k.removesuffix(".scale") + ".weight" in raw:
            continue
        sk = k.removesuffix(".weight") + ".scale"
        quantised = t.dtype in (torch.float8_e4m3fn, torch.uint8, torch.int8)
        scaled = k.endswith(".weight") and sk in raw and quantised
        out[k] = _dequant(t, raw[sk], block) if scaled else t.float()
    return text, out


# ---- the model -----------------------------------------------------------------------------------
class OracleV41:
    """``OracleV41(model_dir).logits(ids)``: ``[len(ids), vocab]`` float32 logits, recomputed."""

    def __init__(self, model_dir: str | Path):
        self.c, self.w = read_checkpoint(model_dir)
        c = self.c
        self.n = c["num_hidden_layers"]
        self.ratios = c["compress_ratios"][: self.n]
        self.kv_src = c["kv_source_layer_ids"]
        self.ix_src = c["index_source_layer_ids"]
        cand = c.get("candidate_source_layer_id")
        self.cand_src = self.kv_src[-1] if cand is None else cand
        self.eps = c.get("rms_norm_eps", 1e-20)
        rd = c["qk_rope_head_dim"]
        self.inv_main = 1.0 / (c.get("rope_theta", 10000.0) ** (torch.arange(0, rd, 2).float() / rd))
        self.inv_comp, self.comp_scale = self._yarn(c, rd)
        self._engram_setup(Path(model_dir))

    @staticmethod
    def _yarn(c: dict, rd: int) -> tuple[torch.Tensor, float]:
        base = c.get("compress_rope_theta", 160000.0)
        pos = base ** (torch.arange(0, rd, 2).float() / rd)
        y = c.get("rope_scaling") or {}
        if y.get("rope_type", y.get("type")) != "yarn":
            return 1.0 / pos, 1.0
        factor, orig = y["factor"], y["original_max_position_embeddings"]

        def dim(rot: float) -> float:
            return rd * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(base))

        lo, hi = math.floor(dim(y.get("beta_fast", 32))), math.ceil(dim(y.get("beta_slow", 1)))
        lo, hi = max(lo, 0), min(hi, rd - 1)
        if lo == hi:
            hi += 0.001
        ramp = ((torch.arange(rd // 2).float() - lo) / (hi - lo)).clamp(0, 1)
        extra = 1 - ramp
        inv = (1.0 / (factor * pos)) * (1 - extra) + (1.0 / pos) * extra
        return inv, y.get("attention_factor", 1.0)

    def _cos_sin(self, positions: torch.Tensor, comp: bool) -> tuple[torch.Tensor, torch.Tensor]:
        inv, scale = (self.inv_comp, self.comp_scale) if comp else (self.inv_main, 1.0)
        f = positions.float()[:, None] * inv[None]
        return f.cos() * scale, f.sin() * scale

    @staticmethod
    def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        rd = cos.shape[-1] * 2
        if x.dim() == 3:
            cos, sin = cos[:, None], sin[:, None]
        nope, r = x[..., :-rd], x[..., -rd:]
        a, b = r[..., 0::2], r[..., 1::2]
        out = torch.stack([a * cos - b * sin, a * sin + b * cos], -1).flatten(-2)
        return torch.cat([nope, out], -1)

    def _rms(self, x: torch.Tensor, w: torch.Tensor | None) -> torch.Tensor:
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return y if w is None else y * w

    @staticmethod
    def _topk_mask(scores: torch.Tensor, k: int) -> torch.Tensor:
        """Bool mask of the ``k`` best finite scores per row, ties to the lower column."""
        order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k]
        keep = torch.zeros_like(scores, dtype=torch.bool).scatter(-1, order, True)
        return keep & (scores > float("-inf"))

    def _attention(self, i: int, x: torch.Tensor, pos: torch.Tensor, state: dict) -> torch.Tensor:
        c, w, p = self.c, self.w, f"layers.{i}.attn."
        s, H, hd = x.shape[0], c["num_attention_heads"], c["head_dim"]
        r = self.ratios[i]
        cos, sin = self._cos_sin(pos, comp=r > 0)
        q_res = self._rms(x @ w[p + "wq_a.weight"].T, w[p + "q_norm.weight"])
        q = self._rope((q_res @ w[p + "wq_b.weight"].T).view(s, H, hd), cos, sin)
        kv = fp8_qdq(self._rope(self._rms(x @ w[p + "wkv.weight"].T, w[p + "kv_norm.weight"]), cos, sin))
        keys = [kv]
        j = torch.arange(s)
        masks = [(j[None] <= j[:, None]) & (j[None] > j[:, None] - c["sliding_window"])]
        if r:
            if i in self.kv_src:
                cw = p + "compressor."
                if r == 1:
                    latent = self._rms(x @ w[cw + "wkv.weight"].T, w[cw + "norm.weight"])
                else:
                    g = s // r
                    kvc = (x[: g * r] @ w[cw + "wkv.weight"].T).view(g, r, hd)
                    gate = (x[: g * r] @ w[cw + "wgate.weight"].T).view(g, r, hd)
                    latent = self._rms((kvc * gate.softmax(dim=1)).sum(1), w[cw + "norm.weight"])
                cpos = torch.arange(latent.shape[0]) * r
                ccos, csin = self._cos_sin(cpos, comp=True)
                k = self._rms(latent @ w[p + "indexer.wk.weight"].T, w[p + "indexer.k_norm.weight"])
                state["ikeys"] = fp4_qdq(self._rope(k, ccos, csin), 32, False)
                state["ckv"] = fp4_qdq(self._rope(latent, ccos, csin), 16, True)
            n_entries = state["ckv"].shape[0]
            visible = torch.arange(n_entries)[None] < ((pos + 1) // r)[:, None]  # [S, E]
            if i in self.ix_src:
                ih, ihd = c["index_n_heads"], c["index_head_dim"]
                iq = (q_res @ w[p + "indexer.wq_b.weight"].T).view(s, ih, ihd)
                iq = fp4_qdq(self._rope(iq, cos, sin), 32, False)
                iw = (x @ w[p + "indexer.weights_proj.weight"].T) * ih**-0.5
                dots = torch.einsum("shd,ed->she", iq, state["ikeys"]).relu() * ihd**-0.5
                scores = (dots * iw[:, :, None]).sum(1).masked_fill(~visible, float("-inf"))
                if i == self.cand_src:
                    state["cand"] = self._candidates(scores, visible)
                elif 0 <= self.cand_src < i and "cand" in state:
                    scores = scores.masked_fill(~state["cand"], float("-inf"))
                state["sel"] = self._topk_mask(scores, min(c["index_topk"], n_entries))
            keys.append(state["ckv"])
            masks.append(state["sel"] & visible)
        return self._attend(p, q, torch.cat(keys), torch.cat(masks, dim=1), cos, sin)

    def _attend(
        self,
        p: str,
        q: torch.Tensor,
        kk: torch.Tensor,
        mask: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> torch.Tensor:
        """Queries ``q`` ``[S, H, hd]`` over keys (= values) ``kk`` where ``mask`` ``[S, K]``,
        with the sinks, inverse rope and output projections of attention ``p`` (``....attn.``)."""
        c, w = self.c, self.w
        s, H, hd = q.shape
        logits = torch.einsum("shd,kd->shk", q, kk) * hd**-0.5
        logits = logits.masked_fill(~mask[:, None], float("-inf"))
        sink = w[p + "attn_sink"].view(1, H, 1).expand(s, H, 1)
        probs = torch.cat([logits, sink], -1).softmax(-1)[..., :-1]
        out = self._rope(torch.einsum("shk,kd->shd", probs, kk), cos, -sin)
        G = c["o_groups"]
        wo_a = w[p + "wo_a.weight"].view(G, -1, H * hd // G)
        o = torch.einsum("sgk,gnk->sgn", out.reshape(s, G, -1), wo_a).reshape(s, -1)
        return o @ w[p + "wo_b.weight"].T

    def _candidates(self, scores: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        c = self.c
        bs, nb = c["candidate_block_size"], c["candidate_topk_blocks"]
        s, e = scores.shape
        n_blocks = -(-e // bs)
        padded = F.pad(scores, (0, n_blocks * bs - e), value=float("-inf"))
        blocks = padded.view(s, n_blocks, bs).amax(-1)
        last = (visible.sum(-1) - 1) // bs
        blocks = torch.where(torch.arange(n_blocks)[None] == last[:, None], float("inf"), blocks)
        keep = self._topk_mask(blocks, min(nb, n_blocks))
        return keep.repeat_interleave(bs, dim=-1)[:, :e]

    def _moe(
        self, i: int, x: torch.Tensor, prefix: str = "", counts: tuple[int, int] | None = None
    ) -> torch.Tensor:
        """Layer ``i``'s MoE; ``prefix`` / ``counts`` = (experts, top-k): another block's
        (a DSpark draft layer's ``mtp.{j}.``)."""
        c, w = self.c, self.w
        p = (prefix or f"layers.{i}.") + "ffn."
        n_exp, k = counts or (c["n_routed_experts"], c["num_experts_per_tok"])
        lim = c.get("swiglu_limit", 10.0)
        scores = F.softplus((x @ w[p + "gate.weight"].T) / c.get("gate_temp", 1.0)).sqrt()
        ids = torch.sort(scores + w[p + "gate.bias"], dim=-1, descending=True, stable=True).indices[:, :k]
        wts = scores.gather(1, ids)
        wts = wts / (wts.sum(-1, keepdim=True) + 1e-20) * c.get("routed_scaling_factor", 1.5)

        def expert(pre: str, v: torch.Tensor) -> torch.Tensor:
            gate = (v @ w[pre + "w1.weight"].T).clamp(max=lim)
            up = (v @ w[pre + "w3.weight"].T).clamp(-lim, lim)
            return (F.silu(gate) * up) @ w[pre + "w2.weight"].T

        out = expert(p + "shared_experts.", x)
        for e in range(n_exp):  # every expert on every token, weighted by the routing
            weight = (wts * (ids == e)).sum(-1, keepdim=True)
            out = out + weight * expert(f"{p}experts.{e}.", x)
        return out

    # ---- Engram ------------------------------------------------------------------------------
    def _engram_setup(self, model_dir: Path) -> None:
        c = self.c
        self.e_layers = c.get("engram_layer_ids") or []
        if not self.e_layers:
            return
        from tokenizers import Regex, Tokenizer, normalizers

        tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        keep_space = "\ue000"
        steps = [normalizers.NFKC(), normalizers.NFD(), normalizers.StripAccents(), normalizers.Lowercase()]
        steps += [
            normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
            normalizers.Replace(Regex(r"^ $"), keep_space),
        ]
        steps += [normalizers.Strip(), normalizers.Replace(keep_space, " ")]
        norm = normalizers.Sequence(steps)
        keys: dict[str, int] = {}
        ids = []
        for t in range(tok.get_vocab_size(with_added_tokens=True)):
            text = tok.decode([t], skip_special_tokens=False)
            key = tok.id_to_token(t) if "\ufffd" in text else (norm.normalize_str(text) or text)
            ids.append(keys.setdefault(key, len(keys)))
        assert len(keys) == c["engram_compressed_vocab_size"]
        self.e_map = torch.tensor(ids)
        n, heads = c["engram_max_ngram_size"], c["engram_n_heads"]
        used: set[int] = set()
        self.e_primes = {}
        for layer in self.e_layers:
            primes = []
            for _ in range(n - 1):
                p = c["engram_vocab_size"] - 1
                for _ in range(heads):
                    p += 1
                    while p in used or any(p % d == 0 for d in range(2, int(p**0.5) + 1)):
                        p += 1
                    used.add(p)
                    primes.append(p)
            self.e_primes[layer] = primes
        bound = (np.iinfo(np.int64).max // len(keys)) // 2
        self.e_mult = {
            layer: torch.from_numpy(
                np.random.default_rng(10007 * layer).integers(0, bound, size=(n,), dtype=np.int64)
            )
            * 2
            + 1
            for layer in self.e_layers
        }

    def _engram(self, i: int, h: torch.Tensor, ids: list[int]) -> torch.Tensor:
        c, w, p = self.c, self.w, f"layers.{i}.engram."
        n, heads, s = c["engram_max_ngram_size"], c["engram_n_heads"], len(ids)
        comp = self.e_map[torch.tensor(ids)]
        pad = int(self.e_map[c["engram_pad_id"] if "engram_pad_id" in c else c["engram_pad_token_id"]])
        primes, mult = self.e_primes[i], self.e_mult[i]
        starts = [sum(primes[:k]) for k in range(len(primes))]
        hashes = torch.zeros(s, len(primes), dtype=torch.long)
        for t in range(s):
            grams = [int(comp[t - k]) if t - k >= 0 else pad for k in range(n)]
            acc = grams[0] * int(mult[0])
            for k in range(1, n):
                acc ^= grams[k] * int(mult[k])
                for j in range(heads):
                    col = (k - 1) * heads + j
                    hashes[t, col] = acc % primes[col] + starts[col]
        rows = w[p + "embed.weight"][hashes].flatten(1)  # [S, cols * E]
        kv = rows @ w[p + "wkv.weight"].T
        hc, d = c["hc_mult"], c["hidden_size"]
        key, value = kv[:, : hc * d].view(s, hc, d), kv[:, hc * d :]
        inner = (h * w[p + "q_weight"] * w[p + "k_weight"] * key).sum(-1)
        rms = torch.rsqrt(h.pow(2).mean(-1) + self.eps) * torch.rsqrt(key.pow(2).mean(-1) + self.eps)
        dot = inner * rms / d**0.5
        gate = torch.sigmoid(torch.copysign(dot.abs().clamp_min(1e-6).sqrt(), dot))
        return h + gate[..., None] * value[:, None]

    def _mixes(self, h: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        c, w = self.c, self.w
        n, eps = c["hc_mult"], c.get("hc_eps", 1e-6)
        fn, base, scale = (w[f"{name}_{k}"] for k in ("fn", "base", "scale"))
        m = self._rms(h.flatten(1), None) @ fn.T
        pre = torch.sigmoid(m[:, :n] * scale[0] + base[:n]) + eps
        post = 2 * torch.sigmoid(m[:, n : 2 * n] * scale[1] + base[n : 2 * n])
        comb = torch.softmax((m[:, 2 * n :] * scale[2] + base[2 * n :]).view(-1, n, n), -1) + eps
        comb = comb / (comb.sum(-2, keepdim=True) + eps)
        for _ in range(c.get("hc_sinkhorn_iters", 20) - 1):
            comb = comb / (comb.sum(-1, keepdim=True) + eps)
            comb = comb / (comb.sum(-2, keepdim=True) + eps)
        return pre, post, comb

    def _block(
        self, lp: str, h: torch.Tensor, pre: torch.Tensor, attn, moe
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One mHC-wrapped block ``lp`` (``layers.{i}.``): ``attn`` / ``moe`` map the normed
        collapsed input to the block's outputs; returns the new streams and the FFN site's pre."""
        w = self.w
        a_pre, post, comb = self._mixes(h, lp + "hc_attn")
        a = attn(self._rms((pre[..., None] * h).sum(1), w[lp + "attn_norm.weight"]))
        h = post[..., None] * a[:, None] + torch.einsum("sjk,sjd->skd", comb, h)
        f_pre, post, comb = self._mixes(h, lp + "hc_ffn")
        m = moe(self._rms((a_pre[..., None] * h).sum(1), w[lp + "ffn_norm.weight"]))
        return post[..., None] * m[:, None] + torch.einsum("sjk,sjd->skd", comb, h), f_pre

    def _before_layer(self, i: int, h: torch.Tensor) -> None:
        """Called with the streams ``[S, N, D]`` entering layer ``i`` (``i = n``: the last
        layer's output); a subclass captures what it needs."""

    @torch.no_grad()
    def logits(self, ids: list[int]) -> torch.Tensor:
        c, w = self.c, self.w
        x = w["embed.weight"][torch.tensor(ids)]
        pos = torch.arange(len(ids))
        h = x[:, None].expand(-1, c["hc_mult"], -1).clone()
        pre = torch.zeros(len(ids), c["hc_mult"])
        pre[:, 0] = 1.0
        state: dict = {}
        for i in range(self.n):
            self._before_layer(i, h)
            if i in self.e_layers:
                h = self._engram(i, h, ids)
            h, pre = self._block(
                f"layers.{i}.",
                h,
                pre,
                lambda x, i=i: self._attention(i, x, pos, state),
                lambda x, i=i: self._moe(i, x),
            )
        self._before_layer(self.n, h)
        y = self._rms((pre[..., None] * h).sum(1), w["norm.weight"])
        return y @ w["head.weight"].T

    def greedy(self, ids: list[int], n: int) -> list[int]:
        out = list(ids)
        for _ in range(n):
            out.append(int(self.logits(out)[-1].argmax()))
        return out[len(ids) :]
