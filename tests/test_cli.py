"""The ``bastion`` command line."""

from __future__ import annotations

import subprocess
import sys

from bastion import LLM, SamplingParams


def test_generate_prints_the_greedy_completion():
    prompt = "The capital of France is"
    out = subprocess.run([sys.executable, "-m", "bastion.procs.cli", "generate", prompt,
                          "--no-chat", "--max-tokens", "6", "--dtype", "float32"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    expected = LLM(dtype="float32", max_model_len=256).generate(
        prompt, SamplingParams(temperature=0, max_tokens=6))[0].outputs[0].text
    assert out.stdout == expected + "\n"


def test_every_engine_flag_maps_to_a_config_field():
    from bastion.core.config import build_engine_config
    from bastion.procs.cli import build_parser, engine_kwargs

    args = build_parser().parse_args(["serve", "--max-model-len", "128", "--block-size", "32",
                                      "--no-enable-prefix-caching", "--ft-inflight", "abort"])
    config = build_engine_config(**engine_kwargs(args))
    assert config.model.max_model_len == 128 and config.cache.block_size == 32
    assert config.cache.enable_prefix_caching is False
    assert config.fault_tolerance.ft_inflight == "abort"
