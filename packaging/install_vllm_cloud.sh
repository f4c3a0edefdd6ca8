#!/usr/bin/env sh
# The cloud on vLLM in a virtual environment of its own (default .venv-vllm; README "The cloud on
# vLLM"): vLLM pins transformers 5, which the device's export toolchain does not allow beside it.
#   sh packaging/install_vllm_cloud.sh [FOLDER]
set -eu
venv="${1:-.venv-vllm}"
python3.11 -m venv "$venv"
"$venv/bin/pip" install -q --no-compile torch==2.13.0       # first and pinned: the CPU build, as for the device
"$venv/bin/pip" install -q --no-compile -r packaging/cloud-vllm.txt
"$venv/bin/pip" install -q --no-compile --no-deps -e .
# CUDA builds of torch's add-ons that the resolver pulls in: they fail to load against the CPU
# torch, and transformers imports torchvision whenever it is there (vLLM serves text without them)
"$venv/bin/pip" uninstall -q -y torchvision torchaudio torchcodec triton
"$venv/bin/python" -c "import vllm, cloud_backend.vllm_engine" && echo "vLLM cloud ready in $venv"
