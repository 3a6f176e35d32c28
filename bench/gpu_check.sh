#!/bin/sh
# bench/gpu_check.py on a GPU machine that has torch and transformers but no DeepSpeed and
# no network. Two halves:
#   sh bench/gpu_check.sh wheels   here: DeepSpeed 0.19.8 (pure Python; its ops compile on
#                                  first use, and the check needs none), the dependencies it
#                                  and gspo_trainer import that the GPU machine's image
#                                  lacks (pydantic, msgspec, hjson), and the transformers the
#                                  learner pins (the image has 5.17; zero3_load patches 5.19's
#                                  loader), as Python 3.12 wheels in .whl/
#   sh bench/gpu_check.sh run      there, with .whl/ carried: install them, run the check
set -eu
PY=${PYTHON:-python3}
case "${1:-run}" in
wheels)
    "$PY" -m pip wheel deepspeed==0.19.8 --no-deps -w .whl/
    "$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .whl/ hjson==3.1.0 py-cpuinfo einops msgpack pydantic==2.14.4 \
        pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
        typing-extensions==4.16.0 msgspec==0.22.0 transformers==5.19.0
    ;;
run)
    # Into a directory of their own, first on the path: the image's site-packages may not be
    # writable, and its transformers (5.17) must not win over the carried one.
    "$PY" -m pip install --no-deps --no-index --no-compile --quiet --upgrade \
        --target /tmp/gspo-site .whl/*.whl
    PYTHONPATH="$PWD/operator:$PWD/trainer:/tmp/gspo-site" exec "$PY" bench/gpu_check.py "$@"
    ;;
*)
    echo "usage: sh bench/gpu_check.sh wheels|run" >&2
    exit 2
    ;;
esac
