#!/usr/bin/env bash
# The README's two commands:
#   bash dev.sh run  [args]   install what is missing, then run the main job (examples/train.py)
#   bash dev.sh test [args]   install what is missing, then run the test suite (pytest)
# Installs into the active Python (set PYTHON=... to pick another). When torch is absent it installs
# torch==2.13.0: an unpinned `pip install torch` would pull several GB of CUDA wheels. The extras installed are
# test,examples,hf (GPUDIST_EXTRAS=... to change them: CI adds mpi).
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
EXTRAS=${GPUDIST_EXTRAS:-test,examples,hf}

install() {
    if ! "$PY" -c "import torch" >/dev/null 2>&1; then
        echo "dev.sh: torch not found; installing torch==2.13.0 (CPU build)"
        "$PY" -m pip install --quiet "torch==2.13.0"
    fi
    # Re-install gpudist (editable, with its extras) when pyproject.toml or the extras changed, or it is not importable.
    local stamp=".dev-installed" here="$PWD" want
    want="$("$PY" -c 'import sys; print(sys.executable)') $(cksum < pyproject.toml) [$EXTRAS]"
    # Also when the gpudist that imports belongs to another checkout (checked from / so that this folder's own
    # gpudist/ does not shadow the installed one).
    if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ] || ! (cd / && "$PY" -c "
import os, sys, gpudist, pytest_timeout, pytest_benchmark, matplotlib, transformers
sys.exit(os.path.realpath(gpudist.__file__) != os.path.realpath('$here/gpudist/__init__.py'))") >/dev/null 2>&1; then
        echo "dev.sh: installing gpudist (editable) with its extras: $EXTRAS"
        "$PY" -m pip install --quiet -e ".[$EXTRAS]"
        echo "$want" > "$stamp"
    fi
}

cmd=${1:-}
[ $# -gt 0 ] && shift
case "$cmd" in
    run)  install; exec "$PY" examples/train.py "$@" ;;
    test) install; exec "$PY" -m pytest "$@" ;;
    *)    echo "usage: bash dev.sh run|test [args]" >&2; exit 2 ;;
esac
