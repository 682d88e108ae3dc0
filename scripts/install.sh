#!/usr/bin/env bash
# Installs mgpu-launch from this checkout, editable, with the given extras, into $PYTHON
# (default python3). The one install command of both CI (scripts/test.sh) and the Dockerfile,
# so the image installs exactly what CI installs and tests.
#
#   scripts/install.sh test,tensorflow-cpu,jax,torch   # what scripts/test.sh installs by default
#                                                      # (one backend extra per MGPU_TEST_BACKENDS)
#   PYTHON=/opt/venv/bin/python scripts/install.sh tensorflow    # the Dockerfile
set -euo pipefail
cd "$(dirname "$0")/.."
if [ $# -ne 1 ] || [ -z "$1" ]; then
  echo "usage: scripts/install.sh EXTRAS   (comma-separated, e.g. test,tensorflow-cpu;" \
       "see [project.optional-dependencies] in pyproject.toml)" >&2
  exit 2
fi
exec "${PYTHON:-python3}" -m pip install -q --disable-pip-version-check -e ".[$1]"
