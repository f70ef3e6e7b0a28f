"""Train the built-in tiny DeepSeek-V4 model (``deepinfer_core/models/deepseek_v4/tiny_trained``).

Reproducible from scratch on a CPU with a fixed seed (the defaults are the recipe; about 8
minutes on a 2-core machine, bitwise the same files on the same software)::

    python scripts/train_tiny.py                     # writes the checkpoint, the log and the plot
    python scripts/train_tiny.py --steps 200 --out /tmp/t --log /tmp/t.json --plot /tmp/t.svg
    python scripts/train_tiny.py --topics PATH       # CPython 3.11.7's topics from another Python

The corpus is the English prose of CPython's ``pydoc_data/topics.py`` (the interactive help's
topics: the language reference, PSF licence), present in every CPython install
(:func:`deepinfer_core.models.deepseek_v4.trained.load_corpus`; the shipped model was trained on
CPython 3.11.7's, and the script warns on another); every 20th paragraph is held out.  A
byte-level BPE tokenizer is trained on the training paragraphs, then a DeepSeek-V4 of every
layer type (sliding window, CSA with its indexer, HCA; hash- and top-k-routed MoE; mHC streams)
is trained with HF transformers' implementation (the engine's parity oracle), jointly with one
multi-token-prediction layer that reads the trunk's detached last-layer streams (so it never
changes the trunk).  The top-k routers' correction biases follow the auxiliary-loss-free
balancing rule (nudged toward equal expert load); the CSA indexers get no gradient (their
top-k is not differentiable) and keep their initial weights.  The checkpoint is written with
DeepSeek's native names, matrices in bfloat16.

Outputs: the checkpoint directory (``--out``), the training log (``--log``: losses, held-out
perplexity, timing, corpus hash) and an SVG loss plot (``--plot``).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import shutil
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from tiny_train_plot import write_loss_svg  # noqa: E402

from deepinfer_core.models.deepseek_v4 import trained  # noqa: E402
from deepinfer_core.models.deepseek_v4.config import SLIDING, DeepseekV4Config  # noqa: E402
from deepinfer_core.models.deepseek_v4.params import (  # noqa: E402
    mtp_parameter_specs,
    parameter_specs,
)
from deepinfer_core.models.deepseek_v4.tiny import (  # noqa: E402
    BOS_TOKEN,
    TINY_CONFIG,
    train_tokenizer,
    write_tokenizer_configs,
)
from deepinfer_core.models.deepseek_v4.trained import CORPUS_SHA256, load_corpus  # noqa: E402
from deepinfer_core.models.deepseek_v4.writer import save_checkpoint  # noqa: E402

DEFAULT_OUT = ROOT / "deepinfer_core" / "models" / "deepseek_v4" / "tiny_trained"
DEFAULT_PLOT = ROOT / "docs" / "tiny_model_loss.svg"
DEFAULT_LOG = ROOT / "docs" / "tiny_model_training.json"
VOCAB = 2048
CONFIG: dict = {  # the built-in random tiny model's architecture, wider
    **copy.deepcopy(TINY_CONFIG),  # its nested dicts are not shared
    "vocab_size": VOCAB,
    "hidden_size": 128,
    "moe_intermediate_size": 64,
    "q_lora_rank": 64,
    "o_lora_rank": 32,
    "sliding_window": 32,
    "index_topk": 8,
}


# ---- data ------------------------------------------------------------------------------------
def token_stream(tok, paras: list[str]) -> torch.Tensor:
    """The paragraphs' tokens, separated by a blank line, concatenated (:func:`trained.token_stream`)."""
    ids = trained.token_stream(paras, lambda text: tok.encode(text, add_special_tokens=False).ids)
    return torch.tensor(ids, dtype=torch.long)


def batch(stream: torch.Tensor, starts: torch.Tensor, length: int, bos: int) -> torch.Tensor:
    """``[B, length + 1]`` windows: BOS then ``length`` tokens from each start (as a prompt is served)."""
    idx = starts.unsqueeze(1) + torch.arange(length).unsqueeze(0)
    return torch.cat([torch.full((len(starts), 1), bos), stream[idx]], dim=1)


