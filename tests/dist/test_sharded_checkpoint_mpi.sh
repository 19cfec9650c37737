#!/usr/bin/env bash
# The sharded checkpoint (docs/checkpoints.md) under mpirun on CPU ranks:
# 1. Bytes per rank: under the distributed optimizer (DP4, and TP2 x DP2) every
#    rank_NNNNN.safetensors holds a quarter of the state; without it (DP2) rank 0 holds
#    everything and rank 1 nothing. Every layout's files hold the state's bytes exactly once:
#    main params and both Adam moments, fp32, 3 x 4 bytes x the model's parameter count.
#    Loading under DP4 with the distributed optimizer, a rank reads the weights and only its
#    shard of the moments (about 6 bytes x params, not 12).
# 2. A damaged rank file (truncated, one byte flipped, deleted) makes `megaton train --load`
#    exit with status 2 and one line naming that file.
# 3. kill -9 during saves: a 2-rank run saving every iteration (and removing the previous
#    checkpoint: retention) is killed at least 10 times: at a random time, a random offset
#    after a save begins, or just after one is renamed. After each kill every final
#    iter_XXXXXXX directory has its metadata.json and every file that lists, of the recorded
#    size (the tracked iteration's also of the recorded crc32), and a one-rank
#    `megaton train --load` resumes from the tracked iteration; the next run's save removes
#    the iter_XXXXXXX.tmp<PID> directories the kill left, and so does a clean run at the end.
# Usage: test_sharded_checkpoint_mpi.sh MEGATON MPIRUN NP_FLAG NP [MPIRUN FLAGS...]
# (CTest passes NP = 2; each part sets its own rank count.) SHARDED_CKPT_SEED=n repeats a
# run's random choices (the kill delays, the damaged files); the timing of a kill relative to
# the saves still varies from run to run.
set -euo pipefail
megaton=$1 mpirun=$2 np_flag=$3
shift 4
mpi_flags=("$@")
seed=${SHARDED_CKPT_SEED:-$(($(date +%s) % 100000))}
RANDOM=$seed
echo "seed $seed (SHARDED_CKPT_SEED=$seed repeats it)"
dir=$(mktemp -d)
job=""  # the session id (= mpirun's PID) of the job part 3 has running
cleanup() {
  if [ -n "$job" ]; then
    local pids
    pids=$(ps -o pid= -s "$job" || true)
    # shellcheck disable=SC2086
    [ -z "$pids" ] || kill -9 $pids 2>/dev/null || true
  fi
  rm -rf "$dir"
}
trap cleanup EXIT
fail() {
  echo "FAILED: $* (seed $seed)"
  exit 1
}
export OMP_NUM_THREADS=1

# The layouts test's small MoE model: 4 layers, hidden 32, 4 experts of 48 (SwiGLU), 4 heads
# of 8, vocabulary 127 + eod padded to 128 rows (under TP 1 and 2), untied embeddings.
small=(--device cpu --mock-data --tokenizer-type NullTokenizer --vocab-size 127
  --make-vocab-size-divisible-by 64 --num-layers 4 --hidden-size 32 --num-attention-heads 4
  --num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 48 --moe-aux-loss-coeff 1e-2
  --swiglu --normalization RMSNorm --position-embedding-type rope --disable-bias-linear
  --untie-embeddings-and-output-weights --hidden-dropout 0 --attention-dropout 0
  --seq-length 16 --global-batch-size 8 --micro-batch-size 2 --lr 1e-3 --lr-warmup-iters 1
  --lr-decay-iters 1000 --clip-grad 1.0 --eval-iters 0 --log-interval 1 --seed 1234)
# Its parameters, counted from the flags above: per layer the two RMSNorm weights [32], QKV
# [3 x 32, 32], the projection [32, 32], the router [4, 32] and 4 experts of fc1 [2 x 48, 32]
# and fc2 [32, 48]; then the final norm, the embedding and the output layer [128, 32].
layer_params=$((2 * 32 + 96 * 32 + 32 * 32 + 4 * 32 + 4 * (96 * 32 + 32 * 48)))
small_params=$((4 * layer_params + 32 + 2 * 128 * 32))

# safetensors files: "FILE BYTES DATA_BYTES" per file (data: the file less its 8-byte length
# and JSON header).
data_bytes() {
  python3 - "$@" <<'EOF'
import os, struct, sys
for path in sys.argv[1:]:
    with open(path, "rb") as f:
        header = struct.unpack("<Q", f.read(8))[0]
    size = os.path.getsize(path)
    print(os.path.basename(path), size, size - 8 - header)
EOF
}

