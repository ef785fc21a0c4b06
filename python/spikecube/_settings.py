"""Settings by Kilosort4's names, split into the groups the Rust core takes.

Every name and default is Kilosort4 4.1.7's (``kilosort.parameters``) where
Kilosort4 has the setting; the few spikecube settings beyond Kilosort4 are the
command line's flags in snake case (README, "Where spikecube differs").
"""

from __future__ import annotations

import json
import math
import numbers
import os

# name: (group, default). Groups: detection and preprocessing go to the core's
# DetectionSettings / PreprocessSettings (serde names), recording to the reader
# and the input checks (the artifact blanking included), templates to the
# choice of universal templates, drift to the drift correction, run to the
# process (its worker threads), sort to the stages after detection.
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
    # stimulus artifacts (spikecube's): a file of times in seconds (text, CSV
    # or .npy), each blanked over artifact_window = (ms before, ms after) in
    # the preprocessed data; blank_transients also blanks the transients
    # common to most channels
    "artifact_times": ("recording", None),
    "artifact_window": ("recording", (0.5, 2.0)),
    "blank_transients": ("recording", False),
    # universal templates: learned from the recording (Kilosort4's
    # templates_from_data; None: learned unless a templates file is given),
    # Kilosort4's built-in ones (False) or a .npz file (templates)
    "templates_from_data": ("templates", None),
    "Th_single_ch": ("templates", 6.0),
    "seed": ("templates", 1),
    "min_learn_clips": ("templates", 300),
    "template_check": ("templates", True),
    "templates": ("templates", None),
    # drift correction (Kilosort4's datashift); nblocks 0 turns it off
    "nblocks": ("drift", 1),
    "drift_smoothing": ("drift", (0.5, 0.5, 0.5)),
    "sig_interp": ("drift", 20.0),
    "binning_depth": ("drift", 5.0),
    # Kilosort4's sharp edges made safe ("spikecube") or kept ("kilosort");
    # sites whose corrected position lies more than drift_edge_margin µm
    # beyond the probe's end read zero (inf: Kilosort4's extrapolation);
    # drift_only stops after the drift estimate (detect only)
    "drift_mode": ("drift", "spikecube"),
    "drift_edge_margin": ("drift", 15.0),
    "drift_only": ("drift", False),
    # CPU worker threads; None: the RAYON_NUM_THREADS environment variable,
    # else one per core. Set once per process (at its first run).
    "threads": ("run", None),
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
    # same-template merges need median amplitudes within this ratio; 0 is
    # Kilosort4's CCG-only rule (README, "Where spikecube differs")
    "same_template_amplitude_ratio": ("sort", 0.5),
    # Kilosort4 4.1.5-4.1.7's check_CCG guard (README, "Where spikecube differs")
    "ks4_swarm_ccg_bug": ("sort", False),
    # memory (GB) for keeping the detection pass's preprocessed windows for the
    # matching: None is the command line's default (half the free CUDA memory
    # on a GPU that preprocesses, none elsewhere); 0 keeps none
    "keep_windows_gb": ("sort", None),
}

# What each setting's value must be, checked (and
# numpy scalars made plain Python values) before any work starts.
KINDS: dict[str, str] = {
    "Th_universal": "number",
    "nt": "count",
    "nt0min": "count?",
    "dmin": "number?",
    "dminx": "number",
    "min_template_size": "number",
    "template_sizes": "count",
    "nearest_chans": "count",
    "nearest_templates": "count",
    "max_channel_distance": "number",
    "n_templates": "count",
    "n_pcs": "count",
    "separate_shanks": "bool",
    "neighbourhoods": "path?",
    "batch_size": "count",
    "highpass_cutoff": "number",
    "whitening_range": "count",
    "nskip": "count",
    "do_CAR": "bool",
    "invert_sign": "bool",
    "artifact_threshold": "number?",
    "tmin": "number",
    "tmax": "time?",
    "scale": "number?",
    "shift": "number?",
    "exclude_channels": "channels",
    "mask_clipped": "bool",
    "keep_boundary_duplicates": "bool",
    "artifact_times": "times?",
    "artifact_window": "pair",
    "blank_transients": "bool",
    "templates_from_data": "bool?",
    "Th_single_ch": "number",
    "seed": "count",
    "min_learn_clips": "count",
    "template_check": "bool",
    "templates": "path?",
    "nblocks": "count",
    "drift_smoothing": "triple",
    "sig_interp": "number",
    "binning_depth": "number",
    "drift_mode": "drift_mode",
    "drift_edge_margin": "margin",
    "drift_only": "bool",
    "threads": "threads?",
    "Th_learned": "number",
    "max_peels": "count",
    "position_limit": "number",
    "cluster_downsampling": "count",
    "max_cluster_subset": "count?",
    "cluster_neighbors": "count",
    "cluster_init_seed": "count",
    "cluster_init_generator": "generator",
    "duplicate_spike_ms": "number",
    "acg_threshold": "number",
    "ccg_threshold": "number",
    "same_template_amplitude_ratio": "number",
    "ks4_swarm_ccg_bug": "bool",
    "keep_windows_gb": "size?",
}
assert set(KINDS) == set(SETTINGS), set(KINDS) ^ set(SETTINGS)

