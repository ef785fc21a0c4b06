"""Kilosort4 4.1.7 on CUDA, built-in templates, nblocks 1, on a simulated
recording: saves its second pass's spike samples and its neighbourhoods
(iC, iC2, weigh) for `spikecube detect --neighbourhoods DIR`.
Usage (PYTHONPATH holding ../shared/tools/ks4ref for ks4common):
    ks4_drift_neighbourhoods.py SIM_DIR OUT_DIR [--no-tf32]"""
import json, sys, time
from pathlib import Path
import numpy as np
import ks4common  # noqa: F401
import torch
from kilosort import io, spikedetect
from kilosort.parameters import DEFAULT_SETTINGS
from kilosort.run_kilosort import initialize_ops, compute_preprocessing, compute_drift_correction

dev = torch.device('cuda')
if '--no-tf32' in sys.argv:
    # PyTorch lets cuDNN convolutions use TF32 (10-bit mantissa) by default.
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
print('cudnn.allow_tf32', torch.backends.cudnn.allow_tf32, flush=True)
sim, out = Path(sys.argv[1]), Path(sys.argv[2])
out.mkdir(parents=True, exist_ok=True)
probe = io.load_probe(sim / 'probe.json')
rec = sim / 'sim_g0_t0.imec0.ap.bin'
n_chan_bin = int(json.load(open(sim / 'probe.json'))['n_chan'])
s = dict(DEFAULT_SETTINGS)
s.update(n_chan_bin=n_chan_bin, fs=30000.0, templates_from_data=False, nblocks=1, filename=[rec])
ops, s = initialize_ops(s, probe, 'int16', True, False, dev, False)
ops['filename'] = [rec]
t0 = time.perf_counter()
ops = compute_preprocessing(ops, dev)
np.random.seed(1); torch.random.manual_seed(1)
ops, bfile, st0 = compute_drift_correction(ops, dev)
st, _, ops = spikedetect.run(ops, bfile, device=dev)
print(f'Kilosort4 nblocks 1 built-in: {len(st)} spikes in {time.perf_counter() - t0:.1f} s', flush=True)
np.save(out / 'st.npy', np.asarray(st))
np.save(out / 'dshift.npy', np.asarray(ops['dshift'], dtype=np.float64))
for k in ('iC', 'iC2', 'weigh'):
    v = ops[k]
    v = v.cpu().numpy() if torch.is_tensor(v) else np.asarray(v)
    np.save(out / f'{k}.npy', v.astype(np.float32) if k == 'weigh' else v.astype(np.int64))
