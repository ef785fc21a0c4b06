//! Kilosort4's probe JSON: `{"chanMap": [...], "xc": [...], "yc": [...], "kcoords": [...], "n_chan": N}`.

use std::path::Path;

use serde_json::Value;

use super::Probe;
use crate::error::ProbeError;

fn field_err(path: &Path, field: &str, message: String) -> ProbeError {
    ProbeError::Field {
        path: path.to_owned(),
        field: field.to_owned(),
        message,
    }
}

/// A 1-D array of numbers; nested arrays such as `[[0], [20]]` are refused (BR-07).
pub(super) fn numbers(json: &Value, field: &str, path: &Path) -> Result<Vec<f64>, ProbeError> {
    let arr = json
        .get(field)
        .ok_or_else(|| field_err(path, field, "is missing".into()))?
        .as_array()
        .ok_or_else(|| field_err(path, field, "must be a 1-D array of numbers".into()))?;
    arr.iter()
        .enumerate()
        .map(|(i, v)| match v {
            Value::Number(n) => n.as_f64().ok_or_else(|| {
                field_err(path, field, format!("entry {i} ({n}) is not a representable number"))
            }),
            Value::Array(_) => Err(field_err(
                path,
                field,
                format!(
                    "entry {i} is an array ({v}); the field must be 1-D (one number per site), not shaped (N, 1)"
                ),
            )),
            other => Err(field_err(
                path,
                field,
                format!("entry {i} is {other}, not a number"),
            )),
        })
        .collect()
}

/// Converts numbers that must be whole and non-negative (channel indices, shank ids).
pub(super) fn whole(
    values: &[f64],
    field: &str,
    path: &Path,
    min: f64,
) -> Result<Vec<i64>, ProbeError> {
    values
        .iter()
        .enumerate()
        .map(|(i, &v)| {
            if v.fract() != 0.0 || !v.is_finite() || v < min || v > 2f64.powi(52) {
                Err(field_err(
                    path,
                    field,
                    format!("entry {i} is {v}; expected a whole number ≥ {min}"),
                ))
            } else {
                Ok(v as i64)
            }
        })
        .collect()
}

pub(super) fn from_value(json: &Value, path: &Path) -> Result<Probe, ProbeError> {
    if !json.is_object() {
        return Err(ProbeError::Parse {
            path: path.to_owned(),
            message: "expected a JSON object with chanMap, xc, yc, kcoords and n_chan".into(),
        });
    }
    let xc = numbers(json, "xc", path)?;
    let yc = numbers(json, "yc", path)?;
    let chan_map = whole(&numbers(json, "chanMap", path)?, "chanMap", path, 0.0)?;
    let n = xc.len();
    let kcoords = match json.get("kcoords") {
        None | Some(Value::Null) => vec![0; n],
        Some(_) => whole(&numbers(json, "kcoords", path)?, "kcoords", path, f64::MIN)?,
    };
    let n_chan = match json.get("n_chan") {
        None | Some(Value::Null) => chan_map.iter().map(|&c| c as u64 + 1).max().unwrap_or(0),
        Some(Value::Number(v)) => match v.as_u64() {
            Some(c) => c,
            None => {
                return Err(field_err(
                    path,
                    "n_chan",
                    format!("is {v}; expected a whole number > 0"),
                ));
            }
        },
        Some(other) => {
            return Err(field_err(
                path,
                "n_chan",
                format!("is {other}; expected a whole number > 0"),
            ));
        }
    };
    let probe = Probe {
        xc: xc.iter().map(|&v| v as f32).collect(),
        yc: yc.iter().map(|&v| v as f32).collect(),
        kcoords,
        chan_map: chan_map.iter().map(|&c| c as u64).collect(),
        n_chan,
        source: path.to_owned(),
    };
    probe.validate()?;
    Ok(probe)
}
