#!/usr/bin/env bash
# mypy cannot follow setuptools' editable-install import hook, and our package is mapped from
# several folders (services/ and operator/). Build a symlink view of `mooncake_k8s` under
# build/typecheck/ and check that, plus bench/ and tests/.
set -euo pipefail
cd "$(dirname "$0")/.."
# The repo-root folder operator/ would shadow the stdlib module `operator` whenever Python puts
# the working directory on sys.path (python -m ...). Never let it.
export PYTHONSAFEPATH=1
view=build/typecheck/mooncake_k8s
rm -rf build/typecheck && mkdir -p "$view"
for entry in services/*; do
  name=$(basename "$entry")
  case "$name" in __pycache__|*.egg-info) continue;; esac
  ln -s "../../../$entry" "$view/$name"
done
ln -s ../../../operator "$view/operator"
MYPYPATH=build/typecheck mypy -p mooncake_k8s "$@"
mypy bench tests "$@"
