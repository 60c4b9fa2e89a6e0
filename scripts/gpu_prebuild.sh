#!/usr/bin/env bash
# Build llama.cpp's CUDA libraries and tools HERE, on a machine without a GPU, for the prepared
# GPU run: a lent GPU machine's minutes then go to measuring, not to compiling (its 16 cores
# take about as long for ggml-cuda as its whole lease). CUDA's compiler, runtime, cuBLAS and
# CCCL headers come from NVIDIA's wheels on PyPI (pinned to the lent machine's CUDA, 13.0);
# ggml-cuda links the driver (libcuda.so.1), which only a GPU machine has, so an empty stub
# stands in for it at link time. The result (the shared libraries and llama-batched-bench,
# llama-server; about 20 minutes on 2 cores) is packed by scripts/gpu_pack.sh into .gpu/.
#
#   scripts/gpu_prebuild.sh            # -> $GPU_PREBUILD_DIR/prebuilt.tar.xz
#
# Variables: CUDA_ARCHITECTURES (90: the H100 and H200), GPU_PREBUILD_DIR (~/.cache/llamabatch/gpu).
set -euo pipefail
cd "$(dirname "$0")/.."
version=$(python -c "import importlib.metadata as m; print(m.version('llama-cpp-python'))")
dir=${GPU_PREBUILD_DIR:-$HOME/.cache/llamabatch/gpu}
cuda="$dir/cuda"
mkdir -p "$dir"

if [ ! -x "$cuda/nvidia/cu13/bin/nvcc" ]; then
    wheels=$(mktemp -d)
    pip download --quiet --no-deps -d "$wheels" "nvidia-cuda-nvcc==13.0.*" "nvidia-cuda-runtime==13.0.*" "nvidia-cublas==13.0.*" \
        "nvidia-cuda-cccl==13.0.*" "nvidia-nvvm==13.0.*" "nvidia-cuda-crt==13.0.*"
    for wheel in "$wheels"/*.whl; do unzip -q -o "$wheel" -d "$cuda"; done
    rm -rf "$wheels"
fi
toolkit="$cuda/nvidia/cu13"
(
    cd "$toolkit/lib"
    for lib in cudart cublas cublasLt; do ln -sf "lib$lib.so.13" "lib$lib.so"; done
    mkdir -p stubs
    echo 'void cuGetErrorString(void) {}' > stubs/stub.c
    gcc -shared -fPIC -o stubs/libcuda.so -Wl,-soname,libcuda.so.1 stubs/stub.c
    ln -sfn lib ../lib64
)

src="$dir/llama.cpp-$version"
if [ ! -d "$src" ]; then
    work=$(mktemp -d)
    pip download --quiet --no-binary :all: --no-deps "llama-cpp-python==$version" -d "$work" >&2
    tar -xzf "$work/llama_cpp_python-$version.tar.gz" -C "$work"
    mv "$work/llama_cpp_python-$version/vendor/llama.cpp" "$src"
    rm -rf "$work"
fi

build="$dir/build-$version"
# The CPU backend for any x86-64 with AVX2 (not this machine's own instructions); executables may
# leave the driver's symbols to the machine that has the driver.
PATH="$toolkit/bin:$PATH" cmake -S "$src" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
    -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES="${CUDA_ARCHITECTURES:-90}" -DCUDAToolkit_ROOT="$toolkit" \
    -DCMAKE_CUDA_COMPILER="$toolkit/bin/nvcc" -DGGML_CUDA_NCCL=OFF \
    -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON \
    "-DCMAKE_EXE_LINKER_FLAGS=-Wl,--allow-shlib-undefined" > "$dir/configure.log"
PATH="$toolkit/bin:$PATH" ninja -C "$build" llama mtmd llama-batched-bench llama-server
echo "-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=${CUDA_ARCHITECTURES:-90} (prebuilt with nvcc $("$toolkit/bin/nvcc" --version | grep -o 'release [0-9.]*'))" > "$build/bin/flags"
# Symbols stripped (the device code is kept): the lent machine takes at most 64 MiB along.
stage=$(mktemp -d)
cp -a "$build/bin/flags" "$build/bin/llama-batched-bench" "$build/bin/llama-server" "$build/bin/"lib*.so* "$stage/"
find "$stage" -type f -name "*.so*" -exec strip --strip-unneeded {} +
strip --strip-unneeded "$stage/llama-batched-bench" "$stage/llama-server"
tar -cf - -C "$stage" --owner=0 --group=0 . | xz -T0 -6 > "$dir/prebuilt.tar.xz"
rm -rf "$stage"
du -h "$dir/prebuilt.tar.xz"
