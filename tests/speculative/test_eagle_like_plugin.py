"""A third-party drafter with layers of its own, added without touching the core: an EAGLE-like
head over the target's hidden states, registered through ``deepinfer_register_drafters``.

:class:`EagleHead` (a :class:`~deepinfer_core.speculative.draft_model.DraftModel`) maps the
target's last hidden state and an embedding of the token the step sampled to next-token logits
(one linear layer, random weights); it asks the runner for the hidden-state taps
(``taps_hidden``), names the model member it reads (``required_members``) and captures its own
graph family (``eagle``) through the runner's graph manager.  :class:`EagleDrafter` follows the
target (``observe``: the last kept hidden row of each request) and drafts one token per step.
The engine's outputs with it equal plain decoding's, greedy and seeded; its graphs replay.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.config import EngineConfig, SpeculativeConfig
from deepinfer_core.engine.graphs import EmulatedGraph
from deepinfer_core.engine.llm_engine import LLMEngine
from deepinfer_core.errors import ConfigError
from deepinfer_core.hookspecs import hookimpl
from deepinfer_core.speculative import Draft, Drafter
from deepinfer_core.speculative.draft_model import DraftModel
from deepinfer_core.speculative.verify_policy import FixedPolicy
from deepinfer_core.testing.managers import manager_with_plugin
from deepinfer_core.testing.observe import record_replays

EMBED = 16  # the head's own token-embedding width

PROMPTS = [{"prompt_token_ids": p} for p in ([5, 9, 23, 7, 7, 41, 3], [88, 12, 4], [17] * 11)]


class EagleHead(DraftModel):
    """``logits = [h_flat, E[token]] @ W``: one linear layer over the target's hidden state at
    ``p`` and the embedding of the token at ``p + 1``, guessing the token at ``p + 2``."""

    required_members = ("hidden_shape",)
    taps_hidden = True

    def __init__(self, runner) -> None:
        super().__init__(runner)
        g = torch.Generator().manual_seed(0)
        d, vocab = math.prod(runner.model.hidden_shape), runner.model_config.vocab_size
        dev = runner.device
        self.embed = (torch.randn(vocab, EMBED, generator=g) * 0.5).to(dev)
        self.w = (torch.randn(d + EMBED, vocab, generator=g) / math.sqrt(d + EMBED)).to(dev)
        slots = runner.config.max_num_seqs
        self._h = torch.zeros((slots, d), device=dev)  # the graphs' inputs (fixed addresses)
        self._t = torch.zeros(slots, dtype=torch.int64, device=dev)

    def forward(self, h: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        return torch.cat([h.flatten(1).float(), self.embed[tokens]], dim=-1) @ self.w

    def execute(self, h: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Logits ``[n, V]``; the smallest ``eagle`` graph holding ``n`` rows when captured."""
        n = tokens.shape[0]
        graphs = self.runner.graph_manager
        bucket = graphs.bucket("eagle", n)
        if bucket is None:
            return self.forward(h, tokens)
        self._h[:n].copy_(h.flatten(1))
        self._t[:n].copy_(tokens)
        return graphs.replay("eagle", bucket)[:n]

    def capture_graphs(self, graphs, buckets):
        def make(b):
            return lambda: self.forward(self._h[:b], self._t[:b])

        return graphs.capture_family("eagle", buckets, make, "batch-{} eagle")


