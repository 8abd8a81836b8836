#!/usr/bin/env bash
# The engine's checks on a machine with a CUDA GPU (CI has none; docs/batched_engine.md, "GPU
# readiness"): real CUDA graphs against the eager forward, the engine's suites with every model
# on the GPU (OSD_TEST_DEVICE=cuda) with graphs off and then on, and the GPU bench.
#   bash scripts/gpu_check.sh [OUT_DIR]        (from the repository root; osd's deps installed)
# Left out of the suites on the GPU: unit tests that feed CPU tensors to a model themselves
# (test_lean_forward, test_core, test_compiled_forward, test_cuda_graphs' CPU stand-ins) and
# the CPU memory budget's test.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-gpu-check}
mkdir -p "$out"
python=.venv/bin/python
[ -x "$python" ] || python=python3
export PYTHONUNBUFFERED=1
parallel=()
"$python" -c "import xdist" 2>/dev/null && parallel=(-n "$(( $(nproc) > 16 ? 16 : $(nproc) ))")
suites=(tests/decode --deselect tests/decode/test_kv_memory.py::test_the_cpu_budget_is_a_share_of_the_machine_less_what_is_in_use
    --ignore tests/decode/test_lean_forward.py --ignore tests/decode/test_core.py
    --ignore tests/decode/test_compiled_forward.py --ignore tests/decode/test_cuda_graphs.py)
echo "== real CUDA graphs against the eager forward"
"$python" -m pytest -q -p no:cacheprovider tests/decode/test_cuda_graphs.py -k real 2>&1 | tail -3
echo "== the engine's suites on CUDA, graphs off"
OSD_TEST_DEVICE=cuda "$python" -m pytest -q -p no:cacheprovider "${parallel[@]}" "${suites[@]}" \
    > "$out/suites.log" 2>&1
tail -3 "$out/suites.log"
echo "== the same, CUDA graphs on (OSD_TEST_CUDA_GRAPHS=1)"
OSD_TEST_DEVICE=cuda OSD_TEST_CUDA_GRAPHS=1 "$python" -m pytest -q -p no:cacheprovider \
    "${parallel[@]}" "${suites[@]}" > "$out/suites_graphs.log" 2>&1
tail -3 "$out/suites_graphs.log"
echo "== bench (target alone: eager, graphs, compiled, compiled with graphs; HF generate)"
"$python" -m bench.bench_cuda --rounds 3 --json "$out/bench_cuda.json" 2>&1 | tee "$out/bench.log" \
    | tail -12
