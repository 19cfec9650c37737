#!/usr/bin/env bash
# A failing background write under --async-save (docs/checkpoints.md): on 2 CPU ranks, rank
# 1's file of the iteration-4 save fails to write (ENOSPC, injected by an LD_PRELOAD shim
# built here that fails fwrite() on paths containing MEGATON_TEST_FAIL_WRITES_TO). Every
# rank exits with status 2 and the one line names the iteration, rank 1 and the error; the
# tracker still names iteration 2, whose files are whole, no iter_0000004 (final or .tmp)
# is left, and a one-rank run resumes from iteration 2. A blocking save's failure alike:
# exit 2 on every rank with the line, tracker unchanged, nothing left.
# Usage: test_async_save_failure_mpi.sh MEGATON MPIRUN NP_FLAG NP [MPIRUN FLAGS...]
set -uo pipefail
megaton=$1 mpirun=$2 np_flag=$3
shift 4
mpi_flags=("$@")
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
fail() {
  echo "FAILED: $*"
  for f in "$dir"/*.err; do [ -s "$f" ] && { echo "--- $f:"; tail -5 "$f"; }; done
  exit 1
}
export OMP_NUM_THREADS=1

# fwrite() fails with ENOSPC on files whose path contains $MEGATON_TEST_FAIL_WRITES_TO.
cc -shared -fPIC -O1 -o "$dir/fail_writes.so" -x c - -ldl <<'EOF' || fail "cannot build the shim"
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
size_t fwrite(const void* data, size_t size, size_t count, FILE* f) {
  static size_t (*real)(const void*, size_t, size_t, FILE*);
  if (!real) real = (size_t (*)(const void*, size_t, size_t, FILE*))dlsym(RTLD_NEXT, "fwrite");
  const char* match = getenv("MEGATON_TEST_FAIL_WRITES_TO");
  if (match && *match) {
    char link[64], path[4096];
    snprintf(link, sizeof link, "/proc/self/fd/%d", fileno(f));
    ssize_t n = readlink(link, path, sizeof path - 1);
    if (n > 0) {
      path[n] = 0;
      if (strstr(path, match)) {
        errno = ENOSPC;
        return 0;
      }
    }
  }
  return real(data, size, count, f);
}
EOF

model=(--device cpu --mock-data --tokenizer-type NullTokenizer --vocab-size 63
  --make-vocab-size-divisible-by 1 --num-layers 2 --hidden-size 32 --num-attention-heads 4
  --ffn-hidden-size 64 --swiglu --normalization RMSNorm --position-embedding-type rope
  --disable-bias-linear --seq-length 16 --micro-batch-size 2 --global-batch-size 4 --lr 1e-3
  --eval-iters 0 --log-interval 1 --use-distributed-optimizer)

check_failed_save() {  # NAME STATUS: the run failed at the iteration-4 save, nothing left
  local name=$1 status=$2 save=$dir/$1
  [ "$status" -eq 2 ] || fail "$name: exit status $status, want 2"
  grep -qE "iteration 4 .*failed on rank 1.*No space left on device" "$dir/$name.err" ||
    fail "$name: no line naming iteration 4, rank 1 and the error"
  grep -q "error: the background save" "$dir/$name.err" || fail "$name: no error line"
  [ "$(cat "$save/latest_checkpointed_iteration.txt")" = 2 ] ||
    fail "$name: the tracker names $(cat "$save/latest_checkpointed_iteration.txt"), want 2"
  local left
  left=$(cd "$save" && ls -d iter_0000004* 2>/dev/null)
  [ -z "$left" ] || fail "$name: $left left behind"
  [ -f "$save/iter_0000002/metadata.json" ] || fail "$name: iteration 2 lost its metadata"
  "$megaton" train "${model[@]}" --use-distributed-optimizer --train-iters 3 --load "$save" \
    >"$dir/$name-resume.out" 2>"$dir/$name-resume.err" || fail "$name: resume from iteration 2"
  grep -q "loaded checkpoint from .*iter_0000002 at iteration 2" "$dir/$name-resume.out" ||
    fail "$name: the resume did not load iteration 2"
  echo "ok: $name: exit 2, '$(grep -m1 -o "the background save.*\|.*No space left.*" "$dir/$name.err" | cut -c1-160)'"
}

"$mpirun" "$np_flag" 2 "${mpi_flags[@]}" \
  -x LD_PRELOAD="$dir/fail_writes.so" -x MEGATON_TEST_FAIL_WRITES_TO="iter_0000004.tmp" \
  bash -c 'if [ "${OMPI_COMM_WORLD_RANK:-0}" != 1 ]; then unset LD_PRELOAD; fi; exec "$@"' _ \
  "$megaton" train "${model[@]}" --train-iters 6 --save "$dir/async" --save-interval 2 \
  --async-save >"$dir/async.out" 2>"$dir/async.err"
check_failed_save async $?

"$mpirun" "$np_flag" 2 "${mpi_flags[@]}" \
  -x LD_PRELOAD="$dir/fail_writes.so" -x MEGATON_TEST_FAIL_WRITES_TO="iter_0000004.tmp" \
  bash -c 'if [ "${OMPI_COMM_WORLD_RANK:-0}" != 1 ]; then unset LD_PRELOAD; fi; exec "$@"' _ \
  "$megaton" train "${model[@]}" --train-iters 6 --save "$dir/blocking" --save-interval 2 \
  >"$dir/blocking.out" 2>"$dir/blocking.err"
status=$?
[ "$status" -eq 2 ] || fail "blocking: exit status $status, want 2"
[ "$(cat "$dir/blocking/latest_checkpointed_iteration.txt")" = 2 ] || fail "blocking: tracker moved"
[ -z "$(cd "$dir/blocking" && ls -d iter_0000004* 2>/dev/null)" ] ||
  fail "blocking: $(cd "$dir/blocking" && ls -d iter_0000004*) left behind"
grep -qE "error: the save of iteration 4 .*failed on rank 1.*No space left on device" \
  "$dir/blocking.err" || fail "blocking: no line naming iteration 4, rank 1 and the error"
echo "ok: blocking: exit 2, '$(grep -m1 "No space left" "$dir/blocking.err" | cut -c1-160)'"
echo PASSED
