#!/usr/bin/env bash
# Build llama.cpp's own reference tools (llama-batched-bench, llama-server, llama-perplexity,
# llama-lookup, llama-speculative, llama-embedding, ggml-rpc-server, llama-mtmd-cli) from the llama.cpp sources
# vendored in the sdist of the installed llama-cpp-python: the same llama.cpp version as the
# binding, so native and llamabatch figures compare fairly. Always with the RPC backend (--rpc).
#
#   scripts/build_native.sh            # prints the folder holding the binaries
#   CMAKE_ARGS="-DGGML_CUDA=on" scripts/build_native.sh
#
# The binaries land in ${LLAMABATCH_NATIVE_DIR:-~/.cache/llamabatch/native/VERSION}/bin, and
# llama.cpp's collection of models' chat templates (models/templates) beside them in templates/:
# the tests write tiny GGUFs that carry them.
set -euo pipefail

version=$(python -c "import importlib.metadata as m; print(m.version('llama-cpp-python'))")
dest=${LLAMABATCH_NATIVE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/llamabatch/native/$version}
tools=(llama-batched-bench llama-server llama-perplexity llama-lookup llama-speculative llama-embedding ggml-rpc-server llama-mtmd-cli)
flags="-DGGML_RPC=ON ${CMAKE_ARGS:-}"

# Binaries built with other flags (before RPC was on, or for another device) are all rebuilt.
# Flags compare as a set, whatever their case and order: CMAKE_ARGS="-DGGML_RPC=on" (as .ci/run
# and the README set it) asks for what these binaries already have.
same_flags() { [ "$(tr ' ' '\n' <<<"${1^^}" | sort -u | xargs)" = "$(tr ' ' '\n' <<<"${2^^}" | sort -u | xargs)" ]; }
if ! same_flags "$(cat "$dest/flags" 2>/dev/null)" "$flags"; then
    rm -rf "$dest/bin"
fi
missing=()
for tool in "${tools[@]}"; do
    [ -x "$dest/bin/$tool" ] || missing+=("$tool")
done
if [ ${#missing[@]} -eq 0 ] && [ -d "$dest/templates" ]; then
    echo "$dest/bin"
    exit 0
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
pip download --quiet --no-binary :all: --no-deps "llama-cpp-python==$version" -d "$work" >&2
tar -xzf "$work"/llama_cpp_python-"$version".tar.gz -C "$work"
src="$work/llama_cpp_python-$version/vendor/llama.cpp"
rm -rf "$dest/templates" && mkdir -p "$dest" && cp -r "$src/models/templates" "$dest/templates"
if [ ${#missing[@]} -eq 0 ]; then
    echo "$dest/bin"
    exit 0
fi

# Static binaries, so they run from the cache folder without the build tree's libraries.
# shellcheck disable=SC2086  # flags is a list of flags, as pip's build reads CMAKE_ARGS
cmake -S "$src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF $flags >&2
cmake --build "$work/build" --target "${missing[@]}" -j "$(nproc)" >&2

mkdir -p "$dest/bin"
for tool in "${missing[@]}"; do
    cp "$work/build/bin/$tool" "$dest/bin/"
done
echo "$flags" > "$dest/flags"
echo "$dest/bin"
