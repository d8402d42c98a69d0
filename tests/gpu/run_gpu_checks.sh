#!/usr/bin/env bash
# One prepared GPU check (issue 7): the GPU tests (with issue 33's two ranks over NCCL,
# test_gpu_ranks.py, skipped with one GPU), then `disagg bench transport --device cuda`.
# Budget: under 5 minutes on one H200 (tests ~2 min, bench ~1 min, set-up seconds).
#
#   bash tests/gpu/run_gpu_checks.sh            # from the repository root
#
# Environment. The Makefile's venv pins torch==2.13.0 as a CPU build and installs from PyPI;
# a GPU machine needs its own CUDA torch, and the lent H200 machines reach no registry at all
# (/work/.library/device/KINDS.md: python3 3.12 with torch 2.11+cu130, numpy, pyyaml,
# prometheus-client, pytest, pytest-timeout; no pyzmq). So this script:
#   1. makes .venv-gpu like the Makefile (python3 -m venv), with the system site packages and
#      the host interpreter's own site-packages visible (a venv made from a venv, such as
#      /opt/torch/.venv, would otherwise not see its CUDA torch); if venv creation fails it
#      uses python3 directly and installs missing packages into .gpu-site/ (--target);
#   2. installs what is missing (pyzmq, at least) from wheels carried in .whl/ if present,
#      else from the package index if one is reachable. To carry pyzmq to an offline
#      machine, on the development machine run once (cp312, x86-64 manylinux):
#        echo /.whl/ >> .git/info/exclude
#        python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#          --implementation cp --platform manylinux_2_28_x86_64 -d .whl pyzmq==27.3.0
#      and name .whl in the device tool's `carry`;
#   3. runs the project from the checkout (PYTHONPATH=core:runtime:operator), as `pip install -e .`
#      would, without touching the machine's packages.
# Outputs go to $OUT (the device tool's folder) or ./.gpu-out: pytest.log, bench.txt,
# gpu_report.jsonl (bandwidth and leak figures from the tests). Exit status: non-zero if
# the tests or the bench failed.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT" || exit 2
OUT="${OUT:-$ROOT/.gpu-out}"
mkdir -p "$OUT"
HOST_PY="${PYTHON:-python3}"
VENV="$ROOT/.venv-gpu"
export PYTHONUNBUFFERED=1
started=$SECONDS
say() { echo "== [$((SECONDS - started))s] $*"; }

say "machine"
nvidia-smi -L 2>&1 || true
"$HOST_PY" -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__,
  "cuda", torch.version.cuda, "available", torch.cuda.is_available())' || exit 2

say "environment"
PY="$HOST_PY"
PIP_TARGET=()
if [ -x "$VENV/bin/python" ] || "$HOST_PY" -m venv --system-site-packages "$VENV" >/dev/null 2>&1; then
  PY="$VENV/bin/python"
  venv_site="$("$PY" -c 'import site; print(site.getsitepackages()[0])')"
  "$HOST_PY" -c 'import site; print("\n".join(site.getsitepackages()))' > "$venv_site/_host_site.pth"
else
  echo "python3 -m venv failed: using $HOST_PY directly, extra packages in .gpu-site/"
  PIP_TARGET=(--target "$ROOT/.gpu-site")
  export PYTHONPATH="$ROOT/.gpu-site"
fi
missing=$("$PY" - <<'EOF'
import importlib.util
need = {"torch": "torch", "zmq": "pyzmq", "numpy": "numpy", "yaml": "pyyaml",
        "prometheus_client": "prometheus-client", "pytest": "pytest"}
print(" ".join(pkg for mod, pkg in need.items() if importlib.util.find_spec(mod) is None))
EOF
)
if [ -n "$missing" ]; then
  echo "installing: $missing"
  pip=("$PY" -m pip install -q --disable-pip-version-check --no-compile "${PIP_TARGET[@]}")
  installed=1
  if [ -d .whl ]; then
    "${pip[@]}" --no-index --find-links .whl $missing && installed=0
  fi
  if [ "$installed" -ne 0 ]; then
    timeout 60 "${pip[@]}" $missing && installed=0
  fi
  if [ "$installed" -ne 0 ]; then
    echo "cannot install $missing: no usable .whl/ and no reachable index (see the header)"
    exit 2
  fi
fi
export PYTHONPATH="$ROOT/core:$ROOT/runtime:$ROOT/operator${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -c 'import torch, zmq, disagg_runtime.relay.backends.cuda_ipc.handles as c
print("pyzmq", zmq.__version__, "| cuda-ipc:", c.unavailable_reason() or "possible")' || exit 2

say "GPU tests"
export DISAGG_GPU_REPORT="$OUT/gpu_report.jsonl"
rm -f "$DISAGG_GPU_REPORT"
# --confcutdir: only tests/gpu/conftest.py (the suite's conftest needs the k8s test deps)
timeout 210 "$PY" -m pytest tests/gpu -q -rA -p no:cacheprovider --confcutdir=tests/gpu \
  -o addopts="--strict-markers" -o timeout=120 2>&1 | tee "$OUT/pytest.log"
tests_rc=${PIPESTATUS[0]}

say "bench transport --device cuda"
timeout 120 "$PY" -m disagg_runtime.cli bench transport --device cuda --sizes 64MiB,256MiB \
  2>&1 | tee "$OUT/bench.txt"
bench_rc=${PIPESTATUS[0]}

say "figures from the tests"
cat "$DISAGG_GPU_REPORT" 2>/dev/null || echo "(none)"
say "done: tests exit $tests_rc, bench exit $bench_rc"
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
