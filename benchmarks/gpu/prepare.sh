#!/usr/bin/env bash
# Run here, on the developer's machine (package registries reachable), before a lent GPU machine's lease:
# the GPU machine reaches no network, and its image lacks a few of dpltm's packages and the datasets.
#   .whl/       wheels of what the image (KINDS.md's package list) lacks, for its Python 3.12 on x86-64
#   .gpu-data/  MNIST and KMNIST in torchvision's layout, copied from ../shared/data
# Both are git-ignored (.git/info/exclude) and travel with `carry: [".whl", ".gpu-data"]` (about 20 MiB).
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p .git/info
for path in /.whl/ /.gpu-data/; do grep -qxF "$path" .git/info/exclude 2>/dev/null || echo "$path" >> .git/info/exclude; done
rm -rf .whl && mkdir .whl
platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
           --platform manylinux_2_24_x86_64 --platform manylinux_2_27_x86_64)
# dp-accounting (and dm-tree, which it needs), kymatio (appdirs, configparser), opacus (the benchmark's baseline)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${platforms[@]}" \
    -d .whl dp-accounting==0.6.0 dm-tree==0.1.10 kymatio==0.3.0 appdirs==1.4.4 configparser==7.3.0 opacus==1.6.0
data=${DPLTM_DATA_DIR:-../shared/data}
rm -rf .gpu-data && mkdir .gpu-data
for name in MNIST KMNIST; do  # the README job: tickets from KMNIST, DP training on MNIST
    if [ -d "$data/$name" ]; then cp -r "$data/$name" .gpu-data/; fi
done
du -sh .whl .gpu-data
ls .whl
