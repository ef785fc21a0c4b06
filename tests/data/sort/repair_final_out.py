"""Recompute final_out.npz (clu, Wall) of a case whose Wall was recorded by reference (the merges
then zeroed and averaged rows in place), from Kilosort4's saved ops.npy: reruns Kilosort4's final
clustering on extract_out's st/tF, checks that its labels equal the recorded ones, and saves a copy
of Wall. Usage: repair.py CASE_DIR OPS_NPY"""
import sys
import numpy as np, torch
from pathlib import Path
from kilosort import io, clustering_qr, template_matching as tm
case, ops_path = Path(sys.argv[1]), sys.argv[2]
torch.set_num_threads(2)
ops = io.load_ops(ops_path, device=torch.device('cpu'))
e = np.load(case / 'extract_out.npz'); f = np.load(case / 'final_out.npz'); m = np.load(case / 'merge_out.npz')
st = np.array(e['st'], copy=True); tF = torch.from_numpy(np.array(e['tF'], copy=True))
clu, Wall = clustering_qr.run(ops, st, tF, mode='template', device=torch.device('cpu'))
clu = np.asarray(clu).astype(np.int32)
print('labels identical', (clu == f['clu']).all(), 'Wall', Wall.shape)
W0 = Wall.clone().cpu().numpy()
Wm, clum, is_ref, stm, tFm = tm.merging_function(ops, Wall.clone(), clu.copy(), st.copy(), tF.clone(), device=torch.device('cpu'))
print('merged', Wm.shape, 'labels = merge_out', (np.asarray(clum) == m['clu']).all(), 'Wall = merge_out', (Wm.numpy() == m['Wall']).all(),
      'st = merge_out', (stm == m['st']).all(), 'extract st shifted', not (np.sort(st[:, 0]) == np.sort(stm[:, 0])).all())
np.savez_compressed(case / 'final_out_repaired.npz', clu=clu, Wall=W0)
