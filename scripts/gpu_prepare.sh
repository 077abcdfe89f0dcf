#!/usr/bin/env bash
# Fill the ignored .whl/ folder that scripts/gpu_run.sh carries to the device machine (Python
# 3.12, torch 2.11, no pyzmq/msgspec/gguf/setproctitle/xgrammar/pydantic):
#   - the wheels in ../shared/wheels-py312/;
#   - xgrammar, apache-tvm-ffi, pydantic (with pydantic-core) and jsonschema (the GPU
#     structured-output test validates with it) for CPython 3.12, from the
#     package registry;
#   - .whl/qwen3tok: configs/qwen3-0.6b's config.json with SmolLM2's vocabulary (49152, bos 1,
#     eos 2) and the embedded model's tokenizer files (the device has no Qwen3 tokenizer).
# Run once from the repository root, after scripts/setup.sh: bash scripts/gpu_prepare.sh
set -eu
PY=${PYTHON:-.venv/bin/python}
mkdir -p .whl/qwen3tok
cp ../shared/wheels-py312/*.whl .whl/ 2>/dev/null || echo "no ../shared/wheels-py312 here"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux_2_17_x86_64 -d .whl \
  xgrammar==0.2.9 apache-tvm-ffi pydantic pydantic-core typing-inspection annotated-types \
  jsonschema jsonschema-specifications referencing rpds-py attrs
"$PY" - <<'PYEOF'
import json, shutil
from pathlib import Path
from bastion.core.loader.embedded import embedded_gguf_path
from bastion.core.loader.gguf_loader import ensure_converted

src = Path(ensure_converted(embedded_gguf_path()))
dst = Path(".whl/qwen3tok")
for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
    shutil.copy(src / name, dst / name)
config = json.loads(Path("configs/qwen3-0.6b/config.json").read_text())
config.update(vocab_size=49152, bos_token_id=1, eos_token_id=2)
(dst / "config.json").write_text(json.dumps(config, indent=2))
print("wrote", dst)
PYEOF
du -sh .whl
