#!/usr/bin/env bash
# llama.cpp's `llama-server` and `llama-quantize`, built from the llama.cpp that the llama-cpp-python sdist vendors
# (vendor/llama.cpp), then a Q4_0 re-quantization of minfer's default Q4_1 GGUF: the peers that
# benchmarks/peer_serve.py runs minfer's server against. Idempotent: each step is skipped when its output exists.
#
#   benchmarks/build_llama_cpp.sh            # BUILD=/work/llama.cpp-build SRC=/work/llama-src Q4_0=/work/smollm2-q4_0.gguf
#
# Environment: BUILD (build folder), SRC (where the sdist is downloaded and unpacked), Q4_0 (the re-quantized
# file), LLAMA_CPP_PYTHON (a pinned version, e.g. 0.3.36; the newest if empty), JOBS (make -j, default 2).
# Only pip (the sdist), cmake and a C++ compiler are needed; no internet besides the package registry.
set -euo pipefail

BUILD=${BUILD:-/work/llama.cpp-build}
SRC=${SRC:-/work/llama-src}
Q4_0=${Q4_0:-/work/smollm2-q4_0.gguf}
JOBS=${JOBS:-2}
SPEC=llama-cpp-python${LLAMA_CPP_PYTHON:+==$LLAMA_CPP_PYTHON}

mkdir -p "$SRC"
sdist=$(ls "$SRC"/llama_cpp_python-*.tar.gz 2>/dev/null | sort -V | tail -1 || true)
if [ -z "$sdist" ]; then
    python3 -m pip download --no-deps --no-binary :all: "$SPEC" -d "$SRC"
    sdist=$(ls "$SRC"/llama_cpp_python-*.tar.gz | sort -V | tail -1)
fi
tree="${sdist%.tar.gz}"
[ -d "$tree/vendor/llama.cpp" ] || tar -xzf "$sdist" -C "$SRC"
LLAMA="$tree/vendor/llama.cpp"
echo "llama.cpp source: $LLAMA ($(basename "$sdist"))"

if [ ! -x "$BUILD/bin/llama-server" ] || [ ! -x "$BUILD/bin/llama-quantize" ]; then
    # GGML_NATIVE: -march=native, so the AVX-512/AVX2 kernels llama.cpp picks at compile time match this CPU.
    # LLAMA_CURL off: no model downloads (and no libcurl dependency); the server loads local files only.
    # AMX off: on a Sapphire Rapids guest whose kernel does not grant the AMX tile state, -march=native compiles
    # ggml's AMX matmul and llama-server dies at its first `ldtilecfg` (a general-protection fault); minfer's
    # kernels use AVX-512 VNNI / AVX2 too, so the comparison stays on the same instructions.
    NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    nice -n 19 cmake -S "$LLAMA" -B "$BUILD" -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DCMAKE_BUILD_TYPE=Release \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON \
        -DCMAKE_C_FLAGS="$NO_AMX" -DCMAKE_CXX_FLAGS="$NO_AMX"
    nice -n 19 cmake --build "$BUILD" --target llama-server llama-quantize -j "$JOBS"
fi
"$BUILD/bin/llama-server" --version 2>&1 | head -2 || true

if [ ! -s "$Q4_0" ]; then
    q4_1=$(python3 -c "from minfer.model.sources import find_default_gguf; print(find_default_gguf())")
    # --allow-requantize: the input is already quantized (Q4_1); Q4_0 is what llama.cpp's fast x86 paths take.
    nice -n 19 "$BUILD/bin/llama-quantize" --allow-requantize "$q4_1" "$Q4_0" Q4_0
fi
ls -la "$BUILD/bin/llama-server" "$BUILD/bin/llama-quantize" "$Q4_0"
