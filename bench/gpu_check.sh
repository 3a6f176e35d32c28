#!/bin/sh
# bench/gpu_check.py on a GPU machine that has torch and transformers but no DeepSpeed and
# no network. Two halves:
#   sh bench/gpu_check.sh wheels   here: DeepSpeed 0.19.8 (pure Python; its ops compile on
#                                  first use, and the check needs none) and the small
#                                  dependencies it imports, as Python 3.12 wheels in .whl/
#   sh bench/gpu_check.sh run      there, with .whl/ carried: install them, run the check
set -eu
PY=${PYTHON:-python3}
case "${1:-run}" in
wheels)
    "$PY" -m pip wheel deepspeed==0.19.8 --no-deps -w .whl/
    "$PY" -m pip download hjson py-cpuinfo einops msgpack --no-deps --only-binary=:all: \
        --python-version 3.12 --platform manylinux2014_x86_64 -d .whl/
    ;;
run)
    "$PY" -m pip install --no-deps --no-index --quiet .whl/*.whl
    PYTHONPATH="$PWD/operator:$PWD/trainer" exec "$PY" bench/gpu_check.py "$@"
    ;;
*)
    echo "usage: sh bench/gpu_check.sh wheels|run" >&2
    exit 2
    ;;
esac
