#!/bin/bash
# Data and target features in two passes (`blockdraft data --responses dataset`, then the feature
# cache `blockdraft train` builds first) against one (`blockdraft data ... --features`), on the
# same N ShareGPT samples; checks that the two caches hold the same features.
#   bash scripts/measure_features_pass.sh [N]      (default 128; run it alone on the machine)
set -e
cd "$(dirname "$0")/.."
[ -f .venv/bin/activate ] && source .venv/bin/activate
N=${1:-128}
W=$(mktemp -d)
trap 'rm -rf "$W"' EXIT
S=$(date +%s.%N)
blockdraft data --out "$W/two" --responses dataset --limit "$N" --batch-size 32 --max-new-tokens 192 2>/dev/null
M=$(date +%s.%N)
python -c "
from blockdraft.data import load_samples
from blockdraft.features import build_feature_cache
from blockdraft.target import load_target
target = load_target()
build_feature_cache('$W/two', 'train', load_samples('$W/two', 'train'), target, [1, 8, 14, 20, 27], progress=False)"
E=$(date +%s.%N)
blockdraft data --out "$W/one" --responses dataset --limit "$N" --batch-size 32 --max-new-tokens 192 --features 2>/dev/null
F=$(date +%s.%N)
python -c "
from blockdraft.data import load_samples
from blockdraft.features import CachedFeatures, feature_dir
two = CachedFeatures(feature_dir('$W/two', 'train', [1, 8, 14, 20, 27]))
one = CachedFeatures(feature_dir('$W/one', 'train', [1, 8, 14, 20, 27]))
n = len(load_samples('$W/one', 'train'))
assert len(two.offsets) == len(one.offsets) == n + 1
err = max((two.get(i) - one.get(i)).abs().max().item() / two.get(i).abs().max().item() for i in range(n))
print('two passes: data %.1f s + features %.1f s = %.1f s; one pass (--features): %.1f s' % ($M-$S, $E-$M, $E-$S, $F-$E))
print('%d train samples; largest difference between the caches, relative to the row maximum: %.1e' % (n, err))
"
