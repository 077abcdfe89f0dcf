"""Model options a vLLM user passes: --chat-template, --generation-config, the served names."""

from __future__ import annotations

import json

import pytest

from bastion.core.config import ConfigError, ModelConfig, build_engine_config
from bastion.core.loader import load_generation_defaults, load_tokenizer, resolve_model
from bastion.procs.serve import served_model_names

MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def resolved():
    return resolve_model(ModelConfig())


def render(config: ModelConfig, resolved) -> str:
    tokenizer = load_tokenizer(config, resolved)
    return tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)


def test_chat_template_inline_or_from_a_file(resolved, tmp_path):
    assert "<|im_start|>user\nhi<|im_end|>" in render(ModelConfig(), resolved)
    inline = "{% for m in messages %}[{{ m.role }}] {{ m.content }}{% endfor %}"
    assert render(ModelConfig(chat_template=inline), resolved) == "[user] hi"
    path = tmp_path / "template.jinja"
    path.write_text("{{ messages[0].content | upper }}")
    assert render(ModelConfig(chat_template=str(path)), resolved) == "HI"
    with pytest.raises(ConfigError, match="neither a file nor a template"):
        ModelConfig(chat_template=str(tmp_path / "missing.jinja"))


def test_generation_config_auto_vllm_or_a_folder(resolved, tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({
        "temperature": 0.6, "top_k": 20, "top_p": 0.95, "max_new_tokens": 77,
        "do_sample": True, "eos_token_id": 2, "min_p": None}))
    folder = ModelConfig(generation_config=str(tmp_path))
    assert load_generation_defaults(folder, resolved) == {
        "temperature": 0.6, "top_k": 20, "top_p": 0.95, "max_tokens": 77}
    # The embedded GGUF has no generation_config.json: auto finds nothing, as vllm asks.
    assert load_generation_defaults(ModelConfig(), resolved) == {}
    assert load_generation_defaults(ModelConfig(generation_config="vllm"), resolved) == {}
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match="generation_config.json does not exist"):
        load_generation_defaults(ModelConfig(generation_config=str(empty)), resolved)


def test_the_embedded_model_is_served_under_a_usable_name_with_aliases(resolved, tmp_path):
    config = build_engine_config("serve", device="cpu")
    assert served_model_names(config, resolved) == (
        "SmolLM2-135M-Instruct", "SmolLM2-135M-Instruct.Q4_1.gguf",
        "HuggingFaceTB/SmolLM2-135M-Instruct")
    named = build_engine_config("serve", device="cpu", served_model_name=["a", "b"])
    assert served_model_names(named, resolved) == ("a", "b")
    folder = tmp_path / "Qwen3-0.6B"
    folder.mkdir()
    other = build_engine_config("serve", device="cpu", model=str(folder) + "/")
    assert served_model_names(other, resolved._replace(path=str(folder) + "/")) == (
        "Qwen3-0.6B", str(folder) + "/")
