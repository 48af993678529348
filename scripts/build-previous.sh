#!/usr/bin/env bash
# Builds fastbroker (both packages) as of git revision REV into DIR, a pip --target directory
# that a node runs from when DIR comes first on its PYTHONPATH: tests/test_rolling_upgrade.py
# runs such a build beside this one. Kept while DIR holds REV.
#   scripts/build-previous.sh REV DIR [PYTHON]
set -euo pipefail
rev=$1
dir=$2
python=${3:-python3}
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
commit=$(git -C "$repo" rev-parse --verify "$rev^{commit}")
if [ -f "$dir/.rev" ] && [ "$(cat "$dir/.rev")" = "$commit" ]; then
    exit 0
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
git -C "$repo" archive "$commit" | tar -x -C "$work"
rm -rf "$dir"
# A target directory of its own, kept beside DIR: sharing this build's would let cargo take
# its artifacts as up to date (the archive's files are older than they are) and install this
# build's engine under the old Python code.
CARGO_TARGET_DIR="$dir.target" "$python" -m pip install -q --no-deps --target "$dir" \
    "$work/rust" "$work"
echo "$commit" > "$dir/.rev"
