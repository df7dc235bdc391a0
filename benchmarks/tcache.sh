# The Triton cache carried between device calls, and the set-up and end every benchmarks/device_*.sh shares (sourced by
# those scripts).
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

# What the device_*.sh scripts share around their benchmark: the set-up, the wheel install, the bench call with its
# time budget, and the end (pack the Triton cache, keep to the 8 files a call returns).

# device_start TOTAL_S PACK LOG_NAME: T0 (now) and END (TOTAL_S from now, less the last 45 s, which pack the Triton
# cache, when PACK is 1, else less 5 s); SCRATCH (a fresh temporary folder); OUT (default benchmarks/results) and LOG
# ($OUT/LOG_NAME); an unbuffered, offline environment with HF_HOME in SCRATCH; TRITON_CACHE_DIR in SCRATCH, restored
# from .tcache/ when a previous call returned its parts (TCACHE_RESTORED=1 then, and a line in the log).
device_start() {
    T0=$(date +%s)
    END=$(( T0 + $1 - ($2 == 1 ? 45 : 5) ))
    SCRATCH=$(mktemp -d)
    OUT=${OUT:-benchmarks/results}
    LOG=$OUT/$3
    mkdir -p "$OUT" "$SCRATCH/tcache"
    export PYTHONUNBUFFERED=1 TQDM_DISABLE=1 HF_HUB_OFFLINE=1 HF_HOME=$SCRATCH/hf
    export TRITON_CACHE_DIR=$SCRATCH/tcache TRITON_CACHE_AUTOTUNING=1
    TCACHE_RESTORED=0
    if tcache_restore "$TRITON_CACHE_DIR"; then
        TCACHE_RESTORED=1
        echo "Triton cache restored" >> "$LOG"
    fi
}

# device_wheels WHEEL...: install the carried wheels into $SCRATCH/site (the device reaches no registry: no index,
# no dependencies), pip's output in the log; status 1 when pip fails (one wheel for another Python fails them all).
device_wheels() {
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SCRATCH/site" \
        "$@" >> "$LOG" 2>&1
}

# device_bench SCRIPT ARGS...: run python3 SCRIPT --out $OUT --budget-s B ARGS..., output in the log, killed at END;
# the bench's own deadline B is 20 s before the kill, so a measurement that runs past its estimate is still saved.
device_bench() {
    local script=$1 budget
    shift
    budget=$(( END - $(date +%s) ))
    echo "== bench, budget $budget s" >> "$LOG"
    timeout "$budget" python3 "$script" --out "$OUT" --budget-s $(( budget - 20 )) "$@" >> "$LOG" 2>&1
    echo "bench exit $? at $(( $(date +%s) - T0 )) s" >> "$LOG"
}

# device_finish PACK: drop a JSON write cut short by the timeout, pack the Triton cache into $OUT when PACK is 1,
# drop its parts again when they would pass the 8 files a call returns, and print the log's last lines.
device_finish() {
    rm -f "$OUT"/*.tmp
    if [ "$1" = 1 ]; then
        tcache_pack "$TRITON_CACHE_DIR" "$OUT"
    fi
    if [ "$(ls "$OUT" | wc -l)" -gt 8 ]; then
        rm -f "$OUT"/tcache.part.*
        echo "more than the 8 files a call returns: the Triton cache is not returned" >> "$LOG"
    fi
    echo "done at $(( $(date +%s) - T0 )) s; Triton cache parts: $(ls "$OUT"/tcache.part.* 2>/dev/null | wc -l)" >> "$LOG"
    tail -n 12 "$LOG"
}
