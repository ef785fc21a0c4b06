//! probeinterface JSON (`{"specification": "probeinterface", "probes": [...]}`).
//! The first probe is used; several probes in one file are refused with a clear error.

use std::path::Path;

use serde_json::Value;

use super::Probe;
use super::kilosort::whole;
use crate::error::ProbeError;

fn field_err(path: &Path, field: &str, message: String) -> ProbeError {
    ProbeError::Field {
        path: path.to_owned(),
        field: field.to_owned(),
        message,
    }
}

pub(super) fn from_value(json: &Value, path: &Path) -> Result<Probe, ProbeError> {
    let probes = json
        .get("probes")
        .and_then(Value::as_array)
        .ok_or_else(|| field_err(path, "probes", "must be an array of probes".into()))?;
    let probe = match probes.as_slice() {
        [p] => p,
        [] => return Err(field_err(path, "probes", "is empty".into())),
        more => {
            return Err(field_err(
                path,
                "probes",
                format!(
                    "holds {} probes; spikecube sorts one probe at a time, so save each probe to its own file",
                    more.len()
                ),
            ));
        }
    };
    if let Some(units) = probe.get("si_units").and_then(Value::as_str)
        && units != "um"
    {
        return Err(field_err(
            path,
            "si_units",
            format!("is {units:?}; only µm (\"um\") positions are supported"),
        ));
    }
    let positions = probe
        .get("contact_positions")
        .and_then(Value::as_array)
        .ok_or_else(|| {
            field_err(
                path,
                "contact_positions",
                "is missing or not an array".into(),
            )
        })?;
    let mut xc = Vec::with_capacity(positions.len());
    let mut yc = Vec::with_capacity(positions.len());
    for (i, p) in positions.iter().enumerate() {
        let pair = p.as_array().filter(|a| a.len() >= 2).ok_or_else(|| {
            field_err(
                path,
                "contact_positions",
                format!("entry {i} is {p}; expected [x, y]"),
            )
        })?;
        let get = |k: usize| {
            pair[k].as_f64().ok_or_else(|| {
                field_err(
                    path,
                    "contact_positions",
                    format!("entry {i} is {p}; expected numbers"),
                )
            })
        };
        xc.push(get(0)? as f32);
        yc.push(get(1)? as f32);
    }
    let n = xc.len();
    let kcoords = match probe.get("shank_ids").and_then(Value::as_array) {
        // No shank ids (absent or an empty list): one shank.
        None => vec![0; n],
        Some(ids) if ids.is_empty() => vec![0; n],
        Some(ids) => shank_numbers(ids, path)?,
    };
    let chan_map: Vec<i64> = match probe.get("device_channel_indices") {
        None | Some(Value::Null) => (0..n as i64).collect(),
        Some(Value::Array(a)) => {
            let v: Vec<f64> = a
                .iter()
                .enumerate()
                .map(|(i, x)| {
                    x.as_f64().ok_or_else(|| {
                        field_err(
                            path,
                            "device_channel_indices",
                            format!("entry {i} is {x}, not a number"),
                        )
                    })
                })
                .collect::<Result<_, _>>()?;
            whole(&v, "device_channel_indices", path, -1.0)?
        }
        Some(other) => {
            return Err(field_err(
                path,
                "device_channel_indices",
                format!("is {other}; expected an array"),
            ));
        }
    };
    if chan_map.len() != n {
        return Err(field_err(
            path,
            "device_channel_indices",
            format!(
                "has {} entries but contact_positions has {n}",
                chan_map.len()
            ),
        ));
    }
    // probeinterface marks unconnected contacts with -1: they are not recorded, so drop them.
    let keep: Vec<usize> = (0..n).filter(|&i| chan_map[i] >= 0).collect();
    let pick = |v: &[f32]| keep.iter().map(|&i| v[i]).collect::<Vec<_>>();
    let chan: Vec<u64> = keep.iter().map(|&i| chan_map[i] as u64).collect();
    let n_chan = chan.iter().map(|&c| c + 1).max().unwrap_or(0);
    let out = Probe {
        xc: pick(&xc),
        yc: pick(&yc),
        kcoords: keep
            .iter()
            .map(|&i| kcoords.get(i).copied().unwrap_or(0))
            .collect(),
        chan_map: chan,
        n_chan,
        source: path.to_owned(),
    };
    if kcoords.len() != n {
        return Err(field_err(
            path,
            "shank_ids",
            format!(
                "has {} entries but contact_positions has {n}",
                kcoords.len()
            ),
        ));
    }
    out.validate()?;
    Ok(out)
}

/// probeinterface stores shank ids as strings ("0", "1", or "" for none). Numeric
/// ids are kept; other labels are numbered in sorted order.
fn shank_numbers(ids: &[Value], path: &Path) -> Result<Vec<i64>, ProbeError> {
    let labels: Vec<String> = ids
        .iter()
        .enumerate()
        .map(|(i, v)| match v {
            Value::String(s) => Ok(s.clone()),
            Value::Number(n) => Ok(n.to_string()),
            other => Err(field_err(
                path,
                "shank_ids",
                format!("entry {i} is {other}; expected a string"),
            )),
        })
        .collect::<Result<_, _>>()?;
    if labels
        .iter()
        .all(|s| s.is_empty() || s.parse::<i64>().is_ok())
    {
        return Ok(labels.iter().map(|s| s.parse().unwrap_or(0)).collect());
    }
    let mut uniq = labels.clone();
    uniq.sort();
    uniq.dedup();
    Ok(labels
        .iter()
        .map(|s| uniq.binary_search(s).map(|i| i as i64).unwrap_or(0))
        .collect())
}
