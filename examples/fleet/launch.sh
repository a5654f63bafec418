#!/usr/bin/env bash
# The fleet of litellm_config.yaml on one machine: four replicas (two stable, a canary, a fallback) on
# ports 8001-8004 and the gateway on 4000. Every process stops with this script (Ctrl-C).
#
#     pip install -e '.[fleet]'                  # LiteLLM (make setup-dev installs it too)
#     sh examples/fleet/launch.sh                # MODEL=path/to/model SERVE_ARGS=... CANARY_ARGS=...
#     curl -s localhost:4000/v1/chat/completions -H 'Content-Type: application/json' \
#         -d '{"model": "smollm2", "messages": [{"role": "user", "content": "Hi"}]}'
#
# On GPUs give each replica its own device (CUDA_VISIBLE_DEVICES) or host; the config's api_base lines
# then name those hosts. SERVE_ARGS go to every replica (on a small CPU, '--max-num-seqs 16' shortens the
# warm-up); CANARY_ARGS to the canary alone: the same model with new options (or a new build).
set -eu
cd "$(dirname "$0")/../.."
MODEL="${MODEL:-smollm2-135m}"
ARGS="--served-model-name smollm2-135m --disable-uvicorn-access-log --log-level warning ${SERVE_ARGS:-}"
pids=""
trap 'kill $pids 2>/dev/null' EXIT INT TERM

for port in 8001 8002 8003 8004; do
    extra=""
    [ "$port" = 8003 ] && extra="${CANARY_ARGS:-}"
    python -m paged_jax.serve --model "$MODEL" --port "$port" $ARGS $extra &
    pids="$pids $!"
done
for port in 8001 8002 8003 8004; do  # ready: every step shape compiled (what a gateway's health check asks)
    until curl -sf "localhost:$port/ready" > /dev/null; do sleep 2; done
    echo "replica on $port ready"
done
python examples/fleet/gateway.py --config examples/fleet/litellm_config.yaml --port 4000 &
pids="$pids $!"
echo "gateway on 4000; per-replica metrics (vLLM's names) at localhost:800N/metrics"
wait
