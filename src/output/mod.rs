//! Output files: .npy arrays, Phy params.py, provenance JSON, drift map.
