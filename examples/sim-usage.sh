#!/bin/sh
# Demo on simulated GPUs: a container that declares GPU memory use through GPUMGR_SIM_USAGE_FILE.
# Usage: examples/sim-usage.sh IMAGE GRANT USE_BYTES   (the API must be on localhost:9400)
set -eu
image=${1:-gpumgr-test/busybox:latest}
grant=${2:-6GiB}
use=${3:-3221225472}
curl -s -X POST localhost:9400/v1/containers -H 'Content-Type: application/json' -d @- <<JSON
{"image": "$image", "gpu_memory": "$grant", "env": {"GPUMGR_SIM_USAGE_FILE": "/tmp/use"},
 "command": ["sh", "-c", "echo $use > /tmp/use; exec sleep 3600"]}
JSON
echo
