#!/usr/bin/env bash
# Wheels of memra's dependencies for a GPU machine with PyTorch, Triton and transformers but no package index
# (CPython 3.12, x86-64), at the versions installed here, into DIR (default .whl):
#
#     bash tools/offline_wheels.sh [DIR] [PYTHON_VERSION]
#
# It prints the line that installs them there.
# The list is memra's own needs (pyproject's dependencies and test extra) less what such an image brings, with
# what they need in turn; one version of each, since two stop a --no-deps install.
set -eu
dir=${1:-.whl}; py=${2:-3.12}
names="annotated-doc annotated-types anyio click fastapi gguf h11 httpcore httpcore2 httpx httpx2 idna jiter
llguidance openai opentelemetry-api prometheus_client pydantic pydantic_core sniffio starlette tqdm truststore
typing-inspection typing_extensions uvicorn"
# the versions installed here (pip install -e '.[test]' first: a missing one stops the script, named)
pins=$(python3 -c 'import importlib.metadata as m, sys; print(" ".join(f"{n}=={m.version(n)}" for n in sys.argv[1:]))' $names)
platforms=""
for n in 17 24 27 28 31 34 35; do platforms+=" --platform manylinux_2_${n}_x86_64"; done
mkdir -p "$dir"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$py" --implementation cp $platforms \
  --platform manylinux2014_x86_64 --platform any -d "$dir" $pins
echo "$(ls "$dir" | wc -l) wheels in $dir ($(du -sh "$dir" | cut -f1))"
echo "there: python3 -m pip install -q --no-index --no-deps --target /tmp/site $dir/*.whl && export PYTHONPATH=/tmp/site:\$PWD"