_EXPECTED = {
    "number": "a finite number",
    "size": "a size in GB, 0 or more",
    "threads": "a whole number of threads, 1 or more",
    "count": "a whole number from 0 to 2**64 - 1",
    "bool": "True or False",
    "path": "a path (str or os.PathLike)",
    "times": "a path (str or os.PathLike) or a 1-D sequence of finite times in seconds",
    "time": "a number of seconds (inf: to the end)",
    "channels": "a list of channel numbers (whole numbers, 0 or more)",
    "pair": "two numbers of milliseconds, before and after each event, e.g. (0.5, 2)",
    "triple": "three numbers (σ over lag, window and block), e.g. (0.5, 0.5, 0.5)",
    "generator": "'torch' or 'chacha8'",
    "drift_mode": "'spikecube' or 'kilosort'",
    "margin": "a number of µm, 0 or more (inf: Kilosort4's extrapolation)",
}


def _number(v):
    """``v`` as a finite float, or None when it is not a real number."""
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        return None
    v = float(v)
    return v if math.isfinite(v) else None


def _count(v):
    """``v`` as an int ≥ 0 (a whole float too), or None."""
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        return None
    if not isinstance(v, numbers.Integral):
        v = float(v)
        if not v.is_integer():
            return None
    v = int(v)
    # The core takes counts and seeds as unsigned 64-bit integers.
    return v if 0 <= v < 2**64 else None


def _numbers(v, n):
    """``v`` as a tuple of ``n`` finite floats, or None."""
    if isinstance(v, (str, bytes)) or not hasattr(v, "__iter__"):
        return None
    vals = [_number(x) for x in v]
    return tuple(vals) if len(vals) == n and None not in vals else None


_MISSING = object()


def _times(key: str, value):
    """``value``, a sequence or array of times in seconds, as a list of
    floats; raises ``ValueError`` naming the setting and what is wrong
    (empty, not one row or column, a time that is not a finite number)."""
    import reprlib

    import numpy as np

    try:
        arr = np.asarray(value, dtype=object)
    except ValueError:
        arr = None
    if arr is None or arr.ndim > 2 or (arr.ndim == 2 and 1 not in arr.shape):
        shape = "ragged" if arr is None else f"of shape {arr.shape}"
        raise ValueError(
            f"{key} = {reprlib.repr(value)}: expected one row or column of times in seconds, "
            f"got an array {shape}"
        )
    # A (1, N) or (N, 1) array (MATLAB's row or column vector): its times.
    items = arr.ravel().tolist()
    if not items:
        raise ValueError(f"{key}: no times given (an empty sequence)")
    out = []
    for i, t in enumerate(items):
        v = _number(t)
        if v is None:
            raise ValueError(
                f"{key}: time {i + 1} of {len(items)} is {reprlib.repr(t)}; "
                "every time must be a finite number of seconds"
            )
        out.append(v)
    return out


