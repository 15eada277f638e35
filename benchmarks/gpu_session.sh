#!/usr/bin/env bash
# The GPU checks in one go, for a CUDA host lent for a few minutes: the GPU check (kernel tests,
# the serving test, decode against the roofline; it rewrites its section of docs/performance.md),
# then n-gram speculation and LoRA adapters served on the GPU beside the same engine without them.
# Each part has its own deadline, so that one stuck part leaves time for the rest.
#
#   bash benchmarks/gpu_session.sh [check] [spec] [lora]     (all three by default)
#
# Results go to $OUT (default ./gpu-session): each part's JSON and log, and docs/performance.md
# as the check rewrote it. On a host without PyPI, run benchmarks/offline_kit.py's unpack first and
# export the PYTHONPATH it prints. spec_bench runs two servers side by side on the GPU, hence the
# small memory share each.
set -u
cd "$(dirname "$0")/.."
out=${OUT:-gpu-session}
mkdir -p "$out"
python=${PYTHON:-python3}
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(check spec lora)
on_gpu=(--set engine.device=cuda --set engine.gpu_memory_utilization=0.2)
status=0

run() {  # name, deadline in seconds, command...
    local name=$1 deadline=$2
    shift 2
    echo "== $name (at most ${deadline}s): $*"
    local start=$SECONDS
    timeout --kill-after=10 "$deadline" "$@" >"$out/$name.log" 2>&1
    local rc=$?
    echo "== $name: exit $rc after $((SECONDS - start))s"
    tail -n 25 "$out/$name.log"
    [ $rc -eq 0 ] || status=1
}

"$python" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name(0), 'torch', torch.__version__)" || exit 1
for part in "${parts[@]}"; do
    case $part in
        check)
            run check 300 "$python" benchmarks/gpu_check.py --json "$out/gpu_check.json" --write-docs
            cp docs/performance.md "$out/performance.md"
            ;;
        spec)
            run spec 180 "$python" benchmarks/spec_bench.py --no-llama --rounds 2 --output-len 64 \
                --num-speculative-tokens 3 "${on_gpu[@]}" --json "$out/spec_bench.json"
            ;;
        lora)
            run lora 180 "$python" benchmarks/lora_bench.py --no-llama --rounds 2 "${on_gpu[@]}" \
                --json "$out/lora_bench.json"
            ;;
        *)
            echo "unknown part $part (check, spec, lora)"
            exit 2
            ;;
    esac
done
exit $status
