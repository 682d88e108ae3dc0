# The GPU runs behind benchmarks/*_h200x4.* (source from the project root on the GPU machine,
# after `. benchmarks/gpu_setup.sh`):   . benchmarks/gpu_bench_session.sh STAGE
# Each stage is one device call (< 10 min). Results land in /tmp/bench/<name>/ and $OUT.
stage=$1
export JAX_COMPILATION_CACHE_DIR=/tmp/jax-cache  # np=1 jobs of one model share a compile
run() {  # run NAME mgpu-bench-args...
  name=$1; shift
  mgpu-bench "$@" --out /tmp/bench/$name 2>&1 | tee /tmp/bench-$name.out
  cp /tmp/bench/$name/results.json $OUT/$name.json 2>/dev/null
  cp /tmp/bench/$name/results.md $OUT/$name.md 2>/dev/null
  cp /tmp/bench/$name/results.png $OUT/$name.png 2>/dev/null
}
case $stage in
  1) run input --backend jax --model resnet50 --gpus 1 --data numpy,host,device --prefetch 0,2 \
         --steps 30 --timeout 240
     run jax-fp32 --backend jax --model resnet50 --gpus 1,2,4 --steps 30 --timeout 150 ;;
  2) run jax-bf16 --backend jax --model resnet50 --precision mixed_bfloat16 --gpus 1,2,4 \
         --steps 30 --timeout 150
     run torch --backend torch --model resnet50 --precision float32,mixed_bfloat16 \
         --gpus 1,2,4 --steps 30 --timeout 120 ;;
  3) run native --backend native --model resnet50 --precision float32,mixed_bfloat16 --gpus 1,2,4 \
         --steps 30 --timeout 60
     run cifar --backend jax,torch --model cifar-cnn --precision float32,mixed_bfloat16 \
         --gpus 1,2,4 --steps 30 --timeout 60 ;;
  4) B="--model resnet50 --gpus 1,2,4 --steps 30 --timeout 150"
     run bf16-again --backend jax --precision mixed_bfloat16 $B
     MGPU_FUSION_MB=32 run bf16-fusion32 --backend jax --precision mixed_bfloat16 $B
     MGPU_PROFILE_SKIP_ALLREDUCE=1 run bf16-noallreduce --backend jax --precision mixed_bfloat16 $B
     run torch-fp32-again --backend torch --precision float32 $B ;;
esac
tar czf $OUT/logs$stage.tgz -C /tmp bench 2>/dev/null
