"""GGUF files, converted once into a cached Hugging Face folder.

The first load reads the GGUF file, dequantizes every tensor to float32, renames it to its
Hugging Face name (undoing llama.cpp's q/k row permutation for Llama-family models) and writes
``model.safetensors``, ``config.json`` and the tokenizer files (from the GGUF metadata, via
transformers' GGUF integration) under ``$BASTION_CACHE_DIR/gguf/<name>-<key>``, keyed by a digest
of the file's bytes. Later loads read that folder with the Hugging Face loader; a copy of the same
file at another path (a fresh clone, a redeploy) reuses it instead of adding a folder per path.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from bastion import envs

logger = logging.getLogger(__name__)

_COMPLETE_MARKER = ".complete"
_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                  "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
# llama.cpp tensor name (inside blk.N.) -> Hugging Face name (inside model.layers.N.)
_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "ffn_gate_inp": "mlp.gate",
}
_EXPERT_NAMES = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj",
                 "ffn_down_exps": "down_proj"}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
                 "output": "lm_head"}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")


def bastion_cache_dir() -> Path:
    return Path(envs.get("BASTION_CACHE_DIR") or Path.home() / ".cache" / "bastion")


def is_gguf_file(path: str) -> bool:
    if not os.path.isfile(path):
        return False
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def converted_dir(path: str) -> Path:
    """Cache folder of one GGUF file, named by its stem and a SHA-256 of its bytes.

    # NOTE: the key is the content, not the path or mtime: keyed by path, every clone or deploy
    folder of the same model added a folder of float32 weights and filled the disk. Hashing reads
    the file (about 1.2 GB/s), once per process: the digest is memoized by path, size and mtime.
    """
    st = os.stat(path)
    digest = _content_digest(os.path.abspath(path), st.st_size, st.st_mtime_ns)
    return bastion_cache_dir() / "gguf" / f"{Path(path).stem}-{digest}"


@functools.lru_cache(maxsize=8)
def _content_digest(path: str, size: int, mtime_ns: int) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()[:16]


def ensure_converted(path: str) -> Path:
    """The Hugging Face folder for GGUF file ``path``, converting it on first use.

    # NOTE: written to a temporary folder and renamed into place, so concurrent workers never
    see a half-written cache; a loser of the race discards its copy.
    """
    target = converted_dir(path)
    if (target / _COMPLETE_MARKER).exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    logger.info("converting GGUF %s on its first use (cached under %s afterwards)", path,
                target.parent)
    start = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".tmp-"))
    try:
        _convert(path, tmp)
        (tmp / _COMPLETE_MARKER).touch()
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    except OSError:
        if not (target / _COMPLETE_MARKER).exists():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("converted GGUF %s into %s in %.1f s", path, target, time.perf_counter() - start)
    return target


def _convert(path: str, out: Path) -> None:
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoTokenizer

    folder, name = os.path.split(os.path.abspath(path))
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    if config.model_type not in _ARCHITECTURES:
        raise ValueError(f"GGUF architecture {config.model_type!r} is not supported; supported: "
                         f"{', '.join(_ARCHITECTURES)}")
    config.architectures = [_ARCHITECTURES[config.model_type]]
    config.save_pretrained(out)
    AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(out)
    tensors = dict(iter_gguf_tensors(path, config.model_type, config.num_attention_heads,
                                     getattr(config, "num_key_value_heads", None)
                                     or config.num_attention_heads))
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})


def iter_gguf_tensors(path: str, model_type: str, num_heads: int, num_kv_heads: int
                      ) -> Iterator[tuple[str, torch.Tensor]]:
    """Dequantized float32 tensors of a GGUF file under their Hugging Face names."""
    from gguf import GGUFReader, dequantize

    for tensor in GGUFReader(path).tensors:
        shape = tuple(reversed([int(d) for d in tensor.shape]))  # ggml lists dims innermost first
        array = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        array = array.reshape(shape)
        hf_name, experts = _hf_name(tensor.name)
        if model_type == "llama" and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = num_heads if "q_proj" in hf_name else num_kv_heads
            array = _unpermute_qk(array, heads)
        if experts:
            for e in range(array.shape[0]):
                yield hf_name.format(e), torch.tensor(array[e])
        else:
            yield hf_name, torch.tensor(array)


def _hf_name(gguf_name: str) -> tuple[str, bool]:
    """(Hugging Face name, whether it is a stacked expert tensor with a ``{}`` expert slot)."""
    base, _, suffix = gguf_name.rpartition(".")
    if base in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[base]}.{suffix}", False
    match = _BLOCK_RE.match(gguf_name)
    if match:
        layer, part, suffix = match.groups()
        prefix = f"model.layers.{layer}."
        if part in _LAYER_NAMES:
            return f"{prefix}{_LAYER_NAMES[part]}.{suffix}", False
        if part in _EXPERT_NAMES:
            return f"{prefix}mlp.experts.{{}}.{_EXPERT_NAMES[part]}.{suffix}", True
    raise ValueError(f"GGUF tensor {gguf_name!r} has no known Hugging Face name")


def _unpermute_qk(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's convert-time permutation, which interleaves the two rotary halves of
    each head's rows (GPT-J order) so that its kernels can rotate adjacent pairs."""
    rows = weight.shape[0] // num_heads
    w = weight.reshape(num_heads, rows // 2, 2, *weight.shape[1:])
    return w.swapaxes(1, 2).reshape(weight.shape)