# ---- model -----------------------------------------------------------------------------------
def hf_config(cfg: dict, **changes):
    from transformers import DeepseekV4Config as HFConfig

    keep = {
        k: v for k, v in cfg.items() if k not in ("architectures", "model_type", "num_nextn_predict_layers")
    }
    return HFConfig(**{**keep, **changes})


class Mtp(nn.Module):
    """The multi-token-prediction layer, as the engine's ``MtpLayer`` computes it: row ``t``
    mixes the trunk's streams at ``t`` with the embedding of token ``t + 1`` (zero at ``t = 0``)
    and predicts token ``t + 2``; embedding and head are the trunk's."""

    def __init__(self, cfg: dict):
        super().__init__()
        from transformers.models.deepseek_v4 import modeling_deepseek_v4 as m

        mcfg = hf_config(cfg, num_hidden_layers=1, layer_types=[SLIDING], mlp_layer_types=["moe"])
        mcfg._attn_implementation = "eager"  # as the trunk's (the module is used outside a PreTrainedModel)
        mcfg._experts_implementation = "eager"
        d, eps = cfg["hidden_size"], cfg["rms_norm_eps"]
        self.enorm, self.hnorm = m.DeepseekV4RMSNorm(d, eps), m.DeepseekV4RMSNorm(d, eps)
        self.e_proj, self.h_proj = nn.Linear(d, d, bias=False), nn.Linear(d, d, bias=False)
        self.block = m.DeepseekV4DecoderLayer(mcfg, 0)
        self.hc_head = m.DeepseekV4HyperHead(mcfg)
        self.norm = m.DeepseekV4RMSNorm(d, eps)

    def forward(self, h, next_ids, embed, head, ctx: dict) -> torch.Tensor:
        e = embed(next_ids)
        e = torch.cat([torch.zeros_like(e[:, :1]), e[:, 1:]], dim=1)  # position 0 has no input
        x = self.h_proj(self.hnorm(h)) + self.e_proj(self.enorm(e)).unsqueeze(2)
        x = self.block(x, input_ids=next_ids, **ctx)
        return head(self.norm(self.hc_head(x)))


def trunk_forward(model, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Logits, last-layer streams ``[B, L, N, D]`` and the layers' keyword arguments."""
    from transformers.masking_utils import create_sliding_window_causal_mask

    m = model.model
    emb = m.embed_tokens(ids)
    pos = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)
    mask = create_sliding_window_causal_mask(
        config=m.config, inputs_embeds=emb, attention_mask=None, cache=None, position_ids=pos
    )
    pe = {f: m.rotary_emb(emb, position_ids=pos, layer_type=f) for f in ("main", "compress")}
    ctx = {"position_embeddings": pe, "position_ids": pos, "attention_mask": mask}
    h = emb.unsqueeze(2).expand(-1, -1, m.config.hc_mult, -1).contiguous()
    for layer in m.layers:
        h = layer(h, input_ids=ids, **ctx)
    return model.lm_head(m.norm(m.hc_head(h))), h, ctx


def frozen_shared(model):
    """The trunk's embedding and head as functions of detached weights: the MTP layer uses them
    but its loss must not train them."""
    emb, head = model.model.embed_tokens.weight, model.lm_head.weight
    return (lambda ids: F.embedding(ids, emb.detach())), (lambda x: F.linear(x, head.detach()))


def build(cfg: dict, seed: int):
    from transformers import DeepseekV4ForCausalLM

    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(hf_config(cfg))
    mtp = Mtp(cfg)
    model.apply(model._init_weights)
    mtp.apply(model._init_weights)
    g = torch.Generator().manual_seed(seed)
    e, k = cfg["n_routed_experts"], cfg["num_experts_per_tok"]
    with torch.no_grad():
        for layer in model.model.layers:  # hash routing: k distinct experts per token
            if hasattr(layer.mlp.gate, "tid2eid"):
                perm = torch.rand(cfg["vocab_size"], e, generator=g).argsort(dim=-1)[:, :k]
                layer.mlp.gate.tid2eid.copy_(perm)
    return model, mtp