class EagleDrafter(Drafter):
    """One draft per request and step from :class:`EagleHead`."""

    draft_model = EagleHead

    def bind(self, runner) -> None:
        self.head = runner.draft_model
        self.last: dict[str, tuple[int, torch.Tensor]] = {}  # request -> (position, hidden row)

    def observe(self, chunks) -> None:
        for c in chunks:
            self.last.pop(c.request_id, None)
            if c.sampled and c.num_rows:
                row = c.hidden_row + c.num_rows - 1
                self.last[c.request_id] = (c.start_pos + c.num_rows - 1, c.hidden[row].clone())

    def propose(self, contexts):
        drafts = [Draft([]) for _ in contexts]
        live = [
            i for i, c in enumerate(contexts) if self.last.get(c.request_id, (-1,))[0] == len(c.token_ids) - 2
        ]
        if live:
            h = torch.stack([self.last[contexts[i].request_id][1] for i in live])
            tokens = torch.tensor([contexts[i].token_ids[-1] for i in live], device=h.device)
            guess = self.head.execute(h, tokens).argmax(dim=-1).tolist()
            for i, t in zip(live, guess, strict=True):
                drafts[i] = Draft([t])
        return drafts

    def on_finished(self, request_id: str) -> None:
        self.last.pop(request_id, None)


class MissingMember(EagleHead):
    required_members = ("hidden_shape", "eagle_fc")


class OneDraft(FixedPolicy):
    """Verifies at most one draft per request (a plugin's verify-length policy)."""

    calls = 0

    def lengths(self, proposed, budget, confidences, cost, causal):
        OneDraft.calls += 1
        return [min(n, 1) for n in super().lengths(proposed, budget, confidences, cost, causal)]


class Plugin:
    @hookimpl
    def deepinfer_register_verify_policies(self, register):
        register("one_draft", lambda: OneDraft, description="test: one draft per request")

    @hookimpl
    def deepinfer_register_drafters(self, register):
        register("eagle_like", lambda: EagleDrafter, description="test EAGLE-like head")
        register("eagle_missing", lambda: type("D", (EagleDrafter,), {"draft_model": MissingMember}))


def _llm(tiny_dir: Path, drafter: str | None, method: str = "fixed") -> LLM:
    spec = SpeculativeConfig(drafter=drafter, method=method, max_draft_tokens=2) if drafter else None
    config = EngineConfig(model=str(tiny_dir), max_num_seqs=4, speculative=spec)
    return LLM.from_engine(LLMEngine(config, plugins=manager_with_plugin(Plugin(), "eagle_test")))


def test_a_draft_model_missing_a_required_member_is_one_clear_error():
    class Model:
        hidden_shape = (2, 4)
        eagle_fc = None  # present but unset counts as missing

    EagleHead.check_model(Model(), "eagle_like")  # has what it needs
    with pytest.raises(ConfigError, match=r"drafter='x'.*MissingMember.*'eagle_fc'.*Model"):
        MissingMember.check_model(Model(), "x")


@pytest.mark.slow
def test_the_engine_refuses_a_model_without_the_members(tiny_dir: Path):
    with pytest.raises(ConfigError, match="'eagle_fc'"):
        _llm(tiny_dir, "eagle_missing")


def test_an_unknown_verify_policy_is_one_error_listing_the_registered_ones(tiny_dir: Path):
    with pytest.raises(
        ConfigError, match=r"speculative.method='nope' is not registered.*'dspark', 'fixed', 'one_draft'"
    ):
        _llm(tiny_dir, "eagle_like", method="nope")


@pytest.mark.slow
@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
        SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=16, ignore_eos=True),
    ],
    ids=["greedy", "seeded"],
)
def test_eagle_like_drafter_is_lossless_and_replays_its_graphs(tiny_dir: Path, params):
    want = _llm(tiny_dir, None).generate(PROMPTS, params, use_tqdm=False)
    llm = _llm(tiny_dir, "eagle_like", method="one_draft")
    runner = llm.engine.runner
    assert isinstance(runner.draft_model, EagleHead) and runner.hidden is not None
    assert runner.capture_graphs(EmulatedGraph) is None
    assert sorted(runner.graph_manager.graphs("eagle")) == [1, 2, 4]
    replays: list[str] = []
    record_replays({f: runner.graph_manager.graphs(f) for f in ("verify", "eagle")}, replays)
    got = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    spec = llm.get_metrics()["speculative"]
    assert spec["num_draft_tokens"] > 0
    assert "eagle" in replays and "verify" in replays
    assert OneDraft.calls > 0  # the plugin's verify-length policy chose the lengths
