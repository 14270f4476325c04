#!/usr/bin/env bash
# The wheels the GPU machine lacks, into .whl/ (git-ignored), for benchmarks/gpu_check.py there.
#
#   bash benchmarks/gpu_wheels.sh            # here, where PyPI is reachable
#
# That machine (Python 3.12, torch 2.11, transformers 5.17, accelerate 1.15, timm; see the device README's
# KINDS.md for its package list) reaches no package index.  It has every dependency of hf-rebasin but these:
# lm-eval and datasets, and the packages of theirs it lacks.  They come as cp312 / manylinux x86_64 wheels
# (--no-deps: each one named here, at the version this project's suite ran with), plus hf-rebasin's own wheel
# built from this checkout.  Packages published as source only (rouge-score, sqlitedict, word2number: pure
# Python) are built into wheels here.  Not carried: pyarrow (datasets wants >= 24; the machine's version is
# unknown, and its wheel alone is about 45 MB) -- gpu_check imports neither datasets nor lm-eval.
#
# The one command there (the device tool's `run`, carry [".whl"]):
#
# P="python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --ignore-requires-python --upgrade"
# $P --target /tmp/site $(ls .whl/*.whl | grep -v hf_rebasin) && $P --target /tmp/hf .whl/hf_rebasin-*.whl || exit
# export PYTHONPATH=/tmp/site; (cd /tmp && PYTHONPATH=/tmp/hf:/tmp/site python3 -c "import hf_rebasin, datasets, lm_eval")
# PYTHONUNBUFFERED=1 timeout 500 python3 benchmarks/gpu_check.py --json $OUT/gpu_check.json 2>&1 | tee $OUT/gpu_check.log
#
# (its lines joined by "; ".  --ignore-requires-python: until the package's requires-python admits 3.12; --no-deps:
# the machine's own torch and transformers stay, whatever the package's metadata pins.  hf_rebasin's own wheel goes
# to /tmp/hf, outside PYTHONPATH: its import checks its dependencies' lower bounds (timm's version there is not
# known), and gpu_check, run from the checkout, does not stop on that.)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
OUT=.whl
rm -rf "$OUT" && mkdir -p "$OUT"

BINARY=(
  lm_eval==0.4.13 datasets==5.2.0 evaluate==0.4.6 dill==0.4.1 multiprocess==0.70.19
  pytablewriter==1.2.1 DataProperty==1.1.1 mbstrdecoder==1.1.5 pathvalidate==3.3.1 tabledata==1.3.5
  tcolorpy==0.1.7 typepy==1.3.5 chardet==6.0.0.post1 nltk==3.10.4 more-itertools==11.2.1
)
SOURCE_ONLY=(rouge_score==0.1.2 sqlitedict==2.1.0 word2number==1.1)

"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$OUT" "${BINARY[@]}"
"$PYTHON" -m pip wheel -q --no-deps -w "$OUT" "${SOURCE_ONLY[@]}"
"$PYTHON" -m pip wheel -q --no-deps -w "$OUT" .

ls -1 "$OUT"
du -ch "$OUT"/*.whl | tail -1