class LoadBalancer:
    """Auxiliary-loss-free balancing: each top-k router's ``e_score_correction_bias`` moves by
    ``rate`` toward equal load after every step (up for under-used experts)."""

    def __init__(self, modules, rate: float = 1e-3):
        from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4TopKRouter

        self.routers = [r for mod in modules for r in mod.modules() if isinstance(r, DeepseekV4TopKRouter)]
        self.counts = {id(r): torch.zeros(r.num_experts, device=r.weight.device) for r in self.routers}
        self.rate = rate
        for r in self.routers:
            self.counts[id(r)] = self.counts[id(r)].to(r.weight.device)
            r.register_forward_hook(self._hook)

    def _hook(self, router, _inputs, out) -> None:
        self.counts[id(router)] += torch.bincount(out[2].reshape(-1), minlength=router.num_experts).float()

    @torch.no_grad()
    def step(self) -> None:
        for r in self.routers:
            c = self.counts[id(r)]
            r.e_score_correction_bias += self.rate * torch.sign(c.mean() - c)
            c.zero_()


# ---- training --------------------------------------------------------------------------------
@torch.no_grad()
def evaluate(model, mtp, windows: torch.Tensor, bsz: int = 16) -> dict:
    """Mean held-out loss (nats/token), perplexity and the MTP's loss and top-1 accuracy."""
    model.eval(), mtp.eval()
    tot = mtot = acc = n = mn = 0.0
    for i in range(0, len(windows), bsz):
        ids = windows[i : i + bsz]
        logits, h, ctx = trunk_forward(model, ids[:, :-1])
        tot += F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten(), reduction="sum").item()
        n += ids[:, 1:].numel()
        ml = mtp(h, ids[:, 1:], *frozen_shared(model), ctx)[:, :-1]
        tgt = ids[:, 2:]
        mtot += F.cross_entropy(ml.flatten(0, 1), tgt.flatten(), reduction="sum").item()
        acc += (ml.argmax(-1) == tgt).sum().item()
        mn += tgt.numel()
    model.train(), mtp.train()
    return {"loss": tot / n, "ppl": math.exp(tot / n), "mtp_loss": mtot / mn, "mtp_top1": acc / mn}


