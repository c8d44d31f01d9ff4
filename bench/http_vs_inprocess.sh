#!/usr/bin/env bash
# `llmc bench` in-process against `llmc bench --url` through `llmc serve`, same engine and workload,
# alternating rounds. Usage: bash bench/http_vs_inprocess.sh ENGINE ROUNDS [llmc bench options]
# Each round uses seed R for both sides: the server's prefix cache never holds a round's prompts.
set -euo pipefail
ENGINE=$1; ROUNDS=$2; shift 2
PORT=${PORT:-8765}
OUT=$(mktemp -d)
cd "$(dirname "$0")/.."
python -m llmc.cli serve "$ENGINE" --port "$PORT" --model-name m 2>"$OUT/serve.log" &
SERVER=$!
trap 'kill -TERM $SERVER 2>/dev/null || true; rm -rf "$OUT"' EXIT
for _ in $(seq 120); do curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break; sleep 0.5; done
python -m llmc.cli bench "$ENGINE" --json --url "http://127.0.0.1:$PORT" "$@" --seed 100 >/dev/null 2>&1  # warm-up
for r in $(seq "$ROUNDS"); do
  python -m llmc.cli bench "$ENGINE" --json "$@" --seed "$r" 2>/dev/null >"$OUT/local.json"
  python -m llmc.cli bench "$ENGINE" --json --url "http://127.0.0.1:$PORT" "$@" --seed "$r" 2>/dev/null >"$OUT/http.json"
  python - "$r" "$OUT/local.json" "$OUT/http.json" <<'PY'
import json, sys
r, local, http = sys.argv[1], json.load(open(sys.argv[2])), json.load(open(sys.argv[3]))
for k in ("requests", "errors", "output_tokens", "throughput_tok_s", "ttft_ms_p50", "ttft_ms_p99", "tpot_ms_p50"):
    ratio = f"  ratio {http[k] / local[k]:.3f}" if isinstance(local[k], float) and local[k] else ""
    print(f"round {r} {k:<18} in-process {local[k]!s:>10} http {http[k]!s:>10}{ratio}")
PY
done
