#!/usr/bin/env bash
# Checks the README's two commands on a pristine Debian 12 (bookworm): makes a debootstrap
# minbase chroot with git and ca-certificates, clones this repository's HEAD commit into it, runs
# scripts/demo.sh and then scripts/test.sh inside with a clean environment (env -i), and prints a
# one-line verdict. Needs root; takes minutes (the chroot builds everything from scratch and
# fetches the test venv from PyPI). Not part of CI: run it before resolving a change to
# dependencies or scripts.
#
#   sudo scripts/check_fresh_machine.sh [--keep]
#
# --keep leaves the chroot in place (its path is printed) for a look inside.
#
# The base system is cached as a tarball under .cache/fresh-machine/ (made once with
# debootstrap, unpacked afresh for every run), so only the first run downloads it. This machine's
# network trust goes into the chroot, as it belongs to the machine and not to qkv: the CA bundle
# (/etc/ssl/certs/ca-certificates.crt), /etc/pip.conf and apt's Acquire settings
# (/etc/apt/apt.conf.d/99artifact-registry) where present, and /etc/resolv.conf. Nothing else
# of this machine is visible inside. The full log goes to .cache/fresh-machine/<commit>.log.
#
# Exit status: 0 when both commands passed, 1 when one failed, 2 for bad usage or setup.
set -euo pipefail

repo_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cache_dir="$repo_root/.cache/fresh-machine"
suite=bookworm
mirror=${QKV_DEBIAN_MIRROR:-http://deb.debian.org/debian}
base_tarball="$cache_dir/$suite-minbase.tar.gz"
keep=0

usage() { sed -n '2,20p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; }
for arg in "$@"; do
  case "$arg" in
    --keep) keep=1 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "check_fresh_machine: error: unknown argument '$arg' (try --help)" >&2; exit 2 ;;
  esac
done
if [[ $(id -u) -ne 0 ]]; then
  echo "check_fresh_machine: error: needs root (debootstrap, chroot, mount)" >&2
  exit 2
fi

say() { echo "check_fresh_machine: $*" >&2; }
commit=$(git -C "$repo_root" rev-parse HEAD)
short=${commit:0:10}
if [[ -n $(git -C "$repo_root" status --porcelain --untracked-files=no) ]]; then
  say "note: the working tree has uncommitted changes; only commit $short is checked"
fi
mkdir -p "$cache_dir"
log="$cache_dir/$short.log"
: >"$log"

if ! command -v debootstrap >/dev/null; then
  say "installing debootstrap"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null
fi

# Outside the repository, so that nothing that walks the tree (grep -r, rm -rf .cache) ever
# steps into the chroot's bind mount of /dev.
root=$(mktemp -d /var/tmp/qkv-fresh-machine.XXXXXX)
# Unmounts everything below the chroot, and deletes it only when nothing is mounted there any
# more (a bind mount of /dev left behind must never be deleted through).
cleanup() {
  local mounts
  mounts=$(findmnt -rn -o TARGET | grep -E "^$root(/|\$)" | sort -r || true)
  for m in $mounts; do umount -l "$m" 2>/dev/null || true; done
  if [[ $keep -eq 1 ]]; then
    say "kept the chroot at $root"
  elif findmnt -rn -o TARGET | grep -qE "^$root(/|\$)"; then
    say "warning: $root still has mounts; not deleted"
  else
    rm -rf "$root"
  fi
}
trap cleanup EXIT

started=$(date +%s)
if [[ ! -f $base_tarball ]]; then
  say "debootstrap $suite minbase (+git, ca-certificates) from $mirror, cached as $base_tarball"
  if ! debootstrap --variant=minbase --include=git,ca-certificates "$suite" "$root" "$mirror" \
      >>"$log" 2>&1; then
    echo "check_fresh_machine: FAIL (setup): debootstrap failed; see $log"
    exit 2
  fi
  tar -C "$root" -czf "$base_tarball.tmp" . && mv "$base_tarball.tmp" "$base_tarball"
else
  say "unpacking the cached base system $base_tarball"
  tar -C "$root" -xzf "$base_tarball"
fi

# The machine's network trust and name service.
cp /etc/resolv.conf "$root/etc/resolv.conf"
[[ -f /etc/ssl/certs/ca-certificates.crt ]] &&
  cp /etc/ssl/certs/ca-certificates.crt "$root/etc/ssl/certs/ca-certificates.crt"
[[ -f /etc/pip.conf ]] && cp /etc/pip.conf "$root/etc/pip.conf"
[[ -f /etc/apt/apt.conf.d/99artifact-registry ]] &&
  cp /etc/apt/apt.conf.d/99artifact-registry "$root/etc/apt/apt.conf.d/"

# The chroot's root a mount point of its own, as a machine's / is (ip netns, which the ring
# test uses, remounts / as a slave and fails on a plain directory).
mount --bind "$root" "$root"
mount -t proc proc "$root/proc"
mount -t sysfs sysfs "$root/sys"
mount --rbind /dev "$root/dev"
mount --make-rslave "$root/dev"

say "cloning commit $short into the chroot"
git clone --quiet --no-local "$repo_root" "$root/root/qkv"
git -C "$root/root/qkv" checkout --quiet --detach "$commit"

# Runs one README command inside the chroot with a clean environment; its output goes to the log.
run_inside() {
  echo "== $1 ==" >>"$log"
  chroot "$root" /usr/bin/env -i HOME=/root LANG=C.UTF-8 TERM=dumb \
    PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    /bin/bash -c "cd /root/qkv && $1" >>"$log" 2>&1
}

elapsed() { local s=$(($(date +%s) - started)); printf '%dm%02ds' $((s / 60)) $((s % 60)); }
say "running scripts/demo.sh (log: $log)"
if ! run_inside scripts/demo.sh; then
  echo "check_fresh_machine: FAIL commit $short: scripts/demo.sh failed on a pristine Debian 12" \
    "($(elapsed)); see $log"
  exit 1
fi
say "running scripts/test.sh"
status=0
run_inside scripts/test.sh || status=$?
summary=$(grep -E '^[0-9]+% tests passed' "$log" | tail -n 1 || true)
if [[ $status -ne 0 ]]; then
  echo "check_fresh_machine: FAIL commit $short: demo ok, scripts/test.sh failed" \
    "(${summary:-no ctest summary}) on a pristine Debian 12 ($(elapsed)); see $log"
  exit 1
fi
echo "check_fresh_machine: PASS commit $short: demo ok, tests ok (${summary}) on a pristine" \
  "Debian 12 ($(elapsed)); log $log"
