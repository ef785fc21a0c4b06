"""spikecube: Kilosort4 4.1.7's universal-template spike detection, in Rust.

The same pipeline as the ``spikecube`` command line (Kilosort4's
preprocessing: channel mean, median CAR, 300 Hz high-pass, local whitening;
then its first detection pass with 6 universal templates × 5 spatial sizes),
from Python::

    import spikecube
    r = spikecube.detect("run_g0_t0.imec0.ap.bin")      # SpikeGLX: probe from the .meta
    r.times            # int64 (n,), samples (Kilosort4's detection time)
    r.positions        # float32 (n, 2), x and y in µm

Settings take Kilosort4's names and defaults (``Th_universal=9``,
``nearest_chans=10``, ``batch_size=60000``, ...); an unknown name raises
``ValueError`` listing the valid ones (:func:`settings`), a value of the wrong
type one naming the setting and the type expected. Long calls release
the GIL and stop on Ctrl-C with ``KeyboardInterrupt``, leaving no partial
output; Rust's errors are raised as :class:`SpikecubeError` with the command
line's text; the core's log lines go to the ``logging`` logger ``"spikecube"``.

The whole sort, from a raw recording to a Phy folder (``spikecube sort``)::

    s = spikecube.sort("run_g0_t0.imec0.ap.bin", out="sorted")
    s.spike_times, s.spike_clusters   # int64 samples, int32 unit ids
    s.labels                           # {unit id: "good" or "mua"}

``spikecube.spikeinterface`` adds the SpikeInterface peak-detection method
``"spikecube"`` and the sorter ``"spikecube"`` for ``run_sorter``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence, Union

import numpy as np

from . import _native, _settings
from ._native import SpikecubeError

__version__ = _native.__version__
__all__ = [
    "Probe",
    "Result",
    "Sorting",
    "SpikecubeError",
    "WindowResult",
    "backends",
    "detect",
    "detect_window",
    "load",
    "load_sorting",
    "preprocess",
    "settings",
    "sort",
]

#: Samples from a spike's trough to its detection time (``times``): peaks in
#: SpikeInterface's convention (``peaks["sample_index"]``) are ``times − TROUGH_OFFSET``.
TROUGH_OFFSET: int = _native.TROUGH_OFFSET

PathLike = Union[str, "os.PathLike[str]"]


def settings() -> dict[str, Any]:
    """Every setting name with its default (Kilosort4's names and defaults)."""
    return {k: v for k, (_, v) in _settings.SETTINGS.items()}


def backends() -> list[str]:
    """Back ends of this build: ``auto``, ``cpu``, and ``cuda``/``wgpu`` in GPU builds."""
    return list(_native.backends())


# ---------------------------------------------------------------------------
# Probe


class Probe:
    """Site geometry in Kilosort4's terms.

    Attributes
    ----------
    xc, yc : float32 (n_sites,)
        Site positions, µm (x across, y along the shank).
    kcoords : int64 (n_sites,)
        Shank of each site.
    chanMap : int64 (n_sites,)
        Column of the recording file that holds each site (0-based).
    n_chan : int
        Channels (columns) in the recording file.

    Build one with :meth:`from_file` (Kilosort JSON, probeinterface JSON,
    ``.prb`` read as data, SpikeGLX ``.meta``), :meth:`from_probeinterface`
    (a ``probeinterface.Probe`` or ``ProbeGroup``), :meth:`from_dict`
    (Kilosort's probe dictionary) or :meth:`from_recording` (a SpikeInterface
    recording). The constructor checks the layout and raises
    :class:`SpikecubeError` naming what is wrong.
    """

    def __init__(self, xc, yc, kcoords=None, chanMap=None, n_chan=None, source="python"):
        xc = np.asarray(xc, dtype=np.float32).ravel()
        yc = np.asarray(yc, dtype=np.float32).ravel()
        n = xc.size
        kcoords = np.zeros(n, np.int64) if kcoords is None else np.asarray(kcoords).ravel()
        if kcoords.dtype.kind not in "iu":
            kcoords = np.asarray(kcoords, dtype=np.float64).astype(np.int64)
        chanMap = np.arange(n) if chanMap is None else np.asarray(chanMap).ravel()
        if n_chan is None:
            n_chan = int(chanMap.max()) + 1 if chanMap.size else 0
        t = _native.check_probe(
            (
                xc.tolist(),
                yc.tolist(),
                [int(k) for k in kcoords],
                [int(c) for c in chanMap],
                int(n_chan),
                str(source),
            )
        )
        self._set(t)

    def _set(self, t):
        self.xc = np.asarray(t[0], dtype=np.float32)
        self.yc = np.asarray(t[1], dtype=np.float32)
        self.kcoords = np.asarray(t[2], dtype=np.int64)
        self.chanMap = np.asarray(t[3], dtype=np.int64)
        self.n_chan = int(t[4])
        self.source = t[5]

    def _tuple(self):
        return (
            self.xc.tolist(),
            self.yc.tolist(),
            self.kcoords.tolist(),
            self.chanMap.tolist(),
            self.n_chan,
            self.source,
        )

    @property
    def n_sites(self) -> int:
        """Sites in use (rows of a window)."""
        return int(self.xc.size)

    def __repr__(self) -> str:
        return f"Probe({self.n_sites} sites, n_chan={self.n_chan}, source={self.source!r})"

    @classmethod
    def from_file(cls, path: PathLike) -> "Probe":
        """Loads a Kilosort JSON, probeinterface JSON, ``.prb`` or SpikeGLX ``.meta`` file."""
        p = cls.__new__(cls)
        p._set(_native.load_probe(os.fspath(path)))
        return p

    @classmethod
    def from_dict(cls, d: dict) -> "Probe":
        """Kilosort's probe dictionary: ``xc``, ``yc``, ``kcoords``, ``chanMap``, ``n_chan``."""
        return cls(d["xc"], d["yc"], d.get("kcoords"), d.get("chanMap"), d.get("n_chan"), "dict")

    @classmethod
    def from_probeinterface(cls, probe, n_chan: int | None = None) -> "Probe":
        """A ``probeinterface.Probe`` or ``ProbeGroup``: contact positions (µm),
        ``device_channel_indices`` as the channel map (contact order when
        unset), shank ids as ``kcoords``."""
        probes = getattr(probe, "probes", None) or [probe]
        xs, ys, ks, cs = [], [], [], []
        shank_names: dict = {}
        offset = 0
        for i, p in enumerate(probes):
            pos = np.asarray(p.contact_positions, dtype=np.float64)
            n = pos.shape[0]
            dci = getattr(p, "device_channel_indices", None)
            chans = np.arange(offset, offset + n) if dci is None else np.asarray(dci)
            sh = getattr(p, "shank_ids", None)
            if sh is None:
                sh = np.array([""] * n)
            for s in sh:
                ks.append(shank_names.setdefault((i, str(s)), len(shank_names)))
            xs.append(pos[:, 0])
            ys.append(pos[:, 1])
            cs.append(chans)
            offset += n
        chan = np.concatenate(cs).astype(np.int64)
        keep = chan >= 0  # probeinterface marks unconnected contacts with -1
        return cls(
            np.concatenate(xs)[keep],
            np.concatenate(ys)[keep],
            np.asarray(ks)[keep],
            chan[keep],
            n_chan,
            "probeinterface",
        )

    @classmethod
    def from_recording(cls, recording) -> "Probe":
        """A SpikeInterface recording's channel locations (µm) and groups:
        site i reads the recording's channel i."""
        locs = np.asarray(recording.get_channel_locations(), dtype=np.float64)
        try:
            groups = np.asarray(recording.get_channel_groups())
        except Exception:
            groups = None
        if groups is None or groups.size != locs.shape[0]:
            groups = np.zeros(locs.shape[0], np.int64)
        if groups.dtype.kind not in "iu":
            _, groups = np.unique(groups, return_inverse=True)
        n = locs.shape[0]
        return cls(locs[:, 0], locs[:, 1], groups, np.arange(n), n, "SpikeInterface recording")

    @classmethod
    def of(cls, obj) -> "Probe":
        """Any accepted probe description as a :class:`Probe`."""
        if isinstance(obj, Probe):
            return obj
        if isinstance(obj, (str, os.PathLike)):
            return cls.from_file(obj)
        if isinstance(obj, dict):
            return cls.from_dict(obj)
        if hasattr(obj, "contact_positions") or hasattr(obj, "probes"):
            return cls.from_probeinterface(obj)
        if hasattr(obj, "get_channel_locations"):
            return cls.from_recording(obj)
        raise TypeError(
            f"cannot make a probe of {type(obj).__name__}; give a file path, a "
            "spikecube.Probe, a Kilosort probe dict or a probeinterface.Probe"
        )


# ---------------------------------------------------------------------------
# Results


@dataclass
class Result:
    """The spikes of a ``detect`` run (the output folder's arrays in memory).

    n = spikes, nC = sites per spike (``nearest_chans``), Nf = template
    centres, n_sites = probe sites.

    Attributes
    ----------
    times : int64 (n,)
        Sample of each detection from the recording's first sample
        (Kilosort4's convention: about ``TROUGH_OFFSET`` = 10 samples after the
        trough), sorted. Seconds: ``times / fs``.
    centers : int64 (n,)
        Template centre of each spike (row of ``template_centers``).
    amplitudes : float32 (n,)
        Detection amplitude |A|, whitened units (noise sd ≈ 1), > ``Th_universal``.
    templates : int64 (n,)
        Winning (size, template) pair, ``size·6 + template``, 0–29.
    signs : int8 (n,)
        +1 for a trough-first spike like the templates, −1 for an inverted one.
    positions : float32 (n, 2)
        x (centre) and y (amplitude-weighted depth), µm.
    pc_features : float32 (n, nC, 6)
        PC features on the centre's nC nearest sites.
    pc_feature_ind : int64 (n, nC)
        Those sites (rows of ``channel_map``).
    peaks : structured (n,)
        SpikeInterface peaks: ``sample_index`` (trough = times − 10),
        ``channel_index`` (site of the largest winning-template output),
        ``amplitude`` (−sign·|A|, whitened units), ``segment_index``.
    template_centers : float64 (Nf, 2)
        Centre positions, µm.
    center_channels : int64 (Nf, nC)
    channel_map : int64 (n_sites,); channel_positions : float64 (n_sites, 2), µm
    whitening_mat : float32 (n_sites, n_sites)
    fs : float
        Sampling rate, Hz.
    info : dict
        ``spikecube.json``: settings, versions, timings, counts, warnings.
    path : Path or None
        The output folder (None when the run wrote to a temporary one).
    """

    times: np.ndarray
    centers: np.ndarray
    amplitudes: np.ndarray
    templates: np.ndarray
    signs: np.ndarray
    positions: np.ndarray
    pc_features: np.ndarray
    pc_feature_ind: np.ndarray
    peaks: np.ndarray
    template_centers: np.ndarray
    center_channels: np.ndarray
    channel_map: np.ndarray
    channel_positions: np.ndarray
    whitening_mat: np.ndarray
    fs: float
    info: dict = field(repr=False)
    path: Path | None = None

    def __len__(self) -> int:
        return int(self.times.size)

    @property
    def seconds(self) -> np.ndarray:
        """Spike times in seconds, float64 (n,)."""
        return self.times / self.fs

    @property
    def warnings(self) -> list[str]:
        """The run's warnings (also logged)."""
        return list(self.info.get("warnings", []))

    def __repr__(self) -> str:
        return f"Result({len(self)} spikes, fs={self.fs}, path={self.path})"


_FILES = {
    "times": "spike_times.npy",
    "centers": "spike_centers.npy",
    "amplitudes": "amplitudes.npy",
    "templates": "spike_detection_templates.npy",
    "signs": "spike_signs.npy",
    "positions": "spike_positions.npy",
    "pc_features": "pc_features.npy",
    "pc_feature_ind": "pc_feature_ind.npy",
    "peaks": "peaks.npy",
    "template_centers": "template_centers.npy",
    "center_channels": "center_channels.npy",
    "channel_map": "channel_map.npy",
    "channel_positions": "channel_positions.npy",
    "whitening_mat": "whitening_mat.npy",
}


def load(out_dir: PathLike, mmap: bool = False) -> Result:
    """Loads a finished ``spikecube detect`` output folder.

    ``mmap=True`` memory-maps the arrays instead of reading them.

    Raises ``FileNotFoundError`` naming a missing file (an unfinished folder is
    never at ``out_dir``: it is written as ``out_dir.partial-PID``), and
    ``ValueError`` for a ``spikecube sort`` (or ``preprocess``) folder,
    naming the call that loads it (:func:`load_sorting` for a sort).
    """
    d = Path(out_dir)
    if not (d / "spikecube.json").is_file():
        raise FileNotFoundError(f"{d}: not a finished spikecube output folder (no spikecube.json)")
    info = json.loads((d / "spikecube.json").read_text())
    _check_kind(d, info, "detect")
    arrays = {}
    for key, name in _FILES.items():
        f = d / name
        if not f.is_file():
            raise FileNotFoundError(f"{f}: missing from the spikecube output folder")
        arrays[key] = np.load(f, mmap_mode="r" if mmap else None)
    fs = float(info.get("input", {}).get("fs", 0) or _fs_from_params(d))
    return Result(**arrays, fs=fs, info=info, path=d)


# What each command's folder holds and how to load it.
_KINDS = {
    "detect": ("a `spikecube detect` output folder (detected spikes, not units)", "spikecube.load(folder)"),
    "sort": ("a `spikecube sort` Phy folder (units)", "spikecube.load_sorting(folder)"),
    "preprocess": ("a `spikecube preprocess` folder (whitened data, no spikes)", "numpy.memmap on its temp_wh.dat"),
}


def _check_kind(d: Path, info: dict, wanted: str) -> None:
    """Raises ``ValueError`` when ``spikecube.json`` says the folder is another
    command's, naming what it is and the call that loads it."""
    command = info.get("command")
    if command is None or command == wanted or command not in _KINDS:
        return
    what, how = _KINDS[command]
    raise ValueError(f"{d} is {what}, not {_KINDS[wanted][0]}: load it with {how}")


def _fs_from_params(d: Path) -> float:
    for line in (d / "params.py").read_text().splitlines():
        if line.startswith("sample_rate"):
            return float(line.split("=", 1)[1])
    return 0.0


# ---------------------------------------------------------------------------
# Progress


def _progress(progress, unit="windows"):
    """(callback for the core, closer) for ``progress``: True (a tqdm bar when
    tqdm is installed; one for the first pass, one for the detection pass),
    False/None, or a callable taking a dict with ``windows_done``,
    ``windows_total``, ``spikes``, ``seconds_done``, ``elapsed`` and
    ``first_pass``."""
    if callable(progress):
        return progress, lambda: None
    if not progress:
        return None, lambda: None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None, lambda: None
    state = {}

    def cb(p):
        bar = state.get("bar")
        first = p.get("first_pass", False)
        if bar is not None and state.get("first") != first:
            bar.close()  # the first pass ended: a bar of its own for the detection pass
            bar = None
        if bar is None:
            state["first"] = first
            # Started at the first report's count, so that the rate counts
            # from there (not one window over no time).
            bar = state["bar"] = tqdm(
                total=p["windows_total"],
                initial=p["windows_done"],
                unit=" window",
                desc="spikecube first pass" if first else "spikecube",
            )
        bar.update(p["windows_done"] - bar.n)
        if p["spikes"]:
            bar.set_postfix(spikes=p["spikes"], refresh=False)
        bar.refresh()

    def close():
        if "bar" in state:
            state["bar"].close()

    return cb, close


def _sync_log_level():
    """Passes the ``spikecube`` logger's effective level to the core, which then
    drops lower events without calling into Python."""
    import logging

    _native.set_log_level(max(1, min(50, logging.getLogger("spikecube").getEffectiveLevel())))


def _start_threads(groups: dict) -> None:
    """Sizes the worker pool (``threads``) before a run starts."""
    n = groups["run"]["threads"]
    if n is not None:
        _native.set_threads(n)


def _paths(path_or_paths) -> list[str]:
    if isinstance(path_or_paths, (str, os.PathLike)):
        return [os.fspath(path_or_paths)]
    paths = [os.fspath(p) for p in path_or_paths]
    if not paths:
        raise ValueError("no recording given")
    return paths


# ---------------------------------------------------------------------------
# The calls


# The Python names of the command line's flags that errors mention: the
# arguments of detect/sort/preprocess, and every setting (its flag is its
# name in lower case with dashes: Th_universal is --th-universal).
_PYTHON_NAMES = {
    "--n-channels": "n_channels",
    "--fs": "fs",
    "--dtype": "dtype",
    "--offset": "offset",
    "--probe": "probe",
    "--out": "out",
    "--backend": "backend",
    **{"--" + name.lower().replace("_", "-"): name for name in _settings.SETTINGS},
}


def _python_names(e: SpikecubeError) -> SpikecubeError:
    """The error with a last line giving the Python names of the command-line
    flags its message mentions (the message itself stays the command line's)."""
    msg = str(e)
    # In order of first mention, each once.
    flags = dict.fromkeys(f for f in re.findall(r"--[a-z0-9][a-z0-9-]*", msg) if f in _PYTHON_NAMES)
    if not flags:
        return e
    names = ", ".join(f"{flag} is {_PYTHON_NAMES[flag]}=" for flag in flags)
    return SpikecubeError(f"{msg}\n(in Python: {names})")


def _native_call(fn, *args):
    """``fn(*args)`` (a ``_native`` call), its SpikecubeError with the Python
    names of the flags it mentions (``_python_names``)."""
    try:
        return fn(*args)
    except SpikecubeError as e:
        raise _python_names(e) from None


def _pass_settings_json(groups, n_channels, fs, dtype, offset):
    """The recording, detection, preprocessing, drift and template settings
    as the JSON strings ``_native.detect`` and ``_native.sort`` take, in
    that order."""
    return (
        _settings.recording_json(groups["recording"], n_channels, fs, dtype, offset),
        _settings.detection_json(groups["detection"]),
        _settings.preprocessing_json(groups["preprocessing"], nt=groups["detection"]["nt"]),
        _settings.drift_json(groups["drift"]),
        _settings.templates_json(groups["templates"]),
    )


def detect(
    path_or_paths: Union[PathLike, Sequence[PathLike]],
    probe=None,
    *,
    n_channels: int | None = None,
    fs: float | None = None,
    dtype=None,
    offset: int = 0,
    out: PathLike | None = None,
    backend: str = "auto",
    progress: Union[bool, Callable[[dict], None]] = True,
    **settings,
) -> Result:
    """Detects the spikes of a recording: ``spikecube detect`` from Python.

    Kilosort4's ``run_kilosort`` up to its first detection pass (whitening fit
    over every ``nskip``-th batch; per batch channel mean, median CAR,
    high-pass, whitening, universal-template matching), with spikecube's input
    checks (README, "Where spikecube differs").

    Parameters
    ----------
    path_or_paths : path or list of paths
        A SpikeGLX ``.bin`` (its ``.meta`` beside it), an Open Ephys folder or
        ``structure.oebin``, or a flat binary file; several files are read one
        after the other as one recording.
    probe : path, Probe, dict or probeinterface.Probe, optional
        The geometry; default: the SpikeGLX metadata's.
    n_channels, fs, dtype, offset :
        Flat binary files: channels per frame (Kilosort4's ``n_chan_bin``),
        sampling rate (Hz), sample type (int16, uint16, int32, float32;
        default int16) and bytes to skip at the start.
    out : path, optional
        Write the output folder there (written as ``out.partial-PID`` and
        renamed when complete; see README). Default: a temporary folder,
        removed after loading.
    backend : {"auto", "cpu", "cuda", "wgpu"}
        Where detection runs (GPU back ends only in GPU builds, see :func:`backends`).
    progress : bool or callable
        True: a tqdm bar when tqdm is installed (one for the drift estimate's
        first pass, one for the detection pass); a callable gets a dict
        (``windows_done``, ``windows_total``, ``spikes``, ``seconds_done``,
        ``elapsed``, ``first_pass``: True in the first pass, whose spikes are
        not the output) after each window.
    **settings
        Kilosort4's settings by name (``Th_universal``, ``nearest_chans``,
        ``batch_size``, ``tmin``, ``tmax``, ...; :func:`settings` lists them
        with their defaults), and the command line's flags in snake case
        where Kilosort4 has no such setting. Among them:

        * universal templates: ``templates_from_data`` (None: learned from
          the recording, as Kilosort4 does, unless ``templates`` is given;
          False: Kilosort4's built-in templates), ``templates`` (a ``.npz``
          file holding ``wTEMP`` and ``wPCA``), ``Th_single_ch`` (6, the
          threshold of the peaks learned from), ``seed`` (1, of the
          learning's k-means++ draws), ``min_learn_clips`` (300: fewer
          isolated peaks and the built-in templates are used, with a
          warning), ``template_check`` (True: a learned template whose peak
          is off centre is realigned or replaced, with a warning);
        * drift correction: ``nblocks`` (1; 0 turns it off),
          ``drift_smoothing`` ((0.5, 0.5, 0.5), Gaussian σ over lag, window
          and block), ``sig_interp`` (20 µm), ``binning_depth`` (5 µm),
          ``drift_mode`` ("spikecube"; "kilosort" keeps Kilosort4's sharp
          edges), ``drift_edge_margin`` (15 µm; ``math.inf``: Kilosort4's
          extrapolation), ``drift_only`` (False; ``detect`` only: stop after
          the drift estimate);
        * stimulus artifacts: ``artifact_times`` (times in seconds from the
          start of the file: a text, CSV or ``.npy`` file, or a 1-D list or
          array of the times themselves), each blanked
          over ``artifact_window`` ((0.5, 2): ms before and after) in the
          preprocessed data; ``blank_transients`` (False) also blanks the
          transients common to most channels;
        * ``threads``: CPU worker threads (None: ``RAYON_NUM_THREADS``, else
          one per core). The pool is made once per Python process, at its
          first run: a different count afterwards raises ``ValueError``.

        Paths (``templates``, ``artifact_times``, ``neighbourhoods``) may be
        str or ``os.PathLike``.

    Returns
    -------
    Result
        Times in samples, positions in µm, amplitudes, templates, signs and
        PC features as numpy arrays.

    Raises
    ------
    ValueError
        An unknown setting name (the message lists the valid ones), a
        setting's value of the wrong type (the message names the setting,
        the value and the type expected), or an unknown back end; raised
        before any work starts.
    SpikecubeError
        Anything the command line reports as an error (bad input, settings,
        a read or write failure), with the same message, and a last line
        giving the Python names of the flags it mentions (``--fs`` is
        ``fs=``).
    KeyboardInterrupt
        Ctrl-C: the run stops and leaves no output folder.
    """
    groups = _settings.split(settings, _settings.DETECT_NAMES)
    paths = _paths(path_or_paths)
    probe_t = None if probe is None else Probe.of(probe)._tuple()
    _start_threads(groups)
    cb, close = _progress(progress)
    tmp = None
    if out is None:
        tmp = tempfile.mkdtemp(prefix="spikecube-")
        target = Path(tmp) / "spikecube"
    else:
        target = Path(out)
    try:
        _sync_log_level()
        _native_call(
            _native.detect,
            paths,
            probe_t,
            *_pass_settings_json(groups, n_channels, fs, dtype, offset),
            os.fspath(target),
            backend,
            cb,
        )
        r = load(target)
        if tmp is not None:
            r.path = None
        return r
    finally:
        close()
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


# ---------------------------------------------------------------------------
# The sort


@dataclass
class Sorting:
    """A finished ``spikecube sort`` Phy folder, loaded.

    n spikes, u units. Unit ids are the values of ``spike_clusters``
    (Kilosort4's cluster ids; ``spike_templates`` holds the same ids, as in
    Kilosort4's own folders).

    Attributes
    ----------
    spike_times : int64 (n,)
        Samples from the file's first sample, at each spike's trough (with
        ``tmin`` too, as ``params.py``'s ``dat_path`` is the whole file).
    spike_clusters : int32 (n,)
        Unit of each spike.
    amplitudes : float32 (n,)
        Template-scaling amplitude of each spike.
    spike_positions : float32 (n, 2)
        x, y in µm.
    templates : float32 (u, nt, n_sites)
        Each unit's mean waveform in whitened units.
    labels : dict
        ``{unit id: "good" | "mua"}`` (``cluster_KSLabel.tsv``).
    fs : float
        Sampling rate, Hz.
    info : dict
        ``spikecube.json`` (settings, timings, warnings).
    path : Path
        The Phy folder: open it with ``phy template-gui path/params.py``.
    """

    spike_times: np.ndarray
    spike_clusters: np.ndarray
    amplitudes: np.ndarray
    spike_positions: np.ndarray
    templates: np.ndarray
    labels: dict
    fs: float
    info: dict = field(repr=False)
    path: Path | None = None

    def __len__(self) -> int:
        return int(self.spike_times.size)

    @property
    def unit_ids(self) -> np.ndarray:
        """Sorted unit ids (int)."""
        return np.unique(self.spike_clusters)

    @property
    def good_units(self) -> list[int]:
        """Units labelled ``good`` (refractory: ACG's R12 below ``acg_threshold``)."""
        return sorted(u for u, lab in self.labels.items() if lab == "good")

    @property
    def warnings(self) -> list[str]:
        """The run's warnings (also logged)."""
        return list(self.info.get("warnings", []))

    def to_spikeinterface(self):
        """The folder as a SpikeInterface sorting (``read_kilosort``)."""
        from spikeinterface.extractors import read_kilosort

        return read_kilosort(self.path)

    def __repr__(self) -> str:
        return f"Sorting({len(self.labels)} units, {len(self.good_units)} good, {len(self)} spikes, path={self.path})"


def load_sorting(phy_dir: PathLike) -> Sorting:
    """Loads a finished ``spikecube sort`` (or Kilosort4) Phy folder.

    Raises ``FileNotFoundError`` naming a missing file, and ``ValueError``
    for a ``spikecube detect`` (or ``preprocess``) folder, naming the call
    that loads it (:func:`load` for detected spikes).
    """
    d = Path(phy_dir)
    if not d.is_dir():
        raise FileNotFoundError(f"{d}: no such folder (a Phy folder written by spikecube.sort or Kilosort4)")
    info = {}
    if (d / "spikecube.json").is_file():
        info = json.loads((d / "spikecube.json").read_text())
        _check_kind(d, info, "sort")
    arrays = {}
    for key in ("spike_times", "spike_clusters", "amplitudes", "spike_positions", "templates"):
        f = d / f"{key}.npy"
        if not f.is_file():
            raise FileNotFoundError(f"{f}: missing from the Phy folder")
        arrays[key] = np.load(f)
    labels = {}
    tsv = d / "cluster_KSLabel.tsv"
    if tsv.is_file():
        for line in tsv.read_text().splitlines()[1:]:
            if line.strip():
                cid, lab = line.split("\t")[:2]
                labels[int(cid)] = lab.strip()
    return Sorting(
        spike_times=arrays["spike_times"].astype(np.int64, copy=False).ravel(),
        spike_clusters=arrays["spike_clusters"].astype(np.int32, copy=False).ravel(),
        amplitudes=arrays["amplitudes"].ravel(),
        spike_positions=arrays["spike_positions"],
        templates=arrays["templates"],
        labels=labels,
        fs=_fs_from_params(d),
        info=info,
        path=d,
    )


_SORT_STAGES = ("detection", "first clustering", "templates", "matching", "final clustering", "merges and export")


def _sort_progress(progress):
    """(callback for the core, closer) for ``sort``'s ``progress``: True (a tqdm
    bar per windowed stage when tqdm is installed), False/None, or a callable
    taking a dict (``stage``, ``windows_done``, ``windows_total``,
    ``seconds_done``, ``elapsed``, ``units``). Each new stage is also logged
    (logger ``"spikecube"``, INFO)."""
    import logging

    log = logging.getLogger("spikecube")
    state = {"stage": None}
    user = progress if callable(progress) else None
    tqdm = None
    if progress and user is None:
        try:
            from tqdm.auto import tqdm
        except ImportError:
            tqdm = None

    def close_bar():
        bar = state.pop("bar", None)
        if bar is not None:
            bar.close()

    def cb(p):
        if p["stage"] != state["stage"]:
            state["stage"] = p["stage"]
            close_bar()
            units = f", {p['units']} units so far" if p["units"] else ""
            log.info("sort: %s (%.1f s in%s)", p["stage"], p["elapsed"], units)
        if user is not None:
            user(p)
        elif tqdm is not None and p["windows_total"]:
            bar = state.get("bar")
            if bar is None:
                bar = state["bar"] = tqdm(
                    total=p["windows_total"],
                    initial=p["windows_done"],
                    unit=" window",
                    desc=f"spikecube {p['stage']}",
                )
            bar.update(p["windows_done"] - bar.n)
            bar.refresh()

    return cb, close_bar


def sort(
    path_or_paths: Union[PathLike, Sequence[PathLike]],
    probe=None,
    *,
    out: PathLike,
    n_channels: int | None = None,
    fs: float | None = None,
    dtype=None,
    offset: int = 0,
    backend: str = "auto",
    progress: Union[bool, Callable[[dict], None]] = True,
    **settings,
) -> Sorting:
    """Sorts a recording into units: ``spikecube sort`` from Python.

    Kilosort4's whole ``run_kilosort``: preprocessing, drift correction,
    universal-template detection, first clustering, learned templates,
    template matching, final clustering, CCG-gated merges, Phy folder.

    Parameters
    ----------
    path_or_paths, probe, n_channels, fs, dtype, offset :
        As :func:`detect`.
    out : path
        The Phy folder to write (required; it must not exist). It appears
        only when complete (written as ``out.partial-PID``, then renamed).
    backend : {"auto", "cpu", "cuda", "wgpu"}
        Where the sort's detection and matching run (the same units on each).
    progress : bool or callable
        True: a tqdm bar per stage when tqdm is installed; a callable gets a
        dict (``stage``, ``windows_done``, ``windows_total``,
        ``seconds_done``, ``elapsed``, ``units``) between stages and after
        each window of the windowed stages.
    **settings
        Kilosort4's settings by name: those of :func:`detect` (the
        templates, drift, artifact and ``threads`` settings included), and
        the sort's (``Th_learned``, ``max_peels``, ``cluster_init_seed``,
        ``duplicate_spike_ms``, ``acg_threshold``, ``ccg_threshold``, ...;
        :func:`settings` lists them with their defaults).

    Returns
    -------
    Sorting
        The Phy folder's spikes, units and labels.

    Raises
    ------
    ValueError
        An unknown setting name, a setting's value of the wrong type, or an
        unknown back end; raised before any work starts.
    SpikecubeError
        Anything the command line reports as an error, with the same message
        and the Python names of the flags it mentions.
    KeyboardInterrupt
        Ctrl-C: the run stops and leaves neither the Phy folder nor its
        working folders.
    """
    groups = _settings.split(settings)
    paths = _paths(path_or_paths)
    probe_t = None if probe is None else Probe.of(probe)._tuple()
    _start_threads(groups)
    cb, close = _sort_progress(progress)
    try:
        _sync_log_level()
        report = json.loads(
            _native_call(
                _native.sort,
                paths,
                probe_t,
                *_pass_settings_json(groups, n_channels, fs, dtype, offset),
                _settings.sort_json(groups["sort"]),
                os.fspath(out),
                backend,
                cb,
            )
        )
    finally:
        close()
    s = load_sorting(report["out"])
    s.info.setdefault("warnings", report.get("warnings", []))
    return s


@dataclass
class WindowResult:
    """Detections in one window, in Kilosort4's names and layouts.

    n detections, nC sites per centre, Nf centres.

    Attributes
    ----------
    xy : int64 (n, 2)
        (centre, sample) of each detection; sample counts window columns
        (the window's own samples are ``nt .. N − nt − 1``).
    amp : float32 (n,)
        |A|, whitened units.
    imax : int64 (n,)
        Winning (size, template) pair, 0–29.
    sign : int8 (n,)
        +1 trough-first, −1 inverted.
    adist : float32 (nC, n)
        Per-site output of the winning temporal template.
    yct : float32 (n,)
        Amplitude-weighted depth, µm.
    tF : float32 (n, nC, 6)
        PC features.
    geometry : dict
        ``xcup``, ``ycup`` (Nf,) µm, ``iC`` (nC, Nf), ``iC2``, ``weigh``, ``dmin``.
    """

    xy: np.ndarray
    amp: np.ndarray
    imax: np.ndarray
    sign: np.ndarray
    adist: np.ndarray
    yct: np.ndarray
    tF: np.ndarray
    geometry: dict = field(repr=False)

    def __len__(self) -> int:
        return int(self.amp.size)


def detect_window(X, probe, *, backend: str = "cpu", **settings) -> WindowResult:
    """Detects in one whitened window (Kilosort4's ``spikedetect.template_match``
    and the steps of ``spikedetect.run`` around it; ``spikecube detect-window``).

    Parameters
    ----------
    X : array (C, N)
        One whitened window, channels × samples (converted to float32), with
        ``nt`` = 61 samples of padding on each side; rows in the probe's
        channel-map order.
    probe : path, Probe, dict or probeinterface.Probe
    backend : {"cpu", "auto", "cuda", "wgpu"}
    **settings
        Detection settings by Kilosort4's names (``Th_universal``, ``nearest_chans``, ...).

    Raises ``ValueError`` for an unknown or non-detection setting and
    :class:`SpikecubeError` for a shape or settings error.
    """
    allowed = {k for k, (g, _) in _settings.SETTINGS.items() if g == "detection"}
    groups = _settings.split(settings, allowed)
    X = np.ascontiguousarray(X, dtype=np.float32)
    if X.ndim != 2:
        raise ValueError(f"X must be 2-D (channels × samples), got shape {X.shape}")
    _sync_log_level()
    det, geom = _native.detect_window(
        X, Probe.of(probe)._tuple(), _settings.detection_json(groups["detection"]), backend
    )
    xy = np.stack([det["centre"].astype(np.int64), det["sample"].astype(np.int64)], axis=1)
    return WindowResult(
        xy=xy.reshape(-1, 2),
        amp=det["amp"],
        imax=det["imax"].astype(np.int64),
        sign=det["sign"],
        adist=np.ascontiguousarray(det["adist"].T),
        yct=det["yct"],
        tF=det["tF"],
        geometry=geom,
    )


@dataclass
class Preprocessed:
    """What :func:`preprocess` wrote.

    Attributes
    ----------
    path : Path
        ``temp_wh.dat``: every window's own samples, sample-major
        (n_samples × n_sites), int16 holding 200 × the whitened value, or
        float32 with ``float32=True``.
    data : np.memmap (n_samples, n_sites)
        That file, memory-mapped (divide int16 values by 200).
    whitening_mat : float32 (n_sites, n_sites)
    channel_map : int64 (n_sites,)
    info : dict
    """

    path: Path
    data: np.ndarray
    whitening_mat: np.ndarray
    channel_map: np.ndarray
    info: dict = field(repr=False)


def preprocess(
    path_or_paths,
    probe=None,
    *,
    out: PathLike,
    float32: bool = False,
    n_channels: int | None = None,
    fs: float | None = None,
    dtype=None,
    offset: int = 0,
    progress=True,
    **settings,
) -> Preprocessed:
    """Kilosort4's preprocessing of a whole recording, written to
    ``out/temp_wh.dat`` (``spikecube preprocess``): whitening fit, then per
    window channel mean, median CAR, high-pass and whitening.

    Parameters as :func:`detect`; ``out`` is a folder, written as the command
    line writes it: ``temp_wh.dat``, ``whitening_mat.npy``, ``hp_filter.npy``
    and ``spikecube.json``, first as ``out.partial-PID`` and renamed when
    complete. An existing ``out`` is replaced only when it is empty or an
    earlier ``preprocess`` result holding nothing else; a folder holding any
    other file raises ``RuntimeError`` naming it, and nothing is touched.
    Preprocessing settings by Kilosort4's names (``batch_size``,
    ``highpass_cutoff``, ``whitening_range``, ``nskip``, ``do_CAR``, ...) and
    the recording's (``tmin``, ``tmax``, ``exclude_channels``, the artifact
    blanking of :func:`detect`, ...).

    Raises as :func:`detect`.
    """
    allowed = {k for k, (g, _) in _settings.SETTINGS.items() if g in ("preprocessing", "recording")}
    allowed.discard("keep_boundary_duplicates")
    groups = _settings.split(settings, allowed)
    groups["recording"].setdefault("keep_boundary_duplicates", False)
    cb, close = _progress(progress)
    try:
        _sync_log_level()
        w, info = _native_call(
            _native.preprocess,
            _paths(path_or_paths),
            None if probe is None else Probe.of(probe)._tuple(),
            _settings.recording_json(groups["recording"], n_channels, fs, dtype, offset),
            _settings.preprocessing_json(groups["preprocessing"]),
            os.fspath(out),
            bool(float32),
            cb,
        )
    finally:
        close()
    info = json.loads(info)
    target = Path(info["path"])
    data = np.memmap(
        target,
        dtype=np.float32 if float32 else np.int16,
        mode="r",
        shape=(info["n_samples"], info["n_sites"]),
    )
    return Preprocessed(
        path=target,
        data=data,
        whitening_mat=w,
        channel_map=np.asarray(info["channel_map"], dtype=np.int64),
        info=info,
    )
