#!/bin/sh
# Synthesize the networks of validation/paper/ (no GPU; needs torch): the vDNN paper's networks
# as its figures identify them (vsim/record/paper_nets.py) and the convnet-benchmarks networks
# that calibrate the Titan X (cb-*), fp32 without TF32, cuDNN 9's layout workspaces (the only
# workspace rule measured; cuDNN 4's cannot be known from shapes), no cuBLAS blocks.
# Then fit hardware/efficiency/titan-x-maxwell.yaml to convnet-benchmarks' timings.
# Op times in the traces are re-modelled when they are used (vsim.paper), so refitting the
# efficiencies does not need new traces.
set -e
cd "$(dirname "$0")/../.."
out=validation/paper/traces
synth() { vsim synth "$1" --batch "$2" --hw titan-x-maxwell --no-tf32 --no-library-blocks -o "$out/$3.vsim.json.gz"; }
N=vsim.record.paper_nets
synth $N:alexnet_owt 128 alexnet-b128
synth $N:overfeat_accurate 128 overfeat-b128
synth googlenet 128 googlenet-b128
for b in 64 128 256; do synth $N:vgg16 $b vgg16-b$b; done
for d in 116 216 316 416; do synth $N:vgg$d 32 vgg$d-b32; done
synth $N:alexnet_owt 128 cb-alexnet-owt-b128
# the other seeds (validation/paper/{superneurons-k40,layrub-k40m}.yaml)
vsim synth resnet50 --batch 32 --hw k40 --no-tf32 --no-library-blocks -o "$out/resnet50-b32.vsim.json.gz"
vsim synth $N:alexnet_caffe --batch 200 --hw k40 --no-tf32 --no-library-blocks -o "$out/alexnet-caffe-b200.vsim.json.gz"
vsim synth $N:resnet34 --batch 32 --hw k40m --no-tf32 --no-library-blocks -o "$out/resnet34-b32.vsim.json.gz"
synth overfeat 128 cb-overfeat-fast-b128
synth vgg11 64 cb-vgg11-b64
synth googlenet 128 cb-googlenet-b128
vsim fit-compute --benchmarks validation/paper/convnet-benchmarks-titanx.yaml --hw titan-x-maxwell \
  -o hardware/efficiency/titan-x-maxwell.yaml --date 2026-11-22
