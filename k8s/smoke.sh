#!/usr/bin/env bash
# Smoke test on kind: CPU overlay, tiny model baked into the image. Needs docker, kind, kubectl,
# helm and curl. Unrun where it was written (no docker there). Usage: k8s/smoke.sh [cluster-name]
set -euo pipefail
CLUSTER=${1:-mmserve-smoke}
IMAGE=mmserve:0.1.0-cpu   # the tag k8s/overlays/cpu uses (IfNotPresent: the loaded image is used)
cd "$(dirname "$0")/.."

kind get clusters | grep -qx "$CLUSTER" || kind create cluster --name "$CLUSTER"
kubectl config use-context "kind-$CLUSTER"
docker build -f k8s/Dockerfile.cpu -t "$IMAGE" .
kind load docker-image "$IMAGE" --name "$CLUSTER"
helm repo add kuberay https://ray-project.github.io/kuberay-helm/ >/dev/null
helm upgrade --install kuberay-operator kuberay/kuberay-operator --version 1.7.0 --wait

kubectl apply -k k8s/overlays/cpu
echo "waiting for the RayService to be ready ..."
kubectl wait rayservice/mmserve --for=condition=Ready --timeout=15m

kubectl port-forward svc/mmserve-serve-svc 18000:8000 >/dev/null 2>&1 &
FORWARD=$!
trap 'kill $FORWARD' EXIT
sleep 3
curl -sf localhost:18000/v1/models
IMAGE_URI="data:image/png;base64,$(python3 -c 'import base64,io,zlib,struct
w,h=56,56; raw=b"".join(b"\0"+b"\xc8\x1e\x5a"*w for _ in range(h))
c=lambda t,d: struct.pack(">I",len(d))+t+d+struct.pack(">I",zlib.crc32(t+d))
print(base64.b64encode(b"\x89PNG\r\n\x1a\n"+c(b"IHDR",struct.pack(">IIBBBBB",w,h,8,2,0,0,0))+c(b"IDAT",zlib.compress(raw))+c(b"IEND",b"")).decode())')"
curl -sf localhost:18000/v1/chat/completions -H 'Content-Type: application/json' -d "{
  \"messages\": [{\"role\": \"user\", \"content\": [
    {\"type\": \"image_url\", \"image_url\": {\"url\": \"$IMAGE_URI\"}},
    {\"type\": \"text\", \"text\": \"What is in the image?\"}]}],
  \"max_tokens\": 8}" | python3 -c 'import json,sys; r=json.load(sys.stdin); assert r["usage"]["completion_tokens"] >= 1, r; print("smoke OK:", r["usage"])'
