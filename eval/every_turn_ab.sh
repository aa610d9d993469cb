#!/usr/bin/env bash
# The every-turn A/B: a draft trained on the
# target's replies to ShareGPT first turns only, against one trained on the replies to every
# user turn of ShareGPT conversations (each turn after the conversation before it, the target
# answering each in order), at EQUAL replies (rows) and equal optimizer steps; served as the
# demo serves its draft (K, greedy) on HumanEval[120:164] and all 80 MT-Bench questions,
# 3 seeds, through eval/ablate.py's data_path variants. Run after `make demo`, from the repo
# root; every step resumes when rerun.
#
#   eval/every_turn_ab.sh                       # the defaults below
#   REPLIES=1100 SEEDS=42 eval/every_turn_ab.sh # a one-seed screen at the demo's row count
#   LANES=2 eval/every_turn_ab.sh               # two cells at once, a share of the cores each
#   STEPS=1000 eval/every_turn_ab.sh            # optimizer steps of every cell [the demo's]
#
# Both arms: the demo's target, reply settings and training YAML, with total_seq_len set to
# ROW_TOKENS (a later turn's row holds the conversation before it; eval/every_turn_prompts.py
# cuts each conversation before a turn whose row may not fit), one reply per user turn.
set -euo pipefail

DEMO=${DEMO:-runs/demo}
OUT=${OUT:-runs/every-turn}
REPLIES=${REPLIES:-2000}
ROW_TOKENS=${ROW_TOKENS:-1024}
SEEDS=${SEEDS:-42,0,1}
LANES=${LANES:-1}
PY=${PY:-.venv/bin/python}

# The demo's target and reply settings (its data's generation_settings.json), how many
# prompts it generated together (the batch sets the speed, not the replies), and the
# optimizer steps its draft trained.
SETTINGS=$("$PY" - "$DEMO" <<'EOF'
import json, sys
from pathlib import Path
from eval.demo_run import demo_inputs
from speculators_peagle_plugin.common.files import METRICS_FILE
demo = demo_inputs(Path(sys.argv[1]))
settings = json.loads((Path(demo["data"]) / "generation_settings.json").read_text())
if demo["trained"] is None:
    raise SystemExit(f"{sys.argv[1]} trained no draft; run `make demo` to the end first.")
metrics = Path(demo["trained"]["checkpoint"]).parent / METRICS_FILE
steps = json.loads(metrics.read_text().splitlines()[-1])["step"]
print(demo["target"], settings["max_new_tokens"], settings["temperature"], demo["dtype"],
      demo["kv_cache_gb"], demo["gen_batch_size"], steps)
EOF
)
read -r TARGET MAX_NEW TEMPERATURE DTYPE KV_GB BATCH DEMO_STEPS <<< "$SETTINGS"
STEPS=${STEPS:-$DEMO_STEPS}

"$PY" -m eval.every_turn_prompts --target "$TARGET" --replies "$REPLIES" \
    --max-new-tokens "$MAX_NEW" --row-tokens "$ROW_TOKENS" --out "$OUT"

for arm in first every; do
    .venv/bin/speculators-peagle generate-data --target "$TARGET" \
        --prompts "$OUT/$arm.jsonl" --output "$OUT/$arm-data" \
        --max-new-tokens "$MAX_NEW" --temperature "$TEMPERATURE" --num-samples 1 \
        --backend vllm --kv-cache-gb "$KV_GB" --dtype "$DTYPE" --batch-size "$BATCH"
done

# Equal steps: a data_path variant would train its own data's epochs (an every-turn row is
# longer, so fewer fit a packed row and an epoch takes more steps): both arms get --steps.
"$PY" -m eval.ablate --demo-dir "$DEMO" --out "$OUT/ablate" --seeds "$SEEDS" --lanes "$LANES" \
    --steps "$STEPS" \
    --variant first "data_path=$OUT/first-data" "total_seq_len=$ROW_TOKENS" \
    --variant every "data_path=$OUT/every-data" "total_seq_len=$ROW_TOKENS" \
    --eval-prompts "humaneval[120:164]" --eval-prompts mt_bench