# --- 1. Bytes per rank ------------------------------------------------------------------
save_once() {  # NAME NP FLAGS...: one iteration, saved to $dir/NAME
  local name=$1 np=$2 files s
  shift 2
  "$mpirun" "$np_flag" "$np" "${mpi_flags[@]}" "$megaton" train "${small[@]}" "$@" \
    --train-iters 1 --save "$dir/$name" --save-interval 1 >"$dir/$name.out" 2>&1 ||
    { status=$?; tail -5 "$dir/$name.out"; fail "$name: exit status $status"; }
  files=("$dir/$name"/iter_0000001/rank_*.safetensors)
  [ "${#files[@]}" -eq "$np" ] || fail "$name: ${#files[@]} rank files, expected $np"
  local data=0 file bytes tensor_bytes
  sizes=()
  while read -r file bytes tensor_bytes; do
    sizes+=("$bytes")
    data=$((data + tensor_bytes))
  done < <(data_bytes "${files[@]}")
  total=0
  for s in "${sizes[@]}"; do total=$((total + s)); done
  echo "$name: rank files ${sizes[*]} bytes (total $total, tensor data $data)"
  # Every layout writes each element of the state once.
  [ "$data" -eq $((12 * small_params)) ] ||
    fail "$name: the rank files hold $data bytes of tensors, expected 3 x 4 x $small_params"
}
# Each of 4 files within 10% of a quarter of the total (measured: within 1.3%; the files
# differ by where the shard boundaries cut the params and by their headers).
quarters() {  # NAME
  local s quarter=$((total / 4))
  for s in "${sizes[@]}"; do
    [ $((10 * (s > quarter ? s - quarter : quarter - s))) -le "$quarter" ] ||
      fail "$1: a rank file of $s bytes is not within 10% of a quarter of $total"
  done
}
save_once dp4-distributed-optimizer 4 --use-distributed-optimizer
quarters dp4-distributed-optimizer
save_once tp2-dp2-distributed-optimizer 4 --tensor-model-parallel-size 2 --use-distributed-optimizer
quarters tp2-dp2-distributed-optimizer
# Without the distributed optimizer the state is replicated over DP: written once, by rank 0.
save_once dp2 2
[ $((20 * sizes[1])) -lt "${sizes[0]}" ] ||
  fail "dp2: rank 1's file (${sizes[1]} bytes) is not under 5% of rank 0's (${sizes[0]})"

# Bytes read per rank at load: DP4 with the distributed optimizer reads the weights whole
# (every rank holds them: 4 bytes x params) and only its shard of each moment (about a quarter
# of 2 x 4 bytes x params): about 6 bytes x params; without it every rank reads all 12.
bytes_read() {  # NAME FLAGS...: resume $dir/dp2 on 4 ranks; prints the logging rank's bytes
  local name=$1
  shift
  "$mpirun" "$np_flag" 4 "${mpi_flags[@]}" "$megaton" train "${small[@]}" "$@" --load "$dir/dp2" \
    --train-iters 2 >"$dir/$name.out" 2>&1 ||
    { status=$?; tail -5 "$dir/$name.out"; fail "$name: exit status $status"; }
  sed -nE 's/.*loaded checkpoint from .*, ([0-9]+) bytes read by this rank.*/\1/p' "$dir/$name.out"
}
sharded_read=$(bytes_read read-dp4-distributed-optimizer --use-distributed-optimizer)
whole_read=$(bytes_read read-dp4)
echo "bytes read at load by one rank of DP4: $sharded_read with the distributed optimizer," \
  "$whole_read without ($small_params params)"
[ -n "$sharded_read" ] && [ -n "$whole_read" ] || fail "no 'bytes read' in the load line"
[ "$whole_read" -eq $((12 * small_params)) ] ||
  fail "DP4 without the distributed optimizer read $whole_read bytes, expected 12 x params"
[ $((10 * sharded_read)) -ge $((55 * small_params)) ] &&
  [ $((10 * sharded_read)) -le $((66 * small_params)) ] ||
  fail "DP4 with the distributed optimizer read $sharded_read bytes, expected about 6 x params"

echo "bytes per rank: done at ${SECONDS} s"