def check_value(key: str, value, kind: str):
    """``value`` of setting ``key`` as the core takes it (plain Python types,
    paths as str); raises ``ValueError`` naming the setting, the value and
    what it must be."""
    optional = kind.endswith("?")
    base = kind.rstrip("?")
    if value is None and optional:
        return None
    got = _MISSING
    if base == "number":
        got = _number(value)
    elif base == "size":
        got = _number(value)
        got = got if got is not None and got >= 0 else None
    elif base == "threads":
        got = _count(value)
        got = got if got is not None and got >= 1 else None
    elif base == "count":
        got = _count(value)
    elif base == "bool":
        import numpy as np

        if isinstance(value, (bool, np.bool_)):
            got = bool(value)
    elif base == "path":
        if isinstance(value, (str, os.PathLike)):
            got = os.fsdecode(os.fspath(value))
    elif base == "times":
        if isinstance(value, (str, os.PathLike)):
            got = os.fsdecode(os.fspath(value))
        elif not isinstance(value, bytes) and hasattr(value, "__iter__"):
            got = _times(key, value)
    elif base == "time":
        if isinstance(value, numbers.Real) and not isinstance(value, bool) and float(value) == math.inf:
            got = math.inf
        else:
            got = _number(value)
    elif base == "channels":
        if not isinstance(value, (str, bytes)) and hasattr(value, "__iter__"):
            chans = [_count(c) for c in value]
            got = tuple(chans) if None not in chans else None
    elif base == "pair":
        got = _numbers(value, 2)
    elif base == "triple":
        got = _numbers(value, 3)
    elif base == "drift_mode":
        if isinstance(value, str) and value in ("spikecube", "kilosort"):
            got = str(value)
    elif base == "margin":
        if isinstance(value, numbers.Real) and not isinstance(value, bool) and float(value) == math.inf:
            got = math.inf
        else:
            got = _number(value)
            got = got if got is not None and got >= 0 else None
    elif base == "generator":
        if isinstance(value, str) and value in ("torch", "chacha8"):
            got = str(value)
    if got is _MISSING or got is None:
        expected = _EXPECTED[base] + (" (or None)" if optional else "")
        raise ValueError(f"{key} = {value!r}: expected {expected}")
    return got


#: Every setting but the sort's: what ``detect`` takes.
DETECT_NAMES: set[str] = {n for n, (g, _) in SETTINGS.items() if g != "sort"}

# Spellings accepted besides Kilosort4's own.
ALIASES = {"th_universal": "Th_universal", "do_car": "do_CAR", "th_learned": "Th_learned"}


def valid_names() -> list[str]:
    """Every setting name, sorted."""
    return sorted(SETTINGS)


def split(settings: dict, allowed: set[str] | None = None) -> dict[str, dict]:
    """Checks names and values and splits ``settings`` into groups, defaults
    filled in.

    Raises ``ValueError`` naming an unknown setting and listing the valid
    ones, or naming a setting whose value has the wrong type, the value and
    the type expected.
    """
    groups: dict[str, dict] = {
        g: {} for g in ("detection", "preprocessing", "recording", "templates", "drift", "run", "sort")
    }
    for name, (group, default) in SETTINGS.items():
        if allowed is None or name in allowed:
            groups[group][name] = default
    for key, value in settings.items():
        name = ALIASES.get(key, key)
        if name in SETTINGS and allowed is not None and name not in allowed:
            where = (
                "spikecube.sort (a setting of the sort's later stages)"
                if SETTINGS[name][0] == "sort"
                else "spikecube.detect and spikecube.sort"
            )
            raise ValueError(f"{key!r} is not a setting of this call: it belongs to {where}")
        if name not in SETTINGS:
            names = valid_names() if allowed is None else sorted(allowed)
            raise ValueError(
                f"unknown setting {key!r}; valid settings (Kilosort4's names): {', '.join(names)}"
            )
        groups[SETTINGS[name][0]][name] = check_value(key, value, KINDS[name])
    return groups


def drift_json(d: dict) -> str:
    margin = float(d.get("drift_edge_margin", 15.0))
    return json.dumps(
        {
            "nblocks": int(d.get("nblocks", 1)),
            "drift_smoothing": [float(v) for v in d.get("drift_smoothing", (0.5, 0.5, 0.5))],
            "sig_interp": float(d.get("sig_interp", 20.0)),
            "binning_depth": float(d.get("binning_depth", 5.0)),
            "drift_mode": str(d.get("drift_mode", "spikecube")),
            # JSON has no infinity: None stands for it.
            "drift_edge_margin": None if math.isinf(margin) else margin,
            "drift_only": bool(d.get("drift_only", False)),
        }
    )


def templates_json(d: dict) -> str:
    return json.dumps(d)


def sort_json(d: dict) -> str:
    s = dict(d)
    # 0 (or None): no limit, as the command line's --max-cluster-subset 0.
    s["max_cluster_subset"] = int(s["max_cluster_subset"] or 0)
    s["ks4_swarm_ccg_bug"] = bool(s["ks4_swarm_ccg_bug"])
    # keep_windows_gb was checked by split() (kind "size?": finite, 0 or more, or None).
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
            "artifact_times": r.get("artifact_times"),
            "artifact_window": [float(v) for v in r.get("artifact_window", (0.5, 2.0))],
            "blank_transients": bool(r.get("blank_transients", False)),
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
