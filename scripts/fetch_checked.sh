# Sourced by the fetch scripts (after they set `dest` and `want`): the
# SHA-256 check both the cached file and a fresh download go through.

sha256() {
  python3 -c 'import hashlib, sys
h = hashlib.sha256()
with open(sys.argv[1], "rb") as f:
    for b in iter(lambda: f.read(1 << 20), b""):
        h.update(b)
print(h.hexdigest())' "$1"
}

# A file already in place is checked, not fetched again: prints its path and
# succeeds when it is the one wanted, fails when it is another; false when absent.
already_fetched() {
  [ -e "$dest" ] || return 1
  local got
  got="$(sha256 "$dest")"
  if [ "$got" != "$want" ]; then
    echo "error: $dest has SHA-256 $got, expected $want; delete it and run $0 again" >&2
    exit 1
  fi
  echo "$dest"
}

# Moves `$dest.part` (what the download made, next to the destination) into
# place if its SHA-256 is the one wanted; `$1` names it in the error.
install_checked() {
  local got
  got="$(sha256 "$dest.part")"
  if [ "$got" != "$want" ]; then
    echo "error: $1 has SHA-256 $got, expected $want; nothing written" >&2
    exit 1
  fi
  mv "$dest.part" "$dest"
  echo "$dest"
}
