# The Triton cache carried between device calls (sourced by the benchmarks/device_*.sh scripts).
# A call returns at most 8 files and carries at most 64 MiB in all, wheels and data included, so the cache travels
# as 15 MB parts (.tcache/tcache.part.aa, .ab, ...) of one tar archive, compressed with xz where the machine has it:
# Triton's cache is mostly text (PTX, LLVM IR, TTIR) that xz -6 packs about 14x (a 415 MB cache: 29 MB, against
# 60 MB with gzip); gzip otherwise. The format is read back from the first part's magic bytes.

# tcache_restore DIR: unpack .tcache/tcache.part.* into DIR; fails (status 1) when there is nothing to unpack.
tcache_restore() {
    ls .tcache/tcache.part.* >/dev/null 2>&1 || return 1
    local magic
    magic=$(head -c 2 .tcache/tcache.part.aa | od -An -tx1 | tr -d ' \n')
    case "$magic" in
        fd37) cat .tcache/tcache.part.* | xz -dc | tar xf - -C "$1" ;;
        1f8b) cat .tcache/tcache.part.* | tar xzf - -C "$1" ;;
        *) echo "tcache_restore: .tcache/tcache.part.aa is neither xz nor gzip (starts with $magic)" >&2; return 1 ;;
    esac
}

# tcache_pack DIR OUT: pack DIR into OUT/tcache.part.* (40 s at most; a cut-short archive is removed).
tcache_pack() {
    local compress="gzip"
    command -v xz >/dev/null 2>&1 && compress="xz -6 -T0"
    if ! timeout 40 bash -o pipefail -c "tar cf - -C '$1' . | $compress | split -b 15m - '$2/tcache.part.'"; then
        rm -f "$2"/tcache.part.*
    fi
}
