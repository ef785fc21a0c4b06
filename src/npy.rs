//! Reading and writing `.npy` files with clear errors, and atomic writes
//! (a temporary name renamed when complete).

use std::fs::File;
use std::io::{BufReader, BufWriter};
use std::path::Path;

use anyhow::{Context, Result};
use ndarray::{ArrayBase, Data, Dimension};
use ndarray_npy::{ReadNpyExt, ReadableElement, WritableElement, WriteNpyExt};

/// Reads an `.npy` file into an array of the given element type and rank.
///
/// # Errors
/// Names the file and says what was expected (dtype, rank) when it does not match.
pub fn read<A, D>(path: &Path) -> Result<ndarray::Array<A, D>>
where
    A: ReadableElement + Clone,
    D: Dimension,
{
    let f = File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
    let arr = ndarray::Array::<A, D>::read_npy(BufReader::new(f)).map_err(|e| {
        anyhow::anyhow!(
            "{}: {e} (expected a {}-D array of {})",
            path.display(),
            D::NDIM.map_or("N".to_string(), |n| n.to_string()),
            std::any::type_name::<A>()
        )
    })?;
    if arr.is_standard_layout() {
        Ok(arr)
    } else {
        Ok(arr.as_standard_layout().into_owned())
    }
}

/// Writes an array to `dir/name` via a temporary file renamed when complete.
///
/// # Errors
/// Names the file when writing fails.
pub fn write<A, S, D>(path: &Path, arr: &ArrayBase<S, D>) -> Result<()>
where
    A: WritableElement,
    S: Data<Elem = A>,
    D: Dimension,
{
    let tmp = path.with_extension("npy.partial");
    {
        let f = File::create(&tmp).with_context(|| format!("cannot create {}", tmp.display()))?;
        let mut w = BufWriter::new(f);
        arr.write_npy(&mut w)
            .with_context(|| format!("cannot write {}", tmp.display()))?;
        use std::io::Write;
        w.flush()
            .with_context(|| format!("cannot write {}", tmp.display()))?;
    }
    std::fs::rename(&tmp, path)
        .with_context(|| format!("cannot rename {} to {}", tmp.display(), path.display()))
}
