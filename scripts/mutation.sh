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

# target | files to mutate (only_mutate globs) | source dirs to copy | fast tests (pytest node ids / -k filters)
declare -A FILES SOURCES TESTS
FILES[sampling]="engine/sampling.py";  SOURCES[sampling]="engine/"
TESTS[sampling]="tests/test_oracle.py::test_threshold_rule_is_above_threshold_plus_the_most_confident tests/test_oracle.py::test_factor_rule_is_the_largest_n_with_the_bound tests/test_oracle.py::test_commit_rules_always_commit_the_most_confident tests/test_oracle.py::test_engine_equals_oracle_on_random_models tests/test_engine.py::test_lower_threshold_never_commits_fewer tests/test_engine.py::test_per_row_top_p tests/test_oracle.py::test_sample_returns_the_probability_of_the_token_under_the_tempered_nucleus tests/test_oracle.py::test_sample_draws_from_the_tempered_nucleus"
FILES[decode]="engine/decode/base.py engine/decode/ar.py engine/decode/diffusion.py engine/decode/rows.py"; SOURCES[decode]="engine/"
# every event against the oracle on tiny random models with a toy tokenizer, joins, cancels, chunks, knobs, sampling
# (~5 s for the file; the oracle tests on the bundled tokenizer took ~8 s a mutant)
TESTS[decode]="tests/test_decode_exact.py"
FILES[model]="engine/model.py";        SOURCES[model]="engine/"
TESTS[model]="tests/test_oracle.py::test_engine_equals_oracle_on_random_models tests/test_oracle.py::test_ar_equals_oracle_ar_on_random_models tests/test_engine.py::test_forward_matches_transformers_tiny_qwen2 tests/test_engine.py::test_block_causal_mask_rule tests/test_engine.py::test_cpu_decode_layout_computes_the_same_forward"
FILES[quant]="engine/weights/gguf.py engine/weights/int4.py"; SOURCES[quant]="engine/"  # the 4-bit unpacking and layers
# a GGUF written by gguf-py and small random blocks (seconds; the real-GGUF tests parse 10+ s per mutant), and a tiny
# checkpoint at 4-bit for the one-call layer step
TESTS[quant]="tests/test_quant.py::test_gguf_blocks_equal_gguf_pys_dequantised_weights tests/test_quant.py::test_gguf_refuses_unexpected_block_types tests/test_quant.py::test_block_cache_reads_back_what_was_parsed tests/test_quant.py::test_pack_pairs_and_tiles_are_the_kernels_layout tests/test_quant.py::test_int4_weight_on_small_blocks tests/test_quant.py::test_int4_linear_switch_bias_and_lora_on_small_blocks tests/test_quant.py::test_dense_bf16_linear tests/test_quant.py::test_q8_head_embedding_and_planes_on_small_rows tests/test_quant.py::test_fused_layer_step_switch tests/test_q4_quantize.py::test_qwen2_checkpoint_at_4bit_keeps_its_biases_and_head"
FILES[serve]="engine/serve/request.py"; SOURCES[serve]="engine/"  # the request validation
TESTS[serve]="tests/test_serve_request.py"  # parse() in process on tiny engines, every message pinned (seconds)
FILES[recipe]="training/recipe.py";    SOURCES[recipe]="training/ engine/"
TESTS[recipe]="tests/test_training.py tests/test_recipe_exact.py"
FILES[checker]="grading/checker.py";   SOURCES[checker]="grading/ bench/ engine/"
TESTS[checker]="tests/test_data.py tests/test_longform.py"
FILES[finish]="engine/finish.py";      SOURCES[finish]="engine/"
TESTS[finish]="tests/test_finish.py"
ALL=(sampling decode model quant serve recipe checker finish)
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
