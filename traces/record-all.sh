#!/bin/sh
# Re-record the shipped traces and the H100 profile on the lent H100 machine (torch with CUDA;
# simpy is not needed). Usage, from the repository root:  sh traces/record-all.sh OUTDIR
# Each recording runs in a fresh process, so the allocator starts clean; a failure is reported
# and the others go on. Then:  python3 -m vsim.record index OUTDIR/*.vsim.json.gz
set -u
out=${1:-traces}
mkdir -p "$out"
python3 -m vsim.record calibrate --name h100-sxm -o "$out/h100-sxm.yaml" || echo "FAILED: calibrate"
for spec in alexnet:128 overfeat:128 googlenet:128 vgg16:64 vgg16:128 vgg16:256 resnet50:64 \
            resnet152:32 gpt2-encoder:8; do
    model=${spec%%:*}
    batch=${spec##*:}
    start=$(date +%s)
    python3 -m vsim.record record "$model" --batch "$batch" --device cuda \
        -o "$out/$model-b$batch-h100.vsim.json.gz" || echo "FAILED: $model batch $batch"
    echo "($model batch $batch: $(( $(date +%s) - start )) s)"
done
