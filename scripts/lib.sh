# Shared by scripts/test, scripts/demo and .ci/run. Source it; do not run it.
#
# Everything here is idempotent: on a machine that already has what is needed, nothing
# is installed and nothing is downloaded.

# Runs a command as root: directly when we are root, else through sudo.
as_root() {
    if [ "$(id -u)" -eq 0 ]; then
        "$@"
    elif command -v sudo >/dev/null 2>&1; then
        sudo "$@"
    else
        echo "error: '$*' needs root and sudo is not installed; run it as root, then re-run this script" >&2
        return 1
    fi
}

# Makes sure `redis-server` is on PATH (the tests and the demo start their own, on a free
# port). Installs Debian's package if it is missing. Installing that package normally
# also starts the system's Redis service on port 6379; that Redis belongs to the people
# of this machine, not to us, so a temporary policy-rc.d forbids service starts during the
# install (the same mechanism Debian's container images use). The package stays installed
# and its service may start at the next boot: `systemctl disable redis-server` if unwanted.
ensure_redis_server() {
    # openssl makes the certificates of the TLS test (rediss://); it is small and usually
    # there already.
    if command -v redis-server >/dev/null 2>&1 && command -v openssl >/dev/null 2>&1; then
        return 0
    fi
    if ! command -v apt-get >/dev/null 2>&1; then
        echo "error: redis-server is not on PATH and this is not a Debian-like system;" >&2
        echo "       install Redis >= 6.2 (redis-server) with your package manager and re-run" >&2
        return 1
    fi
    echo "==> redis-server or openssl not found: installing Debian's redis-server and openssl packages"
    local policy=/usr/sbin/policy-rc.d added_policy=0
    if [ ! -e "$policy" ]; then
        as_root sh -c "printf '#!/bin/sh\nexit 101\n' > $policy && chmod 755 $policy"
        added_policy=1
        # Remove it even if the install is interrupted.
        trap 'as_root rm -f /usr/sbin/policy-rc.d' EXIT INT TERM
    fi
    local rc=0
    as_root env DEBIAN_FRONTEND=noninteractive apt-get update -q || rc=$?
    if [ "$rc" -eq 0 ]; then
        as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends redis-server openssl || rc=$?
    fi
    if [ "$added_policy" -eq 1 ]; then
        as_root rm -f "$policy"
        trap - EXIT INT TERM
    fi
    if [ "$rc" -ne 0 ]; then
        echo "error: installing redis-server failed (apt-get exit $rc)" >&2
        return "$rc"
    fi
    # Debian puts redis-server in /usr/bin, which is on every PATH; check anyway.
    command -v redis-server >/dev/null 2>&1 || {
        echo "error: redis-server installed but not on PATH ($PATH)" >&2
        return 1
    }
}

# Makes sure cargo is there (it is expected on these machines: no toolchain is ever
# downloaded here) and adds the named rustup components (e.g. rustfmt clippy) only if
# they are missing.
ensure_rust() {
    if ! command -v cargo >/dev/null 2>&1; then
        echo "error: cargo is not on PATH. Install Rust (https://rustup.rs, Rust >= 1.85) and re-run" >&2
        return 1
    fi
    local c
    for c in "$@"; do
        case "$c" in
            rustfmt) cargo fmt --version >/dev/null 2>&1 && continue ;;
            clippy) cargo clippy --version >/dev/null 2>&1 && continue ;;
            *) ;;
        esac
        if command -v rustup >/dev/null 2>&1; then
            echo "==> rust component $c missing: rustup component add $c"
            rustup component add "$c"
        else
            echo "error: rust component $c is missing and rustup is not installed to add it" >&2
            return 1
        fi
    done
}
