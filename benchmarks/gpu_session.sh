#!/usr/bin/env bash
# One call of a lent GPU machine (at most 10 minutes, 15 of device time a session): everything the open GPU
# issues need measured, from the repository root of the working tree sent there, the package installed from the
# wheels carried in .whl/ (the machine has no package registry). Prepare them here, then run this there:
#
#   rm -rf .whl && pip wheel -q --no-deps --no-build-isolation -w .whl . \
#     && pip download -q --no-deps -d .whl jsonargparse docstring_parser typeshed_client
#   # .whl/ ignored (.git/info/exclude), carried: run(command="BPPSA_COMMIT=$(git rev-parse --short HEAD) \
#   #   bash benchmarks/gpu_session.sh", carry=[".whl"], timeout_s=600)
#
# Writes under $OUT (at most 8 files come back): results.tgz (every results file of the run), session.log.
# WITHIN: seconds for benchmarks/gpu.py --all (default 420); LAYOUTS: for benchmarks/cluster_layouts.py (60).
set -u -o pipefail
out="${OUT:?run on the device machine: \$OUT is where results go}"
results=/tmp/bppsa-results
mkdir -p "$results"
exec > >(tee "$out/session.log") 2>&1
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader || exit 1
# the partial source folder would shadow the installed package from the repository root
[ -d lightning_bppsa ] && mv lightning_bppsa _src_lightning_bppsa
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 BPPSA_COMMIT="${BPPSA_COMMIT:-unknown}"
python3 -c "import lightning_bppsa, torch; print('lightning_bppsa from', lightning_bppsa.__file__, 'torch', torch.__version__)"
timeout $(( ${WITHIN:-420} + 60 )) python3 benchmarks/gpu.py --all --within "${WITHIN:-420}" --results "$results"
timeout $(( ${LAYOUTS:-60} + 30 )) python3 benchmarks/cluster_layouts.py --within "${LAYOUTS:-60}" --results "$results"
tar czf "$out/results.tgz" -C "$results" .
ls -la "$results"
