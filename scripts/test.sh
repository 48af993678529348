#!/usr/bin/env bash
# Installs what the tests need (Debian packages, a Python venv with both wheels) and runs every
# check and test: rustfmt, clippy, cargo test, fuzzing, ruff, stubtest, pytest. Stops at the
# first failure.
#
# Needs: Debian with Python >= 3.11 and cargo. Environment knobs:
#   PYTHON               interpreter for the venv (default: python3)
#   FASTBROKER_VENV      venv location (default: build/test-venv in the checkout, git-ignored)
#   PYTEST_TIMEOUT       per-test timeout in seconds (default: 120)
#   FASTBROKER_SKIP_FUZZ 1 skips ci/fuzz.sh (ignored when CI=true); FUZZ_SECONDS sets its time
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"

PYTHON=${PYTHON:-python3}
VENV=${FASTBROKER_VENV:-$ROOT/build/test-venv}
PYTEST_TIMEOUT=${PYTEST_TIMEOUT:-120}
# mosquitto installs to /usr/sbin, which is not on every user's PATH.
export PATH="$PATH:/usr/sbin"
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1 PIP_PROGRESS_BAR=off

step() { printf '\n==> %s\n' "$*"; }
fail() {
    printf '\nFAILED: %s\n' "$*" >&2
    exit 1
}
# Runs a named step; on failure names it, so the cause is the last thing in the log.
check() {
    local name=$1
    shift
    step "$name"
    "$@" || fail "$name (exit code $?)"
}

step "checking tools"
command -v "$PYTHON" >/dev/null || fail "$PYTHON not found (Python >= 3.11 needed)"
"$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' ||
    fail "Python >= 3.11 needed, $PYTHON is $("$PYTHON" --version 2>&1)"
command -v cargo >/dev/null || fail "cargo not found (install Rust with rustup)"
cargo fmt --version >/dev/null 2>&1 || fail "rustfmt missing (rustup component add rustfmt)"
cargo clippy --version >/dev/null 2>&1 || fail "clippy missing (rustup component add clippy)"

missing_packages=()
command -v mosquitto >/dev/null || missing_packages+=(mosquitto)
command -v mosquitto_pub >/dev/null || missing_packages+=(mosquitto-clients)
command -v strace >/dev/null || missing_packages+=(strace)
# `ip netns`: the multicast discovery tests run nodes inside network namespaces.
command -v ip >/dev/null || missing_packages+=(iproute2)
# The fault-injection suite: HAProxy in front of the nodes, nftables rules for splits.
command -v haproxy >/dev/null || missing_packages+=(haproxy)
command -v nft >/dev/null || missing_packages+=(nftables)
# Headless Chromium opens the load-test dashboard; Java runs Spark (the fresh machine has 17).
command -v chromium >/dev/null || missing_packages+=(chromium)
command -v java >/dev/null || missing_packages+=(openjdk-17-jre-headless)
# Debian's Python creates venvs only with python3-venv (which provides ensurepip).
"$PYTHON" -c 'import ensurepip' 2>/dev/null || missing_packages+=(python3-venv)
if ((${#missing_packages[@]})); then
    step "installing Debian packages: ${missing_packages[*]}"
    if [[ $(id -u) == 0 ]]; then
        as_root=()
    elif command -v sudo >/dev/null; then
        as_root=(sudo -n)
    else
        fail "need root or sudo to apt-get install ${missing_packages[*]}"
    fi
    export DEBIAN_FRONTEND=noninteractive
    "${as_root[@]}" apt-get update -qq || fail "apt-get update"
    "${as_root[@]}" apt-get install -y -qq --no-install-recommends "${missing_packages[@]}" ||
        fail "apt-get install ${missing_packages[*]}"
fi

if [[ ! -x $VENV/bin/python ]]; then
    check "creating venv $VENV" "$PYTHON" -m venv "$VENV"
fi
# shellcheck source=/dev/null
source "$VENV/bin/activate"
# pyo3 (clippy's python feature) must see the same interpreter as the wheels.
export PYO3_PYTHON="$VENV/bin/python"

check "pip install ./rust .[test]" python -m pip install ./rust ".[test]"
check "fastbroker_core ships its type stubs" python - <<'EOF'
from importlib.resources import files

package = files("fastbroker_core")
missing = [name for name in ("__init__.pyi", "py.typed") if not package.joinpath(name).is_file()]
if missing:
    raise SystemExit(f"not in the installed fastbroker_core package: {', '.join(missing)}")
EOF

check "cargo fmt --check" cargo fmt --manifest-path rust/Cargo.toml --check
check "cargo clippy (python feature)" \
    cargo clippy --manifest-path rust/Cargo.toml --all-targets -- -D warnings
check "cargo clippy (no default features)" \
    cargo clippy --manifest-path rust/Cargo.toml --all-targets --no-default-features -- -D warnings
# Without the python feature: the pure-Rust tests need no libpython to link against.
check "cargo test" cargo test --manifest-path rust/Cargo.toml --no-default-features
# Bounded fuzzing of the codecs and the engine (docs/fuzzing.md). FASTBROKER_SKIP_FUZZ=1 skips
# it on a developer's machine; CI always runs it.
if [[ ${FASTBROKER_SKIP_FUZZ:-} == 1 && ${CI:-} != true ]]; then
    step "fuzzing skipped (FASTBROKER_SKIP_FUZZ=1)"
else
    check "fuzzing (ci/fuzz.sh, ${FUZZ_SECONDS:-60} s per target)" bash ci/fuzz.sh
fi
check "cargo test (load generator)" cargo test --release --manifest-path bench/loadgen/Cargo.toml
# Built here, not only by the perf gate: the bench harness tests run the real load generator.
check "cargo build (load generator)" cargo build --release --manifest-path bench/loadgen/Cargo.toml
check "cargo fmt/clippy (load generator)" bash -c "cargo fmt --manifest-path bench/loadgen/Cargo.toml --check && cargo clippy --release --manifest-path bench/loadgen/Cargo.toml --all-targets -- -D warnings"

check "ruff check" ruff check .
check "ruff format --check" ruff format --check .

# Run from the checkout root, where no fastbroker_core directory shadows the installed one.
check "stubtest fastbroker_core" \
    python -m mypy.stubtest --allowlist scripts/stubtest-allowlist.txt fastbroker_core

step "pytest"
# Both brokers are installed above: a missing one is a failure here, never a skip.
set +e
# -rsx: every skip and expected failure is listed with its reason.
FASTBROKER_REQUIRED=1 python -m pytest tests/ -q -rsx -p no:cacheprovider --timeout="$PYTEST_TIMEOUT"
pytest_status=$?
set -e
case $pytest_status in
    0) ;;
    # pytest's "no tests collected" must not pass for success, nor fail without saying why.
    5) fail "pytest collected no tests from tests/" ;;
    *) fail "pytest (exit code $pytest_status)" ;;
esac
step "all checks and tests passed"
