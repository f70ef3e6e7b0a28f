"""LLM.chat: the checkpoint's chat template, rendered and tokenized once, then generated."""

from __future__ import annotations

import json
import shutil

import jinja2
import pytest
import tokenizers

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.errors import ConfigError
from deepinfer_core.models.deepseek_v4.tiny import builtin_tiny_model_dir

GREEDY = SamplingParams(temperature=0, max_tokens=4)
CONV = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hello there"},
    {"role": "assistant", "content": "Hi."},
    {"role": "user", "content": "Count to three"},
]


def render_independently(messages, add_generation_prompt=True, template=None) -> tuple[str, list[int]]:
    """Render with plain jinja2 from tokenizer_config.json and encode with HF `tokenizers`."""
    model_dir = builtin_tiny_model_dir()
    cfg = json.loads((model_dir / "tokenizer_config.json").read_text())
    text = (
        jinja2.Environment()
        .from_string(template or cfg["chat_template"])
        .render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=cfg["bos_token"],
            eos_token=cfg["eos_token"],
        )
    )
    tok = tokenizers.Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    return text, tok.encode(text, add_special_tokens=False).ids


def test_chat_sends_the_encoded_rendered_template_with_one_bos(llm):
    text, ids = render_independently(CONV)
    out = llm.chat(CONV, GREEDY, use_tqdm=False)[0]
    assert out.prompt == text and out.prompt_token_ids == ids
    bos = llm.get_tokenizer().bos_token_id
    assert ids[0] == bos and ids.count(bos) == 1
    # the engine generated from exactly those ids
    direct = llm.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == direct.outputs[0].token_ids


def test_chat_accepts_a_list_of_conversations(llm):
    convs = [CONV[:2], [{"role": "user", "content": "Another question"}]]
    outs = llm.chat(convs, GREEDY, use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == [render_independently(c)[1] for c in convs]
    assert all(len(o.outputs[0].token_ids) == 4 for o in outs)


def test_add_generation_prompt_false_and_custom_template(llm):
    no_gen = llm.chat(CONV, GREEDY, use_tqdm=False, add_generation_prompt=False)[0]
    assert no_gen.prompt_token_ids == render_independently(CONV, add_generation_prompt=False)[1]
    assert no_gen.prompt_token_ids != render_independently(CONV)[1]
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    custom = llm.chat(CONV, GREEDY, use_tqdm=False, chat_template=template)[0]
    assert custom.prompt == render_independently(CONV, template=template)[0]
    assert llm.get_tokenizer().chat_template != template  # the checkpoint's template is untouched


def test_chat_without_a_template_is_a_config_error(tmp_path):
    model_dir = tmp_path / "no_template"
    shutil.copytree(builtin_tiny_model_dir(), model_dir)
    cfg_path = model_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    del cfg["chat_template"]
    cfg_path.write_text(json.dumps(cfg))
    llm = LLM(model=model_dir, backend="reference")
    with pytest.raises(ConfigError, match="no chat template"):
        llm.chat(CONV, GREEDY, use_tqdm=False)
