"""Small helpers of run.sh (standard library only, except `versions`).

Usage:
  suite_util.py untar ARCHIVE.tar.xz DIR     unpack (Python's tarfile: no xz needed)
  suite_util.py unxz FILE.xz OUT             decompress one file, make it executable
  suite_util.py field META.json KEY          print one field of a JSON object
  suite_util.py versions                     import the suite's packages, print versions
  suite_util.py summary SCORES.json OUT.txt  one line per recording, sorter and unit set
"""
import json
import lzma
import os
import shutil
import sys
import tarfile
from pathlib import Path


def untar(archive, folder):
    with tarfile.open(archive) as t:
        if hasattr(tarfile, 'data_filter'):
            t.extractall(folder, filter='data')
        else:
            t.extractall(folder)


def unxz(src, dst):
    with lzma.open(src) as f, open(dst, 'wb') as g:
        shutil.copyfileobj(f, g, 1 << 22)
    os.chmod(dst, 0o755)


def versions():
    import faiss
    import kilosort
    import numpy
    import pandas
    import probeinterface
    import spikeinterface
    import torch
    print('kilosort', kilosort.__version__, 'faiss', faiss.__version__, 'spikeinterface', spikeinterface.__version__,
          'probeinterface', probeinterface.__version__, 'pandas', pandas.__version__, 'torch', torch.__version__,
          'numpy', numpy.__version__, 'cuda', torch.cuda.is_available())


def summary(scores, out):
    lines = []
    p = Path(scores)
    if p.exists():
        for rec, r in json.loads(p.read_text()).items():
            for name, v in r.items():
                if not (isinstance(v, dict) and 'all' in v):
                    continue
                for k in ('all', 'good'):
                    if k in v:
                        s = v[k]
                        lines.append(
                            f"{rec}\t{name}\t{k}\tunits {s['n_units']}\twell {s['well_detected_0.8']}/{r['gt_units']}"
                            f"\tmedian_acc {s['median_accuracy']:.3f}\tfp_units {s['false_positive_units']}"
                            f"\tredundant {s['redundant_units']}\tovermerged {s['overmerged_units']}"
                            f"\tbad {s['bad_units']}\tlag {s['median_lag_samples']}")
    Path(out).write_text('\n'.join(lines) + '\n')
    print('\n'.join(lines))


def main():
    a = sys.argv[1:]
    if not a:
        sys.exit(__doc__)
    if a[0] == 'untar':
        untar(a[1], a[2])
    elif a[0] == 'unxz':
        unxz(a[1], a[2])
    elif a[0] == 'field':
        print(json.loads(Path(a[1]).read_text())[a[2]])
    elif a[0] == 'versions':
        versions()
    elif a[0] == 'summary':
        summary(a[1], a[2])
    else:
        sys.exit(__doc__)


if __name__ == '__main__':
    main()
