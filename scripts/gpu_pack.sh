#!/usr/bin/env bash
# Pack what a lent GPU machine needs for the prepared run (scripts/gpu_run.sh), into .gpu/ (ignored
# by git; name it in the device tool's `carry`). The machine has Python 3.12, nvcc, CMake and
# ninja but no network, and takes at most 64 MiB with the working tree, so:
#   .gpu/prebuilt.tar.xz    llama.cpp's CUDA libraries and tools built beforehand on this machine
#                           (scripts/gpu_prebuild.sh), where they were: the lent machine's minutes
#                           go to measuring, not compiling
#   .gpu/llama.cpp.tar.gz   the llama.cpp sources vendored in the installed llama-cpp-python's
#                           sdist (the same llama.cpp), without docs, models, tests, examples, the
#                           web UI's assets and the backends a CUDA or CPU build does not use:
#                           gpu_run.sh build compiles them where there is no prebuilt build, or
#                           it does not run
#   .gpu/whl/               wheels for CPython 3.12 (GPU_PYTHON_VERSION: a rehearsal's own) of the
#                           packages the machine's image lacks, at the versions installed here
#   .gpu/site/              llama-cpp-python's own Python files (no libraries: gpu_run.sh builds
#                           them and points LLAMA_CPP_LIB_PATH there), with its metadata
#
#   scripts/gpu_pack.sh          # prints the size of .gpu/
set -euo pipefail
cd "$(dirname "$0")/.."
version=$(python -c "import importlib.metadata as m; print(m.version('llama-cpp-python'))")
rm -rf .gpu && mkdir -p .gpu/whl .gpu/site

# The vendored llama.cpp, trimmed to what a CUDA or CPU build of the libraries and tools reads.
pack_sources() {
    local work src
    work=$(mktemp -d)
    pip download --quiet --no-binary :all: --no-deps "llama-cpp-python==$version" -d "$work" >&2
    tar -xzf "$work/llama_cpp_python-$version.tar.gz" -C "$work"
    src="$work/llama_cpp_python-$version/vendor/llama.cpp"
    (
        cd "$src"
        rm -rf docs models tests benches media gguf-py conversion examples pocs app .github ci skills \
            requirements grammars tools/ui/src tools/ui/static tools/ui/node_modules
        for backend in ggml/src/ggml-*/; do
            case "$(basename "$backend")" in
                ggml-cpu | ggml-cuda | ggml-rpc | ggml-blas) ;;
                *) [ -f "$backend/CMakeLists.txt" ] && rm -rf "$backend" ;;
            esac
        done
    )
    tar -czf .gpu/llama.cpp.tar.gz -C "$(dirname "$src")" llama.cpp
    rm -rf "$work"
}

pack_sources  # (also beside a prebuilt build: where that does not run, gpu_run.sh builds these)
prebuilt=${GPU_PREBUILD_DIR:-$HOME/.cache/llamabatch/gpu}/prebuilt.tar.xz
if [ -f "$prebuilt" ]; then
    cp "$prebuilt" .gpu/prebuilt.tar.xz
fi

# The image's Python has numpy, jinja2, rich, typer, httpx, anyio, pyarrow, prometheus-client,
# annotated-doc, click, h11, tqdm, requests, pyyaml (the device tool's KINDS.md); these it lacks
# (diskcache: llama-cpp-python imports it; opentelemetry-api: FastAPI does).
wanted=(fastapi starlette pydantic pydantic-core annotated-types typing-inspection uvicorn python-multipart llguidance gguf
        diskcache opentelemetry-api)
pins=()
for name in "${wanted[@]}"; do
    pins+=("$name==$(python -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$name")")
done
platforms=()
for n in 35 34 31 28 27 24 17; do  # pip matches a manylinux tag exactly; the image's glibc is newer than any of these
    platforms+=(--platform "manylinux_2_${n}_x86_64")
done
python -m pip download --quiet --no-deps --only-binary=:all: --python-version "${GPU_PYTHON_VERSION:-3.12}" --implementation cp \
    "${platforms[@]}" --platform manylinux2014_x86_64 -d .gpu/whl "${pins[@]}" >&2

binding=$(python -c "import llama_cpp, os; print(os.path.dirname(llama_cpp.__file__))")
cp -r "$binding" .gpu/site/
rm -rf .gpu/site/llama_cpp/lib .gpu/site/llama_cpp/__pycache__
cp -r "$(dirname "$binding")/llama_cpp_python-$version.dist-info" .gpu/site/
# The machine's .git is not this tree's: machine.py reads LLAMABATCH_COMMIT (gpu_run.sh sets it from this).
echo "$(git rev-parse --short HEAD)$(git diff --quiet HEAD -- . ':!.gpu' || echo -dirty)" > .gpu/commit
du -sh .gpu
