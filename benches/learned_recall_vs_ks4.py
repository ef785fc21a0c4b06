"""Recall and precision of Kilosort4's own learned-template detection next to spikecube's
(docs/benchmarks-history.md, "Learned universal templates").

Usage (numpy):

    python3 benches/learned_recall_vs_ks4.py KS4.npz GROUND_TRUTH.npy OURS_LEARNED OURS_BUILTIN [OURS_WITH_KS4_TEMPLATES]

KS4.npz: written by benches/ks4_learned_detect.py (Kilosort4 4.1.7, templates_from_data,
nblocks 0), possibly on some batches only (`batches_detected`). The OURS_* are spikecube
output folders of the same recording: learned templates, built-in templates, and
(optional) Kilosort4's learned templates given with `--templates`.

Prints one JSON line: on the batches Kilosort4 detected, recall / precision / spikes of
each (the true spikes whose trough + 10 falls in those batches; detections in them); on
the whole recording, the same for the spikecube folders; and how many of Kilosort4's
detections spikecube-with-Kilosort4's-templates has at the same sample in those batches.
Matching as benches/learned_vs_ks4.py: a true trough matched one-to-one, greedily in
time, by a detection 10 samples later within ±15 samples.
"""
import json
import sys

import numpy as np


def recall_precision(times, truth_troughs):
    t = np.sort(times) - 10
    gt = np.sort(truth_troughs)
    used = np.zeros(len(t), bool)
    hit = 0
    for g in gt:
        lo, hi = np.searchsorted(t, g - 15), np.searchsorted(t, g + 15, 'right')
        for i in range(lo, hi):
            if not used[i]:
                used[i] = True
                hit += 1
                break
    return [round(hit / max(len(gt), 1), 5), round(float(used.sum()) / max(len(t), 1), 5), int(len(t))]


def in_spans(samples, spans):
    keep = np.zeros(len(samples), bool)
    for lo, hi in spans:
        keep |= (samples >= lo) & (samples < hi)
    return keep


def main():
    ks = np.load(sys.argv[1])
    truth = np.load(sys.argv[2])[:, 0].astype(np.int64)
    folders = {'learned': sys.argv[3], 'builtin': sys.argv[4]}
    if len(sys.argv) > 5:
        folders['with_ks4_templates'] = sys.argv[5]
    batch = 60000
    done = sorted(int(b) for b in ks['batches_detected'])
    spans = [(b * batch, (b + 1) * batch) for b in done]
    gt_sub = truth[in_spans(truth + 10, spans)]
    kt = np.sort(ks['spike_times'])
    r = {'batches': done, 'true_spikes_in_batches': int(len(gt_sub)), 'true_spikes': int(len(truth)),
         'batches_ks4': recall_precision(kt, gt_sub)}
    for name, f in folders.items():
        t = np.sort(np.load(f + '/spike_times.npy'))
        r['batches_' + name] = recall_precision(t[in_spans(t, spans)], gt_sub)
        r['whole_' + name] = recall_precision(t, truth)
        if name == 'with_ks4_templates':
            ts = t[in_spans(t, spans)]
            r['batches_same_sample_as_ks4'] = [int(len(np.intersect1d(ts, kt))), int(len(kt)), int(len(ts))]
    print(json.dumps(r))


if __name__ == '__main__':
    main()
