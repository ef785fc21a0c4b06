"""torch's own CPU draws, for torch_multinomial.npz beside this file (the
clusters' seeding draws as Kilosort4's kmeans_plusplus does, on the CPU).

Usage: python make_torch_draws.py torch_multinomial.npz  (any torch; the file
was made with torch 2.15.0 from PyPI, on the CPU).

Writes, per case k: w{k} (float32 weights), seed{k} (uint64), idx{k} (three
consecutive torch.multinomial(w, 100) calls after torch.manual_seed(seed));
exp (torch.empty(1000).exponential_() after manual_seed(5)); ncases; and
torch_version."""
import sys
import numpy as np
import torch
out = sys.argv[1]
rng = np.random.default_rng(3)
res = {}
cases = [(150, 'spread', 5), (1000, 'equal', 5), (5000, 'spread', 1),
         (3000, 'few', 123456789), (20000, 'heavy', 5), (2218, 'spread', 4294967301)]
for k, (n, kind, seed) in enumerate(cases):
    if kind == 'spread':
        w = (rng.random(n) * 1e3).astype(np.float32); w[::17] = 0
    elif kind == 'equal':
        w = np.full(n, 2.5, np.float32)
    elif kind == 'few':
        w = np.zeros(n, np.float32); w[::50] = rng.random(len(w[::50])).astype(np.float32) + 0.5
    else:
        w = (1.0 / (rng.random(n) + 1e-6)).astype(np.float32)
    torch.manual_seed(seed)
    t = torch.from_numpy(w)
    res[f'w{k}'] = w
    res[f'seed{k}'] = np.array(seed, dtype=np.uint64)
    res[f'idx{k}'] = np.stack([torch.multinomial(t, 100).numpy() for _ in range(3)]).astype(np.int64)
torch.manual_seed(5)
res['exp'] = torch.empty(1000).exponential_().numpy()
res['torch_version'] = np.array(torch.__version__)
res['ncases'] = np.array(len(cases))
np.savez(out, **res)
print('torch', torch.__version__, 'cases', len(cases), 'mkl', torch.backends.mkl.is_available())