# --- 2. Damage is one line, exit 2 --------------------------------------------------------
good="$dir/dp4-distributed-optimizer"
damaged="$dir/damaged"
load_fails() {  # CASE FILE: a one-rank load of $damaged exits 2 with one line naming FILE
  local status=0
  "$megaton" train "${small[@]}" --load "$damaged" --train-iters 2 \
    >"$dir/damaged.out" 2>"$dir/damaged.err" || status=$?
  echo "$1 $2: exit $status: $(cat "$dir/damaged.err")"
  [ "$status" -eq 2 ] || fail "$1 $2: exit status $status, expected 2"
  [ "$(wc -l <"$dir/damaged.err")" -eq 1 ] || fail "$1 $2: stderr is not one line"
  [ "$(cat "$dir/damaged.out" "$dir/damaged.err" | grep -cF "$2")" -eq 1 ] ||
    fail "$1 $2: not one line naming the file"
}
damage() {  # CASE: damages one rank file of a fresh copy of $good
  rm -rf "$damaged"
  cp -r "$good" "$damaged"
  local file
  printf -v file 'rank_%05d.safetensors' $((RANDOM % 4))  # not in a subshell: seeded
  local path="$damaged/iter_0000001/$file"
  case $1 in
    truncated) truncate -s $(($(stat -c %s "$path") / 2)) "$path" ;;
    flipped)  # one byte of the tensor data, at a random place
      python3 - "$path" "$RANDOM" <<'EOF'
import os, random, struct, sys
path = sys.argv[1]
with open(path, "r+b") as f:
    start = 8 + struct.unpack("<Q", f.read(8))[0]
    at = random.Random(int(sys.argv[2])).randrange(start, os.path.getsize(path))
    f.seek(at)
    byte = f.read(1)[0]
    f.seek(at)
    f.write(bytes([byte ^ 0x5A]))
print(f"flipped byte {at} of {os.path.basename(path)}")
EOF
      ;;
    deleted) rm "$path" ;;
  esac
  load_fails "$1" "$file"
}
for case in truncated flipped deleted; do damage "$case"; done
rm -rf "$damaged"
# The undamaged copy loads (the damage, not the copy, failed the loads above).
"$megaton" train "${small[@]}" --load "$good" --train-iters 2 >"$dir/good.out" 2>&1 ||
  { tail -5 "$dir/good.out"; fail "the undamaged checkpoint does not load"; }

echo "damage: done at ${SECONDS} s"

# --- 3. kill -9 during saves --------------------------------------------------------------
# A model whose save (about 31 MB, each rank writing and fsyncing half) takes about as long as
# its training step on CPU, so that a kill at a random time often lands inside a save.
big=(--device cpu --mock-data --tokenizer-type NullTokenizer --vocab-size 127
  --make-vocab-size-divisible-by 64 --num-layers 4 --hidden-size 256 --num-attention-heads 4
  --ffn-hidden-size 512 --swiglu --normalization RMSNorm --position-embedding-type rope
  --disable-bias-linear --untie-embeddings-and-output-weights --hidden-dropout 0
  --attention-dropout 0 --seq-length 16 --global-batch-size 4 --micro-batch-size 2 --lr 1e-3
  --lr-warmup-iters 1 --lr-decay-iters 1000 --clip-grad 1.0 --eval-iters 0 --log-interval 1
  --seed 1234)
save="$dir/kill/save"
mkdir -p "$save"
tracker="$save/latest_checkpointed_iteration.txt"

# Whether every process of PIDS is gone (a zombie counts as gone only when WAIT_REAPED is 0).
gone() {  # PIDS...
  local p state
  for p in "$@"; do
    state=$(ps -o stat= -p "$p" || true)
    [ -z "$state" ] && continue
    [ "${WAIT_REAPED:-1}" = 0 ] && [[ $state == Z* ]] && continue
    return 1
  done
}
wait_gone() {  # SECONDS PIDS...
  local tries=$(($1 * 20))
  shift
  while ! gone "$@"; do
    tries=$((tries - 1))
    [ "$tries" -gt 0 ] || return 1
    sleep 0.05
  done
}

