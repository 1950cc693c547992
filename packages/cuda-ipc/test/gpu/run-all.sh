#!/usr/bin/env bash
# Every GPU check of @tensorwire/cuda-ipc in one run, for a machine with an NVIDIA GPU, each
# step under its own time limit; writes each step's output and one gpu-report.json to OUTDIR.
# Needs node on PATH, the built packages (dist/, the addon) and node_modules (vitest).
#   bash packages/cuda-ipc/test/gpu/run-all.sh OUTDIR
# Steps: verify-gpu.mjs (export/import across processes at a non-zero offset, deferred free,
# pinned copies); the vitest GPU suite and the CUDA conformance run; the bench's `pool`
# scenario on cuda:0 slots; batch-gpu.mjs (batched engine reads between two processes'
# device buffers). Exit 0 when every step passed.
set -u
out=${1:?usage: run-all.sh OUTDIR}
mkdir -p "$out"
root=$(cd "$(dirname "$0")/../../../.." && pwd)
pkg="$root/packages/cuda-ipc"
declare -A rc

step() { # name limit-seconds command...
  local name=$1 limit=$2
  shift 2
  local t0=$SECONDS
  echo "== $name (limit ${limit}s)"
  timeout --kill-after=5 "$limit" "$@" >"$out/$name.out" 2>"$out/$name.err"
  rc[$name]=$?
  echo "   rc ${rc[$name]} in $((SECONDS - t0))s"
  tail -n 5 "$out/$name.err"
}

{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true; node --version; } >"$out/machine.txt" 2>&1
cd "$pkg" || exit 1
step verify 90 node test/gpu/verify-gpu.mjs
step vitest 180 node "$root/node_modules/vitest/vitest.mjs" run test/gpu.test.ts test/conformance.test.ts --reporter=default --reporter=json --outputFile.json="$out/vitest.json"
cd "$root" || exit 1
step pool 150 node apps/bench/dist/cli.js pool --device cuda:0 --json --no-progress
cd "$pkg" || exit 1
step batch 120 node test/gpu/batch-gpu.mjs

# One report: each step's exit code, and the JSON each printed (vitest: its summary).
OUT_DIR="$out" RCS="$(for k in "${!rc[@]}"; do echo "$k=${rc[$k]}"; done)" node --input-type=module -e '
import fs from "node:fs";
const dir = process.env.OUT_DIR;
const rcs = Object.fromEntries(process.env.RCS.trim().split("\n").map((l) => l.split("=")).map(([k, v]) => [k, Number(v)]));
const json = (f) => { try { return JSON.parse(fs.readFileSync(`${dir}/${f}`, "utf8")); } catch (e) { return { unreadable: String(e) }; } };
const v = json("vitest.json");
const tests = (v.testResults ?? []).flatMap((f) => (f.assertionResults ?? []).map((a) => ({ file: f.name.split("/").pop(), name: a.fullName, status: a.status, ...(a.failureMessages?.length ? { failure: a.failureMessages[0].slice(0, 600) } : {}) })));
const report = {
  machine: fs.readFileSync(`${dir}/machine.txt`, "utf8").trim(),
  exitCodes: rcs,
  verify: json("verify.out"),
  vitest: { passed: v.numPassedTests, failed: v.numFailedTests, skipped: v.numPendingTests, failures: tests.filter((t) => t.status === "failed") },
  pool: json("pool.out"),
  batch: json("batch.out"),
};
fs.writeFileSync(`${dir}/gpu-report.json`, JSON.stringify(report, null, 2));
'
fail=0
for k in "${!rc[@]}"; do [ "${rc[$k]}" = 0 ] || fail=1; done
exit $fail
