#!/bin/sh
# Record the Hugging Face traces of issue 17 (bf16 autocast + AdamW, and one fp32 + AdamW GPT-2
# for comparison) on the lent H100 machine (torch with CUDA and transformers; no simpy needed).
# Usage, from the repository root:  sh traces/record-hf.sh OUTDIR
# Each recording runs in a fresh process; a failure is reported and the others go on. Then:
#   python3 -m vsim.record index OUTDIR/*.vsim.json.gz
set -u
out=${1:-traces}
mkdir -p "$out"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', \
transformers.__version__)"
for spec in gpt2:8:1024:bf16 gpt2-medium:8:1024:bf16 llama-1b-8l:4:1024:bf16 \
            bert-base:16:512:bf16 gpt2:8:1024:fp32; do
    IFS=: read model batch seq prec <<ENDSPEC
$spec
ENDSPEC
    start=$(date +%s)
    name="$model-b$batch-s$seq-$prec-adamw-h100.vsim.json.gz"
    python3 -m vsim.record record "$model" --batch "$batch" --seq "$seq" --precision "$prec" \
        --optimizer adamw --device cuda -o "$out/$name" || echo "FAILED: $model $batch $prec"
    echo "($name: $(( $(date +%s) - start )) s)"
done