# After a kill: every final iteration directory is a complete checkpoint: its metadata.json
# and every file that lists, of the recorded size (and, the tracked iteration's, of the
# recorded crc32); a one-rank run resumes from the tracked iteration.
check_after_kill() {  # KILL (prints what is wrong and exits 1)
  tracked=none
  [ ! -e "$tracker" ] || tracked=$(cat "$tracker")
  python3 - "$save" "$tracked" <<'EOF' || fail "kill $1: see the line above"
import json, os, re, sys, zlib
save, tracked = sys.argv[1], sys.argv[2]
def check(ok, what):
    if not ok:
        sys.exit(what)
if tracked != "none":
    check(re.fullmatch(r"[0-9]+", tracked), f"the tracker holds {tracked!r}")
    check(os.path.isdir(os.path.join(save, f"iter_{int(tracked):07d}")),
          f"the tracker names iteration {tracked}, which has no directory")
for name in sorted(os.listdir(save)):
    if not re.fullmatch(r"iter_[0-9]{7}", name):
        continue
    d = os.path.join(save, name)
    check(os.path.isfile(os.path.join(d, "metadata.json")), f"{name} has no metadata.json")
    meta = json.load(open(os.path.join(d, "metadata.json")))
    check(meta["iteration"] == int(name[5:]),
          f"{name}/metadata.json: iteration {meta['iteration']}")
    check(len(meta["sharded_files"]) == 2, f"{name}: {len(meta['sharded_files'])} files listed")
    for file, entry in meta["sharded_files"].items():
        path = os.path.join(d, file)
        check(os.path.isfile(path), f"{name}/{file}, listed in its metadata.json, is missing")
        size = os.path.getsize(path)
        check(size == entry["bytes"], f"{name}/{file}: {size} bytes, recorded {entry['bytes']}")
        if tracked != "none" and int(name[5:]) == int(tracked):
            crc = 0
            with open(path, "rb") as f:
                while chunk := f.read(1 << 22):
                    crc = zlib.crc32(chunk, crc)
            check(crc == entry["crc32"], f"{name}/{file}: crc32 {crc}, recorded {entry['crc32']}")
EOF
  [ "$tracked" != none ] || return 0
  "$megaton" train "${big[@]}" --load "$save" --train-iters $((tracked + 1)) \
    >"$dir/resume.out" 2>&1 || {
    tail -5 "$dir/resume.out"
    fail "kill $1: a one-rank run does not resume from iteration $tracked"
  }
  if ! grep -qE "loaded checkpoint from .* at iteration $tracked( |\$)" "$dir/resume.out" ||
    ! grep -q "iteration *$((tracked + 1))/" "$dir/resume.out"; then
    fail "kill $1: the resumed run did not load iteration $tracked and train one more"
  fi
}

# Sets in_progress to 1 while a rank of $ranks has the .tmp directory of a save of the
# iteration after the tracked one, else to 0 (no process started: polled every 2 ms).
saving() {
  local tracked_now=0 p name
  [ ! -e "$tracker" ] || read -r tracked_now <"$tracker" || true
  printf -v name 'iter_%07d.tmp' $((tracked_now + 1))
  in_progress=0
  for p in $ranks; do
    [ ! -e "$save/$name$p" ] || in_progress=1
  done
}

