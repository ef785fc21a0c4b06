//! The sort after detection, following Kilosort4 4.1.7's stages in order
//! (`../shared/docs/sorting-spec.md` §1): first clustering of the universal
//! spikes, template post-processing (alignment and a 0.9-similarity pre-merge),
//! learned-template matching over every window, final clustering, CCG-gated
//! merges, duplicate removal and the Phy export ([`phy`]). [`run`] chains them.

pub mod ccg;
pub mod clustering;
pub mod ks_arrays;
pub mod matching;
pub mod merge;
pub mod phy;
pub mod postprocess;
pub mod run;
pub mod summary;
pub mod templates;
