#!/usr/bin/env bash
# The prepared GPU run, in two commands that each fit the device tool's ten minutes, on a machine
# that has Python 3.12, nvcc, CMake and ninja but no network (scripts/gpu_pack.sh packed .gpu/
# here; the device tool carries it along with the working tree):
#
#   bash scripts/gpu_run.sh build    # llama.cpp's shared libraries and llama-batched-bench,
#                                    # llama-server, llama-quantize from .gpu/llama.cpp.tar.gz
#                                    # (CUDA for the GPU present where nvcc and a GPU are; else
#                                    # the CPU's), and .gpu/whl's packages
#   bash scripts/gpu_run.sh bench    # python -m benchmarks gpu: its results files into $OUT
#   bash scripts/gpu_run.sh bench --rehearse   # the same at tiny sizes (a CPU)
#
# llama-cpp-python's Python files come from .gpu/site, and the libraries built here go into its
# lib folder, where it loads them from: no second build. Everything is written under
# $LLAMABATCH_GPU_DIR (/tmp/llamabatch-gpu), which lives as long as the machine.
set -euo pipefail
cd "$(dirname "$0")/.."
root=${LLAMABATCH_GPU_DIR:-/tmp/llamabatch-gpu}
phase=${1:?"build or bench"}
shift
case $phase in
build)
    [ -f .gpu/llama.cpp.tar.gz ] || { echo "no .gpu/: run scripts/gpu_pack.sh first (and carry .gpu)" >&2; exit 2; }
    rm -rf "$root/llama.cpp" "$root/build" "$root/site"
    mkdir -p "$root"
    tar -xzf .gpu/llama.cpp.tar.gz -C "$root"
    flags=""
    if command -v nvcc > /dev/null && nvidia-smi -L > /dev/null 2>&1; then  # a GPU, and its compiler
        flags="-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=${CUDA_ARCHITECTURES:-native}"
    fi
    generator=$(command -v ninja > /dev/null && echo "-G Ninja" || echo "")
    # shellcheck disable=SC2086  # flags and generator are lists of arguments
    cmake -S "$root/llama.cpp" -B "$root/build" $generator -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON \
        -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_USE_PREBUILT_UI=OFF $flags
    cmake --build "$root/build" --target llama llama-batched-bench llama-server llama-quantize -j "$(nproc)"
    echo "$flags" > "$root/build/flags"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$root/site" .gpu/whl/*.whl
    cp -r .gpu/site/. "$root/site/"
    mkdir -p "$root/site/llama_cpp/lib"
    cp -a "$root/build/bin/"lib*.so* "$root/site/llama_cpp/lib/"
    ls "$root/build/bin"
    ;;
bench)
    export PYTHONPATH="$root/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
    export LLAMABATCH_NATIVE_DIR="$root/build" PYTHONUNBUFFERED=1
    export LLAMABATCH_COMMIT=${LLAMABATCH_COMMIT:-$(cat .gpu/commit 2>/dev/null || echo unknown)}
    out=${OUT:-$root/out}
    mkdir -p "$out"
    python3 -m benchmarks gpu --out "$out" "$@"
    ;;
*)
    echo "usage: scripts/gpu_run.sh build | bench [--rehearse]" >&2
    exit 2
    ;;
esac
