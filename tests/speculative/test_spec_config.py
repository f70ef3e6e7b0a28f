"""The seed's environment knobs of speculative decoding: ``DEEPINFER_USE_NEXTN_DECODE=N``
(turns it on with ``N`` drafts; ``0`` off) and ``DEEPINFER_ENABLE_MTP_VARLEN=0|1``
(``speculative.varlen``: per-request verify lengths, or one per step)."""

from __future__ import annotations

import pytest

from deepinfer_core.config import EngineConfig, SpeculativeConfig
from deepinfer_core.errors import ConfigError


def test_use_nextn_decode_turns_speculation_on_or_off():
    assert EngineConfig.load(env={}).speculative is None
    cfg = EngineConfig.load(env={"DEEPINFER_USE_NEXTN_DECODE": "3"})
    assert cfg.speculative == SpeculativeConfig(max_draft_tokens=3)
    env = {"DEEPINFER_USE_NEXTN_DECODE": "0", "DEEPINFER_SPECULATIVE": '{"method": "fixed"}'}
    assert EngineConfig.load(env=env).speculative is None
    with pytest.raises(ConfigError, match="DEEPINFER_USE_NEXTN_DECODE='x': expected an integer"):
        EngineConfig.load(env={"DEEPINFER_USE_NEXTN_DECODE": "x"})


def test_enable_mtp_varlen_sets_varlen_unless_given():
    env = {"DEEPINFER_USE_NEXTN_DECODE": "4", "DEEPINFER_ENABLE_MTP_VARLEN": "0"}
    cfg = EngineConfig.load(env=env)
    assert (
        cfg.speculative is not None and not cfg.speculative.varlen and cfg.speculative.max_draft_tokens == 4
    )
    off = {"DEEPINFER_ENABLE_MTP_VARLEN": "0"}
    assert EngineConfig.load(env=off, speculative={"method": "dspark"}).speculative.varlen is False
    assert EngineConfig.load(env=off, speculative=SpeculativeConfig()).speculative.varlen is False
    # given explicitly: the argument wins; without speculation the knob does nothing
    assert EngineConfig.load(env=off, speculative={"varlen": True}).speculative.varlen is True
    assert EngineConfig.load(env=off, speculative=SpeculativeConfig(varlen=True)).speculative.varlen is True
    assert EngineConfig.load(env=off).speculative is None
    assert EngineConfig.load(env={"DEEPINFER_ENABLE_MTP_VARLEN": "1"}, speculative={}).speculative.varlen
    with pytest.raises(ConfigError, match="DEEPINFER_ENABLE_MTP_VARLEN='2': expected 0 or 1"):
        EngineConfig.load(env={"DEEPINFER_ENABLE_MTP_VARLEN": "2"}, speculative={})
