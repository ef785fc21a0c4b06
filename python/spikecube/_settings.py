"""Settings by Kilosort4's names, split into the groups the Rust core takes.

Every name and default is Kilosort4 4.1.7's (``kilosort.parameters``) where
Kilosort4 has the setting; the few spikecube settings beyond Kilosort4 are the
command line's flags in snake case (README, "Where spikecube differs").
"""

from __future__ import annotations

import json
import math

# name: (group, default). Groups: detection and preprocessing go to the core's
# DetectionSettings / PreprocessSettings (serde names), recording to the reader
# and the input checks.
SETTINGS: dict[str, tuple[str, object]] = {
    # detection (Kilosort4's spikedetect)
    "Th_universal": ("detection", 9.0),
    "nt": ("detection", 61),
    "nt0min": ("detection", None),
    "dmin": ("detection", None),
    "dminx": ("detection", 32.0),
    "min_template_size": ("detection", 10.0),
    "template_sizes": ("detection", 5),
    "nearest_chans": ("detection", 10),
    "nearest_templates": ("detection", 100),
    "max_channel_distance": ("detection", 32.0),
    "n_templates": ("detection", 6),
    "n_pcs": ("detection", 6),
    "separate_shanks": ("detection", True),
    # Kilosort4's own iC.npy / iC2.npy / weigh.npy (a folder), instead of
    # spikecube's neighbourhoods (README, "Where spikecube differs")
    "neighbourhoods": ("detection", None),
    # preprocessing
    "batch_size": ("preprocessing", 60000),
    "highpass_cutoff": ("preprocessing", 300.0),
    "whitening_range": ("preprocessing", 32),
    "nskip": ("preprocessing", 25),
    "do_CAR": ("preprocessing", True),
    "invert_sign": ("preprocessing", False),
    "artifact_threshold": ("preprocessing", None),
    # the recording and the input checks
    "tmin": ("recording", 0.0),
    "tmax": ("recording", math.inf),
    "scale": ("recording", None),
    "shift": ("recording", None),
    "exclude_channels": ("recording", ()),
    "mask_clipped": ("recording", True),
    "keep_boundary_duplicates": ("recording", False),
    # drift correction (Kilosort4's datashift); 0 turns it off
    "nblocks": ("drift", 1),
    # the stages after detection (spikecube.sort only)
    "Th_learned": ("sort", 8.0),
    "max_peels": ("sort", 100),
    "position_limit": ("sort", 100.0),
    "cluster_downsampling": ("sort", 20),
    "max_cluster_subset": ("sort", 25000),
    "cluster_neighbors": ("sort", 10),
    "cluster_init_seed": ("sort", 5),
    # "torch" (Kilosort4's CPU draws) or "chacha8"
    "cluster_init_generator": ("sort", "torch"),
    "duplicate_spike_ms": ("sort", 0.25),
    "acg_threshold": ("sort", 0.2),
    "ccg_threshold": ("sort", 0.25),
    # Kilosort4 4.1.5-4.1.7's check_CCG guard (README, "Where spikecube differs")
    "ks4_swarm_ccg_bug": ("sort", False),
    # memory (GB) for keeping the detection pass's preprocessed windows for the
    # matching: None is the command line's default (half the free CUDA memory
    # on a GPU that preprocesses, none elsewhere); 0 keeps none
    "keep_windows_gb": ("sort", None),
}

#: Every setting but the sort's: what ``detect`` takes.
DETECT_NAMES: set[str] = {n for n, (g, _) in SETTINGS.items() if g != "sort"}

# Spellings accepted besides Kilosort4's own.
ALIASES = {"th_universal": "Th_universal", "do_car": "do_CAR", "th_learned": "Th_learned"}


def valid_names() -> list[str]:
    """Every setting name, sorted."""
    return sorted(SETTINGS)


def split(settings: dict, allowed: set[str] | None = None) -> dict[str, dict]:
    """Checks names and splits ``settings`` into groups, defaults filled in.

    Raises ``ValueError`` naming an unknown setting and listing the valid ones.
    """
    groups: dict[str, dict] = {"detection": {}, "preprocessing": {}, "recording": {}, "drift": {}, "sort": {}}
    for name, (group, default) in SETTINGS.items():
        if allowed is None or name in allowed:
            groups[group][name] = default
    for key, value in settings.items():
        name = ALIASES.get(key, key)
        if name not in SETTINGS or (allowed is not None and name not in allowed):
            names = valid_names() if allowed is None else sorted(allowed)
            raise ValueError(
                f"unknown setting {key!r}; valid settings (Kilosort4's names): {', '.join(names)}"
            )
        groups[SETTINGS[name][0]][name] = value
    return groups


def drift_json(d: dict) -> str:
    return json.dumps({"nblocks": int(d.get("nblocks", 1))})


def sort_json(d: dict) -> str:
    s = dict(d)
    # 0 (or None): no limit, as the command line's --max-cluster-subset 0.
    s["max_cluster_subset"] = int(s["max_cluster_subset"] or 0)
    s["ks4_swarm_ccg_bug"] = bool(s["ks4_swarm_ccg_bug"])
    gb = s.get("keep_windows_gb")
    if gb is not None:
        gb = float(gb)
        if not math.isfinite(gb) or gb < 0:
            raise ValueError(f"keep_windows_gb = {s['keep_windows_gb']!r}: a size in GB, 0 or more (or None)")
        s["keep_windows_gb"] = gb
    return json.dumps(s)


def detection_json(d: dict) -> str:
    # Paths (``neighbourhoods``) as strings.
    return json.dumps(d, default=str)


def preprocessing_json(d: dict, fs: float | None = None, nt: int = 61) -> str:
    p = dict(d)
    p["nt"] = nt
    if fs is not None:
        p["fs"] = float(fs)
    return json.dumps(p)


def recording_json(r: dict, n_channels, fs, dtype, offset) -> str:
    tmax = r["tmax"]
    return json.dumps(
        {
            "n_channels": None if n_channels is None else int(n_channels),
            "fs": None if fs is None else float(fs),
            "dtype": None if dtype is None else _dtype_name(dtype),
            "offset": int(offset),
            "scale": r["scale"],
            "shift": r["shift"],
            "tmin": float(r["tmin"]),
            "tmax": None if tmax is None or math.isinf(tmax) else float(tmax),
            "exclude_channels": [int(c) for c in r["exclude_channels"]],
            "mask_clipped": bool(r["mask_clipped"]),
            "keep_boundary_duplicates": bool(r["keep_boundary_duplicates"]),
        }
    )


def _dtype_name(dtype) -> str:
    import numpy as np

    if isinstance(dtype, str) and dtype in ("int16", "uint16", "int32", "float32"):
        return dtype
    try:
        return np.dtype(dtype).name
    except TypeError:
        return str(dtype)
