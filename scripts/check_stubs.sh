#!/usr/bin/env bash
# Fails when the committed generated stubs differ from what the protos generate.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/gen_protos.sh >/dev/null 2>&1
if ! git diff --exit-code --stat -- protos/python || [ -n "$(git status --porcelain -- protos/python)" ]; then
  echo "generated stubs drifted from protos/: run scripts/gen_protos.sh and commit" >&2
  git status --porcelain -- protos/python >&2
  exit 1
fi
echo "stubs up to date"
