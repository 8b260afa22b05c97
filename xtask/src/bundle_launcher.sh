#!/usr/bin/env bash
# rlhf launcher of a relocatable bundle (`cargo xtask bundle`): finds libtorch @TORCH_VERSION@ at
# run time, then runs the real binary (bin/rlhf-bin) with it. Where libtorch comes from, in order:
#   1. $LIBTORCH (a libtorch directory, or a `torch` package directory);
#   2. the `torch` package of the python3 on PATH (its torch/lib);
#   3. the project's own venv (~/.cache/rlhf-rs/torch-@TORCH_VERSION@/venv).
# Another torch version is refused: the binary is built against this one's C++ ABI. Asking
# python3 where its torch is has a deadline ($RLHF_PROBE_TIMEOUT seconds, default 30): a python3
# that hangs is skipped with a warning.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
want="@TORCH_VERSION@"

# The version of the torch or libtorch directory $1 (empty when it has none).
version_of() {
  if [ -f "$1/version.py" ]; then
    sed -n "s/^__version__ *= *['\"]\([^'\"+]*\).*/\1/p" "$1/version.py" | head -n 1
  elif [ -f "$1/build-version" ]; then
    sed 's/+.*//' "$1/build-version" | head -n 1
  fi
}

# The torch package directory of the python3 on PATH (empty when it has none or does not answer
# in time).
python3_torch() {
  local secs="${RLHF_PROBE_TIMEOUT:-30}" rc=0 out
  out="$(timeout --kill-after=2 "$secs" python3 -c 'import importlib.util as u; s = u.find_spec("torch"); print(s.submodule_search_locations[0] if s else "")' 2>/dev/null)" || rc=$?
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    echo "warning: $(command -v python3) did not answer within $secs s (RLHF_PROBE_TIMEOUT); not using its torch" >&2
  fi
  printf '%s' "$out"
}

dir="" from=""
if [ -n "${LIBTORCH:-}" ]; then
  dir="$LIBTORCH" from="LIBTORCH"
elif command -v python3 >/dev/null 2>&1 && found="$(python3_torch)" && [ -n "$found" ]; then
  dir="$found" from="python3 ($(command -v python3))"
else
  for d in "$HOME"/.cache/rlhf-rs/torch-"$want"/venv/lib/python3*/site-packages/torch; do
    if [ -d "$d" ]; then dir="$d" from="the project's venv"; fi
  done
fi
if [ -z "$dir" ]; then
  echo "error: no libtorch found: set LIBTORCH, or put a python3 with torch==$want on PATH (pip install torch==$want)" >&2
  exit 1
fi
have="$(version_of "$dir")"
if [ "$have" != "$want" ]; then
  echo "error: $dir (from $from) is torch ${have:-of unknown version}; this bundle needs torch $want" >&2
  exit 1
fi
if [ ! -f "$dir/lib/libtorch_cpu.so" ]; then
  echo "error: $dir (from $from) has no lib/libtorch_cpu.so" >&2
  exit 1
fi
export LD_LIBRARY_PATH="$dir/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
if [ -z "${RLHF_NCCL_LIB:-}" ] && [ -f "$here/librlhf_nccl.so" ]; then
  export RLHF_NCCL_LIB="$here/librlhf_nccl.so"
fi
if [ -z "${RLHF_CUDA_GRAPH_LIB:-}" ] && [ -f "$here/librlhf_cuda_graph.so" ]; then
  export RLHF_CUDA_GRAPH_LIB="$here/librlhf_cuda_graph.so"
fi
exec "$here/rlhf-bin" "$@"
