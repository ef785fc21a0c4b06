#!/usr/bin/env bash
# Fills benches/gt_suite/carry/ (git-ignored) with what run.sh needs on a
# machine without network, compressed (the device call's tree has a size limit):
#   carry/site.tar.xz   the Python wheels below (CPython 3.12, manylinux x86-64)
#                       unpacked into one site folder, tar + xz (a wheel is a zip
#                       of a site-packages tree: unpacking it is installing it
#                       with --no-deps, without the scripts none of these need);
#   carry/spikecube.xz  the spikecube binary, stripped, xz.
# run.sh unpacks both with Python's own tarfile/lzma (no xz needed there).
#
# Usage: benches/gt_suite/prepare_carry.sh [--lite] [SPIKECUBE_BINARY]
#   (default target/release/spikecube; build it first: cargo build --release)
#   --lite: leave out zarr (with numcodecs, asciitree, fasteners, deprecated,
#   wrapt) and requests (with urllib3, idna, charset_normalizer, certifi), about
#   7 MB of the 32, and put the stub modules of stubs/ in their place.
#
# The wheel set is what Kilosort4 4.1.7's whole sort and SpikeInterface's
# generators, scale, write_binary_recording and comparison import, beyond a
# machine with torch, numpy, scipy, scikit-learn, numba, psutil, matplotlib
# and their own dependencies (packaging, threadpoolctl, typing_extensions):
# found by importing them in a venv holding only that base plus these wheels,
# and running the suite there. pandas is imported by the comparison when it
# runs (python-dateutil, its one need, comes with matplotlib). neo and pydantic, which spikeinterface declares, are not imported on these
# paths. zarr (with numcodecs, asciitree, fasteners, deprecated, wrapt) and
# requests (with urllib3, idna, charset_normalizer, certifi) are imported at
# module level by spikeinterface.core and probeinterface, not used here:
# the --lite stubs only satisfy those imports.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
lite=0
if [ "${1:-}" = --lite ]; then
    lite=1
    shift
fi
bin=${1:-"$here/../../target/release/spikecube"}
full_only=(zarr==2.18.7 numcodecs==0.15.2 asciitree==1.0.0 fasteners==0.20 deprecated==1.3.1 wrapt==2.5.2
    requests==2.34.2 urllib3==2.8.0 idna==3.20 charset_normalizer==3.5.3 certifi==2026.10.19.post1)
if [ $lite = 1 ]; then
    full_only=()
fi
carry="$here/carry"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$carry" "$tmp/wheels" "$tmp/site"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform manylinux_2_5_x86_64 \
    -d "$tmp/wheels" \
    kilosort==4.1.7 faiss-cpu==1.15.1 spikeinterface==0.105.3 probeinterface==0.4.2 pandas==3.1.1 \
    tqdm==4.70.1 "${full_only[@]}"
for w in "$tmp/wheels"/*.whl; do
    python3 -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])' "$w" "$tmp/site"
done
ls "$tmp/wheels" > "$tmp/site/GT_SUITE_WHEELS.txt"
if [ $lite = 1 ]; then
    cp -r "$here/stubs/zarr" "$here/stubs/requests" "$tmp/site/"
    echo "stubs: zarr requests" >> "$tmp/site/GT_SUITE_WHEELS.txt"
fi
XZ_OPT='-6 -T0' tar -C "$tmp/site" -cJf "$carry/site.tar.xz" .
strip -o "$tmp/spikecube" "$bin"
xz -6 -T0 -c "$tmp/spikecube" > "$carry/spikecube.xz"
echo "wheels: $(du -cb "$tmp/wheels"/*.whl | tail -1 | cut -f1) bytes; unpacked site $(du -sb "$tmp/site" | cut -f1) bytes"
echo "stripped spikecube: $(stat -c %s "$tmp/spikecube") bytes ($("$bin" --version))"
ls -l "$carry"
echo "carry total: $(du -cb "$carry"/* | tail -1 | cut -f1) bytes"
