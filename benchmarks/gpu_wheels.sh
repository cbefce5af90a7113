#!/usr/bin/env bash
# Build .whl/ for a GPU visit: ../shared/gpu/wheelhouse.sh (pydantic, optuna, textual, deepspeed, ...) plus
# the packages `import deepspeed` needs that the GPU image lacks (einops, msgpack, py-cpuinfo, ninja;
# found by blocking each import here). Run from the project root in the venv where optplan is installed;
# carry ".whl" in the run and install it as README.md's "Measuring on a GPU" says.
set -euo pipefail
[[ -f pyproject.toml ]] || { echo "run this from the project root" >&2; exit 2; }
../shared/gpu/wheelhouse.sh
plat=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
      --platform manylinux1_x86_64 --platform any)
for p in einops msgpack py-cpuinfo ninja; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${plat[@]}" -d .whl "$p" || { echo "could not fetch a 3.12 wheel of $p" >&2; exit 1; }
done
du -sh .whl
