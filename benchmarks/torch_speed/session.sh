#!/bin/bash
# Issue 54's GPU runs, one stage per device call (each < 10 minutes), from the project root on
# the GPU machine with .whl carried (benchmarks/gpu_setup.sh; no TensorFlow needed):
#     bash benchmarks/torch_speed/session.sh bf16|fp32|four_bf16|four_fp32|profile|matrix|hub
# bf16 / fp32: mgpu-bench ResNet-50, Keras-torch with the captured step (--cuda-graph 1) and
# native torch at 1 and 2 GPUs in one invocation, then the same Keras-torch row at 1 GPU with
# MGPU_TORCH_KERNELS=0 (Keras's own lowering: the "before") and eager (--cuda-graph 0: what a
# user gets without capture). profile: step_profile.py's kernel tables in float32, and
# eager_then_capture.py (capture turned on after eager steps). matrix: the exactness matrix on
# torch at 2 GPUs through NCCL (TF32 off), with torch's kernels for Keras's layers.
# Results land in $OUT (results.md / results.json per invocation, copied flat: the device tool
# returns files at most two folders down).
set -u
stage=$1
export KERAS_BACKEND=torch
. benchmarks/gpu_setup.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, torchvision, keras; print('torch', torch.__version__, 'torchvision', torchvision.__version__, 'keras', keras.__version__)"
matrix() {  # name, JSON case list, seconds: tests/scripts/exactness.py on 2 GPUs (TF32 off), checked
  mkdir -p "/tmp/$1"
  EXACTNESS_FP32=1 NVIDIA_TF32_OVERRIDE=0 timeout "$3" mgpu-train -np 2 tests/scripts/exactness.py \
    "$2" "/tmp/$1" > "$OUT/matrix_$1.log" 2>&1
  echo "$1 job: exit $?"
  PYTHONPATH=tests:$PYTHONPATH python3 benchmarks/multi_gpu/check4.py "/tmp/$1" "$2" 2 \
    | tee "$OUT/check_$1.txt"
}
bench() {  # name, then mgpu-bench arguments
  local name=$1; shift
  echo "=== $name: mgpu-bench $*"
  mgpu-bench --model resnet50 --data device --timeout 240 --out "/tmp/$name" "$@" 2>&1 \
    | grep -v "^\[[0-9]\]" | tail -25
  cp "/tmp/$name/results.md" "$OUT/$name.md" 2>/dev/null
  cp "/tmp/$name/results.json" "$OUT/$name.json" 2>/dev/null
}
case $stage in
  bf16|fp32)
    precision=$([ "$stage" = bf16 ] && echo mixed_bfloat16 || echo float32)
    bench "${stage}_graph" --backend torch,native --precision "$precision" --gpus 1,2 --cuda-graph 1
    MGPU_TORCH_KERNELS=0 bench "${stage}_graph_keras_lowering" --backend torch \
      --precision "$precision" --gpus 1 --cuda-graph 1
    bench "${stage}_eager" --backend torch --precision "$precision" --gpus 1 --cuda-graph 0
    ;;
  four_bf16|four_fp32)  # on a 4-GPU machine: the captured row and native at 1, 2 and 4 GPUs
    precision=$([ "$stage" = four_bf16 ] && echo mixed_bfloat16 || echo float32)
    bench "$stage" --backend torch,native --precision "$precision" --gpus 1,2,4 --cuda-graph 1
    ;;
  profile)
    timeout 200 python3 benchmarks/torch_speed/eager_then_capture.py 2>&1 | tee "$OUT/eager_then_capture.log"
    timeout 280 python3 benchmarks/torch_speed/step_profile.py --precision float32 \
      --out "$OUT/fp32_profile.jsonl" --variant native --variant keras:kernels=0:graph=1 \
      --variant keras:kernels=1:graph=1 > "$OUT/fp32_profile.log" 2>&1
    grep -A3 "^==" "$OUT/fp32_profile.log"
    ;;
  matrix)
    matrix torch '["sgd_momentum","adam","embedding_adam","transformer_adamw","lstm","mixed_bfloat16","vision_sync_bn","gpt2_lm_split"]' 250
    ;;
  hub)  # 2 GPUs, torch, no TensorFlow on the machine: the keras-hub example's tokens/s at 1 and
        # 2 GPUs, and the matrix's keras-hub cases fed as arrays (keras-hub needs grain or TF)
    for np in 1 2; do
      timeout 130 mgpu-train -np $np examples/keras_hub_causal_lm.py --size small \
        --precision mixed_bfloat16 --seq-len 128 --batch-size 32 --sequences $((4096 * np)) \
        --epochs 2 > "$OUT/hub_torch_np$np.log" 2>&1
      echo "torch np=$np: exit $? $(grep -a 'tokens/s' "$OUT/hub_torch_np$np.log" | tail -2)"
    done
    matrix hub_torch '["gpt2_lm_split","bert_classifier_split","bert_lora_split"]' 150
    ;;
esac
