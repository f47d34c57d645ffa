#!/bin/sh
# Record the validation corpus's models beyond the original nine (torchvision models, fp32, SGD
# with momentum 0.9, as record-all.sh) on the lent H100. Usage, from the repository root:
#   sh traces/record-corpus.sh OUTDIR
# Each recording runs in a fresh process; a failure is reported and the others go on.
set -u
out=${1:-traces}
mkdir -p "$out"
for spec in resnet18:128 resnet101:64 wide_resnet50_2:64 resnext50_32x4d:64 densenet121:64 \
            densenet169:32 mobilenet_v2:128 mobilenet_v3_large:128 efficientnet_b0:64 \
            shufflenet_v2_x1_0:128 regnet_y_1_6gf:64 convnext_tiny:64 vit_b_16:32 swin_t:32 \
            vgg11_bn:64 squeezenet1_1:128; do
    model=${spec%%:*}
    batch=${spec##*:}
    start=$(date +%s)
    python3 -m vsim.record record "$model" --batch "$batch" --device cuda \
        -o "$out/$model-b$batch-h100.vsim.json.gz" > "$out/$model-b$batch.log" 2>&1 \
        || echo "FAILED: $model batch $batch: $(tail -2 "$out/$model-b$batch.log")"
    echo "($model batch $batch: $(( $(date +%s) - start )) s)"
done
