#!/usr/bin/env bash
# One session on a lent GPU machine (the device tool): the environment, then `hetdp bench gpu` with its profile.
# Everything lands in $OUT (default hetdp-out/gpu): env.txt, bench.log, gpu.json and profile.tgz (the profiles).
# Runs from a plain checkout with the machine's own torch: PYTHONPATH carries hetdp to every launched rank.
set -uo pipefail
OUT=${OUT:-hetdp-out/gpu}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
{
  date -u
  echo "commit ${COMMIT:-unknown}"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c 'import sys, torch; print(sys.version.split()[0], torch.__version__, torch.version.cuda)'
  echo "cores $(nproc)"
} 2>&1 | tee "$OUT/env.txt"
timeout "${BENCH_TIMEOUT_S:-420}" python3 -m hetdp.cli bench gpu ${BENCH_ARGS:---quick} --json "$OUT/gpu.json" \
  --profile "$OUT/profile" 2>&1 | tee "$OUT/bench.log"
tar czf "$OUT/profile.tgz" -C "$OUT" profile && rm -r "$OUT/profile"
