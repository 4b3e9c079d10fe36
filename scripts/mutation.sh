#!/usr/bin/env bash
# Mutation testing with mutmut 3 (issue 28), out of CI: each target's files are mutated one change at a time and its
# fast test selection must fail for every mutant. Runs in a scratch copy (runs/mutation/<target>/) so the working tree
# is never mutated; writes score and survivors to bench/results/mutation/<target>.{json,txt}.
#   bash scripts/mutation.sh                 # every target (long: an hour or more on 2 cores)
#   bash scripts/mutation.sh sampling        # one target (engine/sampling.py: a few minutes)
# FASTDLLM_THREADS=1 and one mutmut child by default (MUTMUT_CHILDREN=N for more on a quiet machine).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=$ROOT/.venv/bin/python
export FASTDLLM_THREADS=${FASTDLLM_THREADS:-1} TOKENIZERS_PARALLELISM=false FASTDLLM_WEIGHTS=fp32
# test modules that build engines or models may build them at collection (once in mutmut's fork server) instead of
# once per mutant: tests/test_serve_request.py
export PRELOAD_TEST_ENGINES=1
# our CPU kernels (engine/weights/csrc) built once for the scratch copies, apart from the shared ~/.cache build that other
# checkouts rebuild for their own source paths
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$ROOT/runs/torch_extensions}
CHILDREN=${MUTMUT_CHILDREN:-1}

# the targets (files to mutate, source dirs for the scratch copy, fast tests, why): scripts/mutation_targets.json
declare -A FILES SOURCES TESTS
ALL=()
while IFS=$'\t' read -r t f s x; do
  FILES[$t]=$f; SOURCES[$t]=$s; TESTS[$t]=$x; ALL+=("$t")
done < <("$PY" -c 'import json, sys
for n, t in json.load(open(sys.argv[1])).items():
    if not n.startswith("_"): print("\t".join([n] + [" ".join(t[k]) for k in ("files", "sources", "tests")]))' \
  "$ROOT/scripts/mutation_targets.json")
[ $# -gt 0 ] && ALL=("$@")

out=$ROOT/bench/results/mutation
mkdir -p "$out"
for t in "${ALL[@]}"; do
  [ -n "${FILES[$t]:-}" ] || { echo "mutation.sh: unknown target '$t' (known: ${!FILES[*]})" >&2; exit 2; }
  work=$ROOT/runs/mutation/$t
  rm -rf "$work" && mkdir -p "$work"
  # the repository's tracked files (and the untracked ones git does not ignore), then the venv and assets as links
  git ls-files -co --exclude-standard -z | (cd "$ROOT" && xargs -0 cp --parents -t "$work") 2>/dev/null || true
  ln -sfn "$ROOT/.venv" "$work/.venv"
  {
    echo "[mutmut]"
    echo "source_paths ="; for s in ${SOURCES[$t]}; do echo "    $s"; done
    echo "only_mutate ="; for f in ${FILES[$t]}; do echo "    $f"; done
    echo "also_copy ="; for a in pytest.ini assets/ bench/ training/ app/ static/ app.py; do echo "    $a"; done
    echo "process_isolation = forkserver"  # torch in a forked pytest process deadlocks (its thread pools); see setup.cfg
    echo "pytest_add_cli_args ="; for a in -q -p no:randomly -o timeout=300; do echo "    $a"; done
    echo "pytest_add_cli_args_test_selection ="; for s in ${TESTS[$t]}; do echo "    $s"; done
  } > "$work/setup.cfg"
  echo "== mutation: $t (${FILES[$t]}) against: ${TESTS[$t]}"
  start=$(date +%s)
  (cd "$work" && PYTHONPATH=$work "$PY" -m mutmut run --max-children "$CHILDREN" >"$work/run.log" 2>&1) || true
  (cd "$work" && PYTHONPATH=$work "$PY" -m mutmut export-cicd-stats >/dev/null 2>&1 || true
   PYTHONPATH=$work "$PY" -m mutmut results > "$out/$t.txt" 2>/dev/null || true
   for m in $(awk -F: '/: survived/ {gsub(/ /, "", $1); print $1}' "$out/$t.txt"); do
     PYTHONPATH=$work "$PY" -m mutmut show "$m" 2>/dev/null; done > "$out/$t.survivors.diff" || true)
  "$PY" - "$work/mutants/mutmut-cicd-stats.json" "$out/$t.json" "$t" "${FILES[$t]}" "$(( $(date +%s) - start ))" <<'PYEOF'
import json, sys
src, dst, target, files, secs = sys.argv[1:]
try:
    s = json.load(open(src))
except OSError:
    s = {}
killed, survived = s.get("killed", 0), s.get("survived", 0)
timeout, suspicious = s.get("timeout", 0), s.get("suspicious", 0)
done = killed + survived + timeout + suspicious
score = (killed + timeout) / done if done else None
out = {"target": target, "files": files.split(), "seconds": int(secs), "score": score, **s}
json.dump(out, open(dst, "w"), indent=1)
print(f"{target}: score {score if score is None else round(score, 3)} ({killed} killed, {timeout} timeout, "
      f"{survived} survived, {s.get('no_tests', 0)} without tests) in {secs} s")
PYEOF
done
