#!/usr/bin/env bash
# The prepared GPU run, in two commands that each fit the device tool's ten minutes, on a machine
# that has Python 3.12, nvcc, CMake and ninja but no network (scripts/gpu_pack.sh packed .gpu/
# here; the device tool carries it along with the working tree):
#
#   bash scripts/gpu_run.sh build    # llama.cpp's shared libraries and llama-batched-bench,
#                                    # llama-server: .gpu/prebuilt.tar.xz's (built beforehand by
#                                    # scripts/gpu_prebuild.sh) where they see the GPU, else built
#                                    # from .gpu/llama.cpp.tar.gz (CUDA for the GPU present where
#                                    # nvcc and a GPU are; else the CPU's); .gpu/whl's packages
#   bash scripts/gpu_run.sh bench    # python -m benchmarks gpu: its results files into $OUT
#   bash scripts/gpu_run.sh bench --rehearse   # the same at tiny sizes (a CPU)
#   bash scripts/gpu_run.sh exec COMMAND...    # a command with the build's libraries and packages
#
# llama-cpp-python's Python files come from .gpu/site, and the libraries built here go into its
# lib folder, where it loads them from: no second build. Everything is written under
# $LLAMABATCH_GPU_DIR (/tmp/llamabatch-gpu), which lives as long as the machine.
set -euo pipefail
cd "$(dirname "$0")/.."
root=${LLAMABATCH_GPU_DIR:-/tmp/llamabatch-gpu}
phase=${1:?"build or bench"}
shift

# The libraries the build needs at run time: CUDA's runtime and cuBLAS (the image's toolkit or
# its Python packages'), the driver's folder, and the build's own; the system's libstdc++ first
# (the earlier run's model loads crashed in this image without it).
use_libraries() {
    local dirs=("$root/build/bin")
    for d in /usr/local/nvidia/lib64 $(find /usr/local /opt -maxdepth 8 -name 'libcublas.so.13' -printf '%h\n' 2>/dev/null | sort -u); do
        [ -d "$d" ] && dirs+=("$d")
    done
    LD_LIBRARY_PATH="$(IFS=:; echo "${dirs[*]}")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    export LD_LIBRARY_PATH
    if [ -f /usr/lib/x86_64-linux-gnu/libstdc++.so.6 ]; then
        export LD_PRELOAD="/usr/lib/x86_64-linux-gnu/libstdc++.so.6${LD_PRELOAD:+:$LD_PRELOAD}"
    fi
}

# Whether the unpacked prebuilt tools run here and see the GPU (or, without one, run at all).
prebuilt_works() {
    local devices
    devices=$("$root/build/bin/llama-batched-bench" --list-devices 2>&1) || { echo "$devices" | tail -3 >&2; return 1; }
    echo "$devices" >&2
    ! nvidia-smi -L > /dev/null 2>&1 || echo "$devices" | grep -q CUDA0
}

case $phase in
build)
    [ -f .gpu/prebuilt.tar.xz ] || [ -f .gpu/llama.cpp.tar.gz ] || { echo "no .gpu/: run scripts/gpu_pack.sh first (and carry .gpu)" >&2; exit 2; }
    rm -rf "$root/llama.cpp" "$root/build" "$root/site"
    mkdir -p "$root/build/bin"
    use_libraries
    if [ -f .gpu/prebuilt.tar.xz ] && tar -xJf .gpu/prebuilt.tar.xz -C "$root/build/bin" && prebuilt_works; then
        echo "prebuilt: $(cat "$root/build/bin/flags")"
        cp "$root/build/bin/flags" "$root/build/flags"
    else
        [ -f .gpu/llama.cpp.tar.gz ] || { echo "the prebuilt tools do not run here, and .gpu/ has no sources to build" >&2; exit 3; }
        [ -f .gpu/prebuilt.tar.xz ] && echo "the prebuilt tools do not run here: building" >&2
        rm -rf "$root/build" && mkdir -p "$root"
        tar -xzf .gpu/llama.cpp.tar.gz -C "$root"
        flags=""
        if command -v nvcc > /dev/null && nvidia-smi -L > /dev/null 2>&1; then  # a GPU, and its compiler
            flags="-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=${CUDA_ARCHITECTURES:-native}"
        fi
        generator=$(command -v ninja > /dev/null && echo "-G Ninja" || echo "")
        # shellcheck disable=SC2086  # flags and generator are lists of arguments
        cmake -S "$root/llama.cpp" -B "$root/build" $generator -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON \
            -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_USE_PREBUILT_UI=OFF $flags
        cmake --build "$root/build" --target llama llama-batched-bench llama-server -j "$(nproc)"
        echo "$flags" > "$root/build/flags"
    fi
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$root/site" .gpu/whl/*.whl
    cp -r .gpu/site/. "$root/site/"
    # llamabatch runs from the tree (PYTHONPATH), with the metadata its __version__ reads.
    version=$(sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml | head -1)
    mkdir -p "$root/site/llamabatch-$version.dist-info"
    printf 'Metadata-Version: 2.1\nName: llamabatch\nVersion: %s\n' "$version" > "$root/site/llamabatch-$version.dist-info/METADATA"
    mkdir -p "$root/site/llama_cpp/lib"
    cp -a "$root/build/bin/"lib*.so* "$root/site/llama_cpp/lib/"
    ls "$root/build/bin"
    ;;
bench)
    use_libraries
    export PYTHONPATH="$root/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
    export LLAMABATCH_NATIVE_DIR="$root/build" LLAMABATCH_GPU_DIR="$root" PYTHONUNBUFFERED=1
    export LLAMABATCH_COMMIT=${LLAMABATCH_COMMIT:-$(cat .gpu/commit 2>/dev/null || echo unknown)}
    # Each part's results file into $root/out, packed into one file in $OUT after each part (the
    # device tool brings back 8 files at most), and once more at the end with the run's own.
    mkdir -p "$root/out" "${OUT:-$root}"
    archive="${OUT:-$root}/gpu-results.tar"
    status=0
    python3 -m benchmarks gpu --out "$root/out" --pack "$archive" "$@" || status=$?
    tar -cf "$archive" -C "$root/out" .
    exit $status
    ;;
exec)  # any command with the build's libraries and packages: what a diagnosis on the machine needs
    use_libraries
    export PYTHONPATH="$root/site:$PWD${PYTHONPATH:+:$PYTHONPATH}" LLAMABATCH_NATIVE_DIR="$root/build"
    "$@"
    ;;
*)
    echo "usage: scripts/gpu_run.sh build | bench [--rehearse] | exec COMMAND..." >&2
    exit 2
    ;;
esac