# At least $kills kills; more (up to twice as many) until two have landed inside a save.
kills=${SHARDED_CKPT_KILLS:-10} k=0 in_save=0 in_retention=0 delays=()
declare -A stale=() partial=()  # .tmp names left by kills: not yet checked, all
while [ "$k" -lt "$kills" ] || { [ "$in_save" -lt 2 ] && [ "$k" -lt $((2 * kills)) ]; }; do
  k=$((k + 1))
  delay_ms=$((1000 + RANDOM % 2500)) offset_ms=$((RANDOM % 25))
  # Odd kills resume from the directory (new iterations), even ones start afresh and save
  # over iterations that may exist (the atomic exchange). All remove the previous
  # checkpoint after each save (retention), which keeps the directory small.
  # Kills 1, 4, 7... land at the delay, whatever the job does then. Kills 2, 5, 8... wait after
  # the delay for a save to begin (its .tmp directory to appear), then for the offset (0 to
  # 24 ms): mostly inside that save (its .tmp directory exists for 25 to 50 ms on 2 cores).
  # Kills 3, 6, 9... wait for a save's .tmp directory to be renamed, then for a fifth of the
  # offset: in the tracker's update, the retention or the next iteration.
  resume=() mode=$(((k - 1) % 3))
  [ $((k % 2)) = 0 ] || resume=(--load "$save")
  case $mode in
    0) delays+=("$delay_ms") ;;
    1) delays+=("$delay_ms+begin+$offset_ms") ;;
    2) offset_ms=$((offset_ms / 5)) && delays+=("$delay_ms+end+$offset_ms") ;;
  esac
  setsid "$mpirun" "$np_flag" 2 "${mpi_flags[@]}" "$megaton" train "${big[@]}" \
    --use-distributed-optimizer --train-iters 1000000 "${resume[@]}" --save "$save" \
    --save-interval 1 --save-retain-interval 1000000 >"$dir/kill.out" 2>&1 &
  job=$!  # setsid in a background job execs mpirun: its PID is the session id
  sleep "$((delay_ms / 1000)).$(printf %03d $((delay_ms % 1000)))"
  ranks=$(ps -o pid= -s "$job" | awk -v mpirun="$job" '$1 != mpirun')
  if [ -z "$ranks" ] || ! kill -0 "$job" 2>/dev/null; then
    tail -5 "$dir/kill.out"
    fail "kill $k: the job ended before the kill"
  fi
  if [ "$mode" != 0 ]; then
    # Until no save is under way, then until one begins, then (mode 2) until it is renamed
    # (at most 2 s each).
    phases=(1 0)
    [ "$mode" = 1 ] || phases+=(1)
    for waiting_while in "${phases[@]}"; do
      for ((poll = 0; poll < 1000; ++poll)); do
        saving
        [ "$in_progress" = "$waiting_while" ] || break
        sleep 0.002
      done
    done
    sleep "0.$(printf %03d "$offset_ms")"
  fi
  # The ranks die together; mpirun, left alone, reaps them and exits (cleaning up its
  # session directory), else it is killed too.
  # shellcheck disable=SC2086
  kill -9 $ranks || { tail -5 "$dir/kill.out"; fail "kill $k: a rank had exited before the kill"; }
  # shellcheck disable=SC2086
  WAIT_REAPED=0 wait_gone 10 $ranks || fail "kill $k: ranks $ranks still run after kill -9"
  # shellcheck disable=SC2086
  WAIT_REAPED=0 wait_gone 10 $ranks "$job" || kill -9 "$job" 2>/dev/null || true
  wait "$job" || true
  job=""
  # A save takes a process with this PID for alive: wait until none is left, not even a zombie.
  # shellcheck disable=SC2086
  wait_gone 10 $ranks || fail "kill $k: the killed ranks $ranks were not reaped"
  saves=$(grep -c "saved checkpoint from iteration" "$dir/kill.out" || true)
  # Where the kill landed. A .tmp directory of the job is the save of the iteration after the
  # tracked one (iteration 1 before a fresh run's first save), before its commit's rename;
  # else the previous checkpoint, which retention renamed to remove it.
  landed="outside a save's .tmp window (training, or after the commit's rename)"
  before=$(cat "$tracker" 2>/dev/null || echo 0)
  for p in $ranks; do
    [ ! -e "$tracker.tmp$p" ] || landed="in the tracker's update"
    for d in "$save"/iter_*.tmp"$p"; do
      [ -e "$d" ] || continue
      d=$(basename "$d")
      it=$((10#${d:5:7})) next=$((before + 1))
      [ -n "${resume[*]}" ] || [ "$saves" != 0 ] || next=1
      if [ "$it" = "$next" ]; then
        landed="in the save of iteration $it"
        in_save=$((in_save + 1))
      else
        landed="in the removal of ${d%.tmp*} (retention)"
        in_retention=$((in_retention + 1))
      fi
    done
  done
  # The partial saves (.tmp) of dead processes: gone once a later run has saved.
  if [ "$saves" -gt 0 ]; then
    for name in "${!stale[@]}"; do
      [ ! -e "$save/$name" ] || fail "kill $k: a save of this run left the dead process's $name"
      unset "stale[$name]"
    done
  fi
  for d in "$save"/*.tmp*; do
    [ ! -e "$d" ] || { stale[$(basename "$d")]=1; partial[$(basename "$d")]=1; }
  done
  check_after_kill "$k"
  echo "kill $k after ${delays[-1]} ms, $saves saves completed, landed $landed:" \
    "tracked iteration $tracked; $(ls "$save" | tr '\n' ' ')"
done
echo "kill delays (ms): ${delays[*]}"
echo "of $k kills, $in_save landed inside a save (before its commit), $in_retention while" \
  "retention removed the previous checkpoint"
[ "$in_save" -ge 1 ] || fail "no kill landed inside a save: the test did not test what it claims"

# A clean run saving to the same directory removes the partial saves of the dead processes.
[ "$tracked" != none ] || fail "no save completed in $k runs"
"$mpirun" "$np_flag" 2 "${mpi_flags[@]}" "$megaton" train "${big[@]}" --use-distributed-optimizer \
  --load "$save" --train-iters $((tracked + 1)) --save "$save" --save-interval 1 \
  >"$dir/clean.out" 2>&1 || { tail -5 "$dir/clean.out"; fail "the clean run failed"; }
leftover=$(cd "$save" && ls -d -- *.tmp* 2>/dev/null || true)
[ -z "$leftover" ] || fail "after a clean run, partial saves remain: $leftover"
[ "$(cat "$tracker")" = $((tracked + 1)) ] || fail "the clean run's save is not tracked"
echo "the kills left ${#partial[@]} partial saves (.tmp), each gone after the next save;" \
  "after a clean run: $(ls "$save" | tr '\n' ' ')"
echo "kills: done at ${SECONDS} s"
echo "PASSED"