def train(args) -> dict:
    torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)
    dev = torch.device(args.device)
    train_docs, held_docs, digest = load_corpus(args.topics)
    if not digest.startswith(CORPUS_SHA256):
        print(
            f"warning: this corpus (sha256 {digest[:16]}) is not the one the shipped model was trained "
            f"on ({CORPUS_SHA256[:16]}, CPython 3.11's); pass --topics to use that one",
            flush=True,
        )
    tok = train_tokenizer(VOCAB, (line for d in train_docs for line in d.splitlines()))
    bos = tok.token_to_id(BOS_TOKEN)
    stream, held = token_stream(tok, train_docs), token_stream(tok, held_docs)
    L = args.seq_len
    held_windows = batch(held, torch.arange(0, len(held) - L, L), L, bos).to(dev)
    print(f"corpus sha256 {digest[:16]}: {len(stream)} training / {len(held)} held-out tokens", flush=True)

    model, mtp = build(CONFIG, args.seed)
    model.to(dev), mtp.to(dev)
    model.train(), mtp.train()
    params = [p for p in (*model.parameters(), *mtp.parameters()) if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    rest = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
    )
    balancer = LoadBalancer([model, mtp])
    g = torch.Generator().manual_seed(args.seed)
    log: dict = {"steps": [], "eval": []}
    t0 = time.time()
    for step in range(1, args.steps + 1):
        warm = min(1.0, step / args.warmup)
        frac = (step - args.warmup) / max(1, args.steps - args.warmup)
        lr = args.lr * warm * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, max(0.0, frac)))))
        for group in opt.param_groups:
            group["lr"] = lr
        starts = torch.randint(0, len(stream) - L - 1, (args.batch,), generator=g)
        ids = batch(stream, starts, L + 1, bos).to(dev)  # BOS + L + 1 tokens: inputs are the first L + 1
        logits, h, ctx = trunk_forward(model, ids[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
        ml = mtp(h.detach(), ids[:, 1:], *frozen_shared(model), ctx)[:, :-1]
        mloss = F.cross_entropy(ml.flatten(0, 1), ids[:, 2:].flatten())
        opt.zero_grad(set_to_none=True)
        (loss + mloss).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        balancer.step()
        log["steps"].append([step, round(loss.item(), 4), round(mloss.item(), 4)])  # (syncs a GPU)
        if step % args.log_every == 0 or step == args.steps:
            print(
                f"step {step} lr {lr:.2e} loss {loss.item():.3f} mtp {mloss.item():.3f} "
                f"{time.time() - t0:.0f}s",
                flush=True,
            )
        if step % args.eval_every == 0 or step == args.steps:
            ev = evaluate(model, mtp, held_windows)
            log["eval"].append({"step": step, **{k: round(v, 4) for k, v in ev.items()}})
            print(
                f"  held-out loss {ev['loss']:.3f} ppl {ev['ppl']:.1f} mtp top-1 {ev['mtp_top1']:.3f}",
                flush=True,
            )
    log["train_seconds"] = round(time.time() - t0, 1)
    weights = export_weights(model, mtp)
    log["final_bf16"] = {k: round(v, 4) for k, v in evaluate_rounded(model, mtp, held_windows).items()}
    log.update(
        corpus_sha256=digest,
        train_tokens=len(stream),
        held_out_tokens=len(held),
        args={k: _shown(v) for k, v in vars(args).items()},
    )
    return {"tok": tok, "weights": weights, "log": log}


def _shown(value):
    """``value`` for the JSON log: paths inside the repository relative to it."""
    if not isinstance(value, Path):
        return value
    path = value.resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(value)


def evaluate_rounded(model, mtp, windows) -> dict:
    """:func:`evaluate` with every matrix rounded to bfloat16, as the checkpoint stores it."""
    with torch.no_grad():
        for p in (*model.parameters(), *mtp.parameters()):
            if p.dim() >= 2:
                p.copy_(p.to(torch.bfloat16).float())
    return evaluate(model, mtp, windows)


def export_weights(model, mtp) -> dict[str, torch.Tensor]:
    """The trunk's and the MTP layer's tensors by the engine's HF-style names, matrices in bf16."""
    cfg = DeepseekV4Config.from_dict(dict(CONFIG), source="train_tiny CONFIG")
    specs = {**parameter_specs(cfg), **mtp_parameter_specs(cfg)}
    sd = dict(model.state_dict())
    sd.update({"model.mtp.0." + k.removeprefix("block."): v for k, v in mtp.state_dict().items()})
    out = {}
    for name, spec in specs.items():
        if name.startswith("model.mtp.0.") and name.endswith(("embed_tokens.weight", "lm_head.weight")):
            continue  # shared with the trunk
        t = sd[name].detach().cpu()
        if spec.kind in ("linear", "linear_bf16", "experts", "embedding"):
            t = t.to(torch.bfloat16)
        out[name] = t.contiguous()
    return out


def write_checkpoint(result: dict, out: Path, log_path: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    result["tok"].save(str(out / "tokenizer.json"))
    write_tokenizer_configs(out, CONFIG)
    save_checkpoint(result["weights"], {**CONFIG, "dtype": "bfloat16"}, out, names="native")
    licence = Path(os.__file__).with_name("LICENSE.txt")  # CPython's, the corpus's licence
    if licence.is_file():
        shutil.copyfile(licence, out / "CORPUS_LICENSE.txt")
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log_path.write_text(json.dumps(result["log"], separators=(",", ":")) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--plot", type=Path, default=DEFAULT_PLOT)
    p.add_argument("--log", type=Path, default=DEFAULT_LOG, help="the training log (JSON)")
    p.add_argument("--steps", type=int, default=700)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="CPU threads (1 is fastest on a busy machine)")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument(
        "--topics", type=Path, default=None, help="a pydoc_data/topics.py (default: this Python's)"
    )
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument("--eval-every", type=int, default=100)
    args = p.parse_args(argv)
    result = train(args)
    write_checkpoint(result, args.out, args.log)
    write_loss_svg(result["log"], args.plot)
    print(
        json.dumps(
            {"out": str(args.out), **result["log"]["eval"][-1], "final_bf16": result["log"]["final_bf16"]}
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
